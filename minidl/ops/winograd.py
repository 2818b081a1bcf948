"""Winograd F(2x2, 3x3): the stride-1 3x3 convolutions in 16 GEMMs of 4/9 the work of im2col's.

Each 2x2 block of outputs (a tile) is computed from the 4x4 input patch under it as
``A^T [(G w G^T) * (B^T d B)] A`` (Lavin and Gray, 2015). Summed over input channels, the
elementwise product becomes, for each of the 16 positions xi of the 4x4 transform, one GEMM
``M[xi] = U[xi] (O, C) @ V[xi] (C, tiles)``: 16*O*C multiply-adds per tile of 4 outputs
instead of 9*O*C per output, 2.25x fewer. The transforms are additions and subtractions only
(and halves in G), so float64 stays exact to rounding and float32 measured no less accurate
than im2col (tests/minidl/ops/test_winograd.py).

Layout. NumPy's elementwise passes are fast only over long contiguous runs, and the
transforms take every other row and column. So the input is moved (one blocked transpose,
minidl/_transpose.py) to (C, H, W, N) and split by the parity of its rows and columns:
``X[c, ph, i, pw, j, n] = x[n, c, 2i + ph - pad_top, 2j + pw - pad_left]``. Input row 2i + r
of tile row i is then ``X[:, r % 2, i + r // 2]``: a slice over all i at once, with the
columns and the batch as one contiguous run, and the same holds for columns. The batch is
the innermost axis, so V[xi] is a (C, tiles * N) matrix as it lies. The output takes the
same way back.

Backward. ``dM[xi] = A dY A^T`` per tile; then ``dV = U^T @ dM`` and the adjoint of the
input transform gives the input gradient (a stride-1 conv's input gradient is itself a
3x3 correlation, and this is exactly its Winograd form), and ``dU = dM @ V^T`` and
``G^T dU G`` give the weight gradient, V recomputed from the kept phase planes of x (which
are the size of x; V is 4x). Two GEMMs of the forward's size instead of im2col's larger ones.

Chunks and threads. The transforms and GEMMs run per chunk of tile rows small enough that a
chunk's V and M stay in cache, chunk i on thread i % T; the layout moves are split by
channels. The input gradient's row stage mixes neighbouring tile rows, so it runs after all
chunks. See minidl/_intra_op.py.

When it runs: see ``applies`` and ``ENABLED`` (off by default; why is said there).
"""
import os

import numpy

from .. import _intra_op as intra_op
from .._transpose import transpose_into

_G = ((1.0, 0.0, 0.0), (0.5, 0.5, 0.5), (0.5, -0.5, 0.5), (0.0, 0.0, 1.0))


def applies(xp, dtype, kernel, stride, dilation, group, pads, channels):
    """Whether Conv2D takes the Winograd path: turned on (``ENABLED``), NumPy, float32 or float64,
    3x3, stride 1, undilated, ungrouped, padding of at most 2, and at least ``MIN_CHANNELS``
    channels in and out. Everything else stays on im2col (conv.py).
    """
    return (ENABLED and xp is numpy and dtype in (numpy.float32, numpy.float64) and tuple(kernel) == (3, 3)
            and tuple(stride) == (1, 1) and tuple(dilation) == (1, 1) and group == 1
            and all(0 <= p <= 2 for p in pads) and min(channels) >= MIN_CHANNELS)


# Off unless MINIDL_WINOGRAD=1. On the 2-core machine of 2026-11-23 (benchmarks/bench_winograd.py)
# it made the 32- and 64-channel ResNet-20 convs 1.1-1.3x faster on one thread but no faster on
# two, and the whole step 1-9% faster across runs, inside that machine's noise: its transforms
# are memory passes, which the second thread did not speed up. It stays as an exact, tested
# option to measure on other machines.
ENABLED = os.environ.get("MINIDL_WINOGRAD", "0") == "1"
MIN_CHANNELS = 32  # 16-channel convs measured slower than im2col even in isolation
_CHUNK_BYTES = 2 << 20  # V and M of one chunk of tile rows (see Winograd3x3._chunks)


