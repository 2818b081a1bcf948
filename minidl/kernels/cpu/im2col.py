"""The window machinery of the conv kernels: im2col views in chunks of images sized for the
cache (CPU) or bounded for memory (GPU), the GEMM correlation, and the stride-phase rewrite.

xp-generic: the NumPy kernels (conv.py here) and the CuPy ones (minidl/kernels/cuda/conv.py)
share it, each giving its windows a chunk budget (``_Windows(..., budget=(bytes, threads))``).
The reference these are checked against is minidl/ops/im2col.py (im2col, col2im) and
minidl/ops/conv.py.

Layout. Columns are built channel-major, ``col[(c, i, j), (n, oh, q)]``, so a chunk of
images takes one ``(O, K) @ (K, n*OH*Q)`` GEMM, a large matrix for BLAS (batched per-image
GEMMs measured up to 2.5x slower on the 8x8 ResNet-20 stage). The (O, n, ...) result then
needs one transposing copy to NCHW, the size of the output only, which doubles as the crop
of garbage columns described next.

Flat rows (stride 1, every 3x3 ResNet conv). A padded image is viewed as one long row per
channel, and the window at kernel offset (i, j) is the contiguous run that starts at
``i*dh*Wp + j*dw``, so ``q`` runs over the whole padded width Wp instead of OW. The last
``(kw-1)*dw`` columns of each output row are garbage (runs that cross a row end) and are
dropped, but im2col copies runs of OH*Wp elements instead of OW-element pieces. The rows
need not carry both paddings: with a row pitch of W + max(pl, pr) (the padding buffer's
width), the zeros after one row serve as the left padding of the next, and reads past the
end of a row land in them; the last row reads into one spare zero row. That cuts the
garbage to max(pl, pr) columns per row (1 of 9 on the 8x8 ResNet stage instead of 2 of 10).

Chunks. On the CPU the batch goes through in chunks of images whose columns, those of all
threads' chunks together, fit the ``conv_cache_bytes`` option; padding, im2col and GEMM of a
chunk then stay in cache, which halved the time of the 16- and 32-channel convs against one
whole-batch im2col. The chunks run on ``minidl.get_num_threads()`` threads, each with its own
buffers and a single-threaded BLAS (threads.py), so the copies use every core too.
No column matrix is saved: backward keeps x and rebuilds what it needs. On a GPU the chunks
run on one thread and are bounded for memory, not cache (``gpu_im2col_bytes``), and every
column matrix there is a plain contiguous buffer (no padded row pitch), which CuPy's matmul
would otherwise copy before the GEMM.
"""
import numpy

from . import threads as intra_op
from .. import declare_option, get_option
from . import blas

# 4 MB per thread overfilled an 8 MB last-level cache shared by 2 cores; 2 MB each (that machine's
# L2) ran the ResNet-20 step 1.01-1.09x faster over five paired runs (benchmarks/bench_step_ab.py):
# by default each thread's chunk is this machine's L2 (sysfs, threads.py).
declare_option("conv_cache_bytes", None, "column bytes of the conv chunks all intra-op threads work on at "
               "once on the CPU (each thread's chunk: this / threads); None: the L2 size times the threads")
declare_option("images_per_chunk", None, "images per im2col + GEMM chunk of the conv kernels (CPU and GPU); "
               "None: as many as the chunk budget holds (conv_cache_bytes, gpu_im2col_bytes), at least one")


def _matmul(xp, a, b, out, accumulate=False):
    """``out = a @ b`` (``out += a @ b`` with accumulate), batched over the leading (group) axis.
    On NumPy one direct BLAS call per group (blas.py: MKL where installed, NumPy's OpenBLAS
    otherwise, straight into ``out``, no temporary); elsewhere, or where BLAS cannot take the
    views as they lie, ``xp.matmul``."""
    if xp is numpy and blas.matmul(a[0], b[0], out[0], 1.0 if accumulate else 0.0):
        for g in range(1, out.shape[0]):  # the same strides and dtypes: BLAS takes these too
            blas.matmul(a[g], b[g], out[g], 1.0 if accumulate else 0.0)
        return out
    if accumulate:
        out += xp.matmul(a, b)
    else:
        xp.matmul(a, b, out=out)
    return out


def _as_strided(xp, a, shape, strides):
    return xp.lib.stride_tricks.as_strided(a, shape=shape, strides=strides)


