"""The BatchNorm and BatchNormReLU CPU kernels (minidl/kernels/cpu/norm.py) against their references:
hypothesis draws on blocks of one image over every intra-op thread, a ResNet-sized activation, float32
numerics, the statistics seams, and where the kernels stand aside."""
import contextlib

import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import threads as intra_op
from minidl.kernels.cpu import norm as norm_kernels
from minidl.kernels.cpu.norm import BatchNormBlocked, BatchNormReLUBlocked
from minidl.testing import check_op
from minidl.testing.gradcheck import check_kernels
from minidl.testing.strategies import arrays

# NumPy kernels: the device-pinned suite runs the references.
pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("kernels_on")]


@contextlib.contextmanager
def settings(**values):
    """Declared kernel options set for a block, then restored."""
    before = {name: kernels.get_option(name) for name in values}
    try:
        for name, value in values.items():
            kernels.set_option(name, value)
        yield
    finally:
        for name, value in before.items():
            kernels.set_option(name, value)


@pytest.fixture(autouse=True, params=[False, True] if norm_kernels.norm_loops.available else [False],
                ids=lambda compiled: "numba" if compiled else "numpy")
def pass_bodies(request):
    """Every test on both bodies of the passes: NumPy calls per block, and the loops Numba compiles
    (norm_loops.py; only where the numba extra is installed)."""
    with settings(batchnorm_numba=request.param):
        yield request.param


# Every input takes a kernel, one image per block, the blocks on every intra-op thread.
SMALL_BLOCKS = dict(batchnorm_min_bytes=0, batchnorm_block_bytes=1, batchnorm_parallel_bytes=0)


def np_pre_activation(x, scale, bias, mean, var, training, eps, residual=None):
    axes = tuple(i for i in range(x.ndim) if i != 1)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    if training:
        mean, var = x.mean(axis=axes), x.var(axis=axes)
    z = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * scale.reshape(shape) + bias.reshape(shape)
    return z if residual is None else z + residual


@st.composite
def case(draw):
    ndim = draw(st.sampled_from([2, 3, 4]))
    shape = [draw(st.integers(2, 4))] + [draw(st.integers(1, 3)) for _ in range(ndim - 1)]
    c = shape[1]
    x, residual = draw(arrays(tuple(shape))), draw(arrays(tuple(shape)))
    # A spread in every channel: the stated bound is for channels whose variance is not far below
    # eps (a constant channel scales the blocked sums' rounding by 1 / sqrt(eps), see the kernels).
    x = x + 0.7071 * np.arange(shape[0]).reshape((-1,) + (1,) * (ndim - 1))
    assume(np.all(x.var(axis=tuple(i for i in range(ndim) if i != 1)) > 0.01))
    scale, bias = draw(arrays((c,), -2.0, 2.0)), draw(arrays((c,)))
    mean, var = draw(arrays((c,))), draw(arrays((c,), 0.1, 3.0))
    return x, scale, bias, mean, var, residual


@given(case=case())
def test_batch_norm_kernel_on_small_blocks(case):
    x, scale, bias, mean, var, _ = case
    fn = lambda x, s, b: ops.BatchNorm(True, 1e-5, 0.1)(x, s, b, Tensor(mean.copy()), Tensor(var.copy()))
    with settings(**SMALL_BLOCKS), kernels.tracking() as used:
        check_op(fn, [x, scale, bias], reference=lambda x, s, b: np_pre_activation(x, s, b, mean, var, True, 1e-5),
                 fwd_rtol=1e-9)
    assert {k.name for k in used} == {"BatchNormBlocked"}