def _span(parity, lo, size, count):
    """Along one axis, phase ``parity`` of the padded input: (phase slice, x slice) where the
    phase index k holds x element ``2k + parity - lo``, for k in [0, count); None if empty."""
    k0 = max(0, -(-(lo - parity) // 2))
    k1 = min(count, (size - 1 - parity + lo) // 2 + 1)
    if k1 <= k0:
        return None
    start = 2 * k0 + parity - lo
    return slice(k0, k1), slice(start, start + 2 * (k1 - k0 - 1) + 1, 2)


def _run(n, fn):
    """fn(start, stop) over blocks of range(n), one per thread."""
    threads = min(intra_op.get_num_threads(), n)
    blocks = intra_op.split(n, -(-n // threads), threads)
    intra_op.parallel_map(lambda t: fn(*blocks[t]), len(blocks))


class Winograd3x3:
    """One convolution's geometry, and its forward and backward by F(2x2, 3x3)."""

    def __init__(self, x_shape, pads, out_hw):
        self.n, self.c, self.h, self.w = x_shape
        self.pt, _, self.pl, _ = pads
        self.oh, self.ow = out_hw
        self.th, self.tw = -(-self.oh // 2), -(-self.ow // 2)
        # Every pixel of x lies in some tile's 4x4 patch (0 <= pads <= 2), so the input gradient is
        # written everywhere by the adjoint of the input transform.
        self.u = self.xs = None

    # -- layout moves ---------------------------------------------------------------------
    def _to_phases(self, xp, x, c0, c1, out):
        """out[c - c0] = the parity-split, zero-padded (2, th+1, 2, tw+1, N) planes of x's channels c0:c1."""
        n, h, w = self.n, self.h, self.w
        xt = xp.empty((c1 - c0, h, w, n), dtype=x.dtype)
        transpose_into(xp, x.reshape(n, -1)[:, c0 * h * w:c1 * h * w], xt.reshape(-1, n))
        out[...] = 0
        for ph in range(2):
            rows = _span(ph, self.pt, h, self.th + 1)
            for pw in range(2):
                cols = _span(pw, self.pl, w, self.tw + 1)
                if rows is not None and cols is not None:
                    out[:, ph, rows[0], pw, cols[0]] = xt[:, rows[1], cols[1]]

    def _from_phases(self, xp, ps, out, c0, c1, tiled):
        """out[:, c0:c1] (N, C, H, W) = the pixels of the phase planes ``ps`` of channels c0:c1.

        ``tiled``: ps is (C, 2, th, 2, tw, N) with pixel (2i+a, 2j+b) at [a, i, b, j] (outputs);
        else the padded input layout of _to_phases (input gradients).
        """
        n, (h, w) = self.n, (out.shape[2:])
        t = xp.empty((c1 - c0, h, w, n), dtype=ps.dtype)
        lo_h, lo_w = (0, 0) if tiled else (self.pt, self.pl)
        for ph in range(2):
            rows = _span(ph, lo_h, h, ps.shape[2])
            for pw in range(2):
                cols = _span(pw, lo_w, w, ps.shape[4])
                if rows is not None and cols is not None:
                    t[:, rows[1], cols[1]] = ps[:, ph, rows[0], pw, cols[0]]
        transpose_into(xp, t.reshape(-1, n), out.reshape(n, -1)[:, c0 * h * w:c1 * h * w])

    # -- transforms -------------------------------------------------------------------------
    @staticmethod
    def _input_transform(xp, X, V):
        """V (4, 4, C, th, tw, N) = B^T d B of every 4x4 patch of the phase planes X (C, 2, th+1, 2, tw+1, N)."""
        th, tw = V.shape[3], V.shape[4]
        x0, x1 = X[:, 0], X[:, 1]  # rows of parity 0 and 1: (C, th+1, 2, tw+1, N)
        r0, r1, r2, r3 = x0[:, :th], x1[:, :th], x0[:, 1:], x1[:, 1:]
        t = xp.empty((4,) + r0.shape, dtype=X.dtype)
        xp.subtract(r0, r2, out=t[0])
        xp.add(r1, r2, out=t[1])
        xp.subtract(r2, r1, out=t[2])
        xp.subtract(r1, r3, out=t[3])
        for a in range(4):
            c0, c1, c2, c3 = t[a, :, :, 0, :tw], t[a, :, :, 1, :tw], t[a, :, :, 0, 1:], t[a, :, :, 1, 1:]
            xp.subtract(c0, c2, out=V[a, 0])
            xp.add(c1, c2, out=V[a, 1])
            xp.subtract(c2, c1, out=V[a, 2])
            xp.subtract(c1, c3, out=V[a, 3])

    @staticmethod
    def _columns_adjoint(xp, dV, gt):
        """gt (4, C, k, 2, tw+1, N): the column stage of the input transform's adjoint, per tile row
        (from dV (4, 4, C, k, tw, N)); _rows_adjoint finishes it."""
        tw = dV.shape[4]
        for a in range(4):
            g = gt[a]
            v0, v1, v2, v3 = dV[a]
            # V[0] = c0 - c2, V[1] = c1 + c2, V[2] = c2 - c1, V[3] = c1 - c3 (c2, c3: the next tile's c0, c1)
            xp.copyto(g[:, :, 0, :tw], v0)
            g[:, :, 0, tw] = 0
            g[:, :, 0, 1:] += v1
            g[:, :, 0, 1:] += v2
            g[:, :, 0, 1:] -= v0
            xp.subtract(v1, v2, out=g[:, :, 1, :tw])
            g[:, :, 1, :tw] += v3
            g[:, :, 1, tw] = 0
            g[:, :, 1, 1:] -= v3

    @staticmethod
    def _rows_adjoint(xp, gt, gX):
        """gX (C, 2, th+1, 2, tw+1, N): the row stage of the adjoint, summing over the tile rows of gt."""
        th = gt.shape[2]
        t0, t1, t2, t3 = gt
        # T[0] = r0 - r2, T[1] = r1 + r2, T[2] = r2 - r1, T[3] = r1 - r3 (r2, r3: the next tile row's r0, r1)
        g0, g1 = gX[:, 0], gX[:, 1]
        xp.copyto(g0[:, :th], t0)
        g0[:, th] = 0
        g0[:, 1:] += t1
        g0[:, 1:] += t2
        g0[:, 1:] -= t0
        xp.subtract(t1, t2, out=g1[:, :th])
        g1[:, :th] += t3
        g1[:, th] = 0
        g1[:, 1:] -= t3

    @staticmethod
    def _output_transform(xp, M, Y):
        """Y (O, 2, th, 2, tw, N) = A^T m A of every tile's 4x4 m in M (4, 4, O, th, tw, N)."""
        s = xp.empty((2,) + M.shape[1:], dtype=M.dtype)
        xp.add(M[0], M[1], out=s[0])
        s[0] += M[2]
        xp.subtract(M[1], M[2], out=s[1])
        s[1] -= M[3]
        for a in range(2):
            y0, y1 = Y[:, a, :, 0], Y[:, a, :, 1]
            xp.add(s[a, 0], s[a, 1], out=y0)
            y0 += s[a, 2]
            xp.subtract(s[a, 1], s[a, 2], out=y1)
            y1 -= s[a, 3]

    @staticmethod
    def _output_transform_adjoint(xp, GY, dM):
        """dM (4, 4, O, th, tw, N) = A g A^T for every tile's 2x2 gradient g in GY (O, 2, th, 2, tw, N)."""
        r = xp.empty((4,) + GY[:, 0].shape, dtype=GY.dtype)  # (4, O, th, 2, tw, N)
        g0, g1 = GY[:, 0], GY[:, 1]
        xp.copyto(r[0], g0)
        xp.add(g0, g1, out=r[1])
        xp.subtract(g0, g1, out=r[2])
        xp.negative(g1, out=r[3])
        for a in range(4):
            c0, c1 = r[a, :, :, 0], r[a, :, :, 1]
            xp.copyto(dM[a, 0], c0)
            xp.add(c0, c1, out=dM[a, 1])
            xp.subtract(c0, c1, out=dM[a, 2])
            xp.negative(c1, out=dM[a, 3])

    # -- the convolution --------------------------------------------------------------------
    def _chunks(self, c, o, itemsize):
        """(chunks of tile rows, threads): each chunk's V and M (16 planes of C and O rows) fit
        about ``_CHUNK_BYTES``, so a chunk's transform, GEMMs and inverse transform stay in cache."""
        per_row = 16 * (c + o) * self.tw * self.n * itemsize
        threads = intra_op.get_num_threads()
        chunks = intra_op.split(self.th, max(1, _CHUNK_BYTES // per_row), threads)
        return chunks, min(threads, len(chunks))

    def forward(self, xp, x, w, keep):
        n, c, o, th, tw = self.n, self.c, w.shape[0], self.th, self.tw
        g = xp.asarray(_G, dtype=w.dtype)
        u = xp.ascontiguousarray(xp.einsum("ai,ocij,bj->aboc", g, w, g)).reshape(16, o, c)
        xs = xp.empty((c, 2, th + 1, 2, tw + 1, n), dtype=x.dtype)
        _run(c, lambda c0, c1: self._to_phases(xp, x, c0, c1, xs[c0:c1]))
        ys = xp.empty((o, 2, th, 2, tw, n), dtype=x.dtype)
        chunks, threads = self._chunks(c, o, x.itemsize)

        def rows(t):
            for i0, i1 in chunks[t::threads]:
                p = (i1 - i0) * tw * n
                v = xp.empty((4, 4, c, i1 - i0, tw, n), dtype=x.dtype)
                self._input_transform(xp, xs[:, :, i0:i1 + 1], v)
                m = xp.matmul(u, v.reshape(16, c, p)).reshape(4, 4, o, i1 - i0, tw, n)
                self._output_transform(xp, m, ys[:, :, i0:i1])
        intra_op.parallel_map(rows, threads)
        y = xp.empty((n, o, self.oh, self.ow), dtype=x.dtype)
        _run(o, lambda o0, o1: self._from_phases(xp, ys[o0:o1], y, o0, o1, tiled=True))
        if keep:
            self.u, self.xs = u, xs
        return y

    def backward(self, xp, gy, need_x, need_w):
        """(gx or None, gw or None) for the output gradient gy."""
        n, o, th, tw, c = self.n, gy.shape[1], self.th, self.tw, self.c
        u, xs = self.u, self.xs
        gys = xp.empty((o, 2, th, 2, tw, n), dtype=gy.dtype)
        _run(o, lambda o0, o1: self._to_tiles(xp, gy, o0, o1, gys[o0:o1]))
        # The input gradient's column stage per chunk; its row stage mixes neighbouring tile
        # rows, which may belong to another thread's chunk, so it runs after all chunks.
        gt = xp.empty((4, c, th, 2, tw + 1, n), dtype=gy.dtype) if need_x else None
        chunks, threads = self._chunks(c, o, gy.itemsize)

        def rows(t):
            du = xp.zeros((16, o, c), dtype=gy.dtype) if need_w else None
            for i0, i1 in chunks[t::threads]:
                p = (i1 - i0) * tw * n
                dm = xp.empty((4, 4, o, i1 - i0, tw, n), dtype=gy.dtype)
                self._output_transform_adjoint(xp, gys[:, :, i0:i1], dm)
                dm = dm.reshape(16, o, p)
                if need_w:  # V again, from the kept phase planes: cheaper than keeping 4x the input
                    v = xp.empty((4, 4, c, i1 - i0, tw, n), dtype=gy.dtype)
                    self._input_transform(xp, xs[:, :, i0:i1 + 1], v)
                    du += xp.matmul(dm, v.reshape(16, c, p).swapaxes(1, 2))
                if need_x:
                    dv = xp.matmul(u.swapaxes(1, 2), dm).reshape(4, 4, c, i1 - i0, tw, n)
                    self._columns_adjoint(xp, dv, gt[:, :, i0:i1])
            return du

        parts = intra_op.parallel_map(rows, threads)
        gx = gw = None
        if need_w:
            for part in parts[1:]:  # in thread order: the result does not depend on timing
                parts[0] += part
            g = xp.asarray(_G, dtype=gy.dtype)
            gw = xp.ascontiguousarray(xp.einsum("ai,aboc,bj->ocij", g, parts[0].reshape(4, 4, o, c), g))
        if need_x:
            gx = xp.empty((n, c, self.h, self.w), dtype=gy.dtype)

            def adjoint(c0, c1):
                gxs = xp.empty((c1 - c0, 2, th + 1, 2, tw + 1, n), dtype=gy.dtype)
                self._rows_adjoint(xp, gt[:, c0:c1], gxs)
                self._from_phases(xp, gxs, gx, c0, c1, tiled=False)
            _run(c, adjoint)
        return gx, gw

    def _to_tiles(self, xp, gy, o0, o1, out):
        """out = the (O, 2, th, 2, tw, N) tile layout of gy's channels o0:o1, zero beyond the output."""
        n, oh, ow = self.n, self.oh, self.ow
        t = xp.empty((o1 - o0, oh, ow, n), dtype=gy.dtype)
        transpose_into(xp, gy.reshape(n, -1)[:, o0 * oh * ow:o1 * oh * ow], t.reshape(-1, n))
        if oh % 2 or ow % 2:
            out[...] = 0
        for a in range(2):
            rows = _span(a, 0, oh, self.th)
            for b in range(2):
                cols = _span(b, 0, ow, self.tw)
                if rows is not None and cols is not None:
                    out[:, a, rows[0], b, cols[0]] = t[:, rows[1], cols[1]]
