"""SINGA's DistOpt: each update mode against its own exact property, on the threads backend."""
import copy
import inspect
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
import minidl_parallel
from minidl import Tensor, nn
from minidl.backend import to_numpy
from minidl_parallel import CommCounter, run_threads
from minidl_parallel.dist_opt import DistOpt


def _mlp(seed):
    minidl.set_seed(seed)
    f64 = minidl.float64
    return nn.SequentialCell(nn.Dense(3, 5, dtype=f64), nn.Tanh(), nn.Dense(5, 2, dtype=f64))


def _data(rows, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 3)), rng.standard_normal((rows, 2))


LOSS = nn.MSELoss(reduction="mean")


def _params(net):
    return {k: v.asnumpy().copy() for k, v in net.parameters_and_names()}


@pytest.mark.parametrize("how", ["backward_and_update", "call", "threshold_1"])
def test_backward_and_update_equals_one_device_on_the_global_batch(how):
    # "call": SINGA's examples/cnn trains with optimizer(loss), its DistOpt's backward_and_update(loss);
    # "threshold_1": the smallest threshold, one gradient per fused buffer, gives the same values
    n, b, steps = 2, 2, 3
    x, y = _data(n * b * steps)
    ref = _mlp(0)
    opt = nn.Momentum(ref.trainable_params(), 0.05, 0.9)
    grad_fn = minidl.value_and_grad(lambda a, c: LOSS(ref(a), c), None, opt.parameters)
    for s in range(steps):
        opt(grad_fn(Tensor(x[s * n * b:(s + 1) * n * b]), Tensor(y[s * n * b:(s + 1) * n * b]))[1])
    want = _params(ref)

    def rank():
        net = _mlp(0)
        sgd = DistOpt(nn.Momentum(net.trainable_params(), 0.05, 0.9))
        r = sgd.global_rank
        assert (sgd.world_size, sgd.local_rank) == (n, r)
        for s in range(steps):
            rows = slice(s * n * b + r * b, s * n * b + (r + 1) * b)
            loss = LOSS(net(Tensor(x[rows])), Tensor(y[rows]))
            if how == "call":
                assert sgd(loss) is None
            else:
                assert sgd.backward_and_update(loss, **({"threshold": 1} if how == "threshold_1" else {})) is None
            assert all(p.grad is None for p in sgd.parameters)  # taken, then cleared, as SINGA's
        return _params(net)

    for got in run_threads(n, rank):
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-10, atol=1e-12, err_msg=k)


@pytest.mark.parametrize("clip", [0.5, None], ids=["clip_Value=0.5", "default_clip_Value"])
def test_backward_and_update_half_sends_fp16_and_clips(clip):
    x, y = _data(4)
    bound = 100 if clip is None else clip  # SINGA's default clip_Value

    def model():
        minidl.set_seed(0)  # an unreached parameter last: no gradient, nothing to clip, zeros sent
        return nn.SequentialCell(_mlp(0), nn.Dense(2, 2, dtype=minidl.float64))

    def rank():
        net = model()
        sgd = DistOpt(nn.SGD(net.trainable_params(), 0.1))
        r = sgd.global_rank
        rows = (Tensor(x[2 * r:2 * r + 2]), Tensor(y[2 * r:2 * r + 2]))
        grad_fn = minidl.value_and_grad(lambda a, c: LOSS(net[0](a), c) * 1e6, None, sgd.parameters)
        grads = [np.zeros(p.shape) if g is None else g.asnumpy() for p, g in zip(sgd.parameters, grad_fn(*rows)[1])]
        with CommCounter() as counter:
            sgd.backward_and_update_half(LOSS(net[0](rows[0]), rows[1]) * 1e6, clipping=True,
                                         **({} if clip is None else {"clip_Value": clip}))
        return [p.asnumpy().copy() for p in sgd.parameters], grads, counter.bytes("allreduce", "gradients")

    n_params = sum(int(np.prod(p.shape)) for p in model().trainable_params())
    before = [p.asnumpy().copy() for p in model().trainable_params()]
    results = run_threads(2, rank)
    for i, start in enumerate(before):  # SGD on the mean over the ranks of each gradient clipped to the bound
        mean = np.mean([np.clip(grads[i], -bound, bound) for _, grads, _ in results], axis=0)
        assert (np.max(np.abs(mean)) > bound / 5) == (i < 4)  # 1e6 times the loss: most are clipped, not 0
        for got, _, sent in results:
            assert sent == 2 * n_params  # float16 on the wire; a 2-rank ring sends the buffer once
            np.testing.assert_allclose(got[i], start - 0.1 * mean, rtol=0, atol=0.1 * bound * 2 ** -10)