@given(case=case(), training=st.booleans())
def test_batch_norm_relu_kernel_on_small_blocks(case, training):
    x, scale, bias, mean, var, residual = case
    pre = np_pre_activation(x, scale, bias, mean, var, training, 1e-5, residual)
    residual = residual + np.where(np.abs(pre) < 0.05, 0.2, 0.0)  # no finite difference across the kink
    fn = lambda x, s, b, r: ops.BatchNormReLU(training)(x, s, b, Tensor(mean.copy()), Tensor(var.copy()), r)
    ref = lambda x, s, b, r: np.maximum(np_pre_activation(x, s, b, mean, var, training, 1e-5, r), 0)
    with settings(**SMALL_BLOCKS), kernels.tracking() as used:
        check_op(fn, [x, scale, bias, residual], reference=ref, fwd_rtol=1e-9)
    assert "BatchNormReLUBlocked" in {k.name for k in used}


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_kernel_matches_the_separate_kernels(training, with_residual):
    """Outputs, every gradient and the running statistics of BatchNorm, Add and ReLU, on a
    ResNet-sized float32 activation over many blocks and both threads, within the kernels' bound."""
    rng = np.random.default_rng(0)
    shape = (16, 16, 16, 16)  # 4096 values per image: the ReLU takes its zero-row path
    x, gy, res = (rng.normal(1.0, 2.0, shape).astype(np.float32) for _ in range(3))
    scale, bias = rng.normal(size=16).astype(np.float32), rng.normal(size=16).astype(np.float32)
    stats = (rng.normal(size=16).astype(np.float32), rng.uniform(0.5, 2, 16).astype(np.float32))

    def run(fused):
        tx, ts, tb, tr = (Tensor(a, requires_grad=True) for a in (x, scale, bias, res))
        mean, var = (Tensor(a.copy()) for a in stats)
        extra = (tr,) if with_residual else ()
        if fused:
            y = ops.BatchNormReLU(training, 1e-5, 0.1)(tx, ts, tb, mean, var, *extra)
        else:
            y = ops.BatchNorm(training, 1e-5, 0.1)(tx, ts, tb, mean, var)
            y = ops.relu(y + tr if with_residual else y)
        y.backward(Tensor(gy))
        grads = [tx.grad, ts.grad, tb.grad] + ([tr.grad] if with_residual else [])
        return [y.asnumpy()] + [g.asnumpy() for g in grads] + [mean.asnumpy(), var.asnumpy()]

    with settings(batchnorm_min_bytes=0, batchnorm_block_bytes=4096, batchnorm_parallel_bytes=0):
        with kernels.tracking() as used:
            fused = run(True)
        assert "BatchNormReLUBlocked" in {k.name for k in used}
        separate = run(False)
    rtol, atol = BatchNormReLUBlocked().bound_for(np.dtype(np.float32))
    names = ["y", "gx", "gscale", "gbias"] + (["gresidual"] if with_residual else []) + ["mean", "variance"]
    for name, a, b in zip(names, fused, separate):
        assert a.dtype == np.float32 and np.isfinite(b).all(), name  # a finite reference: a finite tolerance
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * max(1.0, float(np.abs(b).max())), err_msg=name)


def run_float32_and_float64(op, x, data_format="NCHW", **options):
    """Training ``op`` (ops.BatchNorm or ops.BatchNormReLU) on float32 x through its kernel, and the
    reference body on the same values in float64: two lists [y, gx, gscale, gbias, running mean,
    running variance], and the kernels that ran."""
    axis = 1 if data_format == "NCHW" else x.ndim - 1
    c = x.shape[axis]
    rng = np.random.default_rng(7)
    gy = rng.standard_normal(x.shape)
    scale, bias = rng.uniform(0.5, 2.0, c), rng.standard_normal(c)

    def run(dtype):
        tx, ts, tb = (Tensor(a.astype(dtype), requires_grad=True) for a in (x, scale, bias))
        mean, var = Tensor(np.zeros(c, dtype)), Tensor(np.ones(c, dtype))
        prim = ops.BatchNorm(True, 1e-5, 1.0, data_format) if op is ops.BatchNorm else op(True, 1e-5, 1.0)
        y = prim(tx, ts, tb, mean, var)
        y.backward(Tensor(gy.astype(dtype)))
        return [a.asnumpy().astype(np.float64) for a in (y, tx.grad, ts.grad, tb.grad, mean, var)]

    with settings(batchnorm_min_bytes=0, **options), kernels.tracking() as used:
        got = run(np.float32)
    with kernels.reference_only():
        want = run(np.float64)
    return got, want, {k.name for k in used}


def max_error(got, want):
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want)))))


