"""MatMul, BatchMatMul, BiasAdd, and ops.matmul / ``@`` (NumPy's matmul: vectors and batches)."""
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
        ops.MatMul()(Tensor(np.ones((4, 3))), Tensor(np.ones((5, 2))))


def test_dtype_mismatch_error():
    with pytest.raises(TypeError, match="MatMul: x has dtype float32 but w has dtype float64"):
        ops.MatMul()(Tensor(np.ones((2, 2), np.float32)), Tensor(np.ones((2, 2))))


def test_rank_error():
    with pytest.raises(ValueError, match="MatMul: x and w must be 2-D"):
        ops.MatMul()(Tensor(np.ones((2, 2, 2))), Tensor(np.ones((2, 2))))
    with pytest.raises(ValueError, match="MatMul: x and w must be 2-D"):
        ops.MatMul()(Tensor(np.ones(2)), Tensor(np.ones((2, 2))))  # the primitive stays 2-D, as MindSpore's


def test_bias_add_channel_error():
    with pytest.raises(ValueError, match="BiasAdd: b of shape \\(4,\\) must match channel dim 1"):
        ops.bias_add(Tensor(np.ones((2, 3))), Tensor(np.ones(4)))


# ---- ops.matmul and @: NumPy's matmul ----------------------------------------------------------

MATMUL_SHAPES = [
    ((3,), (3,)),               # vector . vector -> 0-d
    ((3,), (3, 2)),             # vector @ matrix -> (2,)
    ((2, 3), (3,)),             # matrix @ vector -> (2,)
    ((3,), (2, 3, 4)),          # vector @ batch -> (2, 4)
    ((2, 1, 4, 3), (3,)),       # batch @ vector -> (2, 1, 4)
    ((2, 3), (3, 4)),           # plain MatMul
    ((2, 1, 4, 3), (5, 3, 2)),  # batch dims broadcast, ranks differ
    ((4, 3), (2, 3, 2)),        # a matrix broadcast against a batch
]


@pytest.mark.parametrize("xs, ws", MATMUL_SHAPES)
@given(data=st.data())
def test_matmul_is_numpy_matmul_with_gradients(xs, ws, data):
    x, w = data.draw(arrays(xs)), data.draw(arrays(ws))
    check_op(ops.matmul, [x, w], reference=np.matmul)
    check_op(lambda a, b: a @ b, [x, w], reference=np.matmul)


@pytest.mark.cpu_only
@pytest.mark.parametrize("xs, ws", MATMUL_SHAPES[:5])
def test_matmul_with_a_vector_matches_torch(xs, ws):
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    gy = rng.standard_normal(np.matmul(x, w).shape)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    torch.matmul(tx, tw).backward(torch.tensor(gy))
    mx, mw = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
    (mx @ mw).backward(Tensor(gy))
    np.testing.assert_allclose(mx.grad.asnumpy(), tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(mw.grad.asnumpy(), tw.grad.numpy(), rtol=1e-12)


def test_matmul_keeps_float32_and_takes_arrays_on_either_side():
    x = Tensor(np.ones(3, np.float32))
    assert ops.matmul(x, x).dtype == np.float32 and ops.matmul(x, x).shape == ()
    np.testing.assert_allclose((np.full(3, 2.0) @ Tensor(np.ones((3, 2)))).asnumpy(), [6.0, 6.0])
    np.testing.assert_allclose((Tensor(np.ones((2, 3))) @ np.full(3, 2.0)).asnumpy(), [6.0, 6.0])


def test_matmul_errors_name_the_arguments():
    with pytest.raises(ValueError, match=r"matmul: input of shape \(3,\) and other of shape \(4,\): inner dimensions 3 "
                                         r"and 4 differ"):
        ops.matmul(Tensor(np.ones(3)), Tensor(np.ones(4)))
    with pytest.raises(ValueError, match=r"matmul: input of shape \(2, 3, 4\) and other of shape \(2, 3\)"):
        ops.matmul(Tensor(np.ones((2, 3, 4))), Tensor(np.ones((2, 3))))
    with pytest.raises(ValueError, match=r"matmul: input and other must have at least 1 dimension, got shapes \(\) "
                                         r"and \(3,\)"):
        ops.matmul(Tensor(np.array(2.0)), Tensor(np.ones(3)))
    # As MindSpore 2.10 and PyTorch: no promotion inside a matrix product.
    with pytest.raises(TypeError, match="matmul: input has dtype float32 but other has dtype int64; cast one"):
        Tensor(np.ones((2, 3), np.float32)) @ Tensor(np.ones((3, 2), np.int64))
    with pytest.raises(TypeError, match="matmul: other must be a Tensor, got list"):
        Tensor(np.ones(2)) @ [1.0, 2.0]
