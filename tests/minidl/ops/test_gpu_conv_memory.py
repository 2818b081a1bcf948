"""Conv2D on the GPU path (the device double, the CuPy conv kernel): im2col chunks bounded in
bytes, contiguous column buffers for the GEMM, and the same results in one chunk, in several,
and on the CPU (issue 16)."""
import numpy as np
import pytest

from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import im2col
from minidl.kernels.cuda import conv as cuda_conv
from minidl.testing import cupy_double

# These tests are about the kernels: they run with the kernels table on (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("kernels_on")

ENV = "MINIDL_GPU_IM2COL_BYTES"


@pytest.fixture
def limit():
    """set(n): the gpu_im2col_bytes option (restored to its default afterwards)."""
    yield lambda n: kernels.set_option("gpu_im2col_bytes", n)
    kernels.set_option("gpu_im2col_bytes", None)

# name: (x shape, w shape, Conv2D keyword arguments, whether x needs a gradient)
CASES = {
    "flat rows, pad 1": ((5, 3, 5, 16), (4, 3, 3, 3), dict(pad_mode="pad", pad=1), True),
    "flat rows, valid": ((5, 3, 5, 6), (4, 3, 3, 3), dict(), True),  # garbage columns read real pixels
    "masked flat rows": ((5, 3, 6, 6), (4, 3, 3, 3), dict(pad_mode="pad", pad=1), True),
    "strided 6-D windows": ((5, 3, 7, 6), (4, 3, 3, 3), dict(pad_mode="pad", pad=1, stride=2), True),
    "stride phases 4x4/2": ((5, 3, 8, 9), (4, 3, 4, 4), dict(pad_mode="pad", pad=1, stride=2), True),
    "grouped, dilated": ((5, 4, 7, 7), (4, 2, 3, 3), dict(pad_mode="pad", pad=2, dilation=2, group=2), True),
    "first layer (gw only)": ((5, 3, 5, 16), (4, 3, 3, 3), dict(pad_mode="pad", pad=1), False),
}


def reference(x, w, gy, stride=1, pad=0, dilation=1, group=1, pad_mode=None):
    """(y, gx, gw) by one NumPy einsum per kernel offset: no im2col, no chunks."""
    (h, wd), (o, cg, kh, kw), (oh, ow) = x.shape[2:], w.shape, gy.shape[2:]
    s, d, og = stride, dilation, o // group
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    y, gxp, gw = np.zeros(gy.shape), np.zeros_like(xp), np.zeros_like(w)
    for g in range(group):
        cs, os_ = slice(g * cg, (g + 1) * cg), slice(g * og, (g + 1) * og)
        for i in range(kh):
            for j in range(kw):
                rows, cols = slice(i * d, i * d + s * (oh - 1) + 1, s), slice(j * d, j * d + s * (ow - 1) + 1, s)
                at = (slice(None), cs, rows, cols)
                y[:, os_] += np.einsum("nchw,oc->nohw", xp[at], w[os_, :, i, j])
                gw[os_, :, i, j] = np.einsum("nohw,nchw->oc", gy[:, os_], xp[at])
                gxp[at] += np.einsum("nohw,oc->nchw", gy[:, os_], w[os_, :, i, j])
    return y, gxp[:, :, pad:pad + h, pad:pad + wd], gw


def conv_step(x, w, gy, kwargs, need_x):
    """(y, gx or None, gw) of one Conv2D forward and backward, as NumPy arrays."""
    xt, wt = Tensor(x, requires_grad=need_x), Tensor(w, requires_grad=True)
    y = ops.Conv2D(w.shape[0], w.shape[2:], **kwargs)(xt, wt)
    (y * Tensor(gy)).sum().backward()
    return y.asnumpy(), None if xt.grad is None else xt.grad.asnumpy(), wt.grad.asnumpy()


