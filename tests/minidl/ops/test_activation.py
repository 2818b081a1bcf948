"""Softmax, LogSoftmax, GeLU, LeakyReLU, SiLU: forward vs NumPy, backward vs finite differences, stability,
errors."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import shapes, arrays, distinct_arrays


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


# ---- GeLU, LeakyReLU, SiLU -------------------------------------------------------------------

def np_ndtr(x):
    return np.array([0.5 * math.erfc(-v / math.sqrt(2)) for v in np.ravel(x)]).reshape(np.shape(x))


def np_gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    return x * np_ndtr(x)


@given(x=shapes(max_dims=3).flatmap(lambda s: arrays(s, -5.0, 5.0)), approximate=st.sampled_from(["none", "tanh"]))
def test_gelu(x, approximate):
    check_op(lambda x: ops.gelu(x, approximate), [x], reference=lambda x: np_gelu(x, approximate), fwd_rtol=1e-13)


@given(x=shapes(max_dims=3).flatmap(lambda s: distinct_arrays(s, -4.0, 4.0)),
       alpha=st.sampled_from([0.2, 0.01, 1.5, -0.3]))
def test_leaky_relu(x, alpha):
    check_op(lambda x: ops.LeakyReLU(alpha)(x), [x], reference=lambda x: np.where(x > 0, x, alpha * x))


@given(x=shapes(max_dims=3).flatmap(lambda s: arrays(s, -6.0, 6.0)))
def test_silu(x):
    check_op(ops.silu, [x], reference=lambda x: x / (1 + np.exp(-x)))


def test_erf_matches_math_erf_to_1e15():
    from minidl.ops.activation import _erf, _ndtr
    x = np.concatenate([np.linspace(-7, 7, 20001), np.geomspace(1e-300, 1.0, 301), [0.46875, 4.0, 30.0, -30.0, 0.0]])
    want = np.array([math.erf(v) for v in x])
    got = _erf(np, x)
    np.testing.assert_allclose(got, want, rtol=1e-15, atol=1e-300)
    assert got.dtype == np.float64 and _erf(np, x.astype(np.float32)).dtype == np.float32
    # The left tail goes through erfc: Phi(-10) is 7.6e-24, not 1 - 1 = 0. (Relative error grows
    # like x^2 * 1e-16 there: exp(-x^2 / 2) amplifies the rounding of x / sqrt(2), as in any ndtr.)
    tail = np.array([-10.0, -20.0, -37.0])
    np.testing.assert_allclose(_ndtr(np, tail), [0.5 * math.erfc(-v / math.sqrt(2)) for v in tail], rtol=1e-12)


def test_activation_defaults_follow_mindspore():
    x = Tensor(np.array([-3.0, -1.0, 0.5, 2.0], np.float32))
    # MindSpore 2.10 CPU: ops.GeLU() is the tanh form; ops.gelu defaults to the exact form.
    np.testing.assert_allclose(ops.GeLU()(x).asnumpy(), [-0.00363743, -0.158808, 0.345714, 1.9545977], rtol=1e-4)
    np.testing.assert_allclose(ops.gelu(x).asnumpy(), [-0.00404969, -0.15865526, 0.34573123, 1.9544997], rtol=1e-5)
    np.testing.assert_allclose(ops.leaky_relu(x).asnumpy(), [-0.6, -0.2, 0.5, 2.0], rtol=1e-6)  # alpha 0.2
    np.testing.assert_allclose(ops.silu(x).asnumpy(), [-0.14227754, -0.26894155, 0.3112297, 1.7615943], rtol=1e-5)
    for y in (ops.GeLU()(x), ops.gelu(x), ops.leaky_relu(x), ops.silu(x)):
        assert y.dtype == np.float32


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_smooth_units_stay_finite_for_large_inputs(dtype):
    x = np.array([-1e4, -60.0, 60.0, 1e4], dtype)
    for fn in (lambda t: ops.gelu(t), lambda t: ops.gelu(t, "tanh"), ops.silu):
        t = Tensor(x, requires_grad=True)
        y = fn(t)
        y.sum().backward()
        assert np.isfinite(y.asnumpy()).all() and np.isfinite(t.grad.asnumpy()).all()
        np.testing.assert_allclose(y.asnumpy(), [0.0, 0.0, 60.0, 1e4], atol=1e-6, rtol=1e-6)
        np.testing.assert_allclose(t.grad.asnumpy(), [0.0, 0.0, 1.0, 1.0], atol=1e-6)


def test_leaky_relu_gradient_at_zero_is_alpha():
    t = Tensor(np.array([0.0, -2.0, 3.0]), requires_grad=True)
    ops.leaky_relu(t, 0.1).sum().backward()
    np.testing.assert_allclose(t.grad.asnumpy(), [0.1, 0.1, 1.0])


@pytest.mark.cpu_only
def test_smooth_units_match_torch():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    x = np.random.default_rng(1).standard_normal(50) * 4
    tx = torch.tensor(x)
    pairs = [(ops.gelu(Tensor(x)), torch.nn.functional.gelu(tx)),
             (ops.gelu(Tensor(x), "tanh"), torch.nn.functional.gelu(tx, approximate="tanh")),
             (ops.silu(Tensor(x)), torch.nn.functional.silu(tx)),
             (ops.leaky_relu(Tensor(x), 0.01), torch.nn.functional.leaky_relu(tx, 0.01))]
    for mine, ref in pairs:
        np.testing.assert_allclose(mine.asnumpy(), ref.numpy(), rtol=1e-13, atol=1e-15)


def test_smooth_unit_errors():
    with pytest.raises(ValueError, match=r"gelu: approximate must be one of \('none', 'tanh'\), got 'exact'"):
        ops.gelu(Tensor(np.ones(2)), "exact")
    with pytest.raises(ValueError, match=r"GeLU: approximate must be one of"):
        ops.GeLU(True)
    with pytest.raises(TypeError, match=r"LeakyReLU: alpha must be a float or an int, got '0.2'"):
        ops.LeakyReLU("0.2")
    with pytest.raises(TypeError, match=r"SiLU: x must be a float tensor, got dtype int64"):
        ops.silu(Tensor(np.ones(2, np.int64)))
