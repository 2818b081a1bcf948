"""Dense and DenseReLU: forward vs NumPy, gradients vs finite differences, the reference is MatMul
(transpose_b), BiasAdd and ReLU one after another bit for bit, errors, ops.dense. (Their CPU
kernels: tests/minidl/kernels/test_dense_kernels.py; GRAPH_MODE's fusion: test_graph_mode_dense.py.)"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import kernels, ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import arrays

dims = st.integers(1, 4)


def np_dense(x, w, b=None):
    return x @ w.T + (0 if b is None else b)


@given(n=dims, k=dims, o=dims, bias=st.booleans(), data=st.data())
def test_dense(n, k, o, bias, data):
    inputs = [data.draw(arrays((n, k))), data.draw(arrays((o, k)))] + ([data.draw(arrays((o,)))] if bias else [])
    check_op(lambda *ts: ops.Dense()(*ts), inputs, reference=np_dense)


def away_from_the_kink(x, w, b):
    """b moved so that no pre-activation lies within 0.05 of 0 (no finite difference there)."""
    near = np.abs(np_dense(x, w, b)) < 0.05
    return b + np.where(near.any(axis=0), 0.2, 0.0) if near.any() else b


@given(n=dims, k=dims, o=dims, data=st.data())
def test_dense_relu(n, k, o, data):
    x, w, b = data.draw(arrays((n, k))), data.draw(arrays((o, k))), data.draw(arrays((o,)))
    for _ in range(5):  # each move may bring another pre-activation near 0; a few moves clear them all
        b = away_from_the_kink(x, w, b)
    if np.abs(np_dense(x, w, b)).min() < 0.05:
        return
    check_op(lambda *ts: ops.DenseReLU()(*ts), [x, w, b], reference=lambda *a: np.maximum(np_dense(*a), 0))


def test_dense_relu_without_bias():
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((5, 4)), rng.standard_normal((3, 4))
    assert np.abs(x @ w.T).min() > 1e-3  # (this draw has no pre-activation at the kink)
    check_op(lambda *ts: ops.DenseReLU()(*ts), [x, w], reference=lambda x, w: np.maximum(x @ w.T, 0))


@pytest.mark.parametrize("relu", [False, True], ids=["dense", "dense_relu"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
def test_reference_is_matmul_bias_add_relu(relu, bias):
    """On the reference bodies, the output and every gradient equal those of the separate ops bit for
    bit: the fused reference is MatMul's product, the bias added, max(., 0)."""
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((64, 48), (40, 48), (40,)))
    gy = rng.standard_normal((64, 40)).astype(np.float32)

    def run(fused):
        tx, tw, tb = (Tensor(a, requires_grad=True) for a in (x, w, b))
        extra = (tb,) if bias else ()
        if fused:
            y = (ops.DenseReLU() if relu else ops.Dense())(tx, tw, *extra)
        else:
            y = ops.MatMul(transpose_b=True)(tx, tw)
            y = ops.bias_add(y, tb) if bias else y
            y = ops.relu(y) if relu else y
        y.backward(Tensor(gy))
        return [y.asnumpy(), tx.grad.asnumpy(), tw.grad.asnumpy()] + ([tb.grad.asnumpy()] if bias else [])

    with kernels.reference_only():
        fused, separate = run(True), run(False)
    for name, a, e in zip(["y", "gx", "gw", "gb"], fused, separate):
        assert a.dtype == np.float32, name
        np.testing.assert_array_equal(a, e, err_msg=name)


def test_gradient_at_the_kink_is_zero():
    x = Tensor(np.array([[1.0], [2.0]]), requires_grad=True)
    b = Tensor(np.array([-1.0]), requires_grad=True)  # pre-activations 0 and 1
    ops.DenseReLU()(x, Tensor(np.ones((1, 1))), b).sum().backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), [[0.0], [1.0]])
    np.testing.assert_array_equal(b.grad.asnumpy(), [1.0])


def test_gradients_only_where_asked():
    rng = np.random.default_rng(4)
    x = Tensor(rng.standard_normal((3, 2)))
    w, b = Tensor(rng.standard_normal((4, 2)), requires_grad=True), Tensor(np.zeros(4), requires_grad=True)
    ops.DenseReLU()(x, w, b).sum().backward()
    assert x.grad is None and w.grad is not None and b.grad is not None


def test_dense_function_is_nn_dense():
    from minidl import nn
    fc = nn.Dense(6, 3)
    x = Tensor(np.random.default_rng(5).standard_normal((4, 6)).astype(np.float32))
    with kernels.reference_only():
        np.testing.assert_array_equal(ops.dense(x, fc.weight, fc.bias).asnumpy(), fc(x).asnumpy())
    np.testing.assert_allclose(ops.dense(x, fc.weight).asnumpy(), x.asnumpy() @ fc.weight.asnumpy().T, rtol=1e-6)


def test_errors():
    x, w = Tensor(np.ones((2, 3))), Tensor(np.ones((4, 3)))
    with pytest.raises(ValueError, match=r"Dense: x of shape \(2, 3\) and w of shape \(4, 2\) \(transpose_b\): inner dimensions 3 and 2"):
        ops.Dense()(x, Tensor(np.ones((4, 2))))
    with pytest.raises(ValueError, match=r"DenseReLU: b of shape \(3,\) must be 1-D of length w.shape\[0\] = 4"):
        ops.DenseReLU()(x, w, Tensor(np.ones(3)))
    with pytest.raises(ValueError, match=r"Dense: b of shape \(1, 4\) must be 1-D"):
        ops.Dense()(x, w, Tensor(np.ones((1, 4))))
    with pytest.raises(ValueError, match="Dense: x and w must be 2-D"):
        ops.Dense()(Tensor(np.ones((2, 2, 3))), w)
    with pytest.raises(TypeError, match="Dense: x has dtype float32 but w has dtype float64"):
        ops.Dense()(Tensor(np.ones((2, 3), np.float32)), w)
    with pytest.raises(TypeError, match="Dense: b has dtype float32 but x and w have dtype float64; they must match"):
        ops.Dense()(x, w, Tensor(np.ones(4, np.float32)))
    with pytest.raises(TypeError, match=r"Dense: expected 2 to 3 input\(s\), got 1"):
        ops.Dense()(x)