@pytest.mark.parametrize("op", [ops.BatchNorm, ops.BatchNormReLU])
def test_float32_statistics_of_a_large_offset(op):
    """Mean 1000, deviation 1: E[x^2] - E[x]^2 in float32 would lose the variance to rounding; the
    kernels' shifted sums keep it to float32 accuracy, and the outputs and gradients to the size of
    x's own rounding (eps * 1000 / 1)."""
    x = (1000.0 + np.random.default_rng(1).standard_normal((32, 4, 8, 8))).astype(np.float32)
    # Three samples per block: the last block of each pass is a short one (32 = 10 * 3 + 2).
    got, want, used = run_float32_and_float64(op, x, batchnorm_block_bytes=3 * 1024)
    assert used == {op.__name__ + "Blocked"}
    for name, a, b in zip(["y", "gx", "gscale", "gbias"], got, want):
        assert max_error(a, b) < 2e-3 * 2e-2, name  # 6e-5 * 1000 relative to values of ~1-10
    np.testing.assert_allclose(got[4], want[4], rtol=1e-6, err_msg="running mean")
    np.testing.assert_allclose(got[5], want[5], rtol=1e-5, err_msg="running variance")


@pytest.mark.parametrize("offset, deviation, passes", [(1.0, 1.0, 1), (2.4, 1.0, 1), (3.0, 1.0, 2), (1000.0, 1.0, 2),
                                                       (1.5, 0.1, 2)])
@pytest.mark.parametrize("shape, data_format", [((64, 16, 16, 16), "NCHW"), ((64, 8, 8, 16), "NHWC"),
                                                ((4096, 16), "NCHW")])
def test_a_channel_far_from_zero_is_summed_again_about_its_mean(monkeypatch, offset, deviation, passes, shape,
                                                                data_format):
    """Sums of x and x^2 serve while mean^2 + var <= 8 var (offset 2.4, deviation 1: 6.8); beyond
    (3: 10), x is summed again about the mean found. Either way the statistics and every output
    are as close to float64 as the reference body's (the backward's sums too: centred beyond
    mean^2 + var = 4 var, which a small deviation about a small mean (1.5, 0.1: 226) is)."""
    x = (offset + deviation * np.random.default_rng(3).standard_normal(shape)).astype(np.float32)
    calls = []
    real = norm_kernels._moments
    # A spy that only counts (it changes nothing): how many passes the statistics took.
    monkeypatch.setattr(norm_kernels, "_moments", lambda *a: calls.append(1) or real(*a))
    got, want, used = run_float32_and_float64(ops.BatchNorm, x, data_format)
    assert used == {"BatchNormBlocked"} and len(calls) == passes
    with kernels.reference_only():
        ref, _, _ = run_float32_and_float64(ops.BatchNorm, x, data_format)
    for name, a, r, b in zip(["y", "gx", "gscale", "gbias", "mean", "variance"], got, ref, want):
        assert max_error(a, b) <= 2 * max_error(r, b) + 2e-7, name


def test_channels_last_is_as_close_to_float64_as_the_reference():
    """NHWC (the channels-last route, which (N, C) inputs take too) in float32: the kernel's error
    against float64 no larger than the reference body's own (within a factor 2)."""
    x = np.random.default_rng(4).normal(1.0, 2.0, (64, 8, 8, 32)).astype(np.float32)
    got, want, used = run_float32_and_float64(ops.BatchNorm, x, "NHWC")
    assert used == {"BatchNormBlocked"}
    with kernels.reference_only():
        ref, _, _ = run_float32_and_float64(ops.BatchNorm, x, "NHWC")
    for name, a, r, b in zip(["y", "gx", "gscale", "gbias", "mean", "variance"], got, ref, want):
        assert max_error(a, b) <= 2 * max_error(r, b) + 1e-7, name


class _TwoCopies(ops.BatchNorm):
    """Its batch is this block twice: every cross-batch sum (and the count) doubled at the seams."""

    def sum_over_batch(self, sums):
        return 2 * sums


@kernels.register
class _TwoCopiesBlocked(BatchNormBlocked):
    op = _TwoCopies  # what a subclass that changes only the seams (SyncBatchNormOp) would register

    def applies(self, node, x, *rest):
        return node.is_training  # any size: the tests here run it on small arrays too

    def cases(self):  # in the table now, so test_kernels.py may run it too
        x = np.random.default_rng(3).standard_normal((64, 4, 8, 8))
        return [(lambda: lambda *ts: _TwoCopies(True)(*ts, np.zeros(4), np.ones(4)), [x, np.ones(4), np.zeros(4)])]