def _row_pitch(xp, m, itemsize):
    """Row pitch (elements) for a column matrix of m columns: on the CPU an odd multiple of
    64 bytes, on the GPU m itself.

    On the CPU, a pitch that is a multiple of a large power of two maps the rows that BLAS
    packs together onto the same cache sets: (16, 144) @ (144, 6144) measured 46 GFLOP/s on
    one core with pitch 6144 and 75 with pitch 6160. On the GPU there are no such cache sets
    to dodge, and a padded pitch makes a non-contiguous matrix, which CuPy's matmul copies
    before handing it to cuBLAS: there every column matrix is a plain contiguous buffer.
    """
    if xp is not numpy:
        return m
    unit = max(1, 64 // itemsize)
    units = -(-m // unit)
    return (units + 1 - units % 2) * unit


def _rows(xp, buf, rows, m):
    """A (rows, m) view of buf with the row pitch ``_row_pitch(xp, m)`` (contiguous on the GPU)."""
    pitch = _row_pitch(xp, m, buf.itemsize)
    return buf[:rows * pitch].reshape(rows, pitch)[:, :m]


class _Windows:
    """Where the windows of one convolution lie, and the im2col / col2im moves over them.

    ``flat`` (stride 1): flat rows, Q = Wp (see the module docstring); else Q = OW.
    ``masked`` (flat, and the output as wide as the input: 'same' padding, as in ResNet, on
    narrow images): rows of pitch W with no horizontal padding at all. A window that would read the
    horizontal padding reads the neighbouring row instead, and im2col zeroes those entries
    (the first or last few columns of each row, for the taps left or right of centre). So Q =
    OW: no garbage columns, which saves up to 1/9 of the GEMM work (8x8 images, pitch 9).
    """

    def __init__(self, x_shape, kernel, stride, dilation, pads, out_hw, budget):
        self.n, self.c, self.h, self.w = x_shape
        self.budget = budget  # (bytes of all threads' columns at once, threads)
        self.kernel, self.stride, self.dilation, self.pads = kernel, stride, dilation, pads
        self.oh, self.ow = out_hw
        self.flat = stride == (1, 1)
        pl, pr = pads[2:]
        # Masking costs scattered writes of a few columns per row: it pays only where flat
        # rows would waste more than 1/16 of the GEMM (ResNet's 8x8 stage: 1/9; measured
        # 10% faster there, 15% slower on 32x32 images).
        self.masked = (self.flat and min(pads) >= 0 and self.ow == self.w
                       and 16 * max(pl, pr) > self.w + max(pl, pr))
        # Row pitch of the padding buffer. Flat rows share one zero gap between neighbouring
        # rows: the right padding of a row doubles as the left padding of the next (see the
        # module docstring), so every GEMM and im2col has max(pl, pr) garbage columns, not pl + pr.
        self.pitch = self.w + pl + pr
        if self.masked:
            self.pitch = self.w
        elif self.flat and pl >= 0 and pr >= 0 and min(pl, pr) <= (kernel[1] - 1) * dilation[1]:
            self.pitch = self.w + max(pl, pr)
        self.q = self.pitch if self.flat else self.ow
        self.k = self.c * kernel[0] * kernel[1]

    def chunking(self, xp, dtype):
        """(chunks of images, threads): the chunks that one im2col + GEMM step each takes, and
        how many threads run them, chunk i on thread i % threads (see threads.py).
        A chunk's columns stay under budget bytes / threads, or it holds ``images_per_chunk``."""
        per_image = self.k * self.oh * self.q * dtype.itemsize
        budget, threads = self.budget
        per_chunk = get_option("images_per_chunk") or budget // threads // per_image
        chunks = intra_op.split(self.n, max(1, min(self.n, per_chunk)), threads)
        return chunks, min(threads, len(chunks))

    def buffers(self, xp, dtype, nb):
        """(padded images, columns) for chunks of up to nb images; one set per thread.

        The padding buffer's border is zeroed once; each chunk only rewrites its interior.
        Masked rows get it flat, with pl elements before the first row and pr after the last
        for the windows at the ends to read (their entries are zeroed in the columns).
        """
        xpad = None
        if self.flat or any(self.pads):
            # Flat rows need one spare row: the garbage runs of the last row end inside it.
            rows = self.h + sum(self.pads[:2]) + (1 if self.flat and not self.masked else 0)
            shape = (nb, self.c, rows, self.pitch)
            if self.masked:
                xpad = xp.zeros(self.pads[2] + nb * self.c * rows * self.pitch + self.pads[3], dtype=dtype)
            else:
                xpad = xp.zeros(shape, dtype=dtype)
        m = self.oh * self.q * nb
        return xpad, xp.empty(self.k * _row_pitch(xp, m, dtype.itemsize), dtype=dtype)

    def columns(self, xp, x, n0, n1, xpad, buf):
        """Columns of images n0:n1, channel-major: (C*kh*kw, (n1-n0)*OH*Q), copied into buf."""
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        pt, pb, pl, pr = self.pads
        part = base = x[n0:n1]
        if xpad is not None:
            # A negative pad crops (the input-gradient correlation needs it when the forward
            # padding exceeds the kernel's reach).
            src = part[:, :, max(-pt, 0):self.h - max(-pb, 0), max(-pl, 0):self.w - max(-pr, 0)]
            t, l = max(pt, 0), max(pl, 0)
            if self.masked:
                rows = self.h + pt + pb
                base = xpad  # starts pl elements before the rows: where the first window begins
                part = xpad[pl:pl + (n1 - n0) * self.c * rows * self.w].reshape(n1 - n0, self.c, rows, self.w)
                l = 0
            else:
                part = base = xpad[:n1 - n0]
            part[:, :, t:t + src.shape[2], l:l + src.shape[3]] = src
        s_n, s_c, s_h, s_w = part.strides
        n, it = n1 - n0, buf.itemsize
        m = n * self.oh * self.q
        col = _rows(xp, buf, self.k, m)
        ld = col.strides[0]
        # (c, i, j, n, oh, q) over col's rows
        grid = (kh * kw * ld, kw * ld, ld, self.oh * self.q * it, self.q * it, it)
        dst = grid
        if self.flat:
            shape, strides = (self.c, kh, kw, n, self.oh * self.q), (s_c, dh * s_h, dw * s_w, s_n, s_w)
            dst = grid[:4] + grid[5:]
        else:
            shape = (self.c, kh, kw, n, self.oh, self.ow)
            strides = (s_c, dh * s_h, dw * s_w, s_n, sh * s_h, sw * s_w)
        xp.copyto(_as_strided(xp, col, shape, dst), _as_strided(xp, base, shape, strides))
        if self.masked:
            # Tap j reads input column ow + j*dw - pl: outside the row for the first pl - j*dw
            # or the last j*dw - pl output columns, where it read a neighbouring row.
            grid = _as_strided(xp, col, (self.c, kh, kw, n, self.oh, self.ow), grid)
            for j in range(kw):
                d = j * dw - pl
                if d < 0:
                    grid[:, :, j, :, :, :-d] = 0
                elif d > 0:
                    grid[:, :, j, :, :, max(self.ow - d, 0):] = 0
        return col

    def col2im(self, xp, gcol):
        """Sums a chunk of column gradients (C, kh, kw, n, OH, OW) back onto its images.

        Conv2D uses it for strided windows only (stride 1 takes its input gradient by
        correlation); Conv2DTranspose for any, with OW columns per row (no flat-row garbage).
        Loops over the kh*kw kernel offsets only; returns an (n, C, H, W) view with the padding
        cropped, for the caller to copy into gx. A negative bottom/right pad (windows that stop
        short of the image's end) leaves zeros there.
        """
        assert gcol.shape[-2:] == (self.oh, self.ow), gcol.shape
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        pt, pb, pl, pr = self.pads
        oh, ow = self.oh, self.ow
        rows, cols = self.h + pt + max(pb, 0), self.w + pl + max(pr, 0)
        gpad = xp.zeros((self.c, gcol.shape[3], rows, cols), dtype=gcol.dtype)
        for i in range(kh):
            for j in range(kw):
                hs = slice(i * dh, i * dh + sh * (oh - 1) + 1, sh)
                ws = slice(j * dw, j * dw + sw * (ow - 1) + 1, sw)
                gpad[:, :, hs, ws] += gcol[:, i, j]
        return gpad[:, :, pt:pt + self.h, pl:pl + self.w].transpose(1, 0, 2, 3)


def _correlate(xp, x, w, win, group, times=None):
    """y = x (*) w over the windows ``win``: per chunk of images, im2col then one GEMM.

    With ``times`` (an array of y's shape), also returns ``sum_m col[:, m] * times[:, m]``
    per group, (G, K/G, C_times/G): the weight gradient that the input-gradient
    correlation gets almost for free from its own columns (see Conv2D.backward).
    The chunks run on up to ``intra_op.get_num_threads()`` threads, each with its own buffers
    and its own partial sum of that product, added up in thread order.
    """
    n, o, oh, ow, q = win.n, w.shape[0], win.oh, win.ow, win.q
    w3 = w.reshape(group, o // group, -1)
    y = xp.empty((n, o, oh, ow), dtype=x.dtype)
    chunks, threads = win.chunking(xp, x.dtype)
    nb = max(n1 - n0 for n0, n1 in chunks)
    per_chunk = nb * oh * q
    ct = None if times is None else times.shape[1]

    def run(t):
        xpad, cols = win.buffers(xp, x.dtype, nb)
        pitch = _row_pitch(xp, per_chunk, x.itemsize)
        outs = xp.empty(o * pitch, dtype=x.dtype)
        acc = tbuf = None
        if times is not None:
            # Q is the innermost axis, so the garbage columns of flat rows sit at the same buffer
            # positions in every chunk: zeroed once, they stay zero and add nothing to acc.
            tbuf = (xp.zeros if q != ow else xp.empty)(ct * pitch, dtype=x.dtype)
            acc = xp.zeros((group, win.k // group, ct // group), dtype=x.dtype)
        for n0, n1 in chunks[t::threads]:
            col = win.columns(xp, x, n0, n1, xpad, cols)
            m = col.shape[1]
            col = col.reshape(group, -1, m)
            out = _rows(xp, outs, o, m)
            _matmul(xp, w3, col, out.reshape(group, o // group, m))
            # One transposing copy to NCHW, which also drops the garbage columns of flat rows.
            y[n0:n1] = out.reshape(o, n1 - n0, oh, q)[..., :ow].transpose(1, 0, 2, 3)
            if times is not None:
                # On the CPU the full chunk's pitch, not _row_pitch(m): a shorter last chunk must find
                # its garbage columns where the zeros are (another pitch would put old values there).
                # On the GPU the pitch is m, a multiple of q, so every chunk's garbage columns lie at
                # the buffer positions ow..q-1 modulo q, which no chunk writes: they stay zero.
                tp = pitch if xp is numpy else m
                tc = tbuf[:ct * tp].reshape(ct, tp)[:, :m].reshape(ct, n1 - n0, oh, q)
                tc[..., :ow] = times[n0:n1].transpose(1, 0, 2, 3)
                # (K, m) @ (m, C): BLAS measured this orientation ~1.7x faster than (C, m) @ (m, K).
                _matmul(xp, col, tc.reshape(group, ct // group, m).swapaxes(-1, -2), acc, accumulate=True)
        return acc

    accs = intra_op.parallel_map(run, threads)
    if times is None:
        return y
    return y, intra_op.sum_in_order(accs)


class _Phases:
    """A strided convolution as a stride-1 one over the stride phases of x (space-to-depth).

    With stride (sh, sw), kernel row i meets input rows ``sh * r + i``: phase ``i % sh`` of
    the padded input at row ``r + i // sh``. Stacking the phases as channels, ``(p, q, c)``,
    turns the conv into a stride-1, unpadded one with a ceil(kh/sh) x ceil(kw/sw) kernel,
    zero where a phase has no tap; phases no tap reaches (stride > kernel) are left out.
    That runs the flat-row im2col and the input gradient by correlation instead of 6-D window
    copies and col2im. The conv kernels use it only where no tap is zero (``exact``): a 1x1 strided
    conv becomes a plain GEMM over the subsampled input, 2x faster forward and backward on
    the ResNet-20 shortcuts. For 3x3 stride 2 the zero taps make 16/9 of the GEMM work,
    which measured slower than the strided path (forward 1.8x, backward on par).
    """

    @staticmethod
    def exact(kernel, stride):
        """Whether the phase kernel has no zero taps: each kernel size a multiple of its stride, or
        at most the stride (1x1 strided convs, 2x2 stride 2, 3x3 stride 3)."""
        return all(-(-k // s) * min(s, k) == k for k, s in zip(kernel, stride))

    def __init__(self, x_shape, kernel, stride, pads_lo, out_hw):
        self.x_shape, self.kernel, self.stride, self.pads_lo = tuple(x_shape), kernel, stride, pads_lo
        (kh, kw), (sh, sw), (oh, ow) = kernel, stride, out_hw
        self.ksub = (-(-kh // sh), -(-kw // sw))  # kernel of the phase conv
        self.used = (min(sh, kh), min(sw, kw))  # phases with at least one tap
        self.sub_hw = (oh + self.ksub[0] - 1, ow + self.ksub[1] - 1)  # size of each phase image

    def _pieces(self):
        """Per used phase (p, q): (channel block, phase-image slices, x slices) it exchanges with x."""
        out = []
        for p in range(self.used[0]):
            rows = self._span(p, 0)
            for q in range(self.used[1]):
                cols = self._span(q, 1)
                if rows is not None and cols is not None:
                    out.append((p * self.used[1] + q, (rows[0], cols[0]), (rows[1], cols[1])))
        return out

    def _span(self, p, axis):
        """Phase p along an axis: (phase-image slice, x slice), or None when no x element lands there."""
        s, lo, size, sub = self.stride[axis], self.pads_lo[axis], self.x_shape[2 + axis], self.sub_hw[axis]
        r0 = max(0, -(-(lo - p) // s))  # first phase row at or after x's first row
        r1 = min(sub, (size - 1 - p + lo) // s + 1)
        if r1 <= r0:
            return None
        start = r0 * s + p - lo
        return slice(r0, r1), slice(start, start + s * (r1 - r0 - 1) + 1, s)

    def split_x(self, xp, x):
        """(N, C, H, W) -> (N, Ph*Pw*C, Hs, Ws): the padded input, one channel block per phase."""
        n, c = x.shape[:2]
        (uh, uw), (hs, ws) = self.used, self.sub_hw
        out = xp.zeros((n, uh * uw, c, hs, ws), dtype=x.dtype)
        for k, (rs, cs), (xr, xc) in self._pieces():
            out[:, k, :, rs, cs] = x[:, :, xr, xc]
        return out.reshape(n, uh * uw * c, hs, ws)

    def merge_x(self, xp, gxs):
        """The adjoint of split_x: phase gradients summed back onto x's (N, C, H, W)."""
        n, c, h, w = self.x_shape
        (uh, uw), (hs, ws) = self.used, self.sub_hw
        g = gxs.reshape(n, uh * uw, c, hs, ws)
        pieces = self._pieces()
        # Phases do not overlap; when they tile x, every element of gx is written below.
        covered = sum((rs.stop - rs.start) * (cs.stop - cs.start) for _, (rs, cs), _ in pieces) == h * w
        gx = (xp.empty if covered else xp.zeros)(self.x_shape, dtype=gxs.dtype)
        for k, (rs, cs), (xr, xc) in pieces:
            gx[:, :, xr, xc] = g[:, k, :, rs, cs]
        return gx

    def split_w(self, xp, w):
        """(O, C, kh, kw) -> (O, Ph*Pw*C, kh', kw'), zero where a phase has no tap."""
        o, c, kh, kw = w.shape
        (sh, sw), (uh, uw), (kh2, kw2) = self.stride, self.used, self.ksub
        wpad = xp.zeros((o, c, kh2 * sh, kw2 * sw), dtype=w.dtype)
        wpad[:, :, :kh, :kw] = w
        w2 = wpad.reshape(o, c, kh2, sh, kw2, sw)[:, :, :, :uh, :, :uw].transpose(0, 3, 5, 1, 2, 4)
        return xp.ascontiguousarray(w2).reshape(o, uh * uw * c, kh2, kw2)

    def merge_w(self, xp, gw2):
        """The adjoint of split_w: (O, Ph*Pw*C, kh', kw') -> (O, C, kh, kw)."""
        o, c, (kh, kw) = gw2.shape[0], self.x_shape[1], self.kernel
        (sh, sw), (uh, uw), (kh2, kw2) = self.stride, self.used, self.ksub
        g = gw2.reshape(o, uh, uw, c, kh2, kw2).transpose(0, 3, 4, 1, 5, 2)  # (o, c, i2, p, j2, q)
        gpad = xp.zeros((o, c, kh2, sh, kw2, sw), dtype=gw2.dtype)
        gpad[:, :, :, :uh, :, :uw] = g
        return xp.ascontiguousarray(gpad.reshape(o, c, kh2 * sh, kw2 * sw)[:, :, :kh, :kw])


