"""The conv kernels against the reference bodies of minidl/ops/conv.py: every route their cases
take, in cache-sized chunks and in chunks of two images, on the intra-op threads, and the CuPy
kernels (memory-bounded chunks) on the device double."""
import contextlib
import re

import numpy as np
import pytest

import minidl
from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import conv as cpu_conv
from minidl.kernels.cuda import conv as cuda_conv
from minidl.testing.gradcheck import check_kernels

# These tests are about the kernels: they run with the kernels table on (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("kernels_on")

CPU = [k for k in kernels.registered() if k.op in (ops.Conv2D, ops.Conv2DTranspose) and k.backend == "numpy"]
GPU = [k for k in kernels.registered() if k.op in (ops.Conv2D, ops.Conv2DTranspose) and k.backend == "cupy"]


@contextlib.contextmanager
def option(name, value):
    kernels.set_option(name, value)
    try:
        yield
    finally:
        kernels.set_option(name, None)


def check_cases(kernel):
    if not kernel.available:  # (oneDNN's kernel without the onednn extra: the README's command has none)
        pytest.skip(f"{kernel.name} needs the {kernel.extra} extra: pip install -e '.[{kernel.extra}]'")
    for make, arrays in kernel.cases():
        with kernels.only(kernel):
            used = check_kernels(lambda *ts: make()(*ts), arrays, arrays[0].dtype)
        assert kernel in used, f"{kernel.name} did not run on {[a.shape for a in arrays]}"


def route(x, w, kwargs):
    """Which route the CPU kernel took for Conv2D(**kwargs) on x, w (read off the recorded node)."""
    with kernels.only(cpu_conv.Conv2DRoutes):
        node = ops.Conv2D(w.shape[0], w.shape[2:], **kwargs)(Tensor(x, requires_grad=True), Tensor(w))._node
    if node.win is None:
        return "phases, 1x1" if node.phases is not None else "1x1"
    if node.phases is not None:
        return "phases"
    if node.win.flat:
        return "masked rows" if node.win.masked else "flat rows"
    return "windows"


@pytest.mark.cpu_only
def test_the_cases_take_every_route():
    routes = []
    for make, (x, w) in cpu_conv.Conv2DRoutes().cases():
        prim = make()
        kwargs = dict(pad_mode=prim.pad_mode, pad=prim.pad, stride=prim.stride, dilation=prim.dilation,
                      group=prim.group)
        routes.append(route(x, w, kwargs))
    assert set(routes) == {"flat rows", "masked rows", "phases", "phases, 1x1", "1x1", "windows"}, routes


@pytest.mark.cpu_only
def test_the_flat_row_case_runs_in_several_chunks():
    x, w = next(arrays for _, arrays in cpu_conv.Conv2DRoutes().cases())
    win = cpu_conv.Conv2DRoutes().windows(x.shape, (3, 3), (1, 1), (1, 1), (1, 1, 1, 1), x.shape[2:])
    assert len(win.chunking(np, x.dtype)[0]) > 1


@pytest.mark.cpu_only
@pytest.mark.parametrize("kernel", CPU, ids=lambda k: k.name)
@pytest.mark.parametrize("threads", [1, 2])
def test_chunks_of_two_images_on_threads(kernel, threads):
    """Chunks of two images (a short last one), serially and on two threads: within the bound."""
    before = minidl.get_num_threads()
    minidl.set_num_threads(threads)
    try:
        with option("images_per_chunk", 2):
            check_cases(kernel)
    finally:
        minidl.set_num_threads(before)


@pytest.mark.cpu_only
def test_a_smaller_cache_budget_changes_the_chunks_not_the_results():
    with option("conv_cache_bytes", 64 << 10):
        check_cases(CPU[0])


@pytest.mark.parametrize("kernel", GPU, ids=lambda k: k.name)
@pytest.mark.parametrize("per_chunk", [None, 2])
def test_cupy_kernels_on_the_double(on_the_double, kernel, per_chunk):
    """The CuPy kernels' own cases through check_kernels on the device double: whole batches
    (under the default 256 MiB) and chunks of two images, within the bound of the reference."""
    with option("images_per_chunk", per_chunk):
        check_cases(kernel)


def test_cupy_kernels_chunked_by_bytes_on_the_double(on_the_double):
    """A 1-byte limit: every chunk one image (the memory-bounded path itself)."""
    with option("gpu_im2col_bytes", 1):
        for kernel in GPU:
            check_cases(kernel)


def test_the_cupy_kernel_chunks_by_bytes_on_one_thread():
    kernel = cuda_conv.Conv2DChunked()
    with option("gpu_im2col_bytes", 3 * 144 * 32 * 32 * 4):  # three images of a 16-channel 3x3 conv
        assert kernel.budget() == (3 * 144 * 32 * 32 * 4, 1)
    assert kernel.budget() == (cuda_conv.gpu_im2col_bytes(), 1)


def test_reference_only_runs_no_conv_kernel():
    x, w = np.ones((2, 3, 5, 5)), np.ones((4, 3, 3, 3))
    with kernels.reference_only(), kernels.tracking() as used:
        ops.conv2d(Tensor(x), Tensor(w))
    assert not used


def test_the_gpu_chunk_limit_comes_from_the_option_then_the_environment(monkeypatch):
    """gpu_im2col_bytes: the option when set, else $MINIDL_GPU_IM2COL_BYTES (read at every call),
    else 256 MiB; a limit that is not a positive int is refused naming where it came from."""
    monkeypatch.delenv("MINIDL_GPU_IM2COL_BYTES", raising=False)
    assert cuda_conv.gpu_im2col_bytes() == cuda_conv.GPU_IM2COL_BYTES == 256 << 20
    monkeypatch.setenv("MINIDL_GPU_IM2COL_BYTES", "")
    assert cuda_conv.gpu_im2col_bytes() == 256 << 20  # set but empty: the default
    monkeypatch.setenv("MINIDL_GPU_IM2COL_BYTES", "4096")
    assert cuda_conv.gpu_im2col_bytes() == 4096
    with option("gpu_im2col_bytes", 1):  # the option wins over the environment
        assert cuda_conv.gpu_im2col_bytes() == 1
    for bad in ("0", "-3", "1.5", "lots"):
        monkeypatch.setenv("MINIDL_GPU_IM2COL_BYTES", bad)
        with pytest.raises(ValueError, match=r"^MINIDL_GPU_IM2COL_BYTES must be a positive int \(bytes of one "
                                             r"chunk's im2col columns on the GPU, default 268435456\), got "
                                             + re.escape(repr(bad)) + "$"):
            cuda_conv.gpu_im2col_bytes()
    monkeypatch.setenv("MINIDL_GPU_IM2COL_BYTES", "4096")
    for bad in (0, -1, True, 2.0):
        message = r"^the option gpu_im2col_bytes must be a positive int .*got " + re.escape(repr(bad)) + "$"
        with option("gpu_im2col_bytes", bad), pytest.raises(ValueError, match=message):
            cuda_conv.gpu_im2col_bytes()
