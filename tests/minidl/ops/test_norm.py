"""BatchNorm: forward vs NumPy, gradients vs finite differences, running statistics, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import ops, Tensor, Parameter
from minidl.testing import check_op
from minidl.testing.strategies import arrays


def channel_axis(ndim, data_format):
    return 1 if data_format == "NCHW" else ndim - 1


def np_batch_norm(x, scale, bias, mean, var, training, eps, data_format="NCHW"):
    axis = channel_axis(x.ndim, data_format)
    axes = tuple(i for i in range(x.ndim) if i != axis)
    shape = tuple(-1 if i == axis else 1 for i in range(x.ndim))
    if training:
        mean, var = x.mean(axis=axes), x.var(axis=axes)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * scale.reshape(shape) + bias.reshape(shape)


@st.composite
def bn_case(draw):
    ndim = draw(st.sampled_from([2, 3, 4]))
    data_format = draw(st.sampled_from(["NCHW", "NHWC"]))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    axis = channel_axis(ndim, data_format)
    if int(np.prod(shape)) // shape[axis] < 2:
        shape[0] = 2  # training needs more than one value per channel
    c = shape[axis]
    x = draw(arrays(tuple(shape)))
    scale, bias = draw(arrays((c,), -2.0, 2.0)), draw(arrays((c,)))
    mean, var = draw(arrays((c,))), draw(arrays((c,), 0.1, 3.0))
    eps = draw(st.sampled_from([1e-5, 1e-3]))
    return x, scale, bias, mean, var, eps, data_format


@given(case=bn_case(), training=st.booleans())
def test_batch_norm(case, training):
    x, scale, bias, mean, var, eps, fmt = case
    # Copies per call: training updates the running statistics in place. Tensors, so that they
    # live on the tensors' device (the suite also runs pinned to the GPU).
    fn = lambda x, s, b: ops.BatchNorm(training, eps, 0.1, fmt)(x, s, b, Tensor(mean.copy()), Tensor(var.copy()))
    ref = lambda x, s, b: np_batch_norm(x, s, b, mean, var, training, eps, fmt)
    check_op(fn, [x, scale, bias], reference=ref, fwd_rtol=1e-9)


@given(case=bn_case(), momentum=st.sampled_from([0.0, 0.1, 0.5, 1.0]), steps=st.integers(1, 3))
def test_running_statistics_update(case, momentum, steps):
    x, scale, bias, mean, var, eps, fmt = case
    axis = channel_axis(x.ndim, fmt)
    axes = tuple(i for i in range(x.ndim) if i != axis)
    running_mean, running_var = Tensor(mean.copy()), Tensor(var.copy())
    expected_mean, expected_var = mean.copy(), var.copy()
    bn = ops.BatchNorm(True, eps, momentum, fmt)
    for step in range(steps):
        xs = x + step  # a different batch each step
        bn(Tensor(xs), Tensor(scale), Tensor(bias), running_mean, running_var)
        expected_mean = (1 - momentum) * expected_mean + momentum * xs.mean(axis=axes)
        expected_var = (1 - momentum) * expected_var + momentum * xs.var(axis=axes, ddof=1)
    np.testing.assert_allclose(running_mean.asnumpy(), expected_mean, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(running_var.asnumpy(), expected_var, rtol=1e-12, atol=1e-12)


def test_parameters_are_updated_in_place_and_inference_leaves_them():
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((4, 3, 2, 2)).astype(np.float32), requires_grad=True)
    gamma, beta = Parameter(np.ones(3, np.float32)), Parameter(np.zeros(3, np.float32))
    mm = Parameter(np.zeros(3, np.float32), requires_grad=False)
    mv = Parameter(np.ones(3, np.float32), requires_grad=False)
    before = mm.data
    y = ops.BatchNorm(is_training=True)(x, gamma, beta, mm, mv)
    assert mm.data is before and y.dtype == np.float32
    assert mm.dtype == np.float32 and mv.dtype == np.float32
    np.testing.assert_allclose(mm.asnumpy(), 0.1 * x.asnumpy().mean(axis=(0, 2, 3)), rtol=1e-5)
    y.sum().backward()
    assert x.grad.dtype == np.float32 and gamma.grad.dtype == np.float32 and beta.grad.dtype == np.float32
    assert mm.grad is None and mv.grad is None
    # sum(y) = sum(beta) + gamma * sum(xhat): the x gradient vanishes, beta's is the count.
    np.testing.assert_allclose(x.grad.asnumpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(beta.grad.asnumpy(), [16.0] * 3)
    saved = mm.asnumpy().copy(), mv.asnumpy().copy()
    ops.BatchNorm(is_training=False)(x, gamma, beta, mm, mv)
    np.testing.assert_array_equal(mm.asnumpy(), saved[0])
    np.testing.assert_array_equal(mv.asnumpy(), saved[1])


def test_training_output_is_normalised():
    x = np.random.default_rng(1).normal(5.0, 3.0, (8, 2, 3, 3))
    y = ops.BatchNorm(True, 1e-12)(*map(Tensor, (x, np.ones(2), np.zeros(2), np.zeros(2), np.ones(2)))).asnumpy()
    np.testing.assert_allclose(y.mean(axis=(0, 2, 3)), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=(0, 2, 3)), 1.0, rtol=1e-9)


def test_batch_norm_function():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 2, 2, 2))
    mean, var = Tensor(np.zeros(2)), Tensor(np.ones(2))
    y = ops.batch_norm(Tensor(x), mean, var, training=True, momentum=0.5)
    np.testing.assert_allclose(y.asnumpy(), np_batch_norm(x, np.ones(2), np.zeros(2), None, None, True, 1e-5))
    np.testing.assert_allclose(mean.asnumpy(), 0.5 * x.mean(axis=(0, 2, 3)))
    w, b = rng.standard_normal(2), rng.standard_normal(2)
    check_op(lambda x, w, b: ops.batch_norm(x, mean, var, w, b), [x, w, b],
             reference=lambda x, w, b: np_batch_norm(x, w, b, mean.asnumpy(), var.asnumpy(), False, 1e-5))


def test_training_without_running_statistics():
    x = np.random.default_rng(3).standard_normal((4, 3))
    y = ops.BatchNorm(True)(Tensor(x), Tensor(np.ones(3)), Tensor(np.zeros(3)), None, None)
    np.testing.assert_allclose(y.asnumpy(), np_batch_norm(x, np.ones(3), np.zeros(3), None, None, True, 1e-5))


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1, 1)])
def test_one_value_per_channel_in_training_is_an_error(shape):
    with pytest.raises(ValueError, match=r"BatchNorm: expected more than 1 value per channel when training, "
                                         r"got input of shape \(1, 3"):
        ops.BatchNorm(True)(*map(Tensor, (np.ones(shape), np.ones(3), np.zeros(3), np.zeros(3), np.ones(3))))
    y = ops.BatchNorm(False)(*map(Tensor, (np.ones(shape), np.ones(3), np.zeros(3), np.zeros(3), np.ones(3))))
    assert y.shape == shape  # inference is fine


def test_errors():
    x = Tensor(np.ones((2, 3, 2, 2)))
    c3 = np.ones(3)
    with pytest.raises(ValueError, match=r"BatchNorm: scale of shape \(4,\) must be \(3,\), one per channel "
                                         r"of x of shape \(2, 3, 2, 2\) \(NCHW\)"):
        ops.BatchNorm()(x, np.ones(4), c3, c3, c3)
    with pytest.raises(ValueError, match=r"BatchNorm: variance of shape \(2,\) must be \(3,\)"):
        ops.BatchNorm()(x, c3, c3, c3, np.ones(2))
    with pytest.raises(ValueError, match=r"BatchNorm: x must have at least 2 dimensions"):
        ops.BatchNorm()(Tensor(np.ones(3)), c3, c3, c3, c3)
    with pytest.raises(ValueError, match=r"BatchNorm: data_format must be one of"):
        ops.BatchNorm(data_format="NCDHW")
    with pytest.raises(ValueError, match=r"BatchNorm: momentum must be in \[0.0, 1.0\], got 1.5"):
        ops.BatchNorm(momentum=1.5)
    with pytest.raises(ValueError, match=r"BatchNorm: epsilon must be in \(0.0, 1.0\], got 0"):
        ops.BatchNorm(epsilon=0)
    with pytest.raises(TypeError, match=r"BatchNorm: is_training must be a bool"):
        ops.BatchNorm(is_training=1)
    with pytest.raises(ValueError, match=r"BatchNorm: mean must be a \(3,\) tensor, got None"):
        ops.BatchNorm(False)(x, c3, c3, None, None)
    with pytest.raises(ValueError, match=r"BatchNorm: scale must be a \(3,\) tensor, got None"):
        ops.BatchNorm(True)(x, None, c3, None, None)


class _TwoCopies(ops.BatchNorm):
    """Every per-channel sum goes through sum_over_batch: here the batch is this block twice."""

    def sum_over_batch(self, sums):
        return 2 * sums

    def count_over_batch(self, count):  # the GPU path's count (the CPU's travels with the sums)
        return 2 * count


@pytest.mark.parametrize("fmt, shape", [("NCHW", (3, 2, 2, 2)), ("NHWC", (3, 2, 2, 2)), ("NCHW", (4, 3))])
def test_sum_over_batch_is_the_seam_of_every_cross_batch_sum(fmt, shape):
    """BatchNorm whose sums are those of [x; x] computes, on x, BatchNorm of [x; x]: statistics,
    running update and the input gradient all come from the seam; scale and bias get this
    block's share (a grad reducer adds the other blocks')."""
    rng = np.random.default_rng(5)
    x, gy = rng.standard_normal(shape) * 2 + 1, rng.standard_normal(shape)
    c = shape[channel_axis(len(shape), fmt)]
    scale, bias = rng.standard_normal(c), rng.standard_normal(c)

    def run(op, x, gy):
        xt, st, bt = (Tensor(a, requires_grad=True) for a in (x, scale, bias))
        mean, var = Tensor(np.zeros(c)), Tensor(np.ones(c))
        y = op(xt, st, bt, mean, var)
        y.backward(Tensor(gy))
        return y.asnumpy(), xt.grad.asnumpy(), st.grad.asnumpy(), bt.grad.asnumpy(), mean.asnumpy(), var.asnumpy()

    got = run(_TwoCopies(True, 1e-5, 0.3, fmt), x, gy)
    want = run(ops.BatchNorm(True, 1e-5, 0.3, fmt), np.concatenate([x, x]), np.concatenate([gy, gy]))
    n = shape[0]
    for name, a, b in zip(["y", "gx"], got[:2], want[:2]):
        np.testing.assert_allclose(a, b[:n], rtol=1e-12, atol=1e-12, err_msg=name)
    for name, a, b in zip(["gscale", "gbias"], got[2:4], want[2:4]):
        np.testing.assert_allclose(a, b / 2, rtol=1e-12, atol=1e-12, err_msg=name)
    for name, a, b in zip(["mean", "variance"], got[4:], want[4:]):  # the count is [x; x]'s too
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=name)


def test_plain_batchnorm_sums_nothing_more():
    sums = np.arange(4.0)
    assert ops.BatchNorm(True).sum_over_batch(sums) is sums
