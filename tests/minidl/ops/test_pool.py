"""MaxPool and AvgPool: forward vs a loop reference, gradients vs finite differences, ties."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import distinct_arrays


def same_pads(size, k, s):
    out = -(-size // s)
    total = max((out - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def ref_pool(x, kernel, stride, pad_mode, kind):
    """Pooling with explicit loops; 'same' pads TF-style and averages over real pixels only."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw) = kernel, stride
    if pad_mode == "same":
        (pt, _), (pl, _) = same_pads(h, kh, sh), same_pads(w, kw, sw)
        oh, ow = -(-h // sh), -(-w // sw)
    else:
        pt = pl = 0
        oh, ow = (h - kh) // sh + 1, (w - kw) // sw + 1
    y = np.zeros((n, c, oh, ow), dtype=x.dtype)
    for b in range(n):
        for ch in range(c):
            for i in range(oh):
                for j in range(ow):
                    vals = [x[b, ch, r, s]
                            for r in range(i * sh - pt, i * sh - pt + kh)
                            for s in range(j * sw - pl, j * sw - pl + kw)
                            if 0 <= r < h and 0 <= s < w]
                    y[b, ch, i, j] = max(vals) if kind == "max" else sum(vals) / len(vals)
    return y


@st.composite
def pool_cases(draw):
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    mode = draw(st.sampled_from(["valid", "same"]))
    h = draw(st.integers(kernel[0] if mode == "valid" else 1, 6))
    w = draw(st.integers(kernel[1] if mode == "valid" else 1, 6))
    shape = (draw(st.integers(1, 2)), draw(st.integers(1, 2)), h, w)
    # Distinct values: finite differences are only defined away from ties.
    x = draw(distinct_arrays(shape))
    return x, kernel, stride, mode


@given(case=pool_cases(), kind=st.sampled_from(["max", "avg"]))
def test_pool_matches_reference_and_gradients(case, kind):
    x, kernel, stride, mode = case
    op = (ops.MaxPool if kind == "max" else ops.AvgPool)(kernel_size=kernel, strides=stride, pad_mode=mode)
    check_op(op, [x], reference=lambda x: ref_pool(x, kernel, stride, mode, kind))


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("kernel, stride, mode, shape, pair", [
    (2, 2, "valid", (2, 3, 4, 6), ((2, 2), (2, 2))),   # windows tile the input
    (2, 2, "valid", (1, 2, 5, 7), ((2, 2), (2, 2))),   # a last row / column no window covers
    (3, 2, "same", (2, 2, 6, 5), ((3, 3), (2, 2))),    # overlapping, padded
    (2, 3, "valid", (1, 2, 7, 8), ((2, 2), (3, 3))),   # gaps between windows
    ((1, 1, 2, 3), (1, 1, 2, 1), "SAME", (1, 2, 5, 5), ((2, 3), (2, 1))),  # MindSpore 4-tuples
])
def test_pool_cases(kind, kernel, stride, mode, shape, pair):
    x = np.random.default_rng(0).permutation(int(np.prod(shape))).reshape(shape) / 10.0
    op = (ops.MaxPool if kind == "max" else ops.AvgPool)(kernel_size=kernel, strides=stride, pad_mode=mode)
    check_op(op, [x], reference=lambda x: ref_pool(x, pair[0], pair[1], mode.lower(), kind))


def test_max_pool_ties_go_to_first_maximum():
    """Equal values: the gradient goes to the first maximum of each window, row-major."""
    x = Tensor(np.ones((1, 1, 4, 4)), requires_grad=True)
    ops.max_pool2d(x, 2).sum().backward()
    expected = np.zeros((4, 4))
    expected[::2, ::2] = 1
    np.testing.assert_array_equal(x.grad.asnumpy()[0, 0], expected)
    # Overlapping windows: each of the four 3x3 windows sends its gradient to its own top-left.
    x = Tensor(np.ones((1, 1, 4, 4)), requires_grad=True)
    ops.MaxPool(3, 1)(x).sum().backward()
    expected = np.zeros((4, 4))
    expected[:2, :2] = 1
    np.testing.assert_array_equal(x.grad.asnumpy()[0, 0], expected)
    # A tie between later elements: the first of them in row-major order wins.
    x = Tensor(np.array([[[[0.0, 5.0], [5.0, 1.0]]]]), requires_grad=True)
    ops.max_pool2d(x, 2).sum().backward()
    np.testing.assert_array_equal(x.grad.asnumpy()[0, 0], [[0, 1], [0, 0]])


def test_max_pool_same_pads_with_minus_inf():
    x = -np.arange(1.0, 10.0).reshape(1, 1, 3, 3)  # all negative: zero padding would win
    y = ops.MaxPool(2, 2, "same")(Tensor(x)).asnumpy()
    np.testing.assert_array_equal(y[0, 0], [[-1, -3], [-7, -9]])


def test_avg_pool_same_excludes_padding():
    x = np.ones((1, 1, 3, 3))
    y = ops.AvgPool(2, 2, "same")(Tensor(x)).asnumpy()
    np.testing.assert_array_equal(y[0, 0], np.ones((2, 2)))  # zero padding would give 0.5, 0.25
    x = np.arange(9.0).reshape(1, 1, 3, 3)
    y = ops.AvgPool(2, 2, "same")(Tensor(x)).asnumpy()
    np.testing.assert_allclose(y[0, 0], [[(0 + 1 + 3 + 4) / 4, (2 + 5) / 2], [(6 + 7) / 2, 8]])


def test_functional_stride_defaults_to_kernel():
    x = Tensor(np.arange(36.0).reshape(1, 1, 6, 6))
    assert ops.max_pool2d(x, 3).shape == (1, 1, 2, 2)
    assert ops.avg_pool2d(x, 2, stride=1).shape == (1, 1, 5, 5)
    np.testing.assert_array_equal(ops.max_pool2d(x, 3).asnumpy()[0, 0], [[14, 17], [32, 35]])


def test_float32_and_no_grad():
    x = Tensor(np.random.default_rng(0).random((2, 3, 4, 4)).astype(np.float32), requires_grad=True)
    for op in (ops.MaxPool(2, 2), ops.AvgPool(3, 1, "same")):
        y = op(x)
        y.sum().backward()
        assert y.dtype == np.float32 and x.grad.dtype == np.float32
        x.grad = None
        with minidl.no_grad():
            assert op(x)._node is None


@pytest.mark.parametrize("make, shape, match", [
    (lambda: ops.MaxPool(2, 2), (1, 4, 4), r"MaxPool: x must be 4-D \(N, C, H, W\), got shape \(1, 4, 4\)"),
    (lambda: ops.AvgPool(3, 1), (1, 1, 2, 5), r"AvgPool: x of shape \(1, 1, 2, 5\): the input is too small"),
])
def test_input_errors(make, shape, match):
    with pytest.raises(ValueError, match=match):
        make()(Tensor(np.ones(shape)))


@pytest.mark.parametrize("cls, kwargs, match", [
    (ops.MaxPool, dict(pad_mode="pad"), r"MaxPool: pad_mode must be one of \('valid', 'same'\)"),
    (ops.AvgPool, dict(kernel_size=0), "AvgPool: kernel_size must be a positive int"),
    (ops.MaxPool, dict(strides=(2, 2, 1, 1)), r"MaxPool: strides must be .* or a \(1, 1, h, w\) tuple"),
    (ops.AvgPool, dict(data_format="NHWC"), "AvgPool: data_format='NHWC' is not supported"),
])
def test_attribute_errors(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_avg_pool_needs_float():
    with pytest.raises(TypeError, match="AvgPool: x must be a float tensor, got int64"):
        ops.AvgPool(2, 2)(Tensor(np.ones((1, 1, 2, 2), np.int64)))


def test_matches_torch():
    """Optional cross-check of values and gradients against torch max_pool2d / avg_pool2d."""
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 9, 8))
    for kernel, stride in [(2, 2), (3, 2), (3, 1), ((2, 3), (1, 2))]:
        for kind in ["max", "avg"]:
            mx = Tensor(x, requires_grad=True)
            y = (ops.MaxPool if kind == "max" else ops.AvgPool)(kernel, stride)(mx)
            gy = rng.standard_normal(y.shape)
            y.backward(Tensor(gy))
            tx = torch.tensor(x, requires_grad=True)
            ty = (F.max_pool2d if kind == "max" else F.avg_pool2d)(tx, kernel, stride)
            ty.backward(torch.tensor(gy))
            np.testing.assert_allclose(y.asnumpy(), ty.detach().numpy(), rtol=1e-12)
            np.testing.assert_allclose(mx.grad.asnumpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-15)
