"""Conv2D: forward vs a loop reference, gradients vs finite differences, errors; the reference
body (kernels.reference_only) and the kernels (check_op compares them) alike."""
import contextlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl
from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import im2col as kernel_im2col
from minidl.testing import check_op
from minidl.testing.strategies import arrays


def same_pads(size, k, s, d):
    """TF-style 'same' padding: (before, after), the odd pixel after."""
    out = -(-size // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
    return total // 2, total - total // 2


def ref_conv(x, w, stride=(1, 1), pads=(0, 0, 0, 0), dilation=(1, 1), groups=1):
    """Direct cross-correlation with explicit loops over every output element."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (dh, dw), (pt, pb, pl, pr) = stride, dilation, pads
    xp = np.zeros((n, c, h + pt + pb, wd + pl + pr), dtype=x.dtype)
    xp[:, :, pt:pt + h, pl:pl + wd] = x
    oh = (h + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (wd + pl + pr - (kw - 1) * dw - 1) // sw + 1
    og = o // groups
    y = np.zeros((n, o, oh, ow), dtype=x.dtype)
    for b in range(n):
        for oc in range(o):
            g = oc // og
            for i in range(oh):
                for j in range(ow):
                    acc = 0.0
                    for ci in range(cg):
                        for a in range(kh):
                            for e in range(kw):
                                acc += w[oc, ci, a, e] * xp[b, g * cg + ci, i * sh + a * dh, j * sw + e * dw]
                    y[b, oc, i, j] = acc
    return y


@st.composite
def conv_cases(draw):
    """A small valid convolution: shapes, stride, dilation, groups and a padding mode."""
    groups = draw(st.integers(1, 2))
    cg, og = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    mode = draw(st.sampled_from(["valid", "same", "pad"]))
    pads = tuple(draw(st.integers(0, 2)) for _ in range(4)) if mode == "pad" else (0, 0, 0, 0)
    eh, ew = (kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1
    h = draw(st.integers(max(1, eh - pads[0] - pads[1]), 5))
    w = draw(st.integers(max(1, ew - pads[2] - pads[3]), 5))
    if mode == "same":
        pads = same_pads(h, kh, stride[0], dilation[0]) + same_pads(w, kw, stride[1], dilation[1])
    n = draw(st.integers(1, 2))
    x = draw(arrays((n, groups * cg, h, w)))
    wt = draw(arrays((groups * og, cg, kh, kw)))
    return dict(x=x, w=wt, stride=stride, dilation=dilation, mode=mode, pads=pads, groups=groups)


def run_case(case):
    mode, pads = case["mode"], case["pads"]
    pad = pads if mode == "pad" else 0
    o, _, kh, kw = case["w"].shape
    op = ops.Conv2D(o, (kh, kw), pad_mode=mode, pad=pad, stride=case["stride"], dilation=case["dilation"],
                    group=case["groups"])
    ref = lambda x, w: ref_conv(x, w, case["stride"], pads, case["dilation"], case["groups"])
    check_op(op, [case["x"], case["w"]], reference=ref)


@contextlib.contextmanager
def images_per_chunk(n):
    """The conv kernels take chunks of n images (a declared option, restored after)."""
    kernels.set_option("images_per_chunk", n)
    try:
        yield
    finally:
        kernels.set_option("images_per_chunk", None)


@given(case=conv_cases())
def test_conv2d_matches_reference_and_gradients(case):
    run_case(case)


@given(case=conv_cases())
def test_reference_body_matches_loops_and_gradients(case):
    """The readable body in minidl/ops/conv.py on its own, no kernel."""
    with kernels.reference_only():
        run_case(case)


@settings(max_examples=6)
@given(case=conv_cases(), n=st.integers(3, 4))
def test_conv2d_in_chunks_of_images(case, n):
    """Two images per im2col chunk and a shorter last chunk give the same values and gradients."""
    reps = -(-n // case["x"].shape[0])
    case = dict(case, x=np.concatenate([case["x"]] * reps)[:n])
    with images_per_chunk(2):
        run_case(case)


@pytest.mark.parametrize("pad_mode, stride", [("valid", 1), ("pad", 1), ("pad", 2)])
def test_short_last_chunk(pad_mode, stride):
    """Three images in chunks of two: the last chunk's buffers have another layout.

    A valid stride-1 conv makes the flat-row garbage columns read real pixels, so stale
    values left in the reused gradient buffer would show in gw.
    """
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((3, 2, 5, 6)), rng.standard_normal((3, 2, 3, 2))
    pad = 1 if pad_mode == "pad" else 0
    op = ops.Conv2D(3, (3, 2), pad_mode=pad_mode, pad=pad, stride=stride)
    with images_per_chunk(2):
        check_op(op, [x, w], reference=lambda x, w: ref_conv(x, w, (stride, stride), (pad,) * 4))


@pytest.mark.parametrize("n, threads", [(3, 1), (5, 2)])
def test_a_short_chunk_after_a_full_one_in_the_same_buffers(n, threads):
    """Chunks of two images, so one thread runs a full chunk and then the short last one in the
    same buffers: the weight gradient's buffer must keep its garbage columns zero across the
    change of layout (a pitch computed from the short chunk put stale values there, and gw was
    4-20% wrong on ResNet-sized batches). 16x16 images: smaller ones happen to line up."""
    rng = np.random.default_rng(8)
    x, w, gy = rng.standard_normal((n, 2, 16, 16)), rng.standard_normal((2, 2, 3, 3)), rng.standard_normal((n, 2, 16, 16))
    xt = minidl.Tensor(x, requires_grad=True)
    wt = minidl.Parameter(minidl.Tensor(w))
    before = minidl.get_num_threads()
    minidl.set_num_threads(threads)
    try:
        with images_per_chunk(2):
            (ops.Conv2D(2, 3, pad_mode="pad", pad=1)(xt, wt) * minidl.Tensor(gy)).sum().backward()
    finally:
        minidl.set_num_threads(before)
    xp = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    want = np.stack([np.stack([np.einsum("nohw,nchw->oc", gy, xp[:, :, i:i + 16, j:j + 16]) for j in range(3)], -1)
                     for i in range(3)], -2)
    np.testing.assert_allclose(wt.grad.asnumpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel, dilation, pads", [
    ((3, 3), (1, 1), (1, 1, 1, 1)),   # the ResNet conv
    ((3, 3), (1, 2), (1, 1, 0, 4)),   # all the width padding on the right, dilated
    ((1, 5), (1, 1), (0, 0, 3, 1)),   # lopsided, more than half the kernel on the left
    ((2, 2), (1, 1), (0, 1, 0, 1)),   # even kernel: 'same' pads after only
    ((3, 3), (1, 1), (2, 0, 1, 1)),   # vertical padding all on top
])
def test_masked_flat_rows(kernel, dilation, pads):
    """Stride 1 with the output as wide as the input: rows with no horizontal padding, the
    windows that cross a row end zeroed in the columns. Checked against the loop reference
    on an image narrower than the kernel's reach and on a wider one, chunked and not."""
    rng = np.random.default_rng(11)
    for h, wd in ((4, 2), (5, 6)):
        x, w = rng.standard_normal((3, 2, h, wd)), rng.standard_normal((4, 2) + kernel)
        op = ops.Conv2D(4, kernel, pad_mode="pad", pad=pads, dilation=dilation)
        ow = wd + pads[2] + pads[3] - (kernel[1] - 1) * dilation[1]
        oh = h + pads[0] + pads[1] - (kernel[0] - 1) * dilation[0]
        assert kernel_im2col._Windows(x.shape, kernel, (1, 1), dilation, pads, (oh, ow), (1 << 20, 1)).masked
        with images_per_chunk(2):
            check_op(op, [x, w], reference=lambda x, w: ref_conv(x, w, (1, 1), pads, dilation))
        check_op(op, [x, w], reference=lambda x, w: ref_conv(x, w, (1, 1), pads, dilation))


def test_same_pads_extra_pixel_at_bottom_right():
    # H = W = 5, kernel 2, stride 2: output 3x3, one pixel of padding, below / right only.
    x = np.arange(25.0).reshape(1, 1, 5, 5)
    w = np.ones((1, 1, 2, 2))
    y = ops.Conv2D(1, 2, pad_mode="same", stride=2)(Tensor(x), Tensor(w)).asnumpy()
    assert y.shape == (1, 1, 3, 3)
    np.testing.assert_allclose(y, ref_conv(x, w, (2, 2), (0, 1, 0, 1)))
    assert y[0, 0, 2, 2] == x[0, 0, 4, 4]  # the last window holds one real pixel


def test_same_stride2_output_is_ceil():
    x = Tensor(np.ones((2, 3, 7, 8), np.float32))
    w = Tensor(np.ones((4, 3, 3, 3), np.float32))
    assert ops.Conv2D(4, 3, pad_mode="same", stride=2)(x, w).shape == (2, 4, 4, 4)
    assert ops.Conv2D(4, 3, pad_mode="same", stride=1)(x, w).shape == (2, 4, 7, 8)


@pytest.mark.parametrize("stride", [1, 2])
def test_groups_and_dilation(stride):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 4, 7, 6)), rng.standard_normal((6, 2, 2, 3))
    op = ops.Conv2D(6, (2, 3), pad_mode="pad", pad=(2, 0, 1, 3), stride=stride, dilation=(2, 1), group=2)
    ref = lambda x, w: ref_conv(x, w, (stride, stride), (2, 0, 1, 3), (2, 1), 2)
    check_op(op, [x, w], reference=ref)


