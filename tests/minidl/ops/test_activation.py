"""Softmax, LogSoftmax: forward vs NumPy, backward vs finite differences, stability, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import shapes, arrays


def np_log_softmax(x, axes):
    m = x.max(axis=axes, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=axes, keepdims=True))


@st.composite
def array_and_axis(draw, max_dims=3):
    """An array and an axis: an int (possibly negative) or a tuple of distinct axes."""
    shape = draw(shapes(max_dims=max_dims, max_side=4))
    x = draw(arrays(shape, -5.0, 5.0))
    nd = len(shape)
    if draw(st.booleans()):
        axis = draw(st.integers(-nd, nd - 1))
        axes = axis % nd
    else:
        axis = tuple(draw(st.lists(st.integers(0, nd - 1), min_size=1, max_size=nd, unique=True)))
        axes = axis
    return x, axis, axes


@given(case=array_and_axis())
def test_softmax(case):
    x, axis, axes = case
    check_op(lambda x: ops.Softmax(axis)(x), [x], reference=lambda x: np.exp(np_log_softmax(x, axes)))


@given(case=array_and_axis())
def test_log_softmax(case):
    x, axis, axes = case
    check_op(lambda x: ops.LogSoftmax(axis)(x), [x], reference=lambda x: np_log_softmax(x, axes))


@given(case=array_and_axis())
def test_functions_match_primitives_and_normalise(case):
    x, axis, axes = case
    y = ops.softmax(Tensor(x), axis).asnumpy()
    np.testing.assert_allclose(y.sum(axis=axes), 1.0, rtol=1e-12)
    np.testing.assert_allclose(ops.log_softmax(Tensor(x), axis).asnumpy(), np.log(y), rtol=1e-9, atol=1e-12)


def test_default_axis_is_last():
    x = np.arange(6.0).reshape(2, 3)
    np.testing.assert_allclose(ops.softmax(Tensor(x)).asnumpy().sum(axis=1), [1.0, 1.0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_magnitudes_stay_finite(dtype):
    x = np.array([[1e4, -1e4, 0.0], [-1e4, -1e4 + 1, -1e4 + 2], [3e4, 3e4, 3e4]], dtype)
    t = Tensor(x, requires_grad=True)
    y = ops.softmax(t)
    assert y.dtype == dtype and np.isfinite(y.asnumpy()).all()
    np.testing.assert_allclose(y.asnumpy()[0], [1.0, 0.0, 0.0])
    np.testing.assert_allclose(y.asnumpy()[1], np.exp([-2.0, -1.0, 0.0]) / np.exp([-2.0, -1.0, 0.0]).sum(), rtol=1e-5)
    np.testing.assert_allclose(y.asnumpy()[2], [1 / 3] * 3, rtol=1e-6)
    ls = ops.log_softmax(Tensor(x, requires_grad=True))
    assert np.isfinite(ls.asnumpy()).all()
    np.testing.assert_allclose(ls.asnumpy()[0], [0.0, -2e4, -1e4], rtol=1e-6)
    (y * Tensor(np.arange(9.0).reshape(3, 3).astype(dtype))).sum().backward()
    assert np.isfinite(t.grad.asnumpy()).all()


def test_float32_stays_float32_in_backward():
    t = Tensor(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32), requires_grad=True)
    ops.log_softmax(t).sum().backward()
    assert t.grad.dtype == np.float32
    # Each row's log-softmax gradient of sum() is 1 - C * softmax, which sums to 0.
    np.testing.assert_allclose(t.grad.asnumpy().sum(axis=1), 0.0, atol=1e-5)


def test_scalar_input():
    x = Tensor(np.array(2.5), requires_grad=True)
    np.testing.assert_allclose(ops.softmax(x).asnumpy(), 1.0)
    y = ops.log_softmax(x)
    assert y.shape == () and y.item() == 0.0
    y.backward()
    assert x.grad.item() == 0.0


def test_empty_input():
    y = ops.softmax(Tensor(np.zeros((0, 3))))
    assert y.shape == (0, 3)


def test_errors():
    x = Tensor(np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"Softmax: axis 2 is out of range for a tensor of rank 2"):
        ops.softmax(x, 2)
    with pytest.raises(ValueError, match=r"LogSoftmax: repeated axis"):
        ops.log_softmax(x, (1, -1))
    with pytest.raises(TypeError, match=r"Softmax: axis must be an int or a non-empty tuple of ints, got 1.5"):
        ops.Softmax(1.5)
    with pytest.raises(TypeError, match=r"LogSoftmax: axis must be an int or a non-empty tuple"):
        ops.LogSoftmax(())
    with pytest.raises(TypeError, match=r"Softmax: x must be a float tensor, got dtype int64"):
        ops.softmax(Tensor(np.ones((2, 3), np.int64)))