def test_backward_and_update_half_skips_a_step_that_overflows_and_warns():
    x, y = _data(4)

    def rank():
        net = _mlp(0)
        sgd = DistOpt(nn.SGD(net.trainable_params(), 0.1))
        r = sgd.global_rank
        skipped = [sgd.skipped_steps]
        for _ in range(2):  # 1e6 times the loss, not clipped (the default): beyond fp16's range
            sgd.backward_and_update_half(LOSS(net(Tensor(x[2 * r:2 * r + 2])), Tensor(y[2 * r:2 * r + 2])) * 1e6)
            skipped.append(sgd.skipped_steps)
        return _params(net), skipped

    before = _params(_mlp(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_threads(2, rank)
    for got, skipped in results:
        assert skipped == [0, 1, 2]
        assert all(np.array_equal(got[k], before[k]) for k in got)  # skipped, not applied
    overflows = [w for w in caught if "the fp16 reduction overflowed" in str(w.message)]
    assert len(overflows) == 4  # 2 ranks, 2 steps
    package = os.path.dirname(minidl_parallel.__file__)
    for w in overflows:  # a RuntimeWarning pointing at the caller's line, not inside minidl_parallel
        assert w.category is RuntimeWarning and not w.filename.startswith(package), (w.category, w.filename)
    want = ("DistOpt.backward_and_update_half: the fp16 reduction overflowed (inf or NaN); the step is skipped "
            "({} so far); clipping=True bounds each gradient")
    assert sorted(str(w.message) for w in overflows) == [want.format(1)] * 2 + [want.format(2)] * 2


def _sparse_run(topk, spars, corr, n, seed):
    """Plain SGD (lr 1): each step moves the parameters by -(sum of what the ranks sent) / n; so
    n * (start - end) + the residuals should be the sum of every dense gradient so far. Returns,
    per rank and step, (that left side, that sum)."""
    x, y = _data(4 * n * 3, seed)
    if not topk:
        spars = spars / 10  # a threshold on |g|: a few of these gradients pass it

    def rank():
        net = _mlp(seed)
        sgd = DistOpt(nn.SGD(net.trainable_params(), 1.0))
        r = sgd.global_rank
        grad_fn = minidl.value_and_grad(lambda a, c: LOSS(net(a), c), None, sgd.parameters)
        start = np.concatenate([p.asnumpy().ravel() for p in sgd.parameters])
        dense_sum = np.zeros_like(start)
        checks = []
        for s in range(3):
            rows = slice((s * n + r) * 4, (s * n + r + 1) * 4)
            _, grads = grad_fn(Tensor(x[rows]), Tensor(y[rows]))
            dense = np.concatenate([g.asnumpy().ravel() for g in grads])
            dense_sum += sgd.communicator.allreduce(dense, "sum")
            sgd.backward_and_sparse_update(LOSS(net(Tensor(x[rows])), Tensor(y[rows])), spars=spars, topK=topk,
                                           corr=corr)
            end = np.concatenate([p.asnumpy().ravel() for p in sgd.parameters])
            residual = to_numpy(sgd.residuals[np.dtype(np.float64)]) if corr else np.zeros_like(end)
            residuals = sgd.communicator.allreduce(residual, "sum")
            checks.append((n * (start - end) + residuals, dense_sum.copy()))
        return checks

    return run_threads(n, rank)


@given(topk=st.booleans(), spars=st.sampled_from([0.05, 0.2, 0.5, 1.0]), n=st.integers(1, 4),
       seed=st.integers(0, 100))
def test_sparse_update_with_error_feedback_sent_plus_residual_is_every_gradient(topk, spars, n, seed):
    for checks in _sparse_run(topk, spars if topk else spars / 10, True, n, seed):
        for got, want in checks:
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_sparse_update_without_error_feedback_loses_what_it_did_not_send():
    for topk, spars in ((True, 0.05), (False, 0.02)):
        for checks in _sparse_run(topk, spars, False, 2, 0):
            got, want = checks[-1]
            assert np.max(np.abs(got - want)) > 1e-3 * np.max(np.abs(want))
    for checks in _sparse_run(True, 1.0, False, 2, 0):  # sending everything loses nothing
        for got, want in checks:
            np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_sparse_top_k_sends_the_fraction_of_entries_with_their_indices():
    x, y = _data(8)

    def rank():
        net = _mlp(0)
        sgd = DistOpt(nn.SGD(net.trainable_params(), 0.1))
        r = sgd.global_rank
        with CommCounter() as counter:
            sgd.backward_and_sparse_update(LOSS(net(Tensor(x[4 * r:4 * r + 4])), Tensor(y[4 * r:4 * r + 4])),
                                           spars=0.1, topK=True)
        return counter.events

    n_params = sum(int(np.prod(p.shape)) for p in _mlp(0).trainable_params())  # 42
    k = int(np.ceil(0.1 * n_params))
    for events in run_threads(2, rank):
        sent = [e for e in events if e.phase == "gradients"]
        assert [e.kind for e in sent] == ["allgather"]
        assert sent[0].bytes_per_rank == k * (8 + 8)  # k int64 indices + k float64 values; a 2-rank gather


def test_partial_update_rotation_makes_the_ranks_equal_and_shares_its_schedule():
    x, y = _data(16)
    threshold = 12  # parameters of 15, 5, 10 and 2 elements: chunks [0], [1], [2, 3]

    def rank():
        net = _mlp(0)
        sgd = DistOpt(nn.SGD(net.trainable_params(), 0.1))
        r = sgd.global_rank
        schedule = []
        for s in range(3):  # local steps on different data: the ranks drift apart
            rows = slice(8 * r + 2 * s, 8 * r + 2 * s + 2)
            schedule.append(sgd.backward_and_partial_update(LOSS(net(Tensor(x[rows])), Tensor(y[rows])),
                                                            threshold=threshold))
        drifted = _params(net)
        for p in sgd.opt.param_groups:
            p["lr"] = 0.0  # no further local change
        rotation = len(sgd._chunks(threshold))
        for _ in range(rotation):
            schedule.append(sgd.backward_and_partial_update(LOSS(net(Tensor(x[:2])), Tensor(y[:2])),
                                                            threshold=threshold))
        return schedule, drifted, _params(net)

    (s0, d0, p0), (s1, d1, p1) = run_threads(2, rank)
    assert s0 == s1 == [[0], [1], [2, 3]] * 2  # the same chunks on every rank, in order from the first (SINGA's)
    assert any(not np.array_equal(d0[k], d1[k]) for k in d0)  # local steps made them differ
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k])


