"""Elementwise ops: forward vs NumPy, backward vs finite differences, broadcasting, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import shapes, distinct_arrays

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


# ---- dtype promotion: PyTorch's and MindSpore's rule, not NumPy's -------------------------------

F16, F32, F64, I32, I64, B = np.float16, np.float32, np.float64, np.int32, np.int64, np.bool_
PROMOTED = [  # (x dtype or Python scalar, y dtype or Python scalar, result), as MindSpore 2.10 gives them
    (F32, I64, F32), (I64, F32, F32), (F16, I64, F16), (B, F32, F32), (I32, I64, I64), (F16, F32, F32),
    (F32, F64, F64),                      # two float tensors: the wider one (MindSpore and PyTorch agree)
    (I64, 2.5, F32), (I32, 2.5, F32), (B, 2.5, F32), (B, 2, I64), (I32, 2, I32), (F16, 2.5, F16),
    (F32, np.float64(2.0), F32),          # NumPy scalars are scalars (NumPy itself would give float64)
]


def _operand(d, shape=(2,)):
    return Tensor(np.array([1, 2]).astype(d).reshape(shape)) if isinstance(d, type) else d


@pytest.mark.parametrize("op", [ops.add, ops.sub, ops.mul, ops.div, ops.pow, ops.maximum, ops.minimum,
                                ops.floor_div])
@pytest.mark.parametrize("dx, dy, want", PROMOTED)
def test_an_integer_operand_never_widens_a_float_tensor(op, dx, dy, want):
    if op is ops.div and want in (I32, I64):
        want = F32  # true division of integers gives the default float, as `/` in MindSpore and PyTorch
    if op is ops.pow and dx is B and dy is F32:
        return  # True ** x is defined, but not the point here
    for a, b in ((dx, dy), (dy, dx)):
        if not isinstance(a, type) and not isinstance(b, type):
            continue
        y = op(_operand(a), _operand(b))
        assert y.dtype == want, f"{op.__name__}({a}, {b}) gave {y.dtype}, expected {np.dtype(want)}"


def test_zero_d_tensors_rank_between_tensors_and_scalars():
    x32, i32 = Tensor(np.ones(2, F32)), Tensor(np.ones(2, I32))
    assert (x32 * Tensor(np.array(2.0, F64))).dtype == F32    # same kind: the sized tensor wins
    assert (i32 * Tensor(np.array(2.0, F64))).dtype == F64    # higher kind: the 0-d tensor's own dtype
    assert (Tensor(np.ones(2, np.float16)) * Tensor(np.array(2.0, F32))).dtype == np.float16
    assert (Tensor(np.array(2.0, F64)) * Tensor(np.array(3, I64))).dtype == F64


def test_comparisons_and_the_next_layer_see_float32():
    x, labels = Tensor(np.array([0.5, 2.0], F32)), Tensor(np.array([1, 2], I64))
    assert (x < labels).dtype == np.bool_
    np.testing.assert_array_equal((x < labels).asnumpy(), [True, False])
    h = x * labels  # float32: a float64 here broke the next MatMul
    assert ops.matmul(h, Tensor(np.ones(2, F32))).dtype == F32


@pytest.mark.parametrize("op", [ops.add, ops.sub, ops.mul, ops.div, ops.pow, ops.maximum, ops.minimum])
def test_gradients_come_back_in_each_inputs_own_dtype(op):
    x = Tensor(np.array([[1.5, 2.0]], F32), requires_grad=True)
    y = Tensor(np.array([[0.5], [3.0]], F64), requires_grad=True)
    out = op(x, y)
    assert out.dtype == F64
    out.sum().backward()
    assert x.grad.dtype == F32 and x.grad.shape == (1, 2)
    assert y.grad.dtype == F64 and y.grad.shape == (2, 1)
    # An integer operand gets no gradient; the float one gets its own dtype.
    x.grad = None
    op(x, Tensor(np.array([[1], [2]], I64))).sum().backward()
    assert x.grad.dtype == F32


@pytest.mark.parametrize("name", sorted(BINARY))
@given(pair=broadcast_pair())
def test_mixed_dtype_gradients_equal_the_float64_ones(name, pair):
    """float32 x with float64 y computes in float64; x's gradient is that float64 gradient, cast."""
    fn, _ = BINARY[name]
    x, y = pair
    y = np.atleast_1d(y)  # a 0-d float64 tensor would not widen float32 x (see the test above)
    grads = []
    for dtype in (F32, F64):
        xt = Tensor(x.astype(F32).astype(dtype), requires_grad=True)
        out = fn(xt, Tensor(y))
        assert out.dtype == F64
        out.backward(Tensor(np.cos(np.arange(out.size)).reshape(out.shape)))
        grads.append(xt.grad)
    assert grads[0].dtype == F32 and grads[0].shape == x.shape
    np.testing.assert_array_equal(grads[0].asnumpy(), grads[1].asnumpy().astype(F32))


