"""Conv2DTranspose / conv_transpose2d: forward vs a scatter-loop reference, the adjoint of
Conv2D, gradients vs finite differences, errors, and (cpu_only) PyTorch's values; the reference
body (kernels.reference_only) and the kernels (check_op compares them) alike."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import kernels, ops, Tensor
from minidl.testing import check_op
from minidl.testing.strategies import arrays


def conv_out(size, k, s, d, mode, lo, hi):
    """(out, lo) of a Conv2D along one axis: what ops.Conv2D computes (TF-style 'same')."""
    ek = (k - 1) * d + 1
    if mode == "same":
        out = -(-size // s)
        return out, max((out - 1) * s + ek - size, 0) // 2
    return (size + lo + hi - ek) // s + 1, lo


def ref_conv_transpose(dout, w, size, stride, dilation, top_left, groups):
    """Each dout pixel times w, added onto its window of the output (windows start at -top/-left)."""
    n, o, h, wd = dout.shape
    _, cg, kh, kw = w.shape
    (sh, sw), (dh, dw), (pt, pl) = stride, dilation, top_left
    rows = max((h - 1) * sh + (kh - 1) * dh + 1, pt + size[2])
    cols = max((wd - 1) * sw + (kw - 1) * dw + 1, pl + size[3])
    full = np.zeros((n, size[1], rows, cols))
    og = o // groups
    for b in range(n):
        for oc in range(o):
            g = oc // og
            for i in range(h):
                for j in range(wd):
                    for ci in range(cg):
                        for a in range(kh):
                            for e in range(kw):
                                v = dout[b, oc, i, j] * w[oc, ci, a, e]
                                full[b, g * cg + ci, i * sh + a * dh, j * sw + e * dw] += v
    return full[:, :, pt:pt + size[2], pl:pl + size[3]]


@st.composite
def transpose_cases(draw):
    """A Conv2D geometry (shapes, stride, dilation, groups, padding) and the dout it would give."""
    groups = draw(st.integers(1, 2))
    cg, og = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    mode = draw(st.sampled_from(["valid", "same", "pad"]))
    pads = tuple(draw(st.integers(0, 2)) for _ in range(4)) if mode == "pad" else (0, 0, 0, 0)
    eh, ew = (kh - 1) * dilation[0] + 1, (kw - 1) * dilation[1] + 1
    h = draw(st.integers(max(1, eh - pads[0] - pads[1]), 6))
    w = draw(st.integers(max(1, ew - pads[2] - pads[3]), 6))
    n = draw(st.integers(1, 2))
    oh, pt = conv_out(h, kh, stride[0], dilation[0], mode, pads[0], pads[1])
    ow, pl = conv_out(w, kw, stride[1], dilation[1], mode, pads[2], pads[3])
    dout = draw(arrays((n, groups * og, oh, ow)))
    wt = draw(arrays((groups * og, cg, kh, kw)))
    return dict(dout=dout, w=wt, size=(n, groups * cg, h, w), stride=stride, dilation=dilation, mode=mode,
                pads=pads, top_left=(pt, pl), groups=groups)


def make_op(case):
    o, _, kh, kw = case["w"].shape
    return ops.Conv2DTranspose(o, (kh, kw), pad_mode=case["mode"], pad=case["pads"], stride=case["stride"],
                               dilation=case["dilation"], group=case["groups"])


def run_case(case):
    op, size = make_op(case), case["size"]
    ref = lambda d, w: ref_conv_transpose(d, w, size, case["stride"], case["dilation"], case["top_left"],
                                          case["groups"])
    check_op(lambda d, w: op(d, w, size), [case["dout"], case["w"]], reference=ref)


@given(case=transpose_cases())
def test_conv_transpose_matches_reference_and_gradients(case):
    run_case(case)


@given(case=transpose_cases())
def test_reference_body_matches_loops_and_gradients(case):
    """The readable body in minidl/ops/conv.py on its own, no kernel."""
    with kernels.reference_only():
        run_case(case)


@given(case=transpose_cases(), data=st.data())
def test_conv_transpose_is_the_adjoint_of_conv2d(case, data):
    """<conv2d(x, w), dout> == <x, conv_transpose(dout, w)> for every x: the defining identity."""
    x = data.draw(arrays(case["size"]))
    o, _, kh, kw = case["w"].shape
    conv = ops.Conv2D(o, (kh, kw), pad_mode=case["mode"], pad=case["pads"], stride=case["stride"],
                      dilation=case["dilation"], group=case["groups"])
    lhs = np.sum(conv(Tensor(x), Tensor(case["w"])).asnumpy() * case["dout"])
    rhs = np.sum(x * make_op(case)(Tensor(case["dout"]), Tensor(case["w"]), case["size"]).asnumpy())
    np.testing.assert_allclose(lhs, rhs, rtol=1e-9, atol=1e-9)


def test_uncovered_rows_are_zero_and_get_no_gradient():
    """'valid', stride 3, kernel 2: the Conv2D never reads every third row or column: zeros there."""
    dout = Tensor(np.ones((1, 1, 2, 2)), requires_grad=True)
    w = Tensor(np.ones((1, 1, 2, 2)), requires_grad=True)
    y = ops.Conv2DTranspose(1, 2, stride=3)(dout, w, (1, 1, 6, 6))
    expected = np.ones((6, 6))
    expected[2::3] = expected[:, 2::3] = 0
    np.testing.assert_array_equal(y.asnumpy()[0, 0], expected)
    (y * Tensor(np.arange(36.0).reshape(1, 1, 6, 6))).sum().backward()
    assert dout.grad.shape == (1, 1, 2, 2) and w.grad.shape == (1, 1, 2, 2)


def test_functional_output_size_bias_and_float32():
    x = Tensor(np.ones((2, 4, 5, 5), np.float32))
    w = Tensor(np.ones((4, 8, 3, 3), np.float32))
    assert ops.conv_transpose2d(x, w).shape == (2, 8, 7, 7)
    y = ops.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1)
    assert y.shape == (2, 8, 10, 10) and y.dtype == np.float32
    b = Tensor(np.arange(8.0, dtype=np.float32))
    yb = ops.conv_transpose2d(x, w, bias=b, stride=2, padding=1, output_padding=1)
    np.testing.assert_allclose(yb.asnumpy() - y.asnumpy(),
                               np.broadcast_to(np.arange(8.0)[:, None, None], (2, 8, 10, 10)))
    g = ops.conv_transpose2d(x, Tensor(np.ones((4, 2, 3, 3), np.float32)), groups=2, dilation=(2, 1))
    assert g.shape == (2, 4, 9, 7)


def test_no_grad_keeps_nothing():
    op = ops.Conv2DTranspose(2, 3, pad_mode="same", stride=2)
    with minidl.no_grad():
        y = op(Tensor(np.ones((1, 2, 3, 3)), requires_grad=True), Tensor(np.ones((2, 1, 3, 3))), (1, 1, 6, 6))
    assert y._node is None and y.shape == (1, 1, 6, 6)


def test_pad_list_replaces_pad():
    dout, w = Tensor(np.ones((1, 2, 3, 3))), Tensor(np.ones((2, 1, 3, 3)))
    a = ops.Conv2DTranspose(2, 3, pad_mode="pad", pad_list=(1, 1, 1, 1), stride=2)(dout, w, (1, 1, 5, 5))
    b = ops.Conv2DTranspose(2, 3, pad_mode="pad", pad=1, stride=2)(dout, w, (1, 1, 5, 5))
    np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


@pytest.mark.parametrize("make, args, err, match", [
    (lambda: ops.Conv2DTranspose(2, 3), ((1, 2, 3, 3), (2, 1, 3, 3), (1, 1, 6, 6)), ValueError,
     r"Conv2DTranspose: dout of shape \(1, 2, 3, 3\) does not fit input_size=\(1, 1, 6, 6\): the Conv2D .* maps "
     r"\(6, 6\) to \(4, 4\), not \(3, 3\)"),
    (lambda: ops.Conv2DTranspose(2, 3), ((1, 2, 3, 3), (2, 2, 3, 3), (1, 1, 5, 5)), ValueError,
     r"w of shape \(2, 2, 3, 3\) does not fit input_size=\(1, 1, 5, 5\): expected \(2, 1, 3, 3\)"),
    (lambda: ops.Conv2DTranspose(2, 3), ((1, 3, 3, 3), (2, 1, 3, 3), (1, 1, 5, 5)), ValueError,
     r"dout of shape \(1, 3, 3, 3\) must have N=1 \(input_size\[0\]\) and out_channel=2 channels"),
    (lambda: ops.Conv2DTranspose(2, 3), ((1, 2, 3, 3), (2, 1, 3, 3), "big"), TypeError,
     r"input_size must be a tuple of 4 ints \(N, C, H, W\), got 'big'"),
    (lambda: ops.Conv2DTranspose(2, 3), ((1, 2, 3, 3), (2, 1, 3, 3), (1, 1, 5)), ValueError,
     r"input_size must be 4 positive ints"),
    (lambda: ops.Conv2DTranspose(2, 3, group=2), ((1, 2, 3, 3), (2, 1, 3, 3), (1, 3, 5, 5)), ValueError,
     r"input_size=\(1, 3, 5, 5\) has 3 channels, not divisible by group=2"),
])
def test_op_errors(make, args, err, match):
    with pytest.raises(err, match=match):
        make()(*[Tensor(np.ones(a)) if i < 2 else a for i, a in enumerate(args)])


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(out_channel=3, kernel_size=3, group=2), ValueError,
     "Conv2DTranspose: out_channel=3 must be divisible by group=2"),
    (dict(out_channel=2, kernel_size=3, pad=1), ValueError, r"pad=1 needs pad_mode='pad'"),
    (dict(out_channel=2, kernel_size=3, pad_list=(1, 1, 1, 1)), ValueError,
     r"pad_list=\(1, 1, 1, 1\) needs pad_mode='pad'"),
    (dict(out_channel=2, kernel_size=3, pad_mode="pad", pad_list=(1, 1)), ValueError, "pad_list must be None or"),
    (dict(out_channel=2, kernel_size=3, mode=2), ValueError, r"mode must be 1 \(cross-correlation\)"),
])
def test_attribute_errors(kwargs, err, match):
    with pytest.raises(err, match=match):
        ops.Conv2DTranspose(**kwargs)


@pytest.mark.parametrize("kwargs, err, match", [
    (dict(stride=2, output_padding=2), ValueError,
     r"conv_transpose2d: output_padding=2 must be smaller than stride=2 or dilation=1"),
    (dict(groups=3), ValueError, r"input of shape \(1, 4, 3, 3\) has 4 channels; .* divisible by groups=3"),
    (dict(padding=-1), ValueError, r"padding must be an int or a pair of ints >= 0, got -1"),
    (dict(padding=3), ValueError, r"gives an empty output \(1, 2, -1, -1\)"),
])
def test_functional_errors(kwargs, err, match):
    with pytest.raises(err, match=match):
        ops.conv_transpose2d(Tensor(np.ones((1, 4, 3, 3))), Tensor(np.ones((4, 2, 3, 3))), **kwargs)


@pytest.mark.cpu_only
@pytest.mark.parametrize("stride, padding, output_padding, dilation, groups", [
    (1, 0, 0, 1, 1), (2, 1, 1, 1, 1), (3, 2, 2, 1, 2), ((2, 3), (1, 0), (1, 2), 1, 1), (2, 2, 1, 2, 2), (1, 1, 0, 3, 1),
    (1, 1, 2, 3, 1), (2, 0, 3, 4, 2),  # output_padding from the stride up to the dilation
])
def test_matches_torch(stride, padding, output_padding, dilation, groups):
    """Values and both gradients against torch.nn.functional.conv_transpose2d."""
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((2, 4, 5, 4)), rng.standard_normal((4, 6 // groups, 3, 3)), rng.standard_normal(6)
    tx, tw, tb = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    ty = torch.nn.functional.conv_transpose2d(tx, tw, tb, stride, padding, output_padding, groups, dilation)
    mx, mw, mb = (Tensor(a, requires_grad=True) for a in (x, w, b))
    y = ops.conv_transpose2d(mx, mw, mb, stride, padding, output_padding, groups, dilation)
    gy = rng.standard_normal(tuple(ty.shape))
    ty.backward(torch.tensor(gy))
    y.backward(Tensor(gy))
    np.testing.assert_allclose(y.asnumpy(), ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    for got, want in ((mx, tx), (mw, tw), (mb, tb)):
        np.testing.assert_allclose(got.grad.asnumpy(), want.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("stride, dilation, padding, output_padding", [
    (1, 3, 0, 1), (1, 3, 1, 2), ((1, 2), (3, 3), (2, 0), (2, 1)), (2, 4, 1, 3)])
def test_output_padding_up_to_the_dilation(stride, dilation, padding, output_padding):
    """Where dilation > stride the output padding may reach the stride (a crop of the whole
    transposed convolution, then zero rows): checked against the scatter-loop reference and by
    finite differences."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((2, 4, 3, 4)), rng.standard_normal((4, 2, 2, 3))
    kw = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation)
    pair = lambda v: (v, v) if isinstance(v, int) else v  # noqa: E731
    (sh, sw), (dh, dw), (ph, pw), (eh, ew) = pair(stride), pair(dilation), pair(padding), pair(output_padding)
    size = (2, 2, 2 * sh - 2 * ph + dh + eh + 1, 3 * sw - 2 * pw + 2 * dw + ew + 1)
    check_op(lambda x, w: ops.conv_transpose2d(x, w, **kw), [x, w],
             reference=lambda x, w: ref_conv_transpose(x, w, size, (sh, sw), (dh, dw), (ph, pw), 1))