def test_bad_arguments_are_clear_errors():
    run_threads(1, _bad_arguments)  # DistOpt joins a world (init): a thread-rank's, left with the thread


def _bad_arguments():
    net = _mlp(0)
    sgd = DistOpt(nn.SGD(net.trainable_params(), 0.1))

    def loss():
        return LOSS(net(Tensor(np.ones((1, 3)))), Tensor(np.ones((1, 2))))

    for spars, topk, match in ((0.0, True, r"with topK=True spars is the fraction of entries sent, in \(0, 1\]; "
                                           r"got 0.0"),
                               (1.5, True, r"in \(0, 1\]; got 1.5"),
                               (0.0, False, r"with topK=False spars is the threshold \|g\| >= spars, > 0; got 0.0"),
                               (-1, False, "> 0; got -1")):
        with pytest.raises(ValueError, match=r"^DistOpt\.backward_and_sparse_update: .*" + match):
            sgd.backward_and_sparse_update(loss(), spars=spars, topK=topk)
    for clip in (0, -1.0):
        with pytest.raises(ValueError,
                           match=rf"^DistOpt\.backward_and_update_half: clip_Value must be > 0, got {clip}$"):
            sgd.backward_and_update_half(loss(), clipping=True, clip_Value=clip)
    sgd.backward_and_update(loss(), threshold=7)  # a first reducer exists: each threshold is still checked
    for threshold in (0, -3, True, 2.5, None):
        with pytest.raises(ValueError, match=r"^DistOpt: threshold must be a positive int \(elements per fused "
                                             rf"buffer\), got {threshold!r}$"):
            sgd.backward_and_update(loss(), threshold=threshold)
    with pytest.raises(TypeError, match="^DistOpt: loss must be the Tensor the network's loss returned, got float$"):
        sgd.backward_and_update(1.0)
    with pytest.raises(RuntimeError, match=r"already initialised with backend 'threads'; call release\(\) before "
                                           r"init\('nccl'\)"):
        DistOpt(nn.SGD(net.trainable_params(), 0.1), nccl_id=b"x")  # an nccl id joins the nccl backend
    with pytest.raises(ValueError, match=r"^init: world_size must be None or an int >= 1, got 0$"):
        DistOpt(nn.SGD(net.trainable_params(), 0.1), nccl_id=b"x", world_size=0)  # checked on the nccl path too
    with pytest.raises(RuntimeError, match="world_size=4 was asked, but this process was not started by a launcher"):
        DistOpt(nn.SGD(net.trainable_params(), 0.1), world_size=4)
    assert DistOpt(nn.SGD(net.trainable_params(), 0.1), local_rank=0, world_size=1).local_rank == 0  # the world's
    with pytest.raises(ValueError, match=r"^DistOpt: local_rank=1 was given, but this process is local rank 0 of its "
                                         r"machine; pass local_rank=None$"):
        DistOpt(nn.SGD(net.trainable_params(), 0.1), local_rank=1)
    with pytest.raises(TypeError, match=r"^DistOpt: opt must be a minidl optimizer \(callable, with \.parameters\), "
                                        r"got SequentialCell$"):
        DistOpt(net)


