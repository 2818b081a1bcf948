"""The tap convolution (minidl/kernels/cpu/taps.py) and the direct BLAS calls under it
(minidl/kernels/cpu/blas.py), against NumPy and the reference Conv2D, on each BLAS found."""
import contextlib
import tracemalloc

import numpy as np
import pytest
from hypothesis import example, given, strategies as st

from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import blas, conv as cpu_conv
from minidl.kernels.cpu.taps import Taps, tap_correlate, tap_input_gradient

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("kernels_on")]

LIBRARIES = [name for name in ("openblas", "mkl") if blas.load(name)]


@contextlib.contextmanager
def option(name, value):
    previous = kernels.get_option(name)
    kernels.set_option(name, value)
    try:
        yield
    finally:
        kernels.set_option(name, previous)


@pytest.fixture(params=LIBRARIES)
def library(request):
    with option("blas", request.param):
        yield request.param


def test_numpys_openblas_is_found():
    # NumPy's wheels vendor OpenBLAS; the tap route depends on reaching it (or MKL).
    assert "openblas" in LIBRARIES


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_in_every_layout_and_accumulating(library, dtype):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 5)).astype(dtype)
    b = rng.standard_normal((5, 9)).astype(dtype)
    layouts_b = [b, np.asfortranarray(b), np.pad(b, ((0, 0), (0, 3)))[:, :9]]
    for a_view in (a, np.asfortranarray(a), np.pad(a, ((0, 0), (0, 2)))[:, :5]):
        for b_view in layouts_b:
            out = np.full((7, 12), 2.0, dtype)[:, :9]
            assert blas.matmul(a_view, b_view, out)
            np.testing.assert_allclose(out, a @ b, rtol=1e-5)
            assert blas.matmul(a_view, b_view, out, beta=1.0)
            np.testing.assert_allclose(out, 2 * (a @ b), rtol=1e-5)
    assert (out[:, :9] == out).all()


def test_matmul_declines_what_blas_cannot_take(library):
    a = np.ones((4, 6), np.float32)
    out = np.zeros((4, 3), np.float32)
    assert not blas.matmul(a, np.ones((6, 3), np.float64), out)           # mixed dtypes
    assert not blas.matmul(a, np.ones((6, 6), np.float32)[:, ::2], out)   # no unit stride
    assert not blas.matmul(a, np.ones((6, 3), np.float32), np.zeros((3, 4), np.float32).T)  # out transposed
    assert not blas.matmul(a[:, ::-1], np.ones((6, 3), np.float32), out)  # negative stride
    assert not blas.matmul(a[:0], np.ones((6, 3), np.float32), out[:0])   # empty
    assert not blas.matmul(a.astype(np.int32), np.ones((6, 3), np.int32), out.astype(np.int32))
    assert (out == 0).all()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_on_every_layout_beta_and_thread_count(library, threads, dtype):
    # Every layout (row pitch, either orientation of each operand), beta 0 and 1, one and two threads.
    rng = np.random.default_rng(2)
    a = rng.standard_normal((70, 50)).astype(dtype)
    b = rng.standard_normal((50, 90)).astype(dtype)
    c = rng.standard_normal((70, 90)).astype(dtype)
    for a_view in (a, np.asfortranarray(a), np.pad(a, ((0, 0), (0, 2)))[:, :50]):
        for b_view in (b, np.asfortranarray(b), np.pad(b, ((0, 0), (0, 3)))[:, :90]):
            for beta in (0.0, 1.0):
                out = np.pad(c, ((0, 0), (0, 5)))[:, :90]
                assert blas.matmul(a_view, b_view, out, beta=beta, threads=threads)
                np.testing.assert_allclose(out, a.astype(np.float64) @ b + beta * c, rtol=1e-4, atol=1e-4)


def test_gemm_sums_into_c_from_offset_operands(library):
    rng = np.random.default_rng(1)
    flat = rng.standard_normal((3, 40)).astype(np.float32)
    w = rng.standard_normal((2, 3)).astype(np.float32)
    out = np.zeros((2, 20), np.float32)
    for off in (0, 5):
        blas.gemm(np.float32, 2, 20, 3, blas.address(w), 3, blas.address(flat) + 4 * off, 40,
                  blas.address(out), 20, beta=1.0)
    np.testing.assert_allclose(out, w @ flat[:, 0:20] + w @ flat[:, 5:25], rtol=1e-5, atol=1e-6)


def test_a_bad_blas_option_says_what_is_accepted():
    with option("blas", "atlas"), pytest.raises(ValueError, match="'mkl', 'openblas' or None"):
        blas.library()


def test_mkl_missing_names_the_extra(monkeypatch):
    monkeypatch.setitem(blas._found, "mkl", {})
    with option("blas", "mkl"), pytest.raises(RuntimeError, match=r"minidl\[mkl\]"):
        blas.library()