def test_the_kernel_keeps_the_seams_of_a_subclass():
    """Registered for a subclass, the blocked body computes on x BatchNorm of [x; x], as the reference does."""
    rng = np.random.default_rng(5)
    x, gy = (rng.standard_normal((64, 4, 8, 8)) * 2 + 1 for _ in range(2))
    scale, bias = rng.standard_normal(4), rng.standard_normal(4)

    def run(op, x, gy):
        xt, st_, bt = (Tensor(a, requires_grad=True) for a in (x, scale, bias))
        mean, var = Tensor(np.zeros(4)), Tensor(np.ones(4))
        y = op(xt, st_, bt, mean, var)
        y.backward(Tensor(gy))
        return y.asnumpy(), xt.grad.asnumpy(), st_.grad.asnumpy(), bt.grad.asnumpy(), mean.asnumpy(), var.asnumpy()

    with settings(batchnorm_parallel_bytes=0), kernels.tracking() as used:
        got = run(_TwoCopies(True, 1e-5, 0.3), x, gy)
    assert used == {kernels.registered(_TwoCopies)[0]}
    want = run(ops.BatchNorm(True, 1e-5, 0.3), np.concatenate([x, x]), np.concatenate([gy, gy]))
    for name, a, b in zip(["y", "gx"], got[:2], want[:2]):
        np.testing.assert_allclose(a, b[:64], rtol=1e-12, atol=1e-12, err_msg=name)
    for name, a, b in zip(["gscale", "gbias"], got[2:4], want[2:4]):  # this block's share
        np.testing.assert_allclose(a, b / 2, rtol=1e-12, atol=1e-12, err_msg=name)
    for name, a, b in zip(["mean", "variance"], got[4:], want[4:]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=name)
    for make, arrays_ in _TwoCopiesBlocked().cases():
        assert check_kernels(lambda *ts: make()(*ts), arrays_) == {kernels.registered(_TwoCopies)[0]}


def test_small_inputs_and_inference_take_the_reference():
    rng = np.random.default_rng(2)
    c = 16
    vectors = [Tensor(a) for a in (np.ones(c, np.float32), np.zeros(c, np.float32))]
    stats = lambda: [Tensor(np.zeros(c, np.float32)), Tensor(np.ones(c, np.float32))]
    small = Tensor(rng.standard_normal((8, c, 8, 8)).astype(np.float32))  # 32 KB
    large = Tensor(rng.standard_normal((64, c, 16, 16)).astype(np.float32))  # 1 MB
    with kernels.tracking() as used:
        ops.BatchNorm(True)(small, *vectors, *stats())
        ops.BatchNormReLU(True)(small, *vectors, *stats())
        ops.BatchNorm(False)(large, *vectors, *stats())  # inference: one multiply, one add
    assert used == set()
    with kernels.tracking() as used:
        ops.BatchNorm(True)(large, *vectors, *stats())
        ops.BatchNormReLU(True)(large, *vectors, *stats())
        ops.BatchNormReLU(False)(large, *vectors, *stats())
    assert {k.name for k in used} == {"BatchNormBlocked", "BatchNormReLUBlocked"}


@pytest.mark.parametrize("op, training, needs", [
    (ops.BatchNorm, True, (True, True, True)), (ops.BatchNorm, True, (False, True, False)),
    (ops.BatchNorm, True, (True, False, True)), (ops.BatchNormReLU, True, (True, True, True, False)),
    (ops.BatchNormReLU, True, (False, False, True, True)), (ops.BatchNormReLU, False, (True, True, False, True))])
def test_seams_and_gradients_are_the_references(monkeypatch, op, training, needs):
    """What a subclass or the autograd engine sees is the reference's: sum_over_batch gets the same
    vectors (float32 here, even where x needs no gradient), and backward returns a gradient of the
    input's dtype and shape exactly where an input needs one (None elsewhere, one per input)."""
    rng = np.random.default_rng(6)
    x, gy, res = (rng.normal(1.0, 2.0, (8, 4, 6, 6)).astype(np.float32) for _ in range(3))
    scale, bias = rng.uniform(0.5, 2.0, 4).astype(np.float32), rng.normal(size=4).astype(np.float32)
    log = []
    describe = lambda a: None if a is None else (str(a.dtype), tuple(a.shape))

    def logged(fn):  # a spy: records what the seam or backward got or returned, changes nothing
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            log.append(describe(args[-1]) if fn is real_sum else [describe(g) for g in out])
            return out
        return wrapper

    real_sum = ops.BatchNorm.sum_over_batch
    monkeypatch.setattr(ops.BatchNorm, "sum_over_batch", logged(real_sum))
    monkeypatch.setattr(op, "backward", logged(op.backward))  # the reference's
    monkeypatch.setattr(norm_kernels, "_backward", logged(norm_kernels._backward))

    def run():
        log.clear()
        inputs = [Tensor(a, requires_grad=need) for a, need in zip((x, scale, bias, res), needs)]
        stats = [Tensor(np.zeros(4, np.float32)), Tensor(np.ones(4, np.float32))]
        y = op(training)(*inputs[:3], *stats, *inputs[3:])
        y.backward(Tensor(gy))
        return list(log)

    with settings(batchnorm_min_bytes=0), kernels.tracking() as used:
        got = run()
    assert {k.name for k in used} == {op.__name__ + "Blocked"}
    with kernels.reference_only():
        want = run()
    assert got == want
    *seams, grads = want
    assert [g is not None for g in grads] == list(needs[:3]) + [False, False] + list(needs[3:])
    assert seams == ([("float32", (5,)), ("float32", (4,)), ("float32", (8,))] if training else [])