@pytest.mark.parametrize("pad", [0, 1])
def test_1x1_conv(pad):
    """1x1 stride 1 without padding is a pure GEMM path; with padding it takes im2col."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2, 4, 3, 3)), rng.standard_normal((6, 2, 1, 1))
    op = ops.Conv2D(6, 1, pad_mode="pad", pad=pad, group=2)
    check_op(op, [x, w], reference=lambda x, w: ref_conv(x, w, pads=(pad,) * 4, groups=2))


def test_padding_beyond_kernel_reach():
    """Border outputs that see only padding: their gradient must not leak into x."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((1, 2, 3, 4)), rng.standard_normal((3, 2, 2, 2))
    op = ops.Conv2D(3, 2, pad_mode="pad", pad=(3, 1, 0, 4))
    check_op(op, [x, w], reference=lambda x, w: ref_conv(x, w, pads=(3, 1, 0, 4)))


def test_first_layer_needs_no_input_gradient():
    rng = np.random.default_rng(4)
    x = Tensor(rng.standard_normal((2, 3, 5, 5)))
    w = Tensor(rng.standard_normal((4, 3, 3, 3)), requires_grad=True)
    y = ops.conv2d(x, w, padding=1, pad_mode="pad")
    gy = rng.standard_normal(y.shape)
    y.backward(Tensor(gy))
    assert x.grad is None
    xw = Tensor(x.data, requires_grad=True)
    w2 = Tensor(w.data, requires_grad=True)
    ops.conv2d(xw, w2, padding=1, pad_mode="pad").backward(Tensor(gy))
    np.testing.assert_allclose(w.grad.asnumpy(), w2.grad.asnumpy(), rtol=1e-12)


