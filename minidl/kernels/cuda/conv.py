"""Conv2D and Conv2DTranspose on CuPy: the CPU kernels' routes in chunks bounded for memory.

The reference body (minidl/ops/conv.py) builds one whole-batch column matrix:
C*kh*kw*OH*OW*N*itemsize bytes, 1.9 GB for one 64-channel 56x56 3x3 ResNet-50 conv at batch 256
in float32, with output and gradient buffers of the same width beside it, which can exhaust a
device's memory. These kernels take the CPU kernels' routes (minidl/kernels/cpu/conv.py) on one
thread (the device runs each GEMM on all its cores), in chunks of images whose column matrix
stays under ``gpu_im2col_bytes()``, with plain contiguous column buffers (cuBLAS takes them as
they lie; CuPy's matmul would copy a padded pitch first).

256 MiB holds 36 of those ResNet-50 images' columns: a chunk's GEMM (64, 576) @ (576, 36*56*57)
is still 8.5 GFLOP, which should keep a GPU busy; which chunk size is fastest there has not been
measured yet (issue 16).
"""
import os

import numpy

from .. import declare_option, get_option, register
from ..cpu import conv as cpu_conv

__all__ = ["Conv2DChunked", "Conv2DTransposeChunked", "gpu_im2col_bytes", "GPU_IM2COL_BYTES"]

GPU_IM2COL_BYTES = 256 << 20
_ENV = "MINIDL_GPU_IM2COL_BYTES"
declare_option("gpu_im2col_bytes", None, f"most bytes of one conv chunk's im2col columns on the GPU; None: "
               f"${_ENV} when set (read at every convolution), else {GPU_IM2COL_BYTES} (256 MiB)")


def gpu_im2col_bytes():
    """The byte limit of one chunk's im2col column matrix on the GPU.

    The ``gpu_im2col_bytes`` option when set, else ``$MINIDL_GPU_IM2COL_BYTES`` (a positive int,
    read at every convolution, so a launcher may set it at any time), else ``GPU_IM2COL_BYTES``
    (256 MiB). A chunk holds at least one image, so one image's columns larger than the limit
    still go in one chunk.
    """
    limit, source = get_option("gpu_im2col_bytes"), "the option gpu_im2col_bytes"
    if limit is None:
        env = os.environ.get(_ENV)
        if not env:
            return GPU_IM2COL_BYTES
        limit, source = env, _ENV
        try:
            limit = int(env)
        except ValueError:
            limit = 0
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        value = os.environ.get(_ENV) if source == _ENV else limit
        raise ValueError(f"{source} must be a positive int (bytes of one chunk's im2col columns on the GPU, "
                         f"default {GPU_IM2COL_BYTES}), got {value!r}")
    return limit


class _OnTheDevice:
    def budget(self):
        return gpu_im2col_bytes(), 1


@register
class Conv2DChunked(_OnTheDevice, cpu_conv.Conv2DRoutes):
    backend = "cupy"

    def cases(self):
        return cpu_conv.conv_cases(numpy.random.default_rng(12))


@register
class Conv2DTransposeChunked(_OnTheDevice, cpu_conv.Conv2DTransposeRoutes):
    backend = "cupy"

    def cases(self):
        return cpu_conv.conv_transpose_cases(numpy.random.default_rng(13))