class Recorder:
    """Spies on the GPU path: every chunking, every column buffer, every device GEMM (it watches;
    the options steer)."""

    def __init__(self, monkeypatch, cupy):
        self.chunkings, self.column_bytes, self.gemms = [], [], []
        chunking, buffers, matmul = im2col._Windows.chunking, im2col._Windows.buffers, cupy.matmul

        def spy_chunking(win, xp, dtype):
            chunks, threads = chunking(win, xp, dtype)
            self.chunkings.append((win.k * win.oh * win.q * dtype.itemsize, chunks, threads))
            return chunks, threads

        def spy_buffers(win, xp, dtype, nb):
            xpad, cols = buffers(win, xp, dtype, nb)
            self.column_bytes.append(cols.nbytes)
            return xpad, cols

        def spy_matmul(a, b, out=None, **kwargs):
            self.gemms.append((a, b, out))
            return matmul(a, b, out=out, **kwargs) if out is not None else matmul(a, b, **kwargs)

        monkeypatch.setattr(im2col._Windows, "chunking", spy_chunking)
        monkeypatch.setattr(im2col._Windows, "buffers", spy_buffers)
        monkeypatch.setattr(cupy, "matmul", spy_matmul)


def plain_or_transposed(a):
    """Whether a is a contiguous buffer or the transpose (last two axes) of one: what cuBLAS
    takes as it lies. A padded row pitch is neither, and CuPy's matmul copies it first."""
    return a.flags.c_contiguous or a.swapaxes(-1, -2).flags.c_contiguous


def assert_contiguous_gemms(rec, case):
    """Every device GEMM operand is a plain buffer or its transpose; every out= a plain buffer."""
    assert rec.gemms
    for a, b, out in rec.gemms:
        assert isinstance(a, cupy_double.ndarray) and isinstance(b, cupy_double.ndarray)
        assert plain_or_transposed(a) and plain_or_transposed(b), \
            f"{case}: GEMM operands {a.shape} strides {a.strides}, {b.shape} strides {b.strides}"
        assert out is None or out.flags.c_contiguous, f"{case}: out= {out.shape} strides {out.strides}"


def test_the_limit_defaults_to_256_mib_and_follows_the_environment_and_the_option(monkeypatch, limit):
    monkeypatch.delenv(ENV, raising=False)
    assert cuda_conv.gpu_im2col_bytes() == 256 << 20 == cuda_conv.GPU_IM2COL_BYTES
    monkeypatch.setenv(ENV, "123456")
    assert cuda_conv.gpu_im2col_bytes() == 123456  # read when used, not at import
    limit(4096)
    assert cuda_conv.gpu_im2col_bytes() == 4096  # the declared option wins over the environment


@pytest.mark.parametrize("value", ["0", "-4096", "256M", "1.5e8"])
def test_a_bad_limit_names_the_variable_and_the_value(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=rf"{ENV} must be a positive int .*got '{value}'"):
        cuda_conv.gpu_im2col_bytes()


@pytest.mark.parametrize("value", [0, -1, 1.5, "256M", True])
def test_a_bad_option_names_the_option_and_the_value(limit, value):
    limit(value)
    with pytest.raises(ValueError, match=rf"option gpu_im2col_bytes must be a positive int .*got {value!r}"):
        cuda_conv.gpu_im2col_bytes()


def gpu_windows(x_shape, out_hw):
    """A 3x3 'same' conv's windows with the CuPy kernel's chunk budget."""
    return cuda_conv.Conv2DChunked().windows(x_shape, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), out_hw)


def test_chunks_on_the_gpu_stay_under_the_limit_and_run_on_one_thread(monkeypatch, limit):
    cupy = cupy_double.cupy_module()
    monkeypatch.delenv(ENV, raising=False)
    win = gpu_windows((256, 64, 56, 56), (56, 56))
    per_image = win.k * win.oh * win.q * 4  # a ResNet-50 stage-1 conv, float32: ~7.5 MB an image
    chunks, threads = win.chunking(cupy, np.dtype(np.float32))
    assert threads == 1
    assert max(n1 - n0 for n0, n1 in chunks) * per_image <= 256 << 20 < 256 * per_image
    assert chunks[0][0] == 0 and chunks[-1][1] == 256 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    limit(per_image - 1)  # below one image: still one image a chunk
    win = gpu_windows((256, 64, 56, 56), (56, 56))
    assert win.chunking(cupy, np.dtype(np.float32))[0] == [(i, i + 1) for i in range(256)]


