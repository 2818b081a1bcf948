"""SINGA's DistOpt: each update mode against its own exact property, on the threads backend."""
import warnings

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
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


@pytest.mark.parametrize("how", ["backward_and_update", "call"])
def test_backward_and_update_equals_one_device_on_the_global_batch(how):
    # "call": SINGA's examples/cnn trains with optimizer(loss), its DistOpt's backward_and_update(loss)
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
            assert (sgd(loss) if how == "call" else sgd.backward_and_update(loss)) is None
        return _params(net)

    for got in run_threads(n, rank):
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-10, atol=1e-12, err_msg=k)


def test_backward_and_update_half_sends_fp16_and_clips():
    x, y = _data(4)

    def rank(clipping):
        net = _mlp(0)
        sgd = DistOpt(nn.SGD(net.trainable_params(), 0.1))
        r = sgd.global_rank
        with CommCounter() as counter:
            sgd.backward_and_update_half(LOSS(net(Tensor(x[2 * r:2 * r + 2])), Tensor(y[2 * r:2 * r + 2])) * 1e6,
                                         clipping=clipping, clip_Value=0.5)
        return _params(net), counter.bytes("allreduce", "gradients")

    n_params = sum(int(np.prod(p.shape)) for p in _mlp(0).trainable_params())
    before = _params(_mlp(0))
    clipped = run_threads(2, lambda: rank(True))
    for got, sent in clipped:
        assert sent == 2 * n_params  # float16 on the wire; a 2-rank ring sends the buffer once
        for k, v in got.items():  # every clipped gradient is within 0.5, so each step within lr * 0.5 (+ rounding)
            assert np.max(np.abs(v - before[k])) <= 0.1 * 0.5 * (1 + 2 ** -10), k
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        unclipped = run_threads(2, lambda: rank(False))  # 1e6 times the loss: beyond fp16's range
    assert any("the fp16 reduction overflowed" in str(w.message) for w in caught)
    for got, _ in unclipped:
        assert all(np.array_equal(got[k], before[k]) for k in got)  # skipped, not applied


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

    def rank():
        net = _mlp(0)
        sgd = DistOpt(nn.SGD(net.trainable_params(), 0.1))
        r = sgd.global_rank
        schedule = []
        for s in range(3):  # local steps on different data: the ranks drift apart
            rows = slice(8 * r + 2 * s, 8 * r + 2 * s + 2)
            schedule.append(sgd.backward_and_partial_update(LOSS(net(Tensor(x[rows])), Tensor(y[rows])), threshold=20))
        drifted = _params(net)
        for p in sgd.opt.param_groups:
            p["lr"] = 0.0  # no further local change
        rotation = len(sgd._chunks(20))
        for _ in range(rotation):
            schedule.append(sgd.backward_and_partial_update(LOSS(net(Tensor(x[:2])), Tensor(y[:2])), threshold=20))
        return schedule, drifted, _params(net)

    (s0, d0, p0), (s1, d1, p1) = run_threads(2, rank)
    assert s0 == s1 and len({tuple(c) for c in s0}) > 1  # the same chunks, round robin
    assert any(not np.array_equal(d0[k], d1[k]) for k in d0)  # local steps made them differ
    for k in p0:
        np.testing.assert_array_equal(p0[k], p1[k])


def test_bad_arguments_are_clear_errors():
    run_threads(1, _bad_arguments)  # DistOpt joins a world (init): a thread-rank's, left with the thread


def _bad_arguments():
    net = _mlp(0)
    sgd = DistOpt(nn.SGD(net.trainable_params(), 0.1))
    loss = LOSS(net(Tensor(np.ones((1, 3)))), Tensor(np.ones((1, 2))))
    for spars, topk, match in ((0.0, True, r"in \(0, 1\]; got 0.0"), (1.5, True, r"in \(0, 1\]; got 1.5"),
                               (0.0, False, "> 0; got 0.0"), (-1, False, "> 0; got -1")):
        with pytest.raises(ValueError, match=match):
            sgd.backward_and_sparse_update(loss, spars=spars, topK=topk)
    with pytest.raises(RuntimeError, match=r"already initialised with backend 'threads'; call release\(\) before "
                                           r"init\('nccl'\)"):
        DistOpt(nn.SGD(net.trainable_params(), 0.1), nccl_id=b"x")  # an nccl id joins the nccl backend
    with pytest.raises(RuntimeError, match="world_size=4 was asked, but this process was not started by a launcher"):
        DistOpt(nn.SGD(net.trainable_params(), 0.1), world_size=4)
    with pytest.raises(TypeError, match="opt must be a minidl optimizer"):
        DistOpt(net)
