"""GRAPH_MODE under data and tensor parallelism: its layer wraps the parallel runtime, fuses, and
the run equals the single-device eager run (not itself)."""

import numpy as np
import pytest

import minidl
from minidl import Tensor, nn, ops
from minidl_parallel import run_threads
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel.grad_reducer import DistributedGradReducer
from minidl_parallel.testing import compare_runs, init_arrays, run_rank, run_single
from minidl.testing.modes import mode

F64 = minidl.float64


@pytest.fixture
def fused_calls(monkeypatch):
    """The fused ops' calls (at Primitive.apply: a kernel or the reference body), from any rank's thread."""
    from minidl.ops.primitive import Primitive
    calls, original = [], Primitive.apply

    def apply(prim, *args):
        if type(prim) in (ops.DenseReLU, ops.BatchNormReLU):
            calls.append(type(prim).__name__)
        return original(prim, *args)
    monkeypatch.setattr(Primitive, "apply", apply)
    return calls


def _mlp():
    return nn.SequentialCell(nn.Dense(3, 5, dtype=F64), nn.ReLU(), nn.Dense(5, 4, dtype=F64), nn.ReLU(),
                             nn.Dense(4, 2, dtype=F64))


def _train(init, xs, ys, reducer_factory=None, reduce_loss=float):
    net = _mlp()
    for name, p in net.parameters_and_names():
        p.set_data(init[name].copy())
    net.set_train(True)
    loss_fn = nn.MSELoss()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    reducer = reducer_factory(opt.parameters) if reducer_factory else None
    losses = []
    for x, y in zip(xs, ys):
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        if reducer is not None:
            grads = reducer(grads)
        opt(grads)
        losses.append(reduce_loss(loss.asnumpy()))
    return losses, {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_graph_mode_fuses_and_equals_one_eager_process(n, fused_calls):
    rng = np.random.default_rng(n)
    xs, ys = rng.standard_normal((2, 2 * n, 3)), rng.standard_normal((2, 2 * n, 2))
    init = {name: p.asnumpy().copy() for name, p in _mlp().parameters_and_names()}
    with mode(minidl.PYNATIVE_MODE):
        want_losses, want_params = _train(init, xs, ys)
    assert fused_calls == []

    def rank_body():
        comm = resolve_communicator("test", None)
        part = slice(comm.rank * 2, comm.rank * 2 + 2)
        return _train(init, xs[:, part], ys[:, part], reducer_factory=lambda params: DistributedGradReducer(params),
                      reduce_loss=lambda v: float(comm.allreduce(np.asarray(v), "mean")))
    with mode(minidl.GRAPH_MODE):
        results = run_threads(n, rank_body)
    assert fused_calls.count("DenseReLU") == n * 2 * 2  # each rank, each step, both Dense + ReLU pairs
    for losses, params in results:
        np.testing.assert_allclose(losses, want_losses, rtol=1e-10, atol=1e-12)
        for name, value in params.items():
            np.testing.assert_allclose(value, want_params[name], rtol=1e-10, atol=1e-12, err_msg=name)


def _data(batch=8, features=6, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, features)), "y": rng.standard_normal((batch, 4)),
            "batch": batch, "features": features, "seed": seed, "arrays": init_arrays(LAYERS, features, seed)}


LAYERS = [  # MatMul (x @ w.T) + ReLU: the row GRAPH_MODE fuses into DenseReLU; then a bias and a sharded MatMul
    {"op": "matmul", "out": 8, "transpose_b": True, "strategy": None},
    {"op": "unary", "fn": "relu", "strategy": None},
    {"op": "bias", "strategy": None},
    {"op": "matmul", "out": 4, "transpose_b": True, "strategy": ((2, 1), (1, 1))},
]


@pytest.mark.parametrize("parallel_mode", ["semi_auto_parallel", "auto_parallel"])
def test_tensor_parallel_graph_mode_fuses_and_equals_one_eager_device(parallel_mode, monkeypatch):
    from minidl_parallel.tensor_parallel import dispatch
    seen, original = [], dispatch.run_op

    def run_op(prim, args):
        seen.append(type(prim).__name__)
        return original(prim, args)
    monkeypatch.setattr(dispatch, "run_op", run_op)
    data = _data()
    with mode(minidl.PYNATIVE_MODE):
        ref = run_single(LAYERS, {"loss": "mse"}, data)
    with mode(minidl.GRAPH_MODE):
        got = run_threads(2, run_rank, LAYERS, {"loss": "mse"}, data, parallel_mode)
    assert "DenseReLU" in seen  # the tensor-parallel runtime ran the fused op, by its own rule
    assert "MatMul" in seen  # the sharded MatMul (a user strategy) was not a head: eager's op
    for out in got:
        compare_runs(out, ref)
