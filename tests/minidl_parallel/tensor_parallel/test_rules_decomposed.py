"""Decomposed rules compute their operator exactly.

Run in one process with no parallel context, the ``.shard()`` calls inside a decomposition
are ignored and each primitive runs on the whole tensor, so the composition must give the
plain op's forward and gradients (float64; ReduceMax and ReduceMin with ties, where the
gradient is split evenly among tied extrema).
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import ops
from minidl.tensor import Tensor
from minidl.testing import check_op
from minidl.testing.strategies import arrays

from minidl_parallel.tensor_parallel.rules import Decomposed, TensorSpec, get_rule


def decomposed(prim, args, strategy, device_num=8):
    """The Decomposed a rule returns for ``args`` (ndarrays at tensor positions) under ``strategy``."""
    specs = tuple(TensorSpec(a.shape, a.dtype) if isinstance(a, np.ndarray) else a for a in args)
    out = get_rule(prim).infer(prim, specs, strategy, device_num)
    assert isinstance(out, Decomposed), out
    assert out.description
    return out.fn


def compare(prim, fn, args, seed=0):
    """fn(*args) against prim(*args): forward, and the gradient of every float tensor argument."""
    def tensors():
        return [Tensor(a, requires_grad=a.dtype.kind == "f") if isinstance(a, np.ndarray) else a for a in args]
    plain, mine = tensors(), tensors()
    want, got = prim(*plain), fn(*mine)
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-12, atol=1e-12)
    if want.dtype.kind != "f":
        return
    gy = Tensor(np.random.default_rng(seed).standard_normal(want.shape))
    want.backward(gy)
    got.backward(gy)
    for p, (a, b) in enumerate(zip(plain, mine)):
        if isinstance(a, Tensor) and a.requires_grad:
            np.testing.assert_allclose(b.grad.asnumpy(), a.grad.asnumpy(), rtol=1e-10, atol=1e-12,
                                       err_msg=f"gradient of argument {p}")


AXES = st.sampled_from([1, -1, (0, 1), (), (1, 2)])


CUT = ((2, 2, 2),)  # on 8 devices: whatever the axes, every reduced axis is cut


@given(x=arrays((2, 4, 2)), axis=AXES, keep_dims=st.booleans())
def test_reduce_mean_over_cut_axes_is_sum_over_global_count(x, axis, keep_dims):
    prim = ops.ReduceMean(keep_dims)
    fn = decomposed(prim, [x, axis], CUT)
    compare(prim, fn, [x, axis])
    axes = None if axis == () else axis
    check_op(lambda t: fn(t, axis), [x], reference=lambda a: np.mean(a, axis=axes, keepdims=keep_dims))


@given(x=arrays((2, 4, 2)), axis=AXES, keep_dims=st.booleans(),
       op=st.sampled_from([ops.ReduceMax, ops.ReduceMin]))
def test_reduce_max_min_with_ties_split_the_gradient_as_one_device(x, axis, keep_dims, op):
    x = np.round(x)  # few distinct values: many ties, across the blocks of the cut axes
    prim = op(keep_dims)
    compare(prim, decomposed(prim, [x, axis], CUT), [x, axis])


def test_reduce_max_ignores_minus_inf_and_keeps_float32():
    x = np.array([[-np.inf, 1.0, 3.0, 3.0], [2.0, -np.inf, -np.inf, 0.5]])
    prim = ops.ReduceMax()
    fn = decomposed(prim, [x, 1], ((1, 4),), 4)
    compare(prim, fn, [x, 1])
    t = Tensor(x, requires_grad=True)
    fn(t, 1).backward(Tensor(np.ones(2)))
    assert t.grad.asnumpy().tolist() == [[0, 0, 0.5, 0.5], [1, 0, 0, 0]]
    y = fn(Tensor(x.astype(np.float32)), 1)
    assert y.dtype == np.float32 and y.asnumpy().tolist() == [3.0, 2.0]


def test_integer_mean_and_min_gather_the_reduced_axes():
    x = np.array([[3, -7, 5, 1], [8, 8, -2, 9]], np.int32)
    for prim in (ops.ReduceMean(), ops.ReduceMin(keep_dims=True)):
        compare(prim, decomposed(prim, [x, 1], ((1, 4),), 4), [x, 1])
    with minidl.no_grad():  # and ReduceMax of integers, or without gradient, is a plain partial max
        assert not isinstance(get_rule(ops.ReduceMax()).infer(ops.ReduceMax(), (TensorSpec((2, 4), x.dtype), 1),
                                                              ((1, 4),), 4), Decomposed)


@given(x=arrays((3, 4), low=-20, high=20), log=st.booleans(), axis=st.sampled_from([-1, 0, (0, 1)]))
def test_softmax_over_cut_axes(x, log, axis):
    prim = (ops.LogSoftmax if log else ops.Softmax)(axis)
    fn = decomposed(prim, [x], ((1, 4),) if axis == -1 else ((3, 2),), 24)
    compare(prim, fn, [x])

    def reference(a):
        axes = axis if isinstance(axis, tuple) else (axis,)
        z = a - a.max(axis=axes, keepdims=True)
        lse = np.log(np.exp(z).sum(axis=axes, keepdims=True))
        return z - lse if log else np.exp(z - lse)
    check_op(fn, [x], reference=reference)


def test_softmax_of_large_logits_stays_finite():
    x = np.array([[1e4, -1e4, 0.0, 1e4]])
    fn = decomposed(ops.LogSoftmax(), [x], ((1, 4),), 4)
    y = fn(Tensor(x)).asnumpy()
    np.testing.assert_allclose(y, [[-np.log(2), -2e4 - np.log(2), -1e4 - np.log(2), -np.log(2)]])


@given(logits=arrays((3, 4)), seed=st.integers(0, 100))
def test_cross_entropies_with_cut_classes(logits, seed):
    rng = np.random.default_rng(seed)
    labels = rng.dirichlet(np.ones(4), 3)
    dense = ops.SoftmaxCrossEntropyWithLogits()
    compare(dense, decomposed(dense, [logits, labels], ((1, 4), (1, 4)), 8), [logits, labels])
    index = rng.integers(0, 4, 3).astype(np.int32)
    sparse = ops.SparseSoftmaxCrossEntropyWithLogits()
    fn = decomposed(sparse, [logits, index], ((3, 2), (3,)), 6)
    compare(sparse, fn, [logits, index])
    bad = Tensor(np.array([0, 4, 1], np.int32))
    if isinstance(bad.data, np.ndarray):  # host labels: checked (on the device: NaN, next test)
        with pytest.raises(ValueError, match=r"label 4 is out of range for 4 classes"):
            fn(Tensor(logits), bad)


def test_class_split_cross_entropy_gives_nan_for_a_bad_device_label_without_a_sync(on_the_double):
    from minidl.testing import cupy_double
    logits = np.random.default_rng(0).standard_normal((3, 4))
    sparse = ops.SparseSoftmaxCrossEntropyWithLogits()
    fn = decomposed(sparse, [logits, np.zeros(3, np.int32)], ((3, 2), (3,)), 6)
    good = np.array([0, 3, 1], np.int32)
    x, labels = Tensor(logits, requires_grad=True), Tensor(np.array([0, 4, -1], np.int32))
    with cupy_double.count_host_syncs() as syncs:
        loss = fn(x, labels)
        loss.sum().backward()
    assert syncs.total == 0, syncs.by_reason
    loss, gx = loss.asnumpy(), x.grad.asnumpy()
    assert np.isnan(loss[1:]).all() and np.isnan(gx[1:]).all()  # never a silent 0 (the one-hot of 4 is all 0)
    np.testing.assert_allclose(loss[0], sparse(Tensor(logits), Tensor(good)).asnumpy()[0], rtol=1e-12)
    assert np.isfinite(gx[0]).all()


def test_squeeze_of_nothing_on_cut_blocks_keeps_every_dimension():
    x = np.arange(24.0).reshape(4, 6)
    prim = ops.Squeeze()
    compare(prim, decomposed(prim, [x], ((4, 1),), 4), [x])


def test_sharded_class_split_cross_entropy_on_the_device_marks_bad_labels_nan(on_the_double):
    from rule_helpers import host, on_ranks
    logits = np.random.default_rng(1).standard_normal((4, 6))

    def rank():
        loss = ops.SparseSoftmaxCrossEntropyWithLogits().shard(((1, 2), (1,)))
        return host(loss(Tensor(logits), Tensor(np.array([0, 6, 5, 2], np.int32))).data)

    want = ops.SparseSoftmaxCrossEntropyWithLogits()(Tensor(logits), Tensor(np.array([0, 0, 5, 2], np.int32)))
    for got in on_ranks(2, rank):
        assert np.isnan(got[1]) and np.isfinite(got[[0, 2, 3]]).all()
        np.testing.assert_allclose(got[[0, 2, 3]], host(want.data)[[0, 2, 3]], rtol=1e-12)
