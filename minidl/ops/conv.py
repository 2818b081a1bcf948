"""Conv2D: 2-D cross-correlation over NCHW inputs, by im2col and GEMM.

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

Strides. An ungrouped, undilated strided conv whose kernel splits into stride phases
without zero taps (1x1 strided, 2x2 stride 2) is rewritten as a stride-1 one over the
stride phases of x (space-to-depth, ``_Phases``). Other strided convs use the plain 6-D
``as_strided`` window view.

Chunks. On the CPU the batch goes through in chunks of images whose columns, those of all
threads' chunks together, fit in the last-level cache (``_CACHE_BYTES``); padding, im2col and
GEMM of a chunk then stay in cache,
which halved the time of the 16- and 32-channel convs against one whole-batch im2col. The
chunks run on ``minidl.get_num_threads()`` threads, each with its own buffers and a
single-threaded BLAS (minidl/_intra_op.py), so the copies use every core too. No column
matrix is saved: backward keeps x and rebuilds what it needs. On a GPU the chunks run on
one thread and are bounded for memory, not cache: a chunk's column matrix stays under
``im2col.gpu_im2col_bytes()`` (256 MiB, or $MINIDL_GPU_IM2COL_BYTES), where a whole-batch one
could exhaust the device's memory; and every column matrix there is a plain contiguous
buffer (no padded row pitch), which CuPy's matmul would otherwise copy before the GEMM.

Backward (stride 1). gx is gy correlated with the flipped kernel: the forward path again.
gw comes from the same columns of gy (offset (kh-1-i, kw-1-j) of gy meets offset (i, j)
of x), so x needs no second im2col. Strided convs left on the 6-D view use gy @ columns
for gw and column gradients + col2im (a loop over the kh*kw offsets only) for gx. 1x1,
stride-1, unpadded convs (strided 1x1 ones after their phase split, a subsampling) are
pure GEMMs on the input as it lies.
"""
from .. import _intra_op as intra_op
from ..backend import get_array_module
from ..tensor import is_grad_enabled
from .primitive import Primitive
from .im2col import _PAD_MODES, _is_int, _pair, _pad_mode, _window_axis, _Windows, _correlate, _Phases
from . import winograd


