"""The stride-phase rewrite of minidl/kernels/cpu/im2col.py (``_Phases``) through the Conv2D kernel,
against the reference body of minidl/ops/conv.py, on geometries the kernel's own cases do not
reach: a stride that differs between the axes, image rows or columns that no window reads,
padding wider than a phase, and phases that hold no image element at all."""
import numpy as np
import pytest

from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import conv as cpu_conv
from minidl.testing.gradcheck import check_kernels

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("kernels_on")]

PHASES = [  # (x shape, w shape, Conv2D keywords): all taken by stride phases
    # stride 3 across, 1 down: three column phases, one row phase; the last two columns are unread
    ((2, 3, 5, 7), (4, 3, 3, 3), dict(pad_mode="pad", pad=(1, 0, 1, 0), stride=(1, 3))),
    # 4x4 kernel, stride (2, 4): two of the four column phases hold only padding, no image
    # element; only the first two columns and six rows are read
    ((2, 3, 7, 5), (4, 3, 4, 4), dict(pad_mode="pad", pad=(2, 0, 2, 0), stride=(2, 4))),
    # 1x1 stride 4 on 7x7: only x[:, :, 3, 3] is read; every other element's gradient is zero
    ((2, 3, 7, 7), (4, 3, 1, 1), dict(pad_mode="pad", pad=(1, 0, 1, 0), stride=4)),
    # ResNet's 2x2 stride-2 downsampling on an odd image: the last row and column are unread
    ((2, 3, 7, 7), (4, 3, 2, 2), dict(stride=2)),
]


def conv(w_shape, kwargs):
    return ops.Conv2D(w_shape[0], w_shape[2:], **kwargs)


@pytest.mark.parametrize("x_shape, w_shape, kwargs", PHASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_stride_phases_equal_the_reference(x_shape, w_shape, kwargs, dtype):
    rng = np.random.default_rng(7)
    x = rng.standard_normal(x_shape).astype(dtype)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(dtype)
    with kernels.only(cpu_conv.Conv2DRoutes):
        node = conv(w_shape, kwargs)(Tensor(x, requires_grad=True), Tensor(w))._node
        assert node.phases is not None, "not the stride-phase route"
        used = check_kernels(lambda *ts: conv(w_shape, kwargs)(*ts), [x, w], dtype)
    assert {k.name for k in used} == {"Conv2DRoutes"}


@pytest.mark.parametrize("x_shape, w_shape, kwargs", PHASES)
def test_stride_phases_keep_float32(x_shape, w_shape, kwargs):
    """The output and both gradients of a float32 conv stay float32 (no float64 phase buffers)."""
    rng = np.random.default_rng(8)
    x = Tensor(rng.standard_normal(x_shape).astype(np.float32), requires_grad=True)
    w = Tensor(rng.standard_normal(w_shape).astype(np.float32), requires_grad=True)
    with kernels.only(cpu_conv.Conv2DRoutes), kernels.tracking() as used:
        y = conv(w_shape, kwargs)(x, w)
        y.sum().backward()
    assert {k.name for k in used} == {"Conv2DRoutes"}
    assert (y.dtype, x.grad.dtype, w.grad.dtype) == (np.float32,) * 3
    assert (y.data.dtype, x.grad.data.dtype, w.grad.data.dtype) == (np.float32,) * 3


@pytest.mark.parametrize("x_shape, w_shape, kwargs", PHASES)
def test_image_elements_no_window_reads_get_a_zero_gradient(x_shape, w_shape, kwargs):
    """x's gradient is exact (x, w and gy all ones: each element's count of the taps that read it)
    and zero where no window reads, also where freshly allocated memory is not zero: NaN-filled
    blocks of x's size are freed just before the backward, and NumPy hands small freed blocks
    (under 1 KiB: one image here) back to the next allocation of that size."""
    x_shape = (1,) + x_shape[1:]
    x = Tensor(np.ones(x_shape, np.float32), requires_grad=True)
    w = Tensor(np.ones(w_shape, np.float32))
    with kernels.reference_only():
        x_ref = Tensor(np.ones(x_shape, np.float32), requires_grad=True)
        conv(w_shape, kwargs)(x_ref, w).sum().backward()
    assert (x_ref.grad.data == 0).any() and (x_ref.grad.data > 0).any()  # some elements unread, some read
    with kernels.only(cpu_conv.Conv2DRoutes), kernels.tracking() as used:
        y = conv(w_shape, kwargs)(x, w).sum()
        dirty = [np.full(x_shape, np.nan, np.float32) for _ in range(8)]
        del dirty
        y.backward()
    assert {k.name for k in used} == {"Conv2DRoutes"}
    np.testing.assert_array_equal(x.grad.data, x_ref.grad.data)
