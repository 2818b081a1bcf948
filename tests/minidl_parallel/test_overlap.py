"""Model overlaps the gradient all-reduce with backward through the reducer's ready/finish."""
import numpy as np
import pytest

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.ops.primitive import Primitive
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel import run_threads
from minidl_parallel.grad_reducer import DistributedGradReducer

F64 = minidl.float64
N, PER_RANK, STEPS = 2, 2, 3


class _Mark(Primitive):
    """Identity whose backward logs itself: the layers before it get their gradients after this."""

    n_inputs = 1

    def __init__(self, log):
        super().__init__()
        self.log = log

    def forward(self, x):
        return x

    def backward(self, gy):
        self.log.append("mark backward")
        return (gy,)


class _MarkCell(nn.Cell):
    def __init__(self, log):
        super().__init__()
        self.mark = _Mark(log)

    def construct(self, x):
        return self.mark(x)


def _net(log):
    return nn.SequentialCell(nn.Dense(3, 4, dtype=F64), _MarkCell(log), nn.Tanh(), nn.Dense(4, 3, dtype=F64),
                             nn.Dense(3, 2, dtype=F64))


def _train(overlap, log, data, label, init):
    comm = resolve_communicator("test", None)
    net = _net(log)
    for name, p in net.parameters_and_names():
        p.set_data(init[name].copy())
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    reducer = DistributedGradReducer(opt.parameters, mean=True, fusion_bytes=8 * 8)  # several buckets
    launch, launch_blocking = comm.iallreduce_, comm.allreduce_

    def spy(x, op="sum"):
        log.append("bucket started")
        return launch(x, op)

    def spy_blocking(x, op="sum"):  # the blocking path (reducer.__call__) takes allreduce_
        log.append("bucket started")
        return launch_blocking(x, op)
    comm.iallreduce_, comm.allreduce_ = spy, spy_blocking
    # A plain callable hides ready/finish, which forces Model's blocking path.
    model = minidl.Model(net, nn.MSELoss(), opt, grad_reducer=reducer if overlap else (lambda g: reducer(g)))
    part = slice(comm.rank, None, N)
    ds = NumpySlicesDataset({"data": data[part], "label": label[part]}, shuffle=False).batch(PER_RANK)
    before = comm.collective_count
    try:
        model.train(1, ds, progress=False)
    finally:
        del comm.iallreduce_, comm.allreduce_
    return ({n: p.asnumpy().copy() for n, p in net.parameters_and_names()}, comm.collective_count - before,
            len(reducer.buckets))


def _run_both():
    rng = np.random.default_rng(4)
    data, label = rng.standard_normal((N * PER_RANK * STEPS, 3)), rng.standard_normal((N * PER_RANK * STEPS, 2))
    minidl.set_seed(4)
    init = {n: p.asnumpy().copy() for n, p in _net([]).parameters_and_names()}

    def body():
        logs = {True: [], False: []}
        runs = {flag: _train(flag, logs[flag], data, label, init) for flag in (True, False)}
        return runs, logs
    return run_threads(N, body)


def test_overlapped_steps_equal_blocking_ones_with_one_collective_per_bucket():
    for runs, logs in _run_both():
        (fast, fast_count, buckets), (slow, slow_count, _) = runs[True], runs[False]
        assert buckets >= 3
        # Besides one collective per bucket and step: the reducer's parameter agreement check, and
        # (the reducer given as itself, so Model sees it is collective) the step-count agreement.
        assert fast_count == STEPS * buckets + 2 and slow_count == STEPS * buckets + 1
        for name in slow:
            np.testing.assert_array_equal(fast[name], slow[name], err_msg=name)
        blocking = " ".join(logs[False]).split("mark backward")
        assert len(blocking) == STEPS + 1
        assert blocking[0] == "" and all(s.count("bucket started") == buckets for s in blocking[1:])


def test_buckets_start_before_backward_reaches_the_first_layer():
    for runs, logs in _run_both():
        steps = " ".join(logs[True]).split("mark backward")
        assert len(steps) == STEPS + 1
        # The later layers' buckets start before backward reaches the first layer.
        assert steps[0].count("bucket started") >= 1, logs[True]