def test_no_grad_keeps_nothing_for_backward():
    x, w = Tensor(np.ones((1, 2, 4, 4))), Tensor(np.ones((2, 2, 3, 3)), requires_grad=True)
    with minidl.no_grad():
        y = ops.Conv2D(2, 3)(x, w)
    assert y._node is None
    np.testing.assert_allclose(y.asnumpy(), np.full((1, 2, 2, 2), 18.0))


def test_float32_stays_float32():
    x = Tensor(np.ones((1, 2, 4, 4), np.float32), requires_grad=True)
    w = Tensor(np.ones((3, 2, 3, 3), np.float32), requires_grad=True)
    y = ops.Conv2D(3, 3, pad_mode="same")(x, w)
    y.sum().backward()
    assert y.dtype == np.float32 and x.grad.dtype == np.float32 and w.grad.dtype == np.float32


def test_mindspore_style_arguments():
    """4-tuple stride/dilation (1, 1, s, s), upper-case pad_mode, and the functional form."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((1, 2, 6, 6)), rng.standard_normal((3, 2, 3, 3))
    a = ops.Conv2D(3, (3, 3), pad_mode="SAME", stride=(1, 1, 2, 2), dilation=(1, 1, 1, 1))(Tensor(x), Tensor(w))
    b = ops.conv2d(Tensor(x), Tensor(w), stride=2, pad_mode="same")
    np.testing.assert_allclose(a.asnumpy(), b.asnumpy())
    np.testing.assert_allclose(a.asnumpy(), ref_conv(x, w, (2, 2), (0, 1, 0, 1)), rtol=1e-12)


@pytest.mark.parametrize("make, x_shape, w_shape, error, match", [
    (lambda: ops.Conv2D(4, 3, group=2), (1, 3, 5, 5), (4, 1, 3, 3), ValueError,
     r"Conv2D: x of shape \(1, 3, 5, 5\) has 3 channels, not divisible by group=2"),
    (lambda: ops.Conv2D(4, 3), (1, 3, 5, 5), (4, 2, 3, 3), ValueError,
     r"Conv2D: w of shape \(4, 2, 3, 3\) does not fit x of shape \(1, 3, 5, 5\): expected \(4, 3, 3, 3\)"),
    (lambda: ops.Conv2D(5, 3), (1, 3, 5, 5), (4, 3, 3, 3), ValueError, r"expected \(5, 3, 3, 3\) \(out_channel=5"),
    (lambda: ops.Conv2D(4, 3), (1, 3, 2, 5), (4, 3, 3, 3), ValueError,
     r"Conv2D: x of shape \(1, 3, 2, 5\): the input is too small.*kernel 3"),
    (lambda: ops.Conv2D(4, 3, dilation=2), (1, 3, 4, 9), (4, 3, 3, 3), ValueError,
     r"too small for the window \(kernel 3, dilation 2"),
    (lambda: ops.Conv2D(4, 3), (3, 5, 5), (4, 3, 3, 3), ValueError, r"Conv2D: x must be 4-D \(N, C, H, W\)"),
])
def test_shape_errors(make, x_shape, w_shape, error, match):
    with pytest.raises(error, match=match):
        make()(Tensor(np.ones(x_shape)), Tensor(np.ones(w_shape)))


def test_dtype_error():
    with pytest.raises(TypeError, match="Conv2D: x has dtype float32 but w has dtype float64"):
        ops.Conv2D(2, 1)(Tensor(np.ones((1, 1, 2, 2), np.float32)), Tensor(np.ones((2, 1, 1, 1))))


@pytest.mark.parametrize("kwargs, match", [
    (dict(pad=1), r"Conv2D: pad=1 needs pad_mode='pad', got pad_mode='valid'"),
    (dict(pad_mode="full"), r"Conv2D: pad_mode must be one of \('valid', 'same', 'pad'\)"),
    (dict(pad=(1, 2), pad_mode="pad"), r"Conv2D: pad must be an int or a \(top, bottom, left, right\) tuple"),
    (dict(pad=-1, pad_mode="pad"), "Conv2D: pad values must be non-negative ints"),
    (dict(stride=0), "Conv2D: stride must be a positive int"),
    (dict(dilation=(2, 2, 1, 1)), r"Conv2D: dilation must be .* or a \(1, 1, h, w\) tuple"),
    (dict(group=3), "Conv2D: out_channel=4 must be divisible by group=3"),
    (dict(data_format="NHWC"), "Conv2D: data_format='NHWC' is not supported"),
    (dict(mode=2), "Conv2D: mode must be 1"),
])
def test_attribute_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.Conv2D(4, 3, **kwargs)


def test_kernel_size_error():
    with pytest.raises(ValueError, match=r"Conv2D: kernel_size must be a positive int or a pair"):
        ops.Conv2D(4, (3, 3, 3))
    with pytest.raises(ValueError, match=r"conv2d: w must be 4-D"):
        ops.conv2d(Tensor(np.ones((1, 1, 3, 3))), Tensor(np.ones((3, 3))))


def test_matches_torch():
    """Optional cross-check of values and both gradients against torch.nn.functional.conv2d."""
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    rng = np.random.default_rng(6)
    for stride, dilation, pads, groups in [(1, 1, (1, 1, 1, 1), 1), (2, 1, (1, 1, 1, 1), 1),
                                           (1, 2, (2, 0, 1, 3), 2), (2, 1, (0, 0, 0, 0), 1)]:
        x, w = rng.standard_normal((3, 4, 9, 8)), rng.standard_normal((6, 4 // groups, 3, 3))
        mx, mw = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        y = ops.Conv2D(6, 3, pad_mode="pad", pad=pads, stride=stride, dilation=dilation, group=groups)(mx, mw)
        gy = rng.standard_normal(y.shape)
        y.backward(Tensor(gy))
        tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
        txp = torch.nn.functional.pad(tx, (pads[2], pads[3], pads[0], pads[1]))
        ty = torch.nn.functional.conv2d(txp, tw, stride=stride, dilation=dilation, groups=groups)
        ty.backward(torch.tensor(gy))
        np.testing.assert_allclose(y.asnumpy(), ty.detach().numpy(), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(mx.grad.asnumpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(mw.grad.asnumpy(), tw.grad.numpy(), rtol=1e-10, atol=1e-10)