# ---- Pow at x == 0, FloorDiv ------------------------------------------------------------------

# 0 ** -1 and log 0 warn in NumPy (and in the device double, NumPy underneath); the values are the point.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_pow_gradients_at_zero_follow_torch():
    x = Tensor(np.array([0.0, 0.0, 0.0, -2.0, -2.0, 2.0]), requires_grad=True)
    y = Tensor(np.array([2.0, 0.0, -1.0, 2.0, 0.5, 0.0]), requires_grad=True)
    (x ** y).sum().backward()
    # d/dx: 0 where y == 0 (0 * inf otherwise); d/dy: 0 where x == 0 and y >= 0 (0 * log 0 otherwise).
    np.testing.assert_array_equal(x.grad.asnumpy(), [0.0, 0.0, -np.inf, -4.0, np.nan, 0.0])
    np.testing.assert_array_equal(y.grad.asnumpy(), [0.0, 0.0, -np.inf, np.nan, np.nan, np.log(2.0)])
    for base in (0.0, 2.0):  # a Python base: the exponent's gradient, float32 kept
        e = Tensor(np.array([0.0, 1.0], F32), requires_grad=True)
        (base ** e).sum().backward()
        assert e.grad.dtype == F32
        np.testing.assert_allclose(e.grad.asnumpy(), [0.0, 0.0] if base == 0 else [np.log(2), 2 * np.log(2)],
                                   rtol=1e-6)
    x = Tensor(np.array([0.0, 3.0]), requires_grad=True)
    (x ** 0).sum().backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), [0.0, 0.0])


@pytest.mark.cpu_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_pow_gradients_match_torch_on_the_edges():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    xs = np.array([0.0, 0.0, 0.0, 0.0, -2.0, -2.0, 2.0, 1.5])
    ys = np.array([2.0, 0.5, 0.0, -1.0, 2.0, 3.0, 0.0, -0.5])
    tx, ty = torch.tensor(xs, requires_grad=True), torch.tensor(ys, requires_grad=True)
    (tx ** ty).sum().backward()
    x, y = Tensor(xs, requires_grad=True), Tensor(ys, requires_grad=True)
    (x ** y).sum().backward()
    np.testing.assert_allclose(x.grad.asnumpy(), tx.grad.numpy(), rtol=1e-12)
    np.testing.assert_allclose(y.grad.asnumpy(), ty.grad.numpy(), rtol=1e-12)


@given(pair=broadcast_pair())
def test_floor_div_matches_numpy_and_has_zero_gradient(pair):
    x, y = pair
    y = np.where(np.abs(y) < 0.5, 0.5 + np.abs(y), y)
    check_op(ops.floor_div, [x, y], reference=np.floor_divide, positions=[])
    xt, yt = Tensor(x, requires_grad=True), Tensor(y, requires_grad=True)
    ops.FloorDiv()(xt, yt).sum().backward()
    assert xt.grad.shape == x.shape and not np.any(xt.grad.asnumpy())
    assert yt.grad.shape == y.shape and not np.any(yt.grad.asnumpy())


def test_floor_div_rounds_toward_minus_infinity_like_python():
    a = Tensor(np.array([-7, 7, -7, 7]))
    np.testing.assert_array_equal(ops.floor_div(a, Tensor(np.array([2, 2, -2, -2]))).asnumpy(), [-4, 3, 3, -4])
    assert ops.floor_div(a, 2).dtype == np.int64
    y = Tensor(np.array([-7.5, 7.0], F32)) // 2
    assert y.dtype == F32
    np.testing.assert_array_equal(y.asnumpy(), [-4.0, 3.0])
    np.testing.assert_array_equal((9 // Tensor(np.array([2, -2]))).asnumpy(), [4, -5])
    with pytest.raises(ValueError, match=r"FloorDiv: shapes \(2,\) and \(3,\) cannot be broadcast"):
        ops.floor_div(Tensor(np.ones(2)), Tensor(np.ones(3)))


@pytest.mark.parametrize("op", [ops.add, ops.sub, ops.mul, ops.div, ops.pow, ops.maximum, ops.minimum,
                                ops.floor_div])
def test_float32_inputs_get_float32_gradients(op):
    x = Tensor(np.array([1.0, 2.0, 3.0], F32), requires_grad=True)
    y = Tensor(np.array([1.0, 0.5, 4.0], F32), requires_grad=True)  # a tie at 0: maximum's half
    op(x, y).sum().backward()
    assert x.grad.dtype == F32 and y.grad.dtype == F32
