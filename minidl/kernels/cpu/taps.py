"""Stride-1 convolution as one GEMM per kernel offset ("tap"), with no im2col.

A stride-1 convolution is a sum over the kernel offsets (i, j) of ``w[:, :, i, j] @ x shifted
by (i, j)``. Lay a chunk of padded images out channel-major as one flat row per channel, every
image ``R = H + max(pt, pb)`` rows of pitch ``P = W + max(pl, pr)`` (the zeros after one row
serve as the left padding of the next, the zero rows after one image as the top padding of the
next: im2col.py's flat rows, stacked over images; pads wider than the kernel's reach get a gap
each). Output position ``(img*R + r) * P + s`` then
reads input position ``output + i*dh*P + j*dw`` for offset (i, j): the shifted input of one tap
is the flat buffer seen from another start, a (C, M) matrix with the buffer's row stride. So
the convolution is kh*kw GEMMs ``(O, C) @ (C, M)`` summed into one output (BLAS's beta = 1,
called directly: blas.py), and the only copies are the padding copy in (x's size) and the
transposing crop out (y's size), where im2col writes and reads kh*kw copies of x. Positions
with ``r >= OH`` or ``s >= OW`` are computed and dropped: (R*P) / (OH*OW) of the GEMM work,
1.06x for ResNet's 32x32 images, 1.27x for 8x8.

The weight gradient needs x at every tap against the output gradient: with ``times`` (an array
of y's shape, laid out like the output with zeros at the dropped positions) one more GEMM per
tap, ``times (Ct, M) @ x_tap (C, M)^T``, sums it from the same buffer (see
Conv2DRoutes._grads_by_correlation for why the input gradient's pass is the one that does it).

Chunks of images (sized so a thread's input, output and ``times`` buffers fit the
``conv_cache_bytes`` budget, as im2col.py's columns do) run on the intra-op threads, each with
its own buffers and single-threaded BLAS, in the static order of minidl/_intra_op.py.
"""
import numpy

from ... import _intra_op as intra_op
from .. import get_option
from . import blas
from .im2col import _row_pitch


class Taps:
    """The flat tap layout of one stride-1, ungrouped convolution with non-negative pads."""

    @staticmethod
    def fits(x, w, stride, pads, group):
        """Whether this layout can run the convolution (NumPy float arrays, the direct BLAS call)."""
        return (stride == (1, 1) and group == 1 and min(pads) >= 0 and isinstance(x, numpy.ndarray)
                and x.dtype == w.dtype and blas.available(x.dtype))

    def __init__(self, x_shape, kernel, dilation, pads, out_hw, budget):
        self.n, self.c, self.h, self.w = x_shape
        (kh, kw), (dh, dw) = kernel, dilation
        self.pads, self.budget = pads, budget
        self.oh, self.ow = out_hw
        pt, pb, pl, pr = pads
        # One zero gap serves both sides while the output is no wider than data plus gap: while the
        # smaller pad is within the kernel's reach (as always in ResNets); else each side its own.
        self.rows = self.h + (max(pt, pb) if min(pt, pb) <= (kh - 1) * dh else pt + pb)
        self.pitch = self.w + (max(pl, pr) if min(pl, pr) <= (kw - 1) * dw else pl + pr)
        self.block = self.rows * self.pitch  # flat elements per image, in every buffer
        self.offsets = [i * dh * self.pitch + j * dw for i in range(kh) for j in range(kw)]
        self.reach = self.offsets[-1]  # how far past the last output position the taps read

    def chunking(self, dtype, channels):
        """(chunks of images, threads) so that one thread's buffers of ``channels`` rows in all (input,
        output and times channels) stay under its share of the budget, or ``images_per_chunk``."""
        budget, threads = self.budget
        per_image = channels * self.block * numpy.dtype(dtype).itemsize
        per_chunk = get_option("images_per_chunk") or budget // threads // per_image
        chunks = intra_op.split(self.n, max(1, min(self.n, per_chunk)), threads)
        return chunks, min(threads, len(chunks))


def tap_correlate(x, w, taps, times=None):
    """y = x (*) w (stride 1) by tap GEMMs; with ``times``, also ``(y, acc)`` where
    ``acc[t, ct, c] = sum over positions of times[:, ct] * x shifted by tap t [:, c]``, taps t in
    (i, j) order: the weight gradient of a conv whose output gradient is ``times``."""
    n, c = x.shape[:2]
    o, kh, kw = w.shape[0], w.shape[2], w.shape[3]
    it, dtype = x.itemsize, x.dtype
    pt, _, pl, _ = taps.pads
    oh, ow, block = taps.oh, taps.ow, taps.block
    tap_w = numpy.ascontiguousarray(w.transpose(2, 3, 0, 1))  # (kh, kw, O, C): one (O, C) matrix per tap
    w_addr, w_step = blas.address(tap_w), o * c * it
    y = numpy.empty((n, o, oh, ow), dtype=dtype)
    ct = 0 if times is None else times.shape[1]
    chunks, threads = taps.chunking(dtype, c + o + ct)
    nb = max(n1 - n0 for n0, n1 in chunks)
    gemm = blas.gemm

    def run(t):
        # Zeroed once: padding positions are never written, so they stay zero in every chunk.
        x_ld = _row_pitch(numpy, nb * block + taps.reach, it)
        xbuf = numpy.zeros((c, x_ld), dtype=dtype)
        x_in = xbuf[:, :nb * block].reshape(c, nb, taps.rows, taps.pitch)[:, :, pt:pt + taps.h, pl:pl + taps.w]
        out_ld = _row_pitch(numpy, nb * block, it)
        out = numpy.empty((o, out_ld), dtype=dtype)
        x_addr, out_addr = blas.address(xbuf), blas.address(out)
        acc = tbuf = None
        if times is not None:
            # Dropped positions of times stay zero (never written), so they add nothing to acc.
            tbuf = numpy.zeros((ct, out_ld), dtype=dtype)
            acc = numpy.zeros((kh * kw, ct, c), dtype=dtype)
            t_addr, acc_addr = blas.address(tbuf), blas.address(acc)
        for n0, n1 in chunks[t::threads]:
            k = n1 - n0
            m = k * block
            x_in[:, :k] = x[n0:n1].transpose(1, 0, 2, 3)
            for tap, off in enumerate(taps.offsets):
                gemm(dtype, o, m, c, w_addr + tap * w_step, c, x_addr + off * it, x_ld,
                     out_addr, out_ld, beta=0.0 if tap == 0 else 1.0)
            y[n0:n1] = out[:, :m].reshape(o, k, taps.rows, taps.pitch)[:, :, :oh, :ow].transpose(1, 0, 2, 3)
            if times is not None:
                tbuf[:, :m].reshape(ct, k, taps.rows, taps.pitch)[:, :, :oh, :ow] = times[n0:n1].transpose(1, 0, 2, 3)
                for tap, off in enumerate(taps.offsets):
                    gemm(dtype, ct, c, m, t_addr, out_ld, x_addr + off * it, x_ld,
                         acc_addr + tap * ct * c * it, c, beta=1.0, trans_b=True)
        return acc

    accs = intra_op.parallel_map(run, threads)
    if times is None:
        return y
    for a in accs[1:]:
        accs[0] += a
    return y, accs[0]