def test_the_gpu_limit_leaves_the_cpu_chunks_alone(monkeypatch, limit):
    from minidl.kernels.cpu.conv import Conv2DRoutes
    cpu_windows = lambda: Conv2DRoutes().windows((64, 16, 32, 32), (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), (32, 32))
    monkeypatch.delenv(ENV, raising=False)
    before = cpu_windows().chunking(np, np.dtype(np.float32))
    limit(1)
    assert cpu_windows().chunking(np, np.dtype(np.float32)) == before
    assert len(before[0]) > 1  # the CPU still chunks for its cache
    # and keeps its padded row pitch (an odd multiple of 64 bytes), which the GPU does not use
    assert im2col._row_pitch(np, 6144, 4) == 6160
    assert im2col._row_pitch(cupy_double.cupy_module(), 6144, 4) == 6144


@pytest.mark.parametrize("case", list(CASES))
def test_several_chunks_on_the_gpu_give_one_chunks_and_the_cpus_results(on_the_double, device_target,
                                                                         monkeypatch, limit, case):
    """Forward, input and weight gradients, in one chunk, in several with a short last one, and on
    the CPU; the column buffers stay under the limit and the GEMMs get contiguous buffers."""
    x_shape, w_shape, kwargs, need_x = CASES[case]
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    y_shape = ops.Conv2D(w_shape[0], w_shape[2:], **kwargs)(Tensor(x), Tensor(w)).shape
    gy = rng.standard_normal(y_shape)
    with device_target("CPU"):
        on_cpu = conv_step(x, w, gy, kwargs, need_x)

    limit(1 << 40)
    whole = Recorder(monkeypatch, on_the_double)
    one_chunk = conv_step(x, w, gy, kwargs, need_x)
    assert whole.chunkings and all(len(chunks) == 1 for _, chunks, _ in whole.chunkings)
    assert_contiguous_gemms(whole, case)

    # Forward and backward im2col windows of different sizes: with two images a chunk for the
    # smallest, then for the largest, every one splits five images as 2 + 2 + 1 in some run.
    sizes = {p for p, _, _ in whole.chunkings}
    short_last = set()
    for nbytes in (max(max(sizes), 2 * min(sizes)), 2 * max(sizes)):
        limit(nbytes)
        rec = Recorder(monkeypatch, on_the_double)
        chunked = conv_step(x, w, gy, kwargs, need_x)
        for p, chunks, threads in rec.chunkings:
            sizes_here = [n1 - n0 for n0, n1 in chunks]
            assert threads == 1 and max(sizes_here) * p <= nbytes
            if sizes_here[-1] < sizes_here[0]:
                short_last.add(p)
        assert rec.column_bytes and max(rec.column_bytes) <= nbytes
        assert max(a.nbytes for gemm in rec.gemms for a in gemm if a is not None) <= nbytes
        assert_contiguous_gemms(rec, f"{case}, limit {nbytes}")
        for name, got, single in zip(("y", "gx", "gw"), chunked, one_chunk):
            if got is not None:
                np.testing.assert_allclose(got, single, rtol=1e-12, atol=1e-12, err_msg=f"{name}: chunks vs one")
    assert short_last == sizes, "some im2col never ran a short last chunk"

    want = reference(x, w, gy, **kwargs)
    for name, got, cpu, ref in zip(("y", "gx", "gw"), chunked, on_cpu, want):
        assert (got is None) == (not need_x and name == "gx")
        if got is not None:
            np.testing.assert_allclose(got, ref, rtol=1e-10, atol=1e-10, err_msg=f"{name}: chunks vs reference")
            np.testing.assert_allclose(got, cpu, rtol=1e-12, atol=1e-12, err_msg=f"{name}: GPU vs CPU")