def test_defaults_are_singas():
    # SINGA's opt.DistOpt: __init__(opt, nccl_id=None, local_rank=None, world_size=None, buffSize=4194304),
    # backward_and_update_half(loss, threshold=2097152, clipping=False, clip_Value=100),
    # backward_and_sparse_update(loss, threshold=2097152, spars=0.05, topK=False, corr=True)
    def defaults(fn):
        return {k: v.default for k, v in inspect.signature(fn).parameters.items() if v.default is not v.empty}

    assert defaults(DistOpt.__init__) == {"nccl_id": None, "local_rank": None, "world_size": None, "buffSize": 4194304}
    assert defaults(DistOpt.backward_and_update) == {"threshold": 2097152}
    assert defaults(DistOpt.backward_and_update_half) == {"threshold": 2097152, "clipping": False, "clip_Value": 100}
    assert defaults(DistOpt.backward_and_partial_update) == {"threshold": 2097152}
    assert defaults(DistOpt.backward_and_sparse_update) == {"threshold": 2097152, "spars": 0.05, "topK": False,
                                                            "corr": True}


def test_the_wrapped_optimizers_attributes_read_through():
    def rank():
        opt = nn.SGD(_mlp(0).trainable_params(), 0.1)
        sgd = DistOpt(opt)
        assert sgd.learning_rate is opt.learning_rate and sgd.param_groups is opt.param_groups
        with pytest.raises(AttributeError, match="no_such_attribute"):
            sgd.no_such_attribute
        twin = copy.copy(sgd)  # copy builds the object before its __dict__: no recursion through self.opt
        assert twin.opt is opt and twin.communicator is sgd.communicator
        with pytest.raises(AttributeError, match="^opt$"):  # an instance not initialised names what it lacks
            DistOpt.__new__(DistOpt).learning_rate

    run_threads(1, rank)


