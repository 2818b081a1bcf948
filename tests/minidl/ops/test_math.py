"""Elementwise ops: forward vs NumPy, backward vs finite differences, broadcasting, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import minidl
from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import shapes, arrays, distinct_arrays

BINARY = {
    "add": (ops.add, np.add),
    "sub": (ops.sub, np.subtract),
    "mul": (ops.mul, np.multiply),
    "maximum": (ops.maximum, np.maximum),
    "minimum": (ops.minimum, np.minimum),
}


@st.composite
def broadcast_pair(draw, low=-3.0, high=3.0):
    shape = draw(shapes(max_dims=3, max_side=4))
    other = draw(hnp.broadcastable_shapes(shape, min_dims=0, max_dims=3, max_side=4))
    if draw(st.booleans()):
        shape, other = other, shape
    x = draw(distinct_arrays(shape, low, high))
    y = draw(distinct_arrays(other, low, high)) + 0.0123  # keeps x != y for max/min
    return x, y


@pytest.mark.parametrize("name", sorted(BINARY))
@given(pair=broadcast_pair())
def test_binary_broadcasting(name, pair):
    fn, ref = BINARY[name]
    check_op(fn, list(pair), reference=ref)


@given(pair=broadcast_pair())
def test_div(pair):
    x, y = pair
    y = np.where(np.abs(y) < 0.5, 0.5 + np.abs(y), y)  # keep away from 0
    check_op(ops.div, [x, y], reference=np.divide)


@given(pair=broadcast_pair(0.5, 2.0))
def test_pow(pair):
    check_op(ops.pow, list(pair), reference=np.power)


UNARY = {
    "neg": (ops.neg, np.negative, -3, 3),
    "exp": (ops.exp, np.exp, -3, 3),
    "log": (ops.log, np.log, 0.2, 5),
    "sqrt": (ops.sqrt, np.sqrt, 0.2, 5),
    "square": (ops.square, np.square, -3, 3),
    "tanh": (ops.tanh, np.tanh, -3, 3),
    "sigmoid": (ops.sigmoid, lambda x: 1 / (1 + np.exp(-x)), -6, 6),
    "relu": (ops.relu, lambda x: np.maximum(x, 0), -3, 3),
    "abs": (ops.abs, np.abs, -3, 3),
}


@pytest.mark.parametrize("name", sorted(UNARY))
@given(data=st.data())
def test_unary(name, data):
    fn, ref, lo, hi = UNARY[name]
    shape = data.draw(shapes(max_dims=3))
    x = data.draw(distinct_arrays(shape, lo, hi))
    if name in ("relu", "abs"):
        x = np.where(np.abs(x) < 1e-3, 0.1, x)  # the kink: no finite difference there
    check_op(fn, [x], reference=ref)


def test_ties_split_the_gradient_evenly():
    x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
    y = Tensor(np.array([1.0, 5.0, 0.0]), requires_grad=True)
    ops.maximum(x, y).sum().backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), [0.5, 0.0, 1.0])
    np.testing.assert_array_equal(y.grad.asnumpy(), [0.5, 1.0, 0.0])


def test_relu_gradient_at_zero_is_zero():
    x = Tensor(np.array([-1.0, 0.0, 2.0]), requires_grad=True)
    ops.relu(x).sum().backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), [0.0, 0.0, 1.0])


def test_sigmoid_is_stable_on_the_tails():
    y = ops.sigmoid(Tensor(np.array([-1e4, 0.0, 1e4], dtype=np.float32))).asnumpy()
    np.testing.assert_allclose(y, [0.0, 0.5, 1.0])
    assert y.dtype == np.float32


def test_python_scalars_keep_the_tensor_dtype():
    x = Tensor(np.ones(3, dtype=np.float32))
    for y in (x + 1.5, 2.0 * x, x / 3, 1 - x, x ** 2, 2 ** x):
        assert y.dtype == np.float32


def test_comparisons_give_bool_and_no_gradient():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    m = x > 1.5
    assert m.dtype == np.bool_ and not m.requires_grad
    np.testing.assert_array_equal(m.asnumpy(), [False, True])


def test_broadcast_error_names_op_and_shapes():
    with pytest.raises(ValueError, match=r"Add: shapes \(2, 3\) and \(4,\) cannot be broadcast"):
        ops.add(Tensor(np.ones((2, 3))), Tensor(np.ones(4)))


def test_arity_error_names_op():
    with pytest.raises(TypeError, match="Add: expected 2 input"):
        ops.Add()(Tensor(np.ones(2)))
