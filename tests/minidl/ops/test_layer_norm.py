"""LayerNorm and GroupNorm: forward vs NumPy, gradients (x, gamma, beta) vs finite differences,
stability, the functions' defaults, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import arrays, shapes


def np_layer_norm(x, gamma, beta, begin_norm_axis, eps):
    axes = tuple(range(begin_norm_axis % x.ndim, x.ndim))
    mu = x.mean(axis=axes, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=axes, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def np_group_norm(x, gamma, beta, groups, eps):
    n, c = x.shape[:2]
    xg = x.reshape(n, groups, -1)
    mu = xg.mean(axis=2, keepdims=True)
    var = ((xg - mu) ** 2).mean(axis=2, keepdims=True)
    xhat = ((xg - mu) / np.sqrt(var + eps)).reshape(x.shape)
    at_c = (c,) + (1,) * (x.ndim - 2)
    return xhat * gamma.reshape(at_c) + beta.reshape(at_c)


@st.composite
def layer_norm_case(draw):
    shape = draw(shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    nd = len(shape)
    begin_norm_axis = draw(st.integers(-nd, nd - 1))
    begin_params_axis = draw(st.integers(-nd, nd - 1))
    x = draw(arrays(shape, -3.0, 3.0))
    p = shape[begin_params_axis % nd:]
    gamma, beta = draw(arrays(p, 0.5, 2.0)), draw(arrays(p, -1.0, 1.0))
    return x, gamma, beta, begin_norm_axis, begin_params_axis


# eps >= 1e-5: a normalised group hypothesis draws constant has std sqrt(eps), which must stay
# well above the finite differences' step (1e-6) for them to be a derivative
@given(case=layer_norm_case(), eps=st.sampled_from([1e-5, 1e-2, 0.5]))
def test_layer_norm(case, eps):
    x, gamma, beta, bna, bpa = case
    check_op(lambda x, g, b: ops.LayerNorm(bna, bpa, eps)(x, g, b), [x, gamma, beta],
             reference=lambda x, g, b: np_layer_norm(x, g, b, bna, eps), fwd_rtol=1e-9, fwd_atol=1e-9,
             rtol=1e-4, atol=1e-6)


@st.composite
def group_norm_case(draw):
    groups = draw(st.integers(1, 3))
    c = groups * draw(st.integers(1, 2))
    shape = (draw(st.integers(1, 3)), c) + tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    x = draw(arrays(shape, -3.0, 3.0))
    return x, draw(arrays((c,), 0.5, 2.0)), draw(arrays((c,), -1.0, 1.0)), groups


@given(case=group_norm_case())
def test_group_norm(case):
    x, gamma, beta, groups = case
    eps = 1e-2  # a group of one element has variance 0: eps keeps its gradient finite and checkable
    check_op(lambda x, g, b: ops.GroupNorm(groups, eps)(x, g, b), [x, gamma, beta],
             reference=lambda x, g, b: np_group_norm(x, g, b, groups, eps), fwd_rtol=1e-9, fwd_atol=1e-9,
             rtol=1e-4, atol=1e-6)


def test_functions_default_to_no_affine_and_eps_1e5():
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    y = ops.layer_norm(Tensor(x), (4,)).asnumpy()
    np.testing.assert_allclose(y, np_layer_norm(x, 1.0, 0.0, -1, 1e-5), rtol=1e-12)
    y = ops.layer_norm(Tensor(x), 4, Tensor(np.full(4, 2.0)), Tensor(np.ones(4))).asnumpy()
    np.testing.assert_allclose(y, np_layer_norm(x, 2.0, 1.0, -1, 1e-5), rtol=1e-12)
    y = ops.layer_norm(Tensor(x), (3, 4)).asnumpy()
    np.testing.assert_allclose(y, np_layer_norm(x, 1.0, 0.0, 1, 1e-5), rtol=1e-12)
    y = ops.group_norm(Tensor(x), 3).asnumpy()
    np.testing.assert_allclose(y, np_group_norm(x, np.ones(3), np.zeros(3), 3, 1e-5), rtol=1e-12)
    assert ops.LayerNorm().epsilon == 1e-7 and ops.LayerNorm().begin_norm_axis == 1  # MindSpore's primitive


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_large_mean_small_spread_stays_accurate(dtype):
    # var = mean((x - mu)^2), not mean(x^2) - mu^2, which would cancel to 0 (or below) here.
    rng = np.random.default_rng(1)
    noise = rng.standard_normal((3, 16))
    x = (1e4 + noise).astype(dtype)
    g, b = Tensor(np.ones(16, dtype)), Tensor(np.zeros(16, dtype))
    y = ops.LayerNorm(1, 1, 1e-7)(Tensor(x), g, b)
    assert y.dtype == dtype
    want = np_layer_norm(x.astype(np.float64), 1.0, 0.0, 1, 1e-7)
    np.testing.assert_allclose(y.asnumpy(), want, atol=2e-2 if dtype == np.float32 else 1e-8)
    np.testing.assert_allclose(y.asnumpy().std(axis=1), 1.0, rtol=1e-3)


def test_float32_gradients_stay_float32():
    x = Tensor(np.random.default_rng(2).standard_normal((2, 4, 3)).astype(np.float32), requires_grad=True)
    g = Tensor(np.ones(3, np.float32), requires_grad=True)
    b = Tensor(np.zeros(3, np.float32), requires_grad=True)
    ops.LayerNorm(-1, -1)(x, g, b).sum().backward()
    assert x.grad.dtype == g.grad.dtype == b.grad.dtype == np.float32
    # the normalised rows' gradient of sum() is 0: the output's row sums do not depend on x
    np.testing.assert_allclose(x.grad.asnumpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(b.grad.asnumpy(), 8.0)
    gn_g = Tensor(np.ones(4, np.float32), requires_grad=True)
    y = ops.GroupNorm(2)(x, gn_g, Tensor(np.zeros(4, np.float32)))
    (y * y).sum().backward()
    assert y.dtype == np.float32 and gn_g.grad.dtype == np.float32


@pytest.mark.cpu_only
def test_match_torch():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    rng = np.random.default_rng(3)
    x, w, b = rng.standard_normal((2, 4, 3, 5)), rng.standard_normal(5), rng.standard_normal(5)
    np.testing.assert_allclose(ops.layer_norm(Tensor(x), (5,), Tensor(w), Tensor(b)).asnumpy(),
                               torch.nn.functional.layer_norm(torch.tensor(x), (5,), torch.tensor(w),
                                                              torch.tensor(b)).numpy(), rtol=1e-10, atol=1e-12)
    w4, b4 = rng.standard_normal(4), rng.standard_normal(4)
    np.testing.assert_allclose(ops.group_norm(Tensor(x), 2, Tensor(w4), Tensor(b4)).asnumpy(),
                               torch.nn.functional.group_norm(torch.tensor(x), 2, torch.tensor(w4),
                                                              torch.tensor(b4)).numpy(), rtol=1e-10, atol=1e-12)


def test_errors():
    x = Tensor(np.ones((2, 3, 4)))
    with pytest.raises(ValueError, match=r"LayerNorm: begin_norm_axis=3 is out of range for x of rank 3"):
        ops.LayerNorm(3)(x, Tensor(np.ones((3, 4))), Tensor(np.zeros((3, 4))))
    with pytest.raises(ValueError, match=r"LayerNorm: gamma of shape \(4,\) must be \(3, 4\), "
                                         r"x.shape\[begin_params_axis=1:\]"):
        ops.LayerNorm()(x, Tensor(np.ones(4)), Tensor(np.zeros((3, 4))))
    with pytest.raises(TypeError, match=r"LayerNorm: epsilon must be a float, got '1e-5'"):
        ops.LayerNorm(epsilon="1e-5")
    with pytest.raises(ValueError, match=r"LayerNorm: epsilon must be positive, got 0"):
        ops.LayerNorm(epsilon=0)
    with pytest.raises(TypeError, match=r"LayerNorm: x must be a float tensor, got dtype int64"):
        ops.LayerNorm(-1, -1)(Tensor(np.ones((2, 3), np.int64)), Tensor(np.ones(3)), Tensor(np.ones(3)))
    with pytest.raises(ValueError, match=r"layer_norm: normalized_shape \(3,\) must be a non-empty trailing part "
                                         r"of the input's shape \(2, 3, 4\)"):
        ops.layer_norm(x, (3,))
    with pytest.raises(TypeError, match=r"layer_norm: normalized_shape must be an int or a tuple of ints"):
        ops.layer_norm(x, 4.0)
    with pytest.raises(ValueError, match=r"GroupNorm: the channels C=3 of x of shape \(2, 3, 4\) must be divisible "
                                         r"by num_groups=2"):
        ops.group_norm(x, 2)
    with pytest.raises(ValueError, match=r"GroupNorm: num_groups must be at least 1, got 0"):
        ops.GroupNorm(0)
    with pytest.raises(ValueError, match=r"GroupNorm: x must have at least 2 dimension"):
        ops.GroupNorm(1)(Tensor(np.ones(3)), Tensor(np.ones(3)), Tensor(np.ones(3)))
    with pytest.raises(ValueError, match=r"GroupNorm: beta of shape \(2,\) must be \(3,\), one per channel"):
        ops.GroupNorm(1)(x, Tensor(np.ones(3)), Tensor(np.ones(2)))
