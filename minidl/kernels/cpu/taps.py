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
its own buffers and single-threaded BLAS, in the static order of threads.py.
"""
import numpy

from . import threads as intra_op
from .. import get_option
from . import blas
from .im2col import _row_pitch


class Taps:
    """The flat tap layout of one ungrouped convolution with non-negative pads.

    Strided: output (r, s) meets padded input (r*sh + i*dh, s*sw + j*dw) at offset (i, j), which
    is row ``r + (i*dh) // sh`` of the stride phase ``(i*dh) % sh`` (the padded rows congruent to
    it mod sh), and likewise for columns. Each phase the taps use gets its own flat buffer in the
    same layout (``R = OH + (kh-1)*dh // sh`` rows of pitch ``P = OW + (kw-1)*dw // sw`` per image,
    positions that hold no input zero), so every tap is again one GEMM on a shifted start, with
    no zero taps (im2col.py's _Phases needs 16/9 of the work for 3x3 stride 2). Stride 1 is one
    phase, with the shared zero gaps of the module docstring.
    """

    @staticmethod
    def fits(x, w, stride, pads, group):
        """Whether this layout can run the convolution (NumPy float arrays, the direct BLAS call)."""
        return (group == 1 and min(pads) >= 0 and isinstance(x, numpy.ndarray)
                and x.dtype == w.dtype and blas.available(x.dtype))

    def __init__(self, x_shape, kernel, stride, dilation, pads, out_hw, budget):
        self.n, self.c, self.h, self.w = x_shape
        (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
        self.pads, self.budget = pads, budget
        self.oh, self.ow = out_hw
        pt, pb, pl, pr = pads
        if (sh, sw) == (1, 1):
            # One zero gap serves both sides while the output is no wider than data plus gap: while
            # the smaller pad is within the kernel's reach (as always in ResNets); else each its own.
            self.rows = self.h + (max(pt, pb) if min(pt, pb) <= (kh - 1) * dh else pt + pb)
            self.pitch = self.w + (max(pl, pr) if min(pl, pr) <= (kw - 1) * dw else pl + pr)
        else:
            self.rows, self.pitch = self.oh + (kh - 1) * dh // sh, self.ow + (kw - 1) * dw // sw
        self.block = self.rows * self.pitch  # flat elements per image, in every buffer
        # Per tap (i, j): (phase number, offset of its start in that phase's buffer).
        phases, self.taps = [], []
        for i in range(kh):
            for j in range(kw):
                phase = ((i * dh) % sh, (j * dw) % sw)
                if phase not in phases:
                    phases.append(phase)
                self.taps.append((phases.index(phase), (i * dh // sh) * self.pitch + j * dw // sw))
        self.reach = max(off for _, off in self.taps)  # how far past the last output position taps read
        self.phases = [self._placement(p, q, (sh, sw)) for p, q in phases]

    def _placement(self, p, q, stride):
        """Where phase (p, q)'s input goes in its image block and comes from in x:
        ((row slice, column slice) of the block, (row slice, column slice) of x)."""
        def span(phase, s, lo, size, room):
            first = max(0, -(-(lo - phase) // s))          # first phase row at or after x's first row
            last = min(room, (lo + size - 1 - phase) // s + 1)  # rows past the block are never read
            if last <= first:
                return slice(0, 0), slice(0, 0)
            start = first * s + phase - lo
            return slice(first, last), slice(start, start + s * (last - first - 1) + 1, s)
        rows = span(p, stride[0], self.pads[0], self.h, self.rows)
        cols = span(q, stride[1], self.pads[2], self.w, self.pitch)
        return (rows[0], cols[0]), (rows[1], cols[1])

    def chunking(self, dtype, channels):
        """(chunks of images, threads) so that one thread's buffers of ``channels`` rows in all (input,
        output and times channels) stay under its share of the budget, or ``images_per_chunk``."""
        budget, threads = self.budget
        per_image = channels * self.block * numpy.dtype(dtype).itemsize
        per_chunk = get_option("images_per_chunk") or budget // threads // per_image
        chunks = intra_op.split(self.n, max(1, min(self.n, per_chunk)), threads)
        return chunks, min(threads, len(chunks))

    def input_buffer(self, c, nb, dtype):
        """(zeroed (phases, c, ld) buffer for nb images, ld, [per phase: the view x's data goes to])."""
        ld = _row_pitch(numpy, nb * self.block + self.reach, numpy.dtype(dtype).itemsize)
        buf = numpy.zeros((len(self.phases), c, ld), dtype=dtype)
        views = [buf[k, :, :nb * self.block].reshape(c, nb, self.rows, self.pitch)[:, :, rows, cols]
                 for k, ((rows, cols), _) in enumerate(self.phases)]
        return buf, ld, views

    def fill(self, views, x, n0, n1):
        """Copies images n0:n1 of x into the input buffer's phase views."""
        for view, (_, (rows, cols)) in zip(views, self.phases):
            view[:, :n1 - n0] = x[n0:n1, :, rows, cols].transpose(1, 0, 2, 3)

    def output_view(self, buf, k):
        """The (C, k, OH, OW) positions of k images in an output-layout buffer (C, ld)."""
        return buf[:, :k * self.block].reshape(buf.shape[0], k, self.rows, self.pitch)[:, :, :self.oh, :self.ow]


def tap_correlate(x, w, taps, times=None, forward=True):
    """y = x (*) w by tap GEMMs; with ``times``, also ``(y, acc)`` where ``acc[t, ct, c] = sum over
    output positions of times[:, ct] * x at tap t [:, c]``, taps t in (i, j) order: the weight
    gradient of the convolution when ``times`` is its output gradient. ``forward=False`` skips y
    and returns acc alone."""
    n, c = x.shape[:2]
    o, kh, kw = w.shape[0], w.shape[2], w.shape[3]
    it, dtype = x.itemsize, x.dtype
    tap_w = numpy.ascontiguousarray(w.transpose(2, 3, 0, 1))  # (kh, kw, O, C): one (O, C) matrix per tap
    w_addr, w_step = blas.address(tap_w), o * c * it
    y = numpy.empty((n, o, taps.oh, taps.ow), dtype=dtype) if forward else None
    ct = 0 if times is None else times.shape[1]
    chunks, threads = taps.chunking(dtype, c * len(taps.phases) + (o if forward else 0) + ct)
    nb = max(n1 - n0 for n0, n1 in chunks)
    gemm = blas.gemm_for(dtype)

    def run(t):
        # Zeroed once: padding positions are never written, so they stay zero in every chunk.
        xbuf, x_ld, x_in = taps.input_buffer(c, nb, dtype)
        out_ld = _row_pitch(numpy, nb * taps.block, it)
        out = numpy.empty((o if forward else 0, out_ld), dtype=dtype)
        starts = [blas.address(xbuf[phase]) + off * it for phase, off in taps.taps]
        out_addr = blas.address(out)
        acc = tbuf = None
        if times is not None:
            # Dropped positions of times stay zero (never written), so they add nothing to acc.
            tbuf = numpy.zeros((ct, out_ld), dtype=dtype)
            acc = numpy.zeros((kh * kw, ct, c), dtype=dtype)
            t_addr, acc_addr = blas.address(tbuf), blas.address(acc)
        for n0, n1 in chunks[t::threads]:
            k = n1 - n0
            m = k * taps.block
            taps.fill(x_in, x, n0, n1)
            for tap, start in enumerate(starts if forward else ()):
                gemm(o, m, c, w_addr + tap * w_step, c, start, x_ld, out_addr, out_ld,
                     beta=0.0 if tap == 0 else 1.0)
            if forward:
                y[n0:n1] = taps.output_view(out, k).transpose(1, 0, 2, 3)
            if times is not None:
                taps.output_view(tbuf, k)[...] = times[n0:n1].transpose(1, 0, 2, 3)
                for tap, start in enumerate(starts):
                    gemm(ct, c, m, t_addr, out_ld, start, x_ld, acc_addr + tap * ct * c * it, c,
                         beta=1.0, trans_b=True)
        return acc

    accs = intra_op.parallel_map(run, threads)
    if times is None:
        return y
    acc = intra_op.sum_in_order(accs)
    return (y, acc) if forward else acc


def tap_input_gradient(gy, w, taps):
    """The input gradient of y = x (*) w from gy, as the adjoint of the tap GEMMs: per tap
    ``w_t^T (C, O) @ gy (O, M)`` summed (beta = 1) into the phase buffers at the tap's start, then
    the phases' data positions gathered back onto x (the padding copy's adjoint). Any stride."""
    n, o = gy.shape[:2]
    c = w.shape[1]
    it, dtype = gy.itemsize, gy.dtype
    tap_wt = numpy.ascontiguousarray(w.transpose(2, 3, 1, 0))  # (kh, kw, C, O): w_t^T per tap
    w_addr, w_step = blas.address(tap_wt), o * c * it
    gx = numpy.zeros((n, c, taps.h, taps.w), dtype=dtype)  # zeros: phases may not cover every x position
    chunks, threads = taps.chunking(dtype, c * len(taps.phases) + o)
    nb = max(n1 - n0 for n0, n1 in chunks)
    gemm = blas.gemm_for(dtype)

    def run(t):
        gbuf, g_ld, g_views = taps.input_buffer(c, nb, dtype)
        gy_ld = _row_pitch(numpy, nb * taps.block, it)
        gybuf = numpy.zeros((o, gy_ld), dtype=dtype)  # dropped positions stay zero: they add nothing
        starts = [blas.address(gbuf[phase]) + off * it for phase, off in taps.taps]
        gy_addr = blas.address(gybuf)
        for n0, n1 in chunks[t::threads]:
            k = n1 - n0
            m = k * taps.block
            taps.output_view(gybuf, k)[...] = gy[n0:n1].transpose(1, 0, 2, 3)
            gbuf.fill(0)
            for tap, start in enumerate(starts):
                gemm(c, m, o, w_addr + tap * w_step, o, gy_addr, gy_ld, start, g_ld, beta=1.0)
            for view, (_, (rows, cols)) in zip(g_views, taps.phases):
                gx[n0:n1, :, rows, cols] = view[:, :k].transpose(1, 0, 2, 3)

    intra_op.parallel_map(run, threads)
    return gx