def reference(x, w, stride, pads, dilation, gy):
    """Conv2D's reference body (kernels off) on float64 copies: (y, gx) for output gradient gy."""
    conv = ops.Conv2D(w.shape[0], w.shape[2:], pad_mode="pad", pad=pads, stride=stride, dilation=dilation)
    with kernels.reference_only():
        xt = Tensor(x.astype(np.float64), requires_grad=True)
        y = conv(xt, Tensor(w.astype(np.float64)))
        (y * Tensor(gy.astype(np.float64))).sum().backward()
    return y.data, xt.grad.data


def weight_products(x, times, stride, pads, dilation, kernel):
    """acc[t, ct, c] = sum over output positions of times[:, ct] * padded x at tap t[:, c] (float64)."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    pt, pb, pl, pr = pads
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pt, pb), (pl, pr)))
    oh, ow = times.shape[2:]
    out = np.zeros((kh * kw, times.shape[1], x.shape[1]))
    for i in range(kh):
        for j in range(kw):
            win = xp[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
            out[i * kw + j] = np.einsum("nohw,nchw->oc", times.astype(np.float64), win)
    return out


@given(st.integers(1, 5), st.integers(1, 4), st.integers(1, 4), st.integers(3, 9), st.integers(3, 9),
       st.sampled_from([(1, 1), (2, 2), (3, 3), (1, 3), (3, 2)]), st.sampled_from([(1, 1), (2, 2), (2, 1), (1, 3)]),
       st.sampled_from([(1, 1), (2, 1), (1, 2)]), st.tuples(*[st.integers(0, 3)] * 4), st.sampled_from([None, 1, 2]))
# Geometries the derandomized draws may miss: pads wider than the kernel's reach (a zero gap each);
# a stride phase the taps use that holds no column of x, or none that an output reads; a phase whose
# last rows of x no output reads.
@example(2, 2, 3, 5, 4, (1, 1), (1, 1), (1, 1), (1, 2, 2, 1), None)
@example(2, 2, 3, 3, 3, (2, 2), (1, 3), (1, 2), (1, 1, 1, 1), None)
@example(2, 2, 3, 4, 3, (2, 2), (1, 3), (1, 2), (1, 1, 2, 0), None)
@example(2, 2, 3, 3, 3, (2, 2), (2, 2), (1, 1), (0, 0, 0, 0), None)
@example(2, 2, 3, 6, 3, (2, 2), (2, 2), (1, 1), (3, 0, 2, 1), None)
def test_taps_equal_the_reference(n, c, o, h, wd, kernel, stride, dilation, pads, per_chunk):
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    pt, pb, pl, pr = pads
    oh = (h + pt + pb - (kh - 1) * dh - 1) // sh + 1
    ow = (wd + pl + pr - (kw - 1) * dw - 1) // sw + 1
    if oh < 1 or ow < 1:
        return
    rng = np.random.default_rng(n * 100 + c * 10 + o)
    x = rng.standard_normal((n, c, h, wd)).astype(np.float32)
    w = rng.standard_normal((o, c, kh, kw)).astype(np.float32)
    gy = rng.standard_normal((n, o, oh, ow)).astype(np.float32)
    assert Taps.fits(x, w, stride, pads, 1)
    with option("images_per_chunk", per_chunk):
        taps = Taps(x.shape, kernel, stride, dilation, pads, (oh, ow), (1 << 16, 2))
        y, acc = tap_correlate(x, w, taps, times=gy)
        y_alone = tap_correlate(x, w, taps)
        acc_alone = tap_correlate(x, w, taps, times=gy, forward=False)
        gx = tap_input_gradient(gy, w, taps)
    y_ref, gx_ref = reference(x, w, stride, pads, dilation, gy)
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    assert (y_alone == y).all() and (acc_alone == acc).all()
    np.testing.assert_allclose(acc, weight_products(x, gy, stride, pads, dilation, kernel), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-4, atol=1e-4)
    assert y.dtype == acc.dtype == gx.dtype == np.float32


def test_taps_do_not_take_what_they_cannot_run():
    x, w = np.ones((1, 2, 5, 5), np.float32), np.ones((2, 2, 3, 3), np.float32)
    assert Taps.fits(x, w, (2, 2), (1, 1, 1, 1), 1)
    assert not Taps.fits(x, w, (1, 1), (1, 1, 1, 1), 2)         # grouped
    assert not Taps.fits(x, w, (1, 1), (-1, 0, 0, 0), 1)        # a crop
    assert not Taps.fits(x.astype(np.float16), w.astype(np.float16), (1, 1), (1, 1, 1, 1), 1)


def test_the_conv_kernel_cases_pass_on_every_library(library):
    # The differential cases of both conv kernels (tests/minidl/kernels/test_conv_kernels.py runs them
    # on the default library): forward by taps, backward by taps where that pays (MKL), else im2col.
    from minidl.testing.gradcheck import check_kernels
    for kernel in (cpu_conv.Conv2DRoutes(), cpu_conv.Conv2DTransposeRoutes()):
        for make, arrays in kernel.cases():
            check_kernels(lambda *ts: make()(*ts), arrays, arrays[0].dtype)


@pytest.mark.parametrize("size, k, stride, dilation, pad, rows", [
    (32, 3, 1, 1, 1, 33),  # ResNet's stride-1 3x3: one shared zero gap, 33*33 / 32*32 = 1.06x the output
    (8, 3, 1, 1, 1, 9),    # its 8x8 stage: 1.27x
    (8, 3, 1, 1, 2, 10),   # pads as wide as the kernel's reach still share one gap
    (8, 3, 1, 2, 2, 10),   # dilated: the reach is (k-1)*dilation = 4
    (8, 1, 1, 1, 1, 10),   # pads wider than the reach (1x1): a gap each
    (32, 3, 2, 1, 1, 17),  # strided: OH + (k-1)*dilation // stride
    (8, 3, 2, 2, 2, 6),
])
def test_the_layout_computes_few_positions_the_output_drops(size, k, stride, dilation, pad, rows):
    """Every image takes R x P flat positions (docstrings of taps.py), all computed by the GEMMs; the
    MKL weight-gradient route is chosen on their ratio to the output's (conv.py's correlate)."""
    out = (size + 2 * pad - (k - 1) * dilation - 1) // stride + 1
    taps = Taps((2, 3, size, size), (k, k), (stride,) * 2, (dilation,) * 2, (pad,) * 4, (out, out), (1 << 20, 1))
    assert (taps.rows, taps.pitch, taps.block) == (rows, rows, rows * rows)
    assert out <= rows
    if (size, k, stride, pad) == (32, 3, 1, 1):
        assert round(taps.block / out ** 2, 2) == 1.06
    if (size, k, stride, pad) == (8, 3, 1, 1):
        assert round(taps.block / out ** 2, 2) == 1.27


def test_chunks_hold_as_many_images_as_fit_one_threads_share_of_the_budget():
    def chunking(budget, dtype, per_chunk=None):
        taps = Taps((8, 4, 16, 16), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), (16, 16), budget)
        with option("images_per_chunk", per_chunk):
            return taps.chunking(dtype, 16)

    image = 16 * 17 * 17 * 4  # 16 channels of a float32 image in the layout (17 x 17 positions)
    pairs, singles = [(i, i + 2) for i in range(0, 8, 2)], [(i, i + 1) for i in range(8)]
    assert chunking((2 * 2 * image, 2), np.float32) == (pairs, 2)
    assert chunking((2 * 2 * image, 2), np.float64) == (singles, 2)         # twice the bytes: half the images
    assert chunking((2 * 2 * image - 1, 2), np.float32) == (singles, 2)     # a byte short of two
    assert chunking((image // 2, 2), np.float32) == (singles, 2)            # less than one: still one image
    assert chunking((1 << 30, 1), np.float32) == ([(0, 8)], 1)              # everything at once
    assert chunking((1 << 30, 2), np.float32) == ([(0, 4), (4, 8)], 2)      # split over the threads
    assert chunking((image // 2, 2), np.float32, per_chunk=4) == ([(0, 4), (4, 8)], 2)  # the option wins


def test_the_input_buffer_is_zeroed_with_a_pitch_of_an_odd_multiple_of_64_bytes():
    """The pitch of docs/performance.md (im2col.py's _row_pitch), and room for the taps' reach past the
    last image."""
    for dtype in (np.float32, np.float64):
        taps = Taps((8, 4, 16, 16), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), (16, 16), (1 << 20, 1))
        buf, ld, views = taps.input_buffer(3, 2, dtype)
        itemsize = np.dtype(dtype).itemsize
        assert buf.dtype == dtype and buf.shape == (1, 3, ld) and not buf.any()
        assert ld * itemsize % 128 == 64 and ld >= 2 * taps.block + taps.reach
        assert [v.shape for v in views] == [(3, 2, 16, 16)]


def extra_bytes(fn):
    """Peak bytes fn() allocates (tracemalloc) beyond the arrays it returns."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = fn()
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    arrays = out if isinstance(out, tuple) else (out,)
    return peak - sum(a.nbytes for a in arrays)


def test_the_tap_passes_buffers_fill_the_cache_budget_and_stay_within_it():
    """A chunk's buffers fit ``conv_cache_bytes`` (docs/performance.md) and take as many images as fit:
    here two of the passes' 16 channels (c + o, or c + the Ct of ``times``), so each pass allocates two
    images' worth (with the taps' reach and the rows' pitch on top), not one, not more, and nothing else
    of an image's size (the weight-gradient pass no output); 28 channels (y and acc together): one."""
    n, c, o, size = 8, 4, 12, 32
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, c, size, size)).astype(np.float32)
    w = rng.standard_normal((o, c, 3, 3)).astype(np.float32)
    gy = rng.standard_normal((n, o, size, size)).astype(np.float32)
    budget = 2 * (c + o) * 33 * 33 * 4  # two float32 images of c + o channels in the layout (33 x 33 positions)
    taps = Taps(x.shape, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), (size, size), (budget, 1))
    with option("images_per_chunk", None):
        for fn in (lambda: tap_correlate(x, w, taps), lambda: tap_correlate(x, w, taps, times=gy, forward=False),
                   lambda: tap_input_gradient(gy, w, taps)):
            assert 0.8 * budget < extra_bytes(fn) < 1.2 * budget
        assert extra_bytes(lambda: tap_correlate(x, w, taps, times=gy)) < 1.2 * budget