def test_sparse_update_groups_the_gradients_by_dtype():
    # float32 parameters (one never reached by the loss: its gradient counts as zeros) and a float64
    # one: each dtype is selected, sent and kept as a residual in its own dtype.
    x, y = _data(8)

    def rank():
        minidl.set_seed(0)
        f32 = nn.SequentialCell(nn.Dense(3, 5, dtype=minidl.float32), nn.Tanh(), nn.Dense(5, 2, dtype=minidl.float32))
        f64 = nn.Dense(3, 2, dtype=minidl.float64, has_bias=False)
        unreached = nn.Dense(2, 2, dtype=minidl.float32)
        params = nn.SequentialCell(f32, f64, unreached).trainable_params()
        sgd = DistOpt(nn.SGD(params, 1.0))
        r = sgd.global_rank

        def loss_fn(a, c):
            return LOSS(f32(Tensor(a.asnumpy().astype(np.float32))), Tensor(c.asnumpy().astype(np.float32))) \
                + LOSS(f64(a), c)

        rows = (Tensor(x[4 * r:4 * r + 4]), Tensor(y[4 * r:4 * r + 4]))
        grads = [np.zeros(p.shape, p.dtype) if g is None else g.asnumpy()
                 for p, g in zip(params, minidl.value_and_grad(loss_fn, None, sgd.parameters)(*rows)[1])]
        start = [p.asnumpy().copy() for p in params]
        sgd.backward_and_sparse_update(loss_fn(*rows), spars=0.5, topK=True, corr=True)
        residuals = {dt: to_numpy(v) for dt, v in sgd.residuals.items()}
        return start, [p.asnumpy().copy() for p in params], grads, residuals

    results = run_threads(2, rank)
    start, end, _, residuals = results[0]
    assert {dt: v.dtype for dt, v in residuals.items()} == {np.dtype(np.float32): np.float32,
                                                            np.dtype(np.float64): np.float64}
    dtypes = [p.dtype for p in start]
    assert dtypes == [np.float32] * 4 + [np.float64] + [np.float32] * 2
    for dt in (np.float32, np.float64):  # sent + residual is the gradient, per dtype (lr 1, one step)
        members = [i for i, d in enumerate(dtypes) if d == dt]
        sent = 2 * np.concatenate([(start[i] - end[i]).ravel() for i in members])  # every rank moved by sent / 2
        dense = sum(np.concatenate([g[i].ravel() for i in members]) for _, _, g, _ in results)
        kept = sum(res[np.dtype(dt)] for _, _, _, res in results)
        np.testing.assert_allclose(sent + kept, dense, rtol=1e-5 if dt == np.float32 else 1e-12, atol=1e-6)
    for s, e, _, res in results:
        for i in (5, 6):  # the unreached parameter: nothing to send, nothing kept
            np.testing.assert_array_equal(e[i], s[i])
        assert not res[np.dtype(np.float32)][-6:].any()


def test_threshold_counts_elements_whatever_the_dtype():
    # SINGA's threshold is elements per fused buffer: for float32 gradients of 15, 5, 10 and 2
    # elements, threshold=20 makes buffers of at most 20 float32s (80 bytes), not 20 float64s
    x, y = _data(4)

    def rank():
        minidl.set_seed(0)
        f32 = minidl.float32
        net = nn.SequentialCell(nn.Dense(3, 5, dtype=f32), nn.Tanh(), nn.Dense(5, 2, dtype=f32))
        sgd = DistOpt(nn.SGD(net.trainable_params(), 0.1))
        r = sgd.global_rank
        with CommCounter() as counter:
            sgd.backward_and_update(LOSS(net(Tensor(x[2 * r:2 * r + 2].astype(np.float32))),
                                         Tensor(y[2 * r:2 * r + 2].astype(np.float32))), threshold=20)
        return counter.events

    for events in run_threads(2, rank):
        assert all(e.kind == "allreduce" and e.phase == "gradients" for e in events)
        assert sorted(e.bytes_per_rank for e in events) == [15 * 4, 17 * 4]  # a 2-rank ring sends each buffer once


def test_sparse_update_defaults_are_singas():
    # SINGA's spars=0.05, topK=False, corr=True: every |g| >= 0.05 sent, the rest kept as a residual
    x, y = _data(8)

    def rank():
        runs = []
        for kwargs in ({}, {"spars": 0.05, "topK": False, "corr": True}):
            net = _mlp(0)
            sgd = DistOpt(nn.SGD(net.trainable_params(), 1.0))
            r = sgd.global_rank
            for s in range(2):
                rows = slice(4 * r + 2 * s, 4 * r + 2 * s + 2)
                sgd.backward_and_sparse_update(LOSS(net(Tensor(x[rows])), Tensor(y[rows])), **kwargs)
            runs.append((_params(net), {k: to_numpy(v) for k, v in sgd.residuals.items()}))
        return runs

    for (defaults, kept), (explicit, want_kept) in run_threads(2, rank):
        residual = want_kept[np.dtype(np.float64)]
        assert 0 < np.count_nonzero(residual) < residual.size  # some gradients sent, some kept
        assert set(kept) == set(want_kept)
        np.testing.assert_array_equal(kept[np.dtype(np.float64)], residual)
        for k in explicit:
            np.testing.assert_array_equal(defaults[k], explicit[k], err_msg=k)
