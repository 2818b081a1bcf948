"""Conv2D and Conv2DTranspose on NumPy: the routes that beat the reference's whole-batch im2col.

Forward routes (minidl/ops/conv.py holds the reference: im2col, one GEMM, col2im):

- stride 1 (every 3x3 ResNet conv): one GEMM per kernel offset summed into the output, on
  the input as it lies in a padded flat buffer, no im2col (taps.py), in cache-sized chunks of
  images on the intra-op threads; where the direct BLAS call is missing, flat-row im2col and
  one GEMM per chunk (im2col.py explains the layout);
- strided, ungrouped, undilated convs whose kernel splits into stride phases without zero taps
  (1x1 strided, 2x2 stride 2): a stride-1 conv over the stride phases of x (``_Phases``);
- 1x1 stride 1 unpadded (after a phase split too): a batched GEMM on x as it lies, no copies;
- the rest (3x3 stride 2, dilated or grouped strided convs): 6-D ``as_strided`` windows.

Backward. Stride 1: gx is gy correlated with the flipped kernel, the forward path again, and
gw comes from the same columns of gy (offset (kh-1-i, kw-1-j) of gy meets offset (i, j) of x),
so x needs no second im2col; with MKL on images where the tap layout wastes little, both come
from tap GEMMs instead (``correlate`` says when). Strided windows: gw from gy @ columns, gx from column gradients
and col2im (a loop over the kh*kw offsets). 1x1: pure GEMMs.

Conv2DTranspose: forward is w^T times dout's rows and a col2im in chunks of images;
backward a correlation of gy with w (Conv2D's forward path) whose columns also give gw.

Bound: the chunks, flat rows and orientations change the GEMMs' shapes, so the BLAS blocks and
sums in another order than the reference's one whole-batch GEMM, and the weight gradient adds
per-chunk and per-thread partial sums: rounding differences of a few units in the last place of
float32 sums, relative to the terms' magnitudes (see ``BOUND``).
"""
import numpy

from . import threads as intra_op
from ...backend import get_array_module
from ...ops.conv import Conv2D, Conv2DTranspose
from ...tensor import is_grad_enabled
from .. import Kernel, get_option, register
from . import blas
from .im2col import _Phases, _Windows, _correlate, _matmul
from .taps import Taps, tap_correlate, tap_input_gradient

__all__ = ["Conv2DRoutes", "Conv2DTransposeRoutes"]

# float32 sums of up to ~10^4 terms of values ~1 in another order (the kernels' cases, the op
# harness's draws of values up to 3): measured at most 6e-7 of the largest value and 1.5e-3
# absolute on weight gradients of magnitude 1e4; float64 at most 1.1e-15 relative, 3.4e-13 absolute.
BOUND = {"float32": (1e-4, 1e-3), "float64": (1e-12, 1e-11)}


# Each tap GEMM sums over the input channels only: with few of them (an RGB stem) BLAS runs far
# below its speed, and im2col's kh*kw times longer sums win: ResNet-20's 3-channel stem measured
# 1.2x slower by taps, its 16-channel convs 1.9x faster (forward, 2 threads, Intel Xeon, 2026-11-25).
TAPS_MIN_CHANNELS = 8


class _Chunked(Kernel):
    """What the conv kernels share: which arrays they take and how they chunk."""

    bound = BOUND

    def applies(self, node, x, w, *rest):
        return x.dtype.kind == "f"

    def budget(self):
        """(column bytes of all threads' chunks at once, threads)."""
        threads = intra_op.get_num_threads()
        budget = get_option("conv_cache_bytes")
        return (intra_op.l2_bytes() * threads if budget is None else budget), threads

    def windows(self, x_shape, kernel, stride, dilation, pads, out_hw):
        return _Windows(x_shape, kernel, stride, dilation, pads, out_hw, self.budget())

    def taps(self, x_shape, win):
        return Taps(x_shape, win.kernel, win.stride, win.dilation, win.pads, (win.oh, win.ow), win.budget)

    def correlate(self, xp, x, w, win, group, times=None):
        """y = x (*) w over ``win``, and with ``times`` also ``(y, acc)``, acc as _correlate's.

        Stride 1 by tap GEMMs where they apply (taps.py: no im2col), else im2col and one GEMM
        per chunk. With ``times`` (a weight gradient wanted) taps need one GEMM per tap with an
        output of only Ct x C, which beat the im2col GEMM (measured on ResNet-20's stages, 2
        threads) only with MKL and where the tap layout computes at most 1/8 more positions than
        the output has (32x32 and 16x16 images, not 8x8: 1.27x).
        """
        if Taps.fits(x, w, win.stride, win.pads, group) and x.shape[1] >= TAPS_MIN_CHANNELS:
            taps = self.taps(x.shape, win)
            if times is None:
                return tap_correlate(x, w, taps)
            if blas.library() == "mkl" and taps.block * 8 <= taps.oh * taps.ow * 9:
                y, acc = tap_correlate(x, w, taps, times)  # acc (kh*kw, Ct, C) -> (1, C*kh*kw, Ct)
                kh, kw = win.kernel
                return y, acc.reshape(kh, kw, acc.shape[1], -1).transpose(3, 0, 1, 2).reshape(1, -1, acc.shape[1])
        return _correlate(xp, x, w, win, group, times)


