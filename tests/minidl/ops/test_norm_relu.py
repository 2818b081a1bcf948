"""BatchNormReLU: forward vs NumPy, gradients vs finite differences, the reference is BatchNorm, Add
and ReLU one after another, float32 numerics, errors. (Its CPU kernel: tests/minidl/kernels/test_norm_kernels.py.)"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import kernels, ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import arrays


def pre_activation(x, scale, bias, mean, var, training, eps, residual=None):
    """batch_norm(x) + residual, in NumPy."""
    axes = tuple(i for i in range(x.ndim) if i != 1)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    if training:
        mean, var = x.mean(axis=axes), x.var(axis=axes)
    z = (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * scale.reshape(shape) + bias.reshape(shape)
    return z if residual is None else z + residual


def np_batch_norm_relu(x, scale, bias, mean, var, training, eps, residual=None):
    return np.maximum(pre_activation(x, scale, bias, mean, var, training, eps, residual), 0)


def away_from_the_kink(x, scale, bias, mean, var, training, eps, residual):
    """residual moved so that no pre-activation lies within 0.05 of 0 (no finite difference there)."""
    pre = pre_activation(x, scale, bias, mean, var, training, eps, residual)
    return residual + np.where(np.abs(pre) < 0.05, 0.2, 0.0)


@st.composite
def case(draw):
    ndim = draw(st.sampled_from([2, 3, 4]))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    if int(np.prod(shape)) // shape[1] < 2:
        shape[0] = 2  # training needs more than one value per channel
    c = shape[1]
    x = draw(arrays(tuple(shape)))
    scale, bias = draw(arrays((c,), -2.0, 2.0)), draw(arrays((c,)))
    mean, var = draw(arrays((c,))), draw(arrays((c,), 0.1, 3.0))
    residual = draw(arrays(tuple(shape)))
    eps = draw(st.sampled_from([1e-5, 1e-3]))
    return x, scale, bias, mean, var, eps, residual


@given(case=case(), training=st.booleans())
def test_batch_norm_relu_with_residual(case, training):
    x, scale, bias, mean, var, eps, residual = case
    residual = away_from_the_kink(x, scale, bias, mean, var, training, eps, residual)
    # the running statistics as tensors, so that they live on x's device (also when pinned to the GPU)
    fn = lambda x, s, b, r: ops.BatchNormReLU(training, eps, 0.1)(x, s, b, Tensor(mean.copy()), Tensor(var.copy()), r)
    ref = lambda x, s, b, r: np_batch_norm_relu(x, s, b, mean, var, training, eps, r)
    check_op(fn, [x, scale, bias, residual], reference=ref, fwd_rtol=1e-9)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(4, 3, 2, 2), (5, 2), (3, 2, 4)])
def test_batch_norm_relu_without_residual(training, shape):
    rng = np.random.default_rng(7)
    c = shape[1]
    scale, bias, mean, var = rng.normal(size=c), rng.normal(size=c), rng.normal(size=c), rng.uniform(0.5, 2, c)
    for _ in range(100):  # a draw with no pre-activation near the kink
        x = rng.normal(size=shape)
        if np.abs(pre_activation(x, scale, bias, mean, var, training, 1e-5)).min() > 0.05:
            break
    fn = lambda x, s, b: ops.BatchNormReLU(training)(x, s, b, Tensor(mean.copy()), Tensor(var.copy()))
    check_op(fn, [x, scale, bias], reference=lambda x, s, b: np_batch_norm_relu(x, s, b, mean, var, training, 1e-5),
             fwd_rtol=1e-9)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_reference_is_batch_norm_add_relu(training, with_residual):
    """On the reference bodies, outputs, every gradient and the running statistics equal those of
    the separate ops bit for bit: the fused reference is BatchNorm's body, an add and a max."""
    rng = np.random.default_rng(0)
    shape = (16, 16, 16, 16)
    x, gy, res = (rng.normal(1.0, 2.0, shape).astype(np.float32) for _ in range(3))
    scale, bias = rng.normal(size=16).astype(np.float32), rng.normal(size=16).astype(np.float32)
    stats = (rng.normal(size=16).astype(np.float32), rng.uniform(0.5, 2, 16).astype(np.float32))

    def run(fused):
        tx, ts, tb, tr = (Tensor(a, requires_grad=True) for a in (x, scale, bias, res))
        mean, var = (Tensor(a.copy()) for a in stats)
        extra = (tr,) if with_residual else ()
        if fused:
            y = ops.BatchNormReLU(training, 1e-5, 0.1)(tx, ts, tb, mean, var, *extra)
        else:
            y = ops.BatchNorm(training, 1e-5, 0.1)(tx, ts, tb, mean, var)
            y = ops.relu(y + tr if with_residual else y)
        y.backward(Tensor(gy))
        grads = [tx.grad, ts.grad, tb.grad] + ([tr.grad] if with_residual else [])
        return [y.asnumpy()] + [g.asnumpy() for g in grads] + [mean.asnumpy(), var.asnumpy()]

    with kernels.reference_only():
        fused, separate = run(True), run(False)
    names = ["y", "gx", "gscale", "gbias"] + (["gresidual"] if with_residual else []) + ["mean", "variance"]
    for name, a, b in zip(names, fused, separate):
        assert a.dtype == np.float32, name
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_float32_statistics_of_a_large_offset():
    """Mean 1000, deviation 1: E[x^2] - E[x]^2 in float32 would lose the variance to rounding."""
    rng = np.random.default_rng(1)
    x = (1000.0 + rng.standard_normal((32, 4, 8, 8))).astype(np.float32)
    ones, zeros = np.ones(4, np.float32), np.zeros(4, np.float32)
    mean, var = Tensor(zeros.copy()), Tensor(ones.copy())
    y = ops.BatchNormReLU(True, 1e-5, 1.0)(Tensor(x), Tensor(ones), Tensor(zeros), mean, var).asnumpy()
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(y, np_batch_norm_relu(x64, ones, zeros, None, None, True, 1e-5), atol=2e-3)
    np.testing.assert_allclose(mean.asnumpy(), x64.mean(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(var.asnumpy(), x64.var(axis=(0, 2, 3), ddof=1), rtol=1e-3)


def test_gradient_at_the_kink_is_zero():
    x = Tensor(np.array([[-1.0], [1.0]]), requires_grad=True)  # normalised: -1, 1; plus residual 1: 0, 2
    r = Tensor(np.array([[1.0], [1.0]]), requires_grad=True)
    stats = map(Tensor, (np.ones(1), np.zeros(1), np.zeros(1), np.ones(1) - 1e-5))
    ops.BatchNormReLU(False)(x, *stats, r).sum().backward()
    np.testing.assert_allclose(r.grad.asnumpy(), [[0.0], [1.0]])


def test_batch_norm_relu_function():
    rng = np.random.default_rng(2)
    x, res = rng.standard_normal((3, 2, 2, 2)), rng.standard_normal((3, 2, 2, 2))
    mean, var = Tensor(np.zeros(2)), Tensor(np.ones(2))
    y = ops.batch_norm_relu(Tensor(x), mean, var, Tensor(np.ones(2)), Tensor(np.zeros(2)), Tensor(res), training=True,
                            momentum=0.5)
    expected = np_batch_norm_relu(x, np.ones(2), np.zeros(2), None, None, True, 1e-5, res)
    np.testing.assert_allclose(y.asnumpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(mean.asnumpy(), 0.5 * x.mean(axis=(0, 2, 3)))


def test_errors():
    x = Tensor(np.ones((2, 3, 2, 2)))
    c3 = np.ones(3)
    with pytest.raises(ValueError, match=r"BatchNormReLU: residual of shape \(2, 3, 2\) and dtype float64 must "
                                         r"match x: shape \(2, 3, 2, 2\), dtype float64"):
        ops.BatchNormReLU()(x, c3, c3, c3, c3, Tensor(np.ones((2, 3, 2))))
    with pytest.raises(ValueError, match=r"BatchNormReLU: scale of shape \(4,\) must be \(3,\)"):
        ops.BatchNormReLU()(x, np.ones(4), c3, c3, c3)
    with pytest.raises(ValueError, match=r"BatchNormReLU: expected more than 1 value per channel when training"):
        ops.BatchNormReLU(True)(Tensor(np.ones((1, 3))), c3, c3, c3, c3)
    with pytest.raises(TypeError, match=r"BatchNormReLU: expected 5 to 6 input\(s\), got 4"):
        ops.BatchNormReLU()(x, c3, c3, c3)