def test_residual_is_checked_against_x():
    x = np.ones((8, 4, 6, 6), np.float32)
    vectors = [Tensor(np.ones(4, np.float32)) for _ in range(4)]
    with settings(batchnorm_min_bytes=0):
        with pytest.raises(ValueError, match=r"residual of shape \(8, 4, 6\) and dtype float32 must match x: "
                                             r"shape \(8, 4, 6, 6\), dtype float32"):
            ops.BatchNormReLU(True)(Tensor(x), *vectors, Tensor(np.ones((8, 4, 6), np.float32)))
        with pytest.raises(ValueError, match=r"residual of shape \(8, 4, 6, 6\) and dtype float64 must match x"):
            ops.BatchNormReLU(False)(Tensor(x), *vectors, Tensor(np.ones(x.shape)))


def test_inputs_of_at_least_batchnorm_min_bytes_take_the_kernel():
    """The option's threshold is inclusive, and any non-empty input may take the kernel (in inference
    one value is a batch); an empty one takes the reference."""
    def used_on(x, least):
        vectors = [Tensor(np.ones(x.shape[1], np.float32)) for _ in range(4)]
        with settings(batchnorm_min_bytes=least), kernels.tracking() as used:
            ops.BatchNormReLU(False)(Tensor(x), *vectors)
        return {k.name for k in used}

    x = np.ones((8, 4, 6, 6), np.float32)
    assert used_on(x, x.nbytes) == {"BatchNormReLUBlocked"}
    assert used_on(x, x.nbytes + 1) == set()
    assert used_on(np.ones((1, 1), np.float32), 0) == {"BatchNormReLUBlocked"}
    assert used_on(np.ones((0, 4), np.float32), 0) == set()


@pytest.fixture
def two_threads():
    before = intra_op.get_num_threads()
    intra_op.set_num_threads(2)
    try:
        if intra_op.get_num_threads() != 2:
            pytest.skip("no thread-local BLAS thread count here: the ops stay serial")
        yield
    finally:
        intra_op.set_num_threads(before)


def test_the_options_shape_the_passes(monkeypatch, two_threads):
    """batchnorm_parallel_bytes (inclusive) splits the batch over the threads, one sample each at
    least; batchnorm_block_bytes sets the samples per block, by default (None) a quarter of the L2
    on one thread and half of it per thread on several."""
    x = np.ones((16, 4, 32), np.float32)  # 512 bytes per sample
    with settings(batchnorm_numba=False, batchnorm_block_bytes=None):
        with settings(batchnorm_parallel_bytes=x.nbytes):
            assert len(norm_kernels._Passes(x, 1).spans) == 2
        with settings(batchnorm_parallel_bytes=x.nbytes + 1):
            assert len(norm_kernels._Passes(x, 1).spans) == 1
        with settings(batchnorm_parallel_bytes=0):
            assert len(norm_kernels._Passes(x[:1], 1).spans) == 1  # one sample: one thread
            assert len(norm_kernels._Passes(x[:, :1], 1).spans) == 2  # threads by samples, not channels
        monkeypatch.setattr(intra_op, "l2_bytes", lambda: 8 * 512)
        with settings(batchnorm_parallel_bytes=x.nbytes + 1):
            assert norm_kernels._Passes(x, 1).rows == 2
        with settings(batchnorm_parallel_bytes=0):
            assert norm_kernels._Passes(x, 1).rows == 4
    with settings(batchnorm_numba=False, batchnorm_block_bytes=3 * 512):
        assert norm_kernels._Passes(x, 1).rows == 3
    with settings(batchnorm_numba=False, batchnorm_block_bytes=1):
        assert norm_kernels._Passes(x, 1).rows == 1