@register
class Conv2DRoutes(_Chunked):
    op, backend = Conv2D, "numpy"

    def forward(self, node, x, w):
        node._check(x, w)
        xp = get_array_module(x, w)
        (oh, ow), (pt, pb, pl, pr) = node.geometry(x.shape)
        n, c, h, wd = x.shape
        o, g, (kh, kw), (sh, sw), (dh, dw) = node.out_channel, node.group, node.kernel_size, node.stride, node.dilation
        keep = is_grad_enabled()
        node.phases = None
        if (sh, sw) != (1, 1) and g == 1 and (dh, dw) == (1, 1) and _Phases.exact(node.kernel_size, node.stride):
            # Strided: the same convolution at stride 1 over the stride phases of x (see _Phases).
            node.phases = _Phases(x.shape, node.kernel_size, node.stride, (pt, pl), (oh, ow))
            x, w = node.phases.split_x(xp, x), node.phases.split_w(xp, w)
            n, c, h, wd = x.shape
            (kh, kw), (sh, sw), (pt, pb, pl, pr) = w.shape[2:], (1, 1), (0, 0, 0, 0)
        node.w = w if keep else None
        if kh == kw == sh == sw == 1 and not any((pt, pb, pl, pr)):
            # 1x1 stride 1: already a (C, H*W) matrix per image; batched GEMM, no copies.
            node.win, node.x = None, (x if keep else None)
            return xp.matmul(w.reshape(g, o // g, c // g), x.reshape(n, g, c // g, h * wd)).reshape(n, o, h, wd)
        node.win = self.windows(x.shape, (kh, kw), (sh, sw), (dh, dw), (pt, pb, pl, pr), (oh, ow))
        node.x = x if keep else None  # backward rebuilds the columns from x, chunk by chunk
        return self.correlate(xp, x, w, node.win, g)

    def backward(self, node, gy):
        xp = get_array_module(gy)
        gx, gw = self._backward(node, xp, gy)
        if node.phases is not None:
            gx = None if gx is None else node.phases.merge_x(xp, gx)
            gw = None if gw is None else node.phases.merge_w(xp, gw)
        return gx, gw

    def _backward(self, node, xp, gy):
        need_x, need_w = node.needs_grad
        w, win, g = node.w, node.win, node.group
        o, cg = w.shape[:2]
        if win is None:  # 1x1 stride 1
            n, c, h, wd = node.x.shape
            gy3 = gy.reshape(n, g, o // g, h * wd)
            gw = gx = None
            if need_w:
                x3 = node.x.reshape(n, g, cg, h * wd)
                gw = xp.matmul(gy3, x3.swapaxes(-1, -2)).sum(axis=0).reshape(w.shape)
            if need_x:
                gx = xp.matmul(w.reshape(g, o // g, cg).swapaxes(-1, -2), gy3).reshape(n, c, h, wd)
            return gx, gw
        if need_x and win.flat:
            return self._grads_by_correlation(node, xp, gy, need_w)
        if not win.flat and Taps.fits(gy, w, win.stride, win.pads, g) and w.shape[1] >= TAPS_MIN_CHANNELS:
            # Strided: gx by the tap GEMMs' adjoint, gw by one more GEMM per tap (taps.py).
            taps = self.taps(node.x.shape, win)
            gx = tap_input_gradient(gy, w, taps) if need_x else None
            gw = None
            if need_w:
                acc = tap_correlate(node.x, w, taps, times=gy, forward=False)  # (kh*kw, O, C)
                gw = xp.ascontiguousarray(acc.reshape(w.shape[2:] + w.shape[:2]).transpose(2, 3, 0, 1))
            return gx, gw
        n, c, oh, ow, q = win.n, win.c, win.oh, win.ow, win.q
        chunks, threads = win.chunking(xp, gy.dtype)
        nb = max(n1 - n0 for n0, n1 in chunks)
        w3 = w.reshape(g, o // g, -1)
        gx = xp.empty((n, c, win.h, win.w), dtype=gy.dtype) if need_x else None

        def run(t):  # the chunks of thread t (see _correlate); returns its part of gw, transposed
            xpad, cols = win.buffers(xp, gy.dtype, nb)
            # Zeros in the garbage columns of flat rows keep gw exact. Q is the innermost axis, so
            # those columns sit at the same buffer positions in every chunk: zeroing once suffices.
            gys = (xp.zeros if q != ow else xp.empty)(o * nb * oh * q, dtype=gy.dtype)
            gw_t = xp.zeros((g, win.k // g, o // g), dtype=gy.dtype) if need_w else None
            gcols = xp.empty(win.k * nb * oh * q, dtype=gy.dtype) if need_x else None
            for n0, n1 in chunks[t::threads]:
                m = (n1 - n0) * oh * q
                gyt = gys[:o * m].reshape(o, n1 - n0, oh, q)
                gyt[..., :ow] = gy[n0:n1].transpose(1, 0, 2, 3)
                gyt = gyt.reshape(g, o // g, m)
                if need_w:
                    col = win.columns(xp, node.x, n0, n1, xpad, cols).reshape(g, -1, m)
                    # (K, m) @ (m, O): BLAS measured this orientation ~1.7x faster than (O, m) @ (m, K).
                    _matmul(xp, col, gyt.swapaxes(-1, -2), gw_t, accumulate=True)
                if need_x:
                    gcol = _matmul(xp, w3.swapaxes(-1, -2), gyt, gcols[:win.k * m].reshape(g, -1, m))  # cache-sized
                    gx[n0:n1] = win.col2im(xp, gcol.reshape((c,) + node.kernel_size + (n1 - n0, oh, q)))
            return gw_t

        parts = intra_op.parallel_map(run, threads)
        gw = None
        if need_w:
            gw = intra_op.sum_in_order(parts).swapaxes(-1, -2).reshape(w.shape)
        return gx, gw

    def _grads_by_correlation(self, node, xp, gy, need_w):
        """Stride 1: gx, and gw if needed, from one pass over the columns of gy.

        gx is gy correlated with w flipped in space and transposed per group, gy padded so
        each input pixel sees every window that covered it: the forward path again. It
        measured about 2x faster than a K x O by O x (N*OH*Q) GEMM into column gradients
        followed by col2im. And since gy's columns at kernel offset (kh-1-i, kw-1-j) line up
        with x at offset (i, j), ``gw[o, c, i, j] = sum_m colgy[(o, kh-1-i, kw-1-j), m] *
        x[c, m]``: one more GEMM on columns already in cache, instead of an im2col of x.
        """
        win, g, w = node.win, node.group, node.w
        o, cg, kh, kw = w.shape
        dh, dw = node.dilation
        pt, pb, pl, pr = win.pads
        eh, ew = (kh - 1) * dh, (kw - 1) * dw
        w_t = w.reshape(g, o // g, cg, kh, kw)[..., ::-1, ::-1].swapaxes(1, 2).reshape(g * cg, o // g, kh, kw)
        pads = (eh - pt, eh - pb, ew - pl, ew - pr)
        back = self.windows(gy.shape, (kh, kw), (1, 1), (dh, dw), pads, (win.h, win.w))
        if not need_w:
            return self.correlate(xp, gy, xp.ascontiguousarray(w_t), back, g), None
        # acc: (G, O/G * kh * kw, C/G), rows (o, kh-1-i, kw-1-j)
        gx, acc = self.correlate(xp, gy, xp.ascontiguousarray(w_t), back, g, times=node.x)
        gw = acc.reshape(g, o // g, kh, kw, cg)[:, :, ::-1, ::-1].transpose(0, 1, 4, 2, 3)
        return gx, xp.ascontiguousarray(gw).reshape(w.shape)

    def cases(self):
        return conv_cases(numpy.random.default_rng(10))


@register
class Conv2DTransposeRoutes(_Chunked):
    op, backend = Conv2DTranspose, "numpy"

    def forward(self, node, dout, w, input_size):
        size = node._check(dout, w, input_size)
        xp = get_array_module(dout, w)
        out_hw, pads = node.geometry(size, dout.shape)
        n, c, h, wd = size
        o, g, (kh, kw) = node.out_channel, node.group, node.kernel_size
        win = node.win = self.windows(size, (kh, kw), node.stride, node.dilation, pads, out_hw)
        node.dout, node.w = (dout, w) if is_grad_enabled() else (None, None)
        # w^T (K, O) times dout's rows (O, m) gives the output's columns, which col2im sums back
        # onto the image. Chunks of images keep the columns as large as Conv2D's own.
        y = xp.empty(size, dtype=dout.dtype)
        w3t = w.reshape(g, o // g, -1).swapaxes(1, 2)  # (G, C/G*kh*kw, O/G)
        chunks, _ = win.chunking(xp, dout.dtype)
        for n0, n1 in chunks:
            rows = dout[n0:n1].transpose(1, 0, 2, 3).reshape(g, o // g, -1)  # (G, O/G, n*H*W)
            cols = xp.matmul(w3t, rows)
            y[n0:n1] = win.col2im(xp, cols.reshape((c, kh, kw, n1 - n0) + out_hw))
        return y

    def backward(self, node, gy):
        # dout's gradient is the Conv2D's forward of gy; w's is the correlation of gy's windows
        # with dout: Conv2D's weight gradient with gy as its input and dout as its output
        # gradient, taken from the same columns of gy (_correlate's ``times``).
        xp = get_array_module(gy)
        need_dout, need_w = node.needs_grad[:2]
        if not need_w:
            return self.correlate(xp, gy, node.w, node.win, node.group), None, None
        # (When only w needs a gradient the forward GEMM is wasted; a first decoder layer fed
        # by a constant pays one extra conv.)
        gdout, acc = self.correlate(xp, gy, node.w, node.win, node.group, times=node.dout)
        gw = xp.ascontiguousarray(acc.swapaxes(-1, -2)).reshape(node.w.shape)  # acc: (G, C/G*kh*kw, O/G)
        return (gdout if need_dout else None), gw, None

    def cases(self):
        return conv_transpose_cases(numpy.random.default_rng(11))


def conv_cases(rng):
    """(make, [x, w]) for every Conv2D route, float32 and float64: flat rows (ResNet's 3x3, in
    several cache-sized chunks; masked rows on 8x8 images; valid), stride phases (1x1 and 2x2
    stride 2), 1x1 GEMMs, strided 6-D windows (3x3 stride 2), dilated and grouped windows."""
    routes = [  # (x shape, w shape, Conv2D keywords)
        ((8, 16, 32, 32), (16, 16, 3, 3), dict(pad_mode="pad", pad=1)),                # flat rows, chunked
        ((4, 32, 8, 8), (32, 32, 3, 3), dict(pad_mode="pad", pad=1)),                  # masked flat rows
        ((3, 4, 9, 11), (5, 4, 3, 2), dict()),                                           # flat rows, valid
        ((2, 3, 7, 6), (5, 3, 1, 2), dict(pad_mode="pad", pad=(2, 1, 0, 3))),           # pads past the kernel's reach
        ((4, 16, 16, 16), (32, 16, 1, 1), dict(stride=2)),                               # phases: 1x1 stride 2
        ((3, 4, 10, 9), (6, 4, 4, 4), dict(pad_mode="pad", pad=1, stride=2)),            # phases: 4x4 stride 2
        ((4, 16, 8, 8), (32, 16, 1, 1), dict()),                                         # 1x1 GEMM
        ((4, 16, 16, 16), (32, 16, 3, 3), dict(pad_mode="pad", pad=1, stride=2)),        # 6-D windows
        ((3, 4, 9, 8), (6, 2, 3, 3), dict(pad_mode="pad", pad=(2, 0, 1, 3), dilation=2, group=2)),  # dilated, groups
        ((3, 4, 9, 8), (6, 2, 2, 3), dict(pad_mode="same", stride=2, dilation=(2, 1), group=2)),   # strided, groups
    ]
    out = []
    for dtype in (numpy.float32, numpy.float64):
        for x_shape, w_shape, kwargs in routes:
            make = (lambda o, k, kw: lambda: Conv2D(o, k, **kw))(w_shape[0], w_shape[2:], kwargs)
            x = rng.standard_normal(x_shape).astype(dtype)
            w = (rng.standard_normal(w_shape) / numpy.sqrt(numpy.prod(w_shape[1:]))).astype(dtype)
            out.append((make, [x, w]))
    return out


def conv_transpose_cases(rng):
    """(make, [dout, w, input_size]) for Conv2DTranspose: stride 1 and 2 (a last row and column
    no window covers), dilation and groups, in chunks (the 32-channel 16x16 case), float32 and float64."""
    routes = [  # (input_size, w shape, keywords)
        ((8, 32, 16, 16), (32, 32, 3, 3), dict(pad_mode="pad", pad=1)),
        ((3, 4, 10, 8), (6, 4, 3, 3), dict(pad_mode="valid", stride=2)),
        ((2, 4, 10, 9), (6, 2, 3, 2), dict(pad_mode="same", stride=(2, 3), dilation=(1, 2), group=2)),
    ]
    out = []
    for dtype in (numpy.float32, numpy.float64):
        for size, w_shape, kwargs in routes:
            conv = Conv2D(w_shape[0], w_shape[2:], **kwargs)
            (oh, ow), _ = conv.geometry(size)
            make = (lambda o, k, kw, s: lambda: lambda d, w: Conv2DTranspose(o, k, **kw)(d, w, s))(
                w_shape[0], w_shape[2:], kwargs, size)
            dout = rng.standard_normal((size[0], w_shape[0], oh, ow)).astype(dtype)
            w = (rng.standard_normal(w_shape) / numpy.sqrt(numpy.prod(w_shape[1:]))).astype(dtype)
            out.append((make, [dout, w]))
    return out