class Conv2D(Primitive):
    """2-D convolution (cross-correlation) of x (N, C, H, W) with w (out_channel, C/group, kh, kw).

    Args:
        out_channel: output channels; must equal w.shape[0].
        kernel_size: int or (kh, kw); must match w.shape[2:].
        mode: 1 (cross-correlation), the only mode MindSpore defines.
        pad_mode: 'valid' (no padding), 'same' (output = ceil(input / stride); any odd pixel of
            padding goes to the bottom/right, as TensorFlow and MindSpore do) or 'pad' (``pad``).
        pad: int or (top, bottom, left, right); non-zero only with pad_mode='pad'.
        stride: int, (sh, sw) or (1, 1, sh, sw).
        dilation: int, (dh, dw) or (1, 1, dh, dw).
        group: input and output channels are split into this many independent groups.
        data_format: 'NCHW' only.

    Example:
        >>> conv = ops.Conv2D(8, 3, pad_mode="pad", pad=1)
        >>> conv(Tensor(np.ones((2, 3, 5, 5), np.float32)), Tensor(np.ones((8, 3, 3, 3), np.float32))).shape
        (2, 8, 5, 5)
    """

    n_inputs = 2

    def __init__(self, out_channel, kernel_size, mode=1, pad_mode="valid", pad=0, stride=1, dilation=1,
                 group=1, data_format="NCHW"):
        super().__init__()
        op = "Conv2D"
        if not _is_int(out_channel) or out_channel < 1:
            raise ValueError(f"{op}: out_channel must be a positive int, got {out_channel!r}")
        if mode != 1:
            raise ValueError(f"{op}: mode must be 1 (cross-correlation), got {mode!r}")
        if not _is_int(group) or group < 1:
            raise ValueError(f"{op}: group must be a positive int, got {group!r}")
        if out_channel % group:
            raise ValueError(f"{op}: out_channel={out_channel} must be divisible by group={group}")
        if data_format != "NCHW":
            raise ValueError(f"{op}: data_format={data_format!r} is not supported; only 'NCHW' is")
        self.out_channel = out_channel
        self.kernel_size = _pair(op, "kernel_size", kernel_size)
        self.stride = _pair(op, "stride", stride, allow_nchw4=True)
        self.dilation = _pair(op, "dilation", dilation, allow_nchw4=True)
        self.pad_mode = _pad_mode(op, pad_mode, _PAD_MODES)
        if _is_int(pad):
            pads = (pad,) * 4
        elif isinstance(pad, (tuple, list)) and len(pad) == 4:
            pads = tuple(pad)
        else:
            raise ValueError(f"{op}: pad must be an int or a (top, bottom, left, right) tuple, got {pad!r}")
        if not all(_is_int(p) and p >= 0 for p in pads):
            raise ValueError(f"{op}: pad values must be non-negative ints, got {pad!r}")
        if self.pad_mode != "pad" and any(pads):
            raise ValueError(f"{op}: pad={pad!r} needs pad_mode='pad', got pad_mode={pad_mode!r}")
        self.pad = pads
        self.group = group
        self.mode = mode
        self.data_format = data_format

    def _check(self, x, w):
        op, g = self.name, self.group
        if x.ndim != 4:
            raise ValueError(f"{op}: x must be 4-D (N, C, H, W), got shape {tuple(x.shape)}")
        if w.ndim != 4:
            raise ValueError(f"{op}: w must be 4-D (out_channel, C/group, kh, kw), got shape {tuple(w.shape)}")
        c = x.shape[1]
        if c % g:
            raise ValueError(f"{op}: x of shape {tuple(x.shape)} has {c} channels, not divisible by group={g}")
        want = (self.out_channel, c // g) + self.kernel_size
        if tuple(w.shape) != want:
            raise ValueError(f"{op}: w of shape {tuple(w.shape)} does not fit x of shape {tuple(x.shape)}: expected "
                             f"{want} (out_channel={self.out_channel}, C/group={c}/{g}, "
                             f"kernel_size={self.kernel_size})")
        if x.dtype != w.dtype:
            raise TypeError(f"{op}: x has dtype {x.dtype} but w has dtype {w.dtype}; cast one of them")

    def forward(self, x, w):
        self._check(x, w)
        xp = get_array_module(x, w)
        n, c, h, wd = x.shape
        o, g, (kh, kw), (sh, sw), (dh, dw) = self.out_channel, self.group, self.kernel_size, self.stride, self.dilation
        pt, pb, pl, pr = self.pad
        where = f"x of shape {tuple(x.shape)}"
        oh, pt, pb = _window_axis(self.name, h, kh, sh, dh, self.pad_mode, pt, pb, where)
        ow, pl, pr = _window_axis(self.name, wd, kw, sw, dw, self.pad_mode, pl, pr, where)
        keep = is_grad_enabled()
        self.phases = self.wino = None
        if winograd.applies(xp, x.dtype, (kh, kw), (sh, sw), (dh, dw), g, (pt, pb, pl, pr), (c, o)):
            self.wino = winograd.Winograd3x3(x.shape, (pt, pb, pl, pr), (oh, ow))
            return self.wino.forward(xp, x, w, keep)
        if (sh, sw) != (1, 1) and g == 1 and (dh, dw) == (1, 1) and _Phases.exact(self.kernel_size, self.stride):
            # Strided: the same convolution at stride 1 over the stride phases of x (see _Phases).
            self.phases = _Phases(x.shape, self.kernel_size, self.stride, (pt, pl), (oh, ow))
            x, w = self.phases.split_x(xp, x), self.phases.split_w(xp, w)
            n, c, h, wd = x.shape
            (kh, kw), (sh, sw), (pt, pb, pl, pr) = w.shape[2:], (1, 1), (0, 0, 0, 0)
        self.w = w if keep else None
        if kh == kw == sh == sw == 1 and not any((pt, pb, pl, pr)):
            # 1x1 stride 1: already a (C, H*W) matrix per image; batched GEMM, no copies.
            self.win, self.x = None, (x if keep else None)
            return xp.matmul(w.reshape(g, o // g, c // g), x.reshape(n, g, c // g, h * wd)).reshape(n, o, h, wd)
        self.win = _Windows(x.shape, (kh, kw), (sh, sw), (dh, dw), (pt, pb, pl, pr), (oh, ow))
        self.x = x if keep else None  # backward rebuilds the columns from x, chunk by chunk
        return _correlate(xp, x, w, self.win, g)

    def backward(self, gy):
        xp = get_array_module(gy)
        if self.wino is not None:
            return self.wino.backward(xp, gy, *self.needs_grad)
        gx, gw = self._backward(xp, gy)
        if self.phases is not None:
            gx = None if gx is None else self.phases.merge_x(xp, gx)
            gw = None if gw is None else self.phases.merge_w(xp, gw)
        return gx, gw

    def _backward(self, xp, gy):
        need_x, need_w = self.needs_grad
        w, win, g = self.w, self.win, self.group
        o, cg = w.shape[:2]
        if win is None:  # 1x1 stride 1
            n, c, h, wd = self.x.shape
            gy3 = gy.reshape(n, g, o // g, h * wd)
            gw = gx = None
            if need_w:
                x3 = self.x.reshape(n, g, cg, h * wd)
                gw = xp.matmul(gy3, x3.swapaxes(-1, -2)).sum(axis=0).reshape(w.shape)
            if need_x:
                gx = xp.matmul(w.reshape(g, o // g, cg).swapaxes(-1, -2), gy3).reshape(n, c, h, wd)
            return gx, gw
        if need_x and win.flat:
            return self._grads_by_correlation(xp, gy, need_w)
        n, c, oh, ow, q = win.n, win.c, win.oh, win.ow, win.q
        k = win.k
        chunks, threads = win.chunking(xp, gy.dtype)
        nb = max(n1 - n0 for n0, n1 in chunks)
        w3 = w.reshape(g, o // g, -1)
        gx = xp.empty((n, c, win.h, win.w), dtype=gy.dtype) if need_x else None

        def run(t):  # the chunks of thread t (see _correlate); returns its part of gw, transposed
            xpad, cols = win.buffers(xp, gy.dtype, nb)
            # Zeros in the garbage columns of flat rows keep gw exact. Q is the innermost axis, so
            # those columns sit at the same buffer positions in every chunk: zeroing once suffices.
            gys = (xp.zeros if q != ow else xp.empty)(o * nb * oh * q, dtype=gy.dtype)
            gw_t = xp.zeros((g, k // g, o // g), dtype=gy.dtype) if need_w else None
            for n0, n1 in chunks[t::threads]:
                m = (n1 - n0) * oh * q
                gyt = gys[:o * m].reshape(o, n1 - n0, oh, q)
                gyt[..., :ow] = gy[n0:n1].transpose(1, 0, 2, 3)
                gyt = gyt.reshape(g, o // g, m)
                if need_w:
                    col = win.columns(xp, self.x, n0, n1, xpad, cols).reshape(g, -1, m)
                    # (K, m) @ (m, O): BLAS measured this orientation ~1.7x faster than (O, m) @ (m, K).
                    gw_t += xp.matmul(col, gyt.swapaxes(-1, -2))
                if need_x:
                    gcol = xp.matmul(w3.swapaxes(-1, -2), gyt)  # (G, K/G, m), one chunk: cache-sized
                    gx[n0:n1] = win.col2im(xp, gcol.reshape((c,) + self.kernel_size + (n1 - n0, oh, q)))
            return gw_t

        parts = intra_op.parallel_map(run, threads)
        gw = None
        if need_w:
            for part in parts[1:]:
                parts[0] += part
            gw = parts[0].swapaxes(-1, -2).reshape(w.shape)
        return gx, gw

    def _grads_by_correlation(self, xp, gy, need_w):
        """Stride 1: gx, and gw if needed, from one pass over the columns of gy.

        gx is gy correlated with w flipped in space and transposed per group, gy padded so
        each input pixel sees every window that covered it: the forward path again. It
        measured about 2x faster than a K x O by O x (N*OH*Q) GEMM into column gradients
        followed by col2im. And since gy's columns at kernel offset (kh-1-i, kw-1-j) line up
        with x at offset (i, j), ``gw[o, c, i, j] = sum_m colgy[(o, kh-1-i, kw-1-j), m] *
        x[c, m]``: one more GEMM on columns already in cache, instead of an im2col of x.
        """
        win, g, w = self.win, self.group, self.w
        o, cg, kh, kw = w.shape
        dh, dw = self.dilation
        pt, pb, pl, pr = win.pads
        eh, ew = (kh - 1) * dh, (kw - 1) * dw
        w_t = w.reshape(g, o // g, cg, kh, kw)[..., ::-1, ::-1].swapaxes(1, 2).reshape(g * cg, o // g, kh, kw)
        pads = (eh - pt, eh - pb, ew - pl, ew - pr)
        back = _Windows(gy.shape, (kh, kw), (1, 1), (dh, dw), pads, (win.h, win.w))
        out = _correlate(xp, gy, xp.ascontiguousarray(w_t), back, g, times=self.x if need_w else None)
        if not need_w:
            return out, None
        gx, acc = out  # acc: (G, O/G * kh * kw, C/G), rows (o, kh-1-i, kw-1-j)
        gw = acc.reshape(g, o // g, kh, kw, cg)[:, :, ::-1, ::-1].transpose(0, 1, 4, 2, 3)
        return gx, xp.ascontiguousarray(gw).reshape(w.shape)


def conv2d(x, w, stride=1, pad_mode="valid", padding=0, dilation=1, groups=1):
    """Functional Conv2D; the output channels and kernel size are read from w.

    Example:
        >>> ops.conv2d(x, w, stride=2, pad_mode="same")
    """
    shape = tuple(getattr(w, "shape", ()))
    if len(shape) != 4:
        raise ValueError(f"conv2d: w must be 4-D (out_channel, C/groups, kh, kw), got shape {shape}")
    return Conv2D(shape[0], shape[2:], pad_mode=pad_mode, pad=padding, stride=stride, dilation=dilation,
                  group=groups)(x, w)


__all__ = ["Conv2D", "conv2d"]
