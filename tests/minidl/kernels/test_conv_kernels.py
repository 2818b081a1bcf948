"""The conv kernels against the reference bodies of minidl/ops/conv.py: every route their cases
take, in cache-sized chunks and in chunks of two images, on the intra-op threads, and the CuPy
kernels (memory-bounded chunks) on the device double."""
import contextlib
import re
import tracemalloc

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
ROUTES = [k for k in CPU if type(k).__module__ == cpu_conv.__name__]  # Conv2DRoutes, Conv2DTransposeRoutes


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
def test_the_transpose_cases_are_strided_dilated_grouped_and_chunked():
    """Conv2DTranspose's cases, as their docstring says: stride 1 and strided (one with a last row
    and column of the output no window covers: they must come out zero), dilated, grouped, the
    32-channel one in several chunks, each in float32 and float64 (read off the recorded nodes)."""
    nodes = []
    for make, (dout, w) in cpu_conv.Conv2DTransposeRoutes().cases():
        with kernels.only(cpu_conv.Conv2DTransposeRoutes):
            nodes.append((make()(Tensor(dout, requires_grad=True), Tensor(w))._node, dout.dtype))
    assert {n.stride == (1, 1) for n, _ in nodes} == {True, False}
    assert any(n.dilation != (1, 1) for n, _ in nodes) and any(n.group > 1 for n, _ in nodes)

    def last_covered(win, axis):  # the last row (axis 0) or column (1) of the output a window reaches
        size = (win.oh, win.ow)[axis]
        return (size - 1) * win.stride[axis] + (win.kernel[axis] - 1) * win.dilation[axis] - win.pads[2 * axis]
    assert any(last_covered(n.win, 0) < n.win.h - 1 and last_covered(n.win, 1) < n.win.w - 1 for n, _ in nodes)
    chunked = [dtype for n, dtype in nodes if n.out_channel == 32 and len(n.win.chunking(np, dtype)[0]) > 1]
    assert set(chunked) == {np.dtype(np.float32), np.dtype(np.float64)}, chunked


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


def with_one_input_frozen(make, arrays, frozen):
    """(y, gradients) of make()(*arrays) where input ``frozen`` does not require grad, as a user
    reads them (None where there is no .grad), from a fixed output gradient."""
    ts = [Tensor(a, requires_grad=i != frozen) for i, a in enumerate(arrays)]
    y = make()(*ts)
    y.backward(Tensor(np.random.default_rng(0).standard_normal(y.shape).astype(y.dtype)))
    return y.asnumpy(), [None if t.grad is None else t.grad.asnumpy() for t in ts]


@pytest.mark.cpu_only
@pytest.mark.parametrize("kernel", ROUTES, ids=lambda k: k.name)
@pytest.mark.parametrize("frozen", [0, 1], ids=["input_frozen", "weight_frozen"])
def test_a_frozen_input_or_weight_gets_no_gradient_and_the_other_the_references(kernel, frozen):
    """A first layer on data (x needs no gradient) or a frozen weight (fine-tuning), on every route
    of the cases: the other input gets the reference's gradient within the bound, in its own dtype
    (float32 stays float32, as the output does), and the frozen one none."""
    for make, arrays in kernel.cases():
        with kernels.only(kernel), kernels.tracking() as used:
            y, grads = with_one_input_frozen(make, arrays, frozen)
        with kernels.reference_only():
            y_ref, grads_ref = with_one_input_frozen(make, arrays, frozen)
        what = f"{kernel.name} on {[a.shape for a in arrays]} in {arrays[0].dtype}, input {frozen} frozen"
        assert kernel in used, what
        rtol, atol = kernel.bound_for(arrays[0].dtype)
        assert y.dtype == arrays[0].dtype, what
        np.testing.assert_allclose(y, y_ref, rtol=rtol, atol=atol, err_msg=what)
        assert grads[frozen] is None and grads_ref[frozen] is None, what
        live = 1 - frozen
        assert grads[live].dtype == arrays[live].dtype, what
        np.testing.assert_allclose(grads[live], grads_ref[live], rtol=rtol, atol=atol, err_msg=what)


@pytest.mark.cpu_only
def test_grouped_pointwise_and_eight_channel_strided_convs_equal_the_reference():
    """Routes the cases do not take: grouped 1x1 convs (ResNeXt's, ShuffleNet's), stride 1 (one
    batched GEMM per group) and stride 2 (strided windows), and a strided 3x3 conv with exactly
    TAPS_MIN_CHANNELS input channels, the fewest that its backward runs by tap GEMMs."""
    rng = np.random.default_rng(3)
    convs = [((3, 8, 5, 6), (6, 4, 1, 1), dict(group=2)),
             ((3, 8, 5, 6), (8, 2, 1, 1), dict(group=4, stride=2)),
             ((2, cpu_conv.TAPS_MIN_CHANNELS, 9, 9), (4, cpu_conv.TAPS_MIN_CHANNELS, 3, 3),
              dict(pad_mode="pad", pad=1, stride=2))]
    for x_shape, w_shape, kwargs in convs:
        for dtype in (np.float32, np.float64):
            x = rng.standard_normal(x_shape).astype(dtype)
            w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)
            conv = ops.Conv2D(w_shape[0], w_shape[2:], **kwargs)
            with kernels.only(cpu_conv.Conv2DRoutes):
                used = check_kernels(conv, [x, w], dtype)
            assert {k.name for k in used} == {"Conv2DRoutes"}, (x_shape, w_shape, kwargs)


def backward_peak(conv, x, w, x_frozen):
    """Bytes NumPy allocates at the peak of conv's backward (tracemalloc) on two intra-op threads,
    in chunks of one image; after one untraced step (first calls, the pool's threads)."""
    def forward():
        y = conv(Tensor(x, requires_grad=not x_frozen), Tensor(w, requires_grad=True))
        y.asnumpy()  # (computed now in graph mode too, outside the traced backward)
        return y, Tensor(np.ones(y.shape, np.float32))

    before = minidl.get_num_threads()
    minidl.set_num_threads(2)
    try:
        with option("images_per_chunk", 1), kernels.only(cpu_conv.Conv2DRoutes), kernels.tracking() as used:
            y, gy = forward()
            y.backward(gy)
            y, gy = forward()
            tracemalloc.start()
            try:
                y.backward(gy)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
    finally:
        minidl.set_num_threads(before)
    assert {k.name for k in used} == {"Conv2DRoutes"}
    return peak


@pytest.mark.cpu_only  # tracemalloc sees host memory only
@pytest.mark.parametrize("channels", [4, cpu_conv.TAPS_MIN_CHANNELS], ids=["im2col", "taps"])
def test_the_strided_backward_holds_one_chunk_of_scratch_and_no_unwanted_gradient(channels):
    """Strided windows' backward, by im2col (4 channels) or by tap GEMMs (8), in chunks of one
    image: each thread's scratch is one chunk's (the batch's im2col columns would take 2.25x x's
    size), and with x frozen it allocates no input gradient. At its peak NumPy holds less than
    half of x's size on top of the input gradient."""
    x = np.random.default_rng(4).standard_normal((512 // channels, channels, 16, 16)).astype(np.float32)  # 512 KiB
    w = np.random.default_rng(5).standard_normal((8, channels, 3, 3)).astype(np.float32)
    conv = ops.Conv2D(8, 3, pad_mode="pad", pad=1, stride=2)
    assert backward_peak(conv, x, w, x_frozen=False) < x.nbytes + x.nbytes // 2
    assert backward_peak(conv, x, w, x_frozen=True) < x.nbytes // 2


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
