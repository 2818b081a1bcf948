"""MatMul, BatchMatMul, BiasAdd."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import arrays

dims = st.integers(1, 4)


@given(m=dims, k=dims, n=dims, ta=st.booleans(), tb=st.booleans(), data=st.data())
def test_matmul(m, k, n, ta, tb, data):
    x = data.draw(arrays((k, m) if ta else (m, k)))
    w = data.draw(arrays((n, k) if tb else (k, n)))
    ref = lambda x, w: (x.T if ta else x) @ (w.T if tb else w)
    check_op(lambda x, w: ops.MatMul(ta, tb)(x, w), [x, w], reference=ref)


@given(b=st.lists(st.integers(1, 3), min_size=1, max_size=2), m=dims, k=dims, n=dims,
       ta=st.booleans(), tb=st.booleans(), bcast=st.booleans(), data=st.data())
def test_batch_matmul(b, m, k, n, ta, tb, bcast, data):
    wb = [1] * len(b) if bcast else b  # broadcast the weight over the batch dims
    x = data.draw(arrays(tuple(b) + ((k, m) if ta else (m, k))))
    w = data.draw(arrays(tuple(wb) + ((n, k) if tb else (k, n))))
    t = lambda a: np.swapaxes(a, -1, -2)
    ref = lambda x, w: np.matmul(t(x) if ta else x, t(w) if tb else w)
    check_op(lambda x, w: ops.BatchMatMul(ta, tb)(x, w), [x, w], reference=ref)


@given(shape=st.sampled_from([(2, 3), (2, 3, 2), (1, 2, 3, 2)]), data=st.data())
def test_bias_add(shape, data):
    x = data.draw(arrays(shape))
    b = data.draw(arrays((shape[1],)))
    ref = lambda x, b: x + b.reshape((1, -1) + (1,) * (x.ndim - 2))
    check_op(ops.bias_add, [x, b], reference=ref)


def test_matmul_operator_dispatch():
    a, b = np.arange(6.0).reshape(2, 3), np.arange(6.0).reshape(3, 2)
    np.testing.assert_allclose((Tensor(a) @ Tensor(b)).asnumpy(), a @ b)
    a3 = np.arange(12.0).reshape(2, 2, 3)
    np.testing.assert_allclose((Tensor(a3) @ Tensor(b)).asnumpy(), a3 @ b)


def test_inner_dimension_error():
    with pytest.raises(ValueError, match=r"MatMul: x of shape \(4, 3\) and w of shape \(5, 2\): inner dimensions 3 and 5 differ"):
        ops.matmul(Tensor(np.ones((4, 3))), Tensor(np.ones((5, 2))))


def test_dtype_mismatch_error():
    with pytest.raises(TypeError, match="MatMul: x has dtype float32 but w has dtype float64"):
        ops.matmul(Tensor(np.ones((2, 2), np.float32)), Tensor(np.ones((2, 2))))


def test_rank_error():
    with pytest.raises(ValueError, match="MatMul: x and w must be 2-D"):
        ops.matmul(Tensor(np.ones((2, 2, 2))), Tensor(np.ones((2, 2))))


def test_bias_add_channel_error():
    with pytest.raises(ValueError, match="BiasAdd: b of shape \\(4,\\) must match channel dim 1"):
        ops.bias_add(Tensor(np.ones((2, 3))), Tensor(np.ones(4)))
