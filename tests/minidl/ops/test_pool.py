"""MaxPool and AvgPool: forward vs a loop reference, gradients vs finite differences, ties."""
import numpy as np
import pytest
from hypothesis import assume, given, strategies as st

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
    (ops.MaxPool, dict(pad_mode="full"), r"MaxPool: pad_mode must be one of \('valid', 'same', 'pad'\)"),
    (ops.MaxPool, dict(kernel_size=3, pad=2, pad_mode="pad"),
     r"MaxPool: pad=2 must be at most half of kernel_size=\(3, 3\)"),
    (ops.MaxPool, dict(kernel_size=3, pad=1), r"MaxPool: pad=1 needs pad_mode='pad', got pad_mode='valid'"),
    (ops.AvgPool, dict(kernel_size=3, pad=(2, 2, 0, 0), pad_mode="pad"), r"AvgPool: pad=\(2, 2, 0, 0\) is too large"),
    (ops.AvgPool, dict(kernel_size=3, pad=(3, 0, 0, 0), pad_mode="pad"), "no window entirely in the padding"),
    (ops.AvgPool, dict(pad=(1, 2, 3), pad_mode="pad"), r"AvgPool: pad must be an int, a \(pad_h, pad_w\) pair"),
    (ops.AvgPool, dict(divisor_override=-2), "AvgPool: divisor_override must be None or a positive int, got -2"),
    (ops.AvgPool, dict(kernel_size=0), "AvgPool: kernel_size must be a positive int"),
    (ops.MaxPool, dict(strides=(2, 2, 1, 1)), r"MaxPool: strides must be .* or a \(1, 1, h, w\) tuple"),
    (ops.AvgPool, dict(data_format="NHWC"), "AvgPool: data_format='NHWC' is not supported"),
])
def test_attribute_errors(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("cls, kwargs", [(ops.MaxPool, dict(ceil_mode=1)), (ops.AvgPool, dict(count_include_pad=0))])
def test_flag_type_errors(cls, kwargs):
    with pytest.raises(TypeError, match="must be a bool, got"):
        cls(**kwargs)


def test_avg_pool_needs_float():
    with pytest.raises(TypeError, match="AvgPool: x must be a float tensor, got int64"):
        ops.AvgPool(2, 2)(Tensor(np.ones((1, 1, 2, 2), np.int64)))


def test_matches_torch():
    """Optional cross-check of values and gradients against torch max_pool2d / avg_pool2d."""
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
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


# ---- explicit padding, ceil_mode, count_include_pad, divisor_override, dilation, indices ------

def ref_pool_padded(x, kernel, stride, pads, kind, ceil=False, dilation=(1, 1), count_include_pad=True, divisor=None):
    """Pooling with explicit loops over PyTorch's window rules, with (top, bottom, left, right) pads.

    Returns (y, flat index of each maximum in its (H, W) plane; None for 'avg')."""
    n, c, h, w = x.shape
    (kh, kw), (sh, sw), (dh, dw), (pt, pb, pl, pr) = kernel, stride, dilation, pads

    def size(length, k, s, d, lo, hi):
        span = length + lo + hi - (k - 1) * d - 1
        out = (-(-span // s) if ceil else span // s) + 1
        return out - 1 if ceil and (out - 1) * s >= length + lo else out

    oh, ow = size(h, kh, sh, dh, pt, pb), size(w, kw, sw, dw, pl, pr)
    y, where = np.zeros((n, c, oh, ow)), np.zeros((n, c, oh, ow), np.int64)
    for i in range(oh):
        for j in range(ow):
            r0, c0 = i * sh - pt, j * sw - pl
            taps = [(r0 + a * dh, c0 + e * dw) for a in range(kh) for e in range(kw)]
            inside = [(r, q) for r, q in taps if 0 <= r < h and 0 <= q < w]
            vals = np.stack([x[:, :, r, q] for r, q in inside], axis=-1)
            if kind == "max":
                y[:, :, i, j] = vals.max(-1)
                r, q = np.array(inside).T
                where[:, :, i, j] = (r * w + q)[vals.argmax(-1)]
            else:
                if divisor:
                    count = divisor
                elif count_include_pad:
                    count = (min(r0 + kh, h + pb) - r0) * (min(c0 + kw, w + pr) - c0)
                else:
                    count = len(inside)
                y[:, :, i, j] = vals.sum(-1) / count
    return y, (where if kind == "max" else None)


@st.composite
def padded_cases(draw, kinds=("max", "avg"), symmetric=False):
    kind = draw(st.sampled_from(kinds))
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2))) if kind == "max" else (1, 1)
    pads = tuple(draw(st.integers(0, k // 2)) for k in (kernel[0], kernel[0], kernel[1], kernel[1]))
    if symmetric:
        pads = (pads[0], pads[0], pads[2], pads[2])
    ceil = draw(st.booleans())
    ext = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
    h = draw(st.integers(max(1, ext[0] - pads[0] - pads[1]), 6))
    w = draw(st.integers(max(1, ext[1] - pads[2] - pads[3]), 6))
    # A dilated window can fall wholly in the padding (taps at -1 and 1 of a 1-wide input): PyTorch
    # and MindSpore give it no defined maximum, so no case holds one.
    for length, k, s, d, lo in ((h, kernel[0], stride[0], dilation[0], pads[0]), (w, kernel[1], stride[1], dilation[1], pads[2])):
        assume(all(any(0 <= start + e * d < length for e in range(k)) for start in range(-lo, length, s)))
    x = draw(distinct_arrays((draw(st.integers(1, 2)), draw(st.integers(1, 2)), h, w)))
    return dict(x=x, kind=kind, kernel=kernel, stride=stride, dilation=dilation, pads=pads, ceil=ceil,
                count_include_pad=draw(st.booleans()), divisor=draw(st.sampled_from([None, None, 3])))


def make_pool(case):
    args = dict(kernel_size=case["kernel"], strides=case["stride"], pad_mode="pad", pad=case["pads"],
                ceil_mode=case["ceil"])
    if case["kind"] == "max":
        return ops.MaxPool(dilation=case["dilation"], **args)
    return ops.AvgPool(count_include_pad=case["count_include_pad"], divisor_override=case["divisor"], **args)


@given(case=padded_cases())
def test_padded_pool_matches_reference_and_gradients(case):
    ref = lambda x: ref_pool_padded(x, case["kernel"], case["stride"], case["pads"], case["kind"], case["ceil"],
                                    case["dilation"], case["count_include_pad"], case["divisor"])[0]
    check_op(make_pool(case), [case["x"]], reference=ref)


@given(case=padded_cases(kinds=("max",), symmetric=True))  # the functional form takes (pad_h, pad_w)
def test_max_pool_indices_match_reference(case):
    x, pads = case["x"], case["pads"]
    y, where = ops.max_pool2d(Tensor(x), case["kernel"], case["stride"], (pads[0], pads[2]), case["dilation"],
                              return_indices=True, ceil_mode=case["ceil"])
    want_y, want_where = ref_pool_padded(x, case["kernel"], case["stride"], pads, "max", case["ceil"],
                                         case["dilation"])
    np.testing.assert_array_equal(y.asnumpy(), want_y)
    assert where.dtype == np.int64
    np.testing.assert_array_equal(where.asnumpy(), want_where)


def test_ceil_mode_drops_a_window_that_would_start_in_the_padding():
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    # kernel 2, stride 3, padding 1: ceil((4 + 2 - 2) / 3) + 1 = 3 windows, but the third would
    # start at row 5, in the bottom padding; PyTorch's rule drops it.
    y = ops.MaxPool(2, 3, pad_mode="pad", pad=1, ceil_mode=True)(Tensor(x)).asnumpy()
    assert y.shape == (1, 1, 2, 2)
    np.testing.assert_array_equal(y[0, 0], [[0, 3], [12, 15]])
    # kernel 3, stride 2, padding 1 on 4 rows: the third window starts in the input (row 3) and hangs
    # past the padded end; it is kept, and its overhang is never counted.
    y = ops.AvgPool(3, 2, pad_mode="pad", pad=1, ceil_mode=True)(Tensor(np.ones((1, 1, 4, 4)))).asnumpy()
    assert y.shape == (1, 1, 3, 3)
    # rows counted per window: 3 (pad + 2 rows), 3, 2 (row 3 + the bottom pad): ones sum to 2, 3, 1 rows.
    rows = np.array([2 / 3, 1.0, 1 / 2])
    np.testing.assert_allclose(y[0, 0], np.outer(rows, rows))


def test_count_include_pad_both_ways_and_divisor_override():
    x = Tensor(np.ones((1, 1, 3, 3)))
    incl = ops.AvgPool(2, 2, pad_mode="pad", pad=1)(x).asnumpy()[0, 0]
    excl = ops.AvgPool(2, 2, pad_mode="pad", pad=1, count_include_pad=False)(x).asnumpy()[0, 0]
    np.testing.assert_allclose(incl, [[0.25, 0.5], [0.5, 1.0]])
    np.testing.assert_allclose(excl, np.ones((2, 2)))
    over = ops.avg_pool2d(x, 2, 2, 1, divisor_override=2).asnumpy()[0, 0]
    np.testing.assert_allclose(over, [[0.5, 1.0], [1.0, 2.0]])
    # 'same' never counts its padding, whatever count_include_pad says (MindSpore's rule).
    same = ops.AvgPool(2, 2, "same", count_include_pad=True)(x).asnumpy()[0, 0]
    np.testing.assert_allclose(same, np.ones((2, 2)))


def test_padding_on_every_side():
    x = -np.arange(1.0, 13.0).reshape(1, 1, 3, 4)  # all negative: a zero (not -inf) padding would win
    y = ops.MaxPool(3, 1, pad_mode="pad", pad=(1, 0, 0, 1))(Tensor(x)).asnumpy()[0, 0]
    # rows -1..1 and 0..2 (top pad), columns 0..2, 1..3 and 2..4 (right pad)
    np.testing.assert_array_equal(y, [[-1, -2, -3], [-1, -2, -3]])
    y = ops.avg_pool2d(Tensor(np.ones((1, 1, 3, 4))), 3, 1, (1, 0, 0, 1)).asnumpy()[0, 0]
    np.testing.assert_allclose(y, [[6 / 9, 6 / 9, 4 / 9], [1.0, 1.0, 6 / 9]])


def test_functional_defaults_follow_mindspore():
    x = Tensor(np.arange(36.0).reshape(1, 1, 6, 6))
    assert ops.avg_pool2d(x, 2).shape == (1, 1, 5, 5)  # MindSpore 2.10: stride=1
    assert ops.max_pool2d(x, 2).shape == (1, 1, 3, 3)  # stride=None: the kernel size
    assert ops.max_pool2d(x, 3, 2, pad_mode="same").shape == (1, 1, 3, 3)  # minidl's extra keyword
    y = ops.max_pool2d(x, 3, 2, 1, 1, False, True)  # MindSpore's order: return_indices before ceil_mode
    assert y.shape == (1, 1, 4, 4)


@pytest.mark.cpu_only
@pytest.mark.parametrize("kernel, stride, padding, dilation, ceil_mode, count_include_pad", [
    (3, 2, 1, 1, False, True), (3, 2, 1, 1, True, False), (2, 3, 1, 1, True, True),
    ((3, 2), (2, 1), (1, 0), 1, True, False),
    (3, 2, 1, 2, True, True), (2, 2, 0, 1, True, True), (4, 3, 2, 1, True, False),
])
def test_padded_pools_match_torch(kernel, stride, padding, dilation, ceil_mode, count_include_pad):
    """Values, gradients and indices against torch max_pool2d / avg_pool2d for the same arguments."""
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    F = torch.nn.functional
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 9, 8))
    for kind in ("max", "avg"):
        if kind == "avg" and dilation != 1:
            continue
        mx, tx = Tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
        if kind == "max":
            y, where = ops.max_pool2d(mx, kernel, stride, padding, dilation, True, ceil_mode)
            ty, twhere = F.max_pool2d(tx, kernel, stride, padding, dilation, ceil_mode, return_indices=True)
            np.testing.assert_array_equal(where.asnumpy(), twhere.numpy())
        else:
            y = ops.avg_pool2d(mx, kernel, stride, padding, ceil_mode, count_include_pad)
            ty = F.avg_pool2d(tx, kernel, stride, padding, ceil_mode, count_include_pad)
        gy = rng.standard_normal(tuple(ty.shape))
        y.backward(Tensor(gy))
        ty.backward(torch.tensor(gy))
        np.testing.assert_allclose(y.asnumpy(), ty.detach().numpy(), rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(mx.grad.asnumpy(), tx.grad.numpy(), rtol=1e-12, atol=1e-15)
