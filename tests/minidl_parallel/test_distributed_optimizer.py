"""Horovod's spellings (DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state,
Average/Sum/Adasum) against one device, on the threads backend."""
import warnings

import numpy as np
import pytest

import minidl
from minidl import Tensor, nn
from minidl_parallel import run_threads
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel.compression import Compression
from minidl_parallel.distributed_optimizer import (Adasum, Average, DistributedOptimizer, Sum,
                                                   broadcast_optimizer_state, broadcast_parameters)


def _mlp(seed):
    minidl.set_seed(seed)
    f64 = minidl.float64
    return nn.SequentialCell(nn.Dense(3, 4, dtype=f64), nn.Tanh(), nn.Dense(4, 2, dtype=f64))


def _data(n_rows, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n_rows, 3)), rng.standard_normal((n_rows, 2))


def test_horovod_loop_with_broadcasts_equals_one_device():
    """Ranks start from different seeds; broadcast_parameters makes rank 0's model everyone's,
    and DistributedOptimizer's averaged steps then follow one device on the global batch."""
    n, b, steps = 2, 3, 3
    x, y = _data(n * b * steps)
    loss_fn = nn.MSELoss(reduction="mean")

    def train(net, opt, rows):
        grad_fn = minidl.value_and_grad(lambda a, c: loss_fn(net(a), c), None, opt.parameters)
        for r in rows:
            _, grads = grad_fn(Tensor(x[r]), Tensor(y[r]))
            assert opt(grads) is not False
        return {k: v.asnumpy() for k, v in net.parameters_and_names()}

    ref_net = _mlp(0)
    want = train(ref_net, nn.Momentum(ref_net.trainable_params(), 0.05, 0.9),
                 [slice(s * n * b, (s + 1) * n * b) for s in range(steps)])

    def rank():
        r = resolve_communicator("test", None).rank
        net = _mlp(0 if r == 0 else 7 + r)
        opt = DistributedOptimizer(nn.Momentum(net.trainable_params(), 0.05, 0.9),
                                   named_parameters=net.parameters_and_names())
        assert broadcast_parameters(net.parameters_dict(), root_rank=0) >= 1
        broadcast_optimizer_state(opt, root_rank=0)
        return train(net, opt, [slice(s * n * b + r * b, s * n * b + (r + 1) * b) for s in range(steps)])

    for got in run_threads(n, rank):
        for k, v in want.items():
            np.testing.assert_allclose(got[k], v, rtol=1e-10, atol=1e-12, err_msg=k)


def test_broadcast_optimizer_state_copies_rank_0s_momentum():
    def rank():
        r = resolve_communicator("test", None).rank
        net = _mlp(0)
        opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
        grads = tuple(Tensor(np.full(p.shape, float(r + 1))) for p in opt.parameters)
        opt(grads)  # the momentum buffers now differ per rank: r + 1
        broadcast_optimizer_state(opt, root_rank=1)
        return {k: np.array(v.asnumpy()) for k, v in opt.parameters_and_names()}

    states = run_threads(2, rank)
    assert set(states[0]) == set(states[1]) and len(states[0]) > 1
    for k in states[0]:
        np.testing.assert_array_equal(states[0][k], states[1][k])
    moments = [v for k, v in states[0].items() if k != "global_step"]
    assert all(np.all(m == 2.0) for m in moments)  # rank 1's: its gradient was 2


def test_sum_op_sums_and_accumulation_returns_false_until_the_kth_call():
    def rank():
        r = resolve_communicator("test", None).rank
        net = _mlp(0)
        inner = nn.SGD(net.trainable_params(), 1.0)
        opt = DistributedOptimizer(inner, op=Sum, backward_passes_per_step=2)
        before = [p.asnumpy().copy() for p in opt.parameters]
        ones = tuple(Tensor(np.full(p.shape, float(r + 1))) for p in opt.parameters)
        applied = [opt(ones), opt(ones)]
        return applied, [b - p.asnumpy() for b, p in zip(before, opt.parameters)]

    for applied, deltas in run_threads(2, rank):
        assert applied == [False, True]
        assert all(np.allclose(d, 2 * (1 + 2)) for d in deltas)  # 2 passes, summed over ranks 1 + 2


def test_an_overflowed_fp16_step_is_skipped_and_reported():
    def rank():
        net = _mlp(0)
        opt = DistributedOptimizer(nn.SGD(net.trainable_params(), 0.1), compression=Compression.fp16)
        before = [p.asnumpy().copy() for p in opt.parameters]
        huge = tuple(Tensor(np.full(p.shape, 6e4)) for p in opt.parameters)  # the sum exceeds fp16's 65504
        applied = opt(huge)
        unchanged = all(np.array_equal(b, p.asnumpy()) for b, p in zip(before, opt.parameters))
        return applied, unchanged, opt.skipped_steps

    with warnings.catch_warnings(record=True) as caught:  # the warnings module is process-wide: catch here
        warnings.simplefilter("always")
        results = run_threads(2, rank)
    for applied, unchanged, skipped in results:
        assert applied is False and unchanged and skipped == 1
    messages = [str(w.message) for w in caught]
    assert sum("call 1: the reduced gradients hold inf or NaN" in m and "step is skipped" in m for m in messages) == 2


def test_adasum_op_and_bad_settings():
    def rank():
        r = resolve_communicator("test", None).rank
        net = nn.SequentialCell(nn.Dense(2, 1, has_bias=False, dtype=minidl.float64))
        opt = DistributedOptimizer(nn.SGD(net.trainable_params(), 1.0), op=Adasum)
        w0 = opt.parameters[0].asnumpy().copy()
        g = np.zeros((1, 2))
        g[0, r] = 1.0  # orthogonal gradients: Adasum adds them
        opt((Tensor(g),))
        return w0 - opt.parameters[0].asnumpy()

    for delta in run_threads(2, rank):
        np.testing.assert_allclose(delta, [[1.0, 1.0]])
    net = _mlp(0)
    with pytest.raises(ValueError, match="op must be Average, Sum or Adasum, got 'Max'"):
        DistributedOptimizer(nn.SGD(net.trainable_params(), 0.1), op="Max")
    with pytest.raises(TypeError, match="optimizer must be a minidl optimizer"):
        DistributedOptimizer(net)
    assert Average == "Average"