def test_the_compiled_passes_run_where_asked(monkeypatch, pass_bodies):
    """batchnorm_numba: every pass of a training step through the loops Numba compiles, or none."""
    calls = []
    for name in ("moments", "affine", "grad_sums", "grad_apply"):
        real = getattr(norm_kernels.norm_loops, name)
        spy = (lambda *a, real=real, name=name: calls.append(name) or real(*a))
        monkeypatch.setattr(norm_kernels.norm_loops, name, spy)
    x = Tensor(np.random.default_rng(8).standard_normal((8, 4, 6, 6)).astype(np.float32), requires_grad=True)
    vectors = [Tensor(a, requires_grad=True) for a in (np.ones(4, np.float32), np.zeros(4, np.float32))]
    with settings(batchnorm_min_bytes=0):
        y = ops.BatchNorm(True)(x, *vectors, Tensor(np.zeros(4, np.float32)), Tensor(np.ones(4, np.float32)))
        y.backward(Tensor(np.ones(x.shape, np.float32)))
    assert sorted(set(calls)) == (["affine", "grad_apply", "grad_sums", "moments"] if pass_bodies else [])


def test_the_differential_cases_are_the_documented_draws():
    """batchnorm_cases (the differential cases of these kernels and of SyncBatchNormOp's): the documented
    shapes, dtypes and distributions, the same on every call, each case's primitive in its mode
    (epsilon 1e-5) with the residual where there is one, and a factory's primitive where one is given."""
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    bn, relu = BatchNormBlocked().cases(), BatchNormReLUBlocked().cases()
    again = BatchNormBlocked().cases() + BatchNormReLUBlocked().cases()
    draws = [((64, 16, 32, 32), f32, 1.0, 2.0), ((4096, 16), f64, 1.0, 2.0), ((64, 32, 16, 16), f32, 4.0, 1.0)]
    want = [(d, 3, True) for d in draws]
    want += [(d, 4, training) for d in draws[:2] for training in (True, False)]
    want += [(((64, 16, 16, 16), f32, 1.0, 2.0), 3, training) for training in (True, False)]
    assert len(bn + relu) == len(want)
    for i, ((make, arrays), (_, same), ((shape, dtype, loc, spread), inputs, training)) in enumerate(
            zip(bn + relu, again, want)):
        x = arrays[0]
        assert (x.shape, len(arrays)) == (shape, inputs) and all(a.dtype == dtype for a in arrays)
        assert all(np.array_equal(a, b) for a, b in zip(arrays, same))  # fresh from seed 0 each time
        assert abs(float(x.mean()) - loc) < 0.05 and abs(float(x.std()) / spread - 1) < 0.01
        with kernels.reference_only():
            y = make()(*arrays)
        axes = tuple(i for i in range(x.ndim) if i != 1)
        pre = (x - x.mean(axis=axes, keepdims=True)) / np.sqrt(x.var(axis=axes, keepdims=True) + 1e-5)
        pre = pre * arrays[1].reshape((1, -1) + (1,) * (x.ndim - 2)) + arrays[2].reshape((1, -1) + (1,) * (x.ndim - 2))
        pre = pre + arrays[3] if inputs == 4 else pre
        batch_stats = np.maximum(pre, 0) if i >= len(bn) else pre
        assert np.allclose(y.asnumpy(), batch_stats, rtol=1e-3, atol=1e-3) == training
    made = []
    (make, arrays), = norm_kernels.batchnorm_cases(
        ops.BatchNorm, with_residual=False, modes=(True,), shapes=[(8, 2, 3)],
        factory=lambda training: made.append(training) or ops.BatchNorm(training, 0.5))
    y = make()(*arrays).asnumpy()
    x = arrays[0]
    assert made == [True]
    want = (x - x.mean(axis=(0, 2), keepdims=True)) / np.sqrt(x.var(axis=(0, 2), keepdims=True) + 0.5)
    np.testing.assert_allclose(y, want * arrays[1][:, None] + arrays[2][:, None], rtol=1e-5, atol=1e-5)
