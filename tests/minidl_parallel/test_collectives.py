"""The differentiable collectives on the threads backend.

Each rank r holds X[r]; its loss is sum(W[r] * op(X[r])). The gradient each rank computes
must equal the gradient of the global loss (the sum of the ranks' losses) computed by one
process on the stacked data X, for forward values and adjoints alike.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Tensor
from minidl_parallel.collectives import AllGather, AllReduce, Broadcast, ReduceScatter, resolve_communicator
from minidl_parallel import run_threads

WORLDS = st.sampled_from([1, 2, 3, 4])
SHAPES = st.lists(st.integers(1, 3), min_size=1, max_size=2).map(tuple)


def _per_rank(op_factory, X, W):
    """Runs op on every rank: returns [(y_r, gx_r)] of the rank's loss sum(W[r] * op(X[r]))."""
    def body():
        r = minidl_parallel_rank()
        x = Tensor(X[r])
        op = op_factory()
        y = op(x)
        gx = minidl.grad(lambda t: (op_factory()(t) * Tensor(W[r])).sum())(x)
        return y.asnumpy(), gx.asnumpy()
    return run_threads(len(X), body)


def minidl_parallel_rank():
    return resolve_communicator("test", None).rank


def _reference(fn, X, W):
    """One process: the stacked outputs fn(X) (one row per rank) and d sum(W * fn(X)) / dX."""
    y = fn(Tensor(X))
    gx = minidl.grad(lambda t: (fn(t) * Tensor(W)).sum())(Tensor(X))
    return y.asnumpy(), gx.asnumpy()


def _draw(data, n, shape, distinct=False):
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    X = rng.standard_normal((n,) + shape)
    if distinct:  # max/min: no ties, so the reference gradient is unambiguous
        X = rng.permutation(np.arange(X.size, dtype=np.float64)).reshape(X.shape) / 7.0
    return X, rng


def _check(results, y_ref, g_ref):
    for r, (y, gx) in enumerate(results):
        np.testing.assert_allclose(y, y_ref[r], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(gx, g_ref[r], rtol=1e-12, atol=1e-12)


@given(data=st.data(), n=WORLDS, shape=SHAPES, op=st.sampled_from(["sum", "mean", "max", "min"]))
def test_allreduce_value_and_adjoint(data, n, shape, op):
    X, rng = _draw(data, n, shape, distinct=op in ("max", "min"))
    W = rng.standard_normal(X.shape)
    reduce = {"sum": lambda t: t.sum(axis=0, keepdims=True), "mean": lambda t: t.mean(axis=0, keepdims=True),
              "max": lambda t: t.max(axis=0, keepdims=True), "min": lambda t: -(-t).max(axis=0, keepdims=True)}[op]
    ones = Tensor(np.ones((n,) + (1,) * len(shape)))
    y_ref, g_ref = _reference(lambda t: reduce(t) * ones, X, W)
    _check(_per_rank(lambda: AllReduce(op), X, W), y_ref, g_ref)


def test_allreduce_max_ties_share_the_gradient():
    X = np.array([[1.0, 5.0], [1.0, 2.0], [1.0, 5.0]])  # column 0: all tie; column 1: ranks 0 and 2
    W = np.ones_like(X)
    got = np.stack([g for _, g in _per_rank(lambda: AllReduce("max"), X, W)])
    np.testing.assert_allclose(got, [[1.0, 1.5], [1.0, 0.0], [1.0, 1.5]])


def test_allreduce_prod_has_no_gradient():
    X, W = np.array([[2.0], [3.0]]), np.ones((2, 1))
    y = run_threads(2, lambda: AllReduce("prod")(Tensor(X[minidl_parallel_rank()])).asnumpy())
    np.testing.assert_allclose(y, [[6.0], [6.0]])
    with pytest.raises(RuntimeError, match="AllReduce: op=.prod. has no gradient"):
        _per_rank(lambda: AllReduce("prod"), X, W)


@given(data=st.data(), n=WORLDS, shape=SHAPES)
def test_allgather_value_and_adjoint(data, n, shape):
    X, rng = _draw(data, n, shape)
    W = rng.standard_normal((n, n * shape[0]) + shape[1:])
    tile = Tensor(np.ones((n, 1) + (1,) * (len(shape) - 1)))
    y_ref, g_ref = _reference(lambda t: t.reshape((1, n * shape[0]) + shape[1:]) * tile, X, W)
    _check(_per_rank(AllGather, X, W), y_ref, g_ref)


@given(data=st.data(), n=WORLDS, shape=SHAPES, op=st.sampled_from(["sum", "mean"]))
def test_reduce_scatter_value_and_adjoint(data, n, shape, op):
    shape = (n * shape[0],) + shape[1:]
    X, rng = _draw(data, n, shape)
    W = rng.standard_normal((n, shape[0] // n) + shape[1:])
    reduce = (lambda t: t.sum(axis=0)) if op == "sum" else (lambda t: t.mean(axis=0))
    y_ref, g_ref = _reference(lambda t: reduce(t).reshape(W.shape), X, W)
    _check(_per_rank(lambda: ReduceScatter(op), X, W), y_ref, g_ref)


@given(data=st.data(), n=WORLDS, shape=SHAPES, root=st.integers(0, 3))
def test_broadcast_value_and_adjoint(data, n, shape, root):
    root = root % n
    X, rng = _draw(data, n, shape)
    W = rng.standard_normal(X.shape)
    ones = Tensor(np.ones((n,) + (1,) * len(shape)))
    y_ref, g_ref = _reference(lambda t: t[root:root + 1] * ones, X, W)
    _check(_per_rank(lambda: Broadcast(root), X, W), y_ref, g_ref)


def test_collectives_keep_float32():
    def body():
        x = Tensor(np.ones((2, 2), np.float32))
        return [op(x).dtype for op in (AllReduce("mean"), AllGather(), ReduceScatter(), Broadcast(1))]
    for dtypes in run_threads(2, body):
        assert all(d == np.float32 for d in dtypes)


def test_errors_name_the_operator():
    with pytest.raises(ValueError, match="AllReduce: op must be one of"):
        AllReduce("avg")
    with pytest.raises(ValueError, match="ReduceScatter: op must be one of"):
        ReduceScatter("max")
    with pytest.raises(ValueError, match="Broadcast: root must be a non-negative int"):
        Broadcast(-1)
    with pytest.raises(TypeError, match="AllGather: group must be a Communicator"):
        AllGather(group="world")(Tensor(np.ones(2)))

    def bad_root():
        Broadcast(5)(Tensor(np.ones(2)))
    with pytest.raises(ValueError, match="Broadcast: root 5 is not a rank of a group of size 2"):
        run_threads(2, bad_root)

    def bad_scatter():
        ReduceScatter()(Tensor(np.ones(3)))
    with pytest.raises(ValueError, match=r"ReduceScatter: x of shape \(3,\): axis 0 must be divisible by the group"):
        run_threads(2, bad_scatter)


def test_explicit_group_is_used():
    def body():
        world = resolve_communicator("test", None)
        sub = world.split([0, 1] if world.rank < 2 else [2, 3])
        return AllReduce("sum", group=sub)(Tensor(np.array([float(world.rank)]))).asnumpy()[0]
    assert run_threads(4, body) == [1.0, 1.0, 5.0, 5.0]
