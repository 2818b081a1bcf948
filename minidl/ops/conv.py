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

Conv2DTranspose (the input gradient of a Conv2D, as an op of its own) is a readable
reference on the same building blocks: forward is w^T times dout's rows and a col2im onto
the image (_Windows.col2im); backward is a Conv2D forward of the output gradient
(_correlate) and, from the same columns, the weight gradient (_correlate's ``times``).
"""
import numbers

from .. import _intra_op as intra_op
from ..backend import get_array_module
from ..tensor import is_grad_enabled
from .primitive import Primitive
from .manipulation import pad
from .linalg import BiasAdd
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
        _set_conv_attrs(self, "Conv2D", out_channel, kernel_size, mode, pad_mode, pad, stride, dilation, group,
                        data_format)

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


def _set_conv_attrs(prim, op, out_channel, kernel_size, mode, pad_mode, pad, stride, dilation, group, data_format):
    """Checks and stores the attributes Conv2D and Conv2DTranspose share (MindSpore's names)."""
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
    prim.out_channel = out_channel
    prim.kernel_size = _pair(op, "kernel_size", kernel_size)
    prim.stride = _pair(op, "stride", stride, allow_nchw4=True)
    prim.dilation = _pair(op, "dilation", dilation, allow_nchw4=True)
    prim.pad_mode = _pad_mode(op, pad_mode, _PAD_MODES)
    if _is_int(pad):
        pads = (pad,) * 4
    elif isinstance(pad, (tuple, list)) and len(pad) == 4:
        pads = tuple(pad)
    else:
        raise ValueError(f"{op}: pad must be an int or a (top, bottom, left, right) tuple, got {pad!r}")
    if not all(_is_int(p) and p >= 0 for p in pads):
        raise ValueError(f"{op}: pad values must be non-negative ints, got {pad!r}")
    if prim.pad_mode != "pad" and any(pads):
        raise ValueError(f"{op}: pad={pad!r} needs pad_mode='pad', got pad_mode={pad_mode!r}")
    prim.pad = pads
    prim.group = group
    prim.mode = mode
    prim.data_format = data_format


class Conv2DTranspose(Primitive):
    """2-D transposed convolution: the gradient of a Conv2D with respect to its input, as an op.

    ``op(dout, w, input_size)`` spreads each pixel of dout, times w, over the window it came
    from in an image of shape ``input_size``: the adjoint of ``Conv2D(out_channel, kernel_size,
    ...)(x, w)`` for x of that shape. Upsampling layers (nn.Conv2dTranspose) use it. The
    attributes describe that Conv2D, as in MindSpore (which spells the same op
    Conv2DBackpropInput): out_channel is dout's channels, the output has w.shape[1] * group.

    Args:
        out_channel: the Conv2D's output channels: dout's channels and w.shape[0].
        kernel_size, pad_mode, pad, mode, stride, dilation, group, data_format: the Conv2D's,
            as ops.Conv2D takes them ('same' pads are computed from input_size).
        pad_list: (top, bottom, left, right), or None; replaces pad with pad_mode='pad'
            (MindSpore's primitive takes it; nn layers never need it).

    Inputs:
        dout: (N, out_channel, H, W).
        w: (out_channel, C / group, kh, kw).
        input_size: (N, C, Hi, Wi), the output's shape; the Conv2D must map (Hi, Wi) to (H, W).

    Example:
        >>> up = ops.Conv2DTranspose(out_channel=8, kernel_size=3, pad_mode="pad", pad=1, stride=2)
        >>> up(Tensor(np.ones((2, 8, 4, 4))), Tensor(np.ones((8, 3, 3, 3))), (2, 3, 8, 8)).shape
        (2, 3, 8, 8)
    """

    n_inputs = 3
    n_tensor_inputs = 2  # dout and w; input_size is a shape

    def __init__(self, out_channel, kernel_size, pad_mode="valid", pad=0, pad_list=None, mode=1, stride=1,
                 dilation=1, group=1, data_format="NCHW"):
        super().__init__()
        op = "Conv2DTranspose"
        _set_conv_attrs(self, op, out_channel, kernel_size, mode, pad_mode, pad, stride, dilation, group, data_format)
        if pad_list is not None:
            if (not isinstance(pad_list, (tuple, list)) or len(pad_list) != 4
                    or not all(_is_int(p) and p >= 0 for p in pad_list)):
                raise ValueError(f"{op}: pad_list must be None or (top, bottom, left, right) non-negative ints, "
                                 f"got {pad_list!r}")
            if self.pad_mode != "pad":
                raise ValueError(f"{op}: pad_list={pad_list!r} needs pad_mode='pad', got pad_mode={pad_mode!r}")
            self.pad = tuple(pad_list)

    def _check(self, dout, w, input_size):
        """input_size as a tuple, after checking that dout, w and it describe one Conv2D."""
        op, g = self.name, self.group
        if (not isinstance(input_size, (tuple, list))
                or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in input_size)):
            raise TypeError(f"{op}: input_size must be a tuple of 4 ints (N, C, H, W), got {input_size!r}")
        size = tuple(int(v) for v in input_size)
        if len(size) != 4 or min(size) < 1:
            raise ValueError(f"{op}: input_size must be 4 positive ints (N, C, H, W), got {input_size!r}")
        if dout.ndim != 4:
            raise ValueError(f"{op}: dout must be 4-D (N, out_channel, H, W), got shape {tuple(dout.shape)}")
        if w.ndim != 4:
            raise ValueError(f"{op}: w must be 4-D (out_channel, C/group, kh, kw), got shape {tuple(w.shape)}")
        n, c = size[:2]
        if c % g:
            raise ValueError(f"{op}: input_size={size} has {c} channels, not divisible by group={g}")
        want = (self.out_channel, c // g) + self.kernel_size
        if tuple(w.shape) != want:
            raise ValueError(f"{op}: w of shape {tuple(w.shape)} does not fit input_size={size}: expected {want} "
                             f"(out_channel={self.out_channel}, C/group={c}/{g}, kernel_size={self.kernel_size})")
        if tuple(dout.shape[:2]) != (n, self.out_channel):
            raise ValueError(f"{op}: dout of shape {tuple(dout.shape)} must have N={n} (input_size[0]) and "
                             f"out_channel={self.out_channel} channels")
        if dout.dtype != w.dtype:
            raise TypeError(f"{op}: dout has dtype {dout.dtype} but w has dtype {w.dtype}; cast one of them")
        return size

    def forward(self, dout, w, input_size):
        size = self._check(dout, w, input_size)
        xp = get_array_module(dout, w)
        n, c, h, wd = size
        o, g, (kh, kw), (sh, sw), (dh, dw) = self.out_channel, self.group, self.kernel_size, self.stride, self.dilation
        pt, pb, pl, pr = self.pad
        where = f"input_size {size}"
        oh, pt, pb = _window_axis(self.name, h, kh, sh, dh, self.pad_mode, pt, pb, where)
        ow, pl, pr = _window_axis(self.name, wd, kw, sw, dw, self.pad_mode, pl, pr, where)
        if (oh, ow) != tuple(dout.shape[2:]):
            raise ValueError(f"{self.name}: dout of shape {tuple(dout.shape)} does not fit input_size={size}: the "
                             f"Conv2D (kernel_size={self.kernel_size}, stride={self.stride}, dilation={self.dilation}, "
                             f"pad_mode={self.pad_mode!r}, pad={self.pad}) maps {(h, wd)} to {(oh, ow)}, "
                             f"not {tuple(dout.shape[2:])}")
        # The bottom/right padding the windows really reach: less than the Conv2D's by the rows
        # its stride left unread, negative where the windows stop short of the image's end
        # (those rows of the output get nothing: zeros).
        pb = (oh - 1) * sh + (kh - 1) * dh + 1 - pt - h
        pr = (ow - 1) * sw + (kw - 1) * dw + 1 - pl - wd
        win = _Windows(size, (kh, kw), (sh, sw), (dh, dw), (pt, pb, pl, pr), (oh, ow))
        keep = is_grad_enabled()
        self.win = win
        self.dout, self.w = (dout, w) if keep else (None, None)
        # Conv2D's forward multiplies w (O, K) by x's columns (K, m); its adjoint multiplies
        # w^T (K, O) by dout's rows (O, m), giving the output's columns, which col2im sums back
        # onto the image. Chunks of images keep the columns as large as Conv2D's own.
        y = xp.empty(size, dtype=dout.dtype)
        w3t = w.reshape(g, o // g, -1).swapaxes(1, 2)  # (G, C/G*kh*kw, O/G)
        chunks, _ = win.chunking(xp, dout.dtype)
        for n0, n1 in chunks:
            rows = dout[n0:n1].transpose(1, 0, 2, 3).reshape(g, o // g, -1)  # (G, O/G, n*H*W)
            cols = xp.matmul(w3t, rows)
            y[n0:n1] = win.col2im(xp, cols.reshape((c, kh, kw, n1 - n0, oh, ow)))
        return y

    def backward(self, gy):
        # dout's gradient is the Conv2D's forward of gy; w's is the correlation of gy's windows
        # with dout: Conv2D's weight gradient with gy as its input and dout as its output
        # gradient, taken from the same columns of gy (_correlate's ``times``).
        xp = get_array_module(gy)
        need_dout, need_w = self.needs_grad[:2]
        if not need_w:
            return _correlate(xp, gy, self.w, self.win, self.group), None, None
        # (When only w needs a gradient the forward GEMM is wasted; a first decoder layer fed
        # by a constant pays one extra conv.)
        gdout, acc = _correlate(xp, gy, self.w, self.win, self.group, times=self.dout)
        gw = xp.ascontiguousarray(acc.swapaxes(-1, -2)).reshape(self.w.shape)  # acc: (G, C/G*kh*kw, O/G)
        return (gdout if need_dout else None), gw, None

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


def _two(op, arg, value, low):
    """An int or a pair of ints >= low, as a pair."""
    v = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(v) != 2 or not all(_is_int(e) and e >= low for e in v):
        raise ValueError(f"{op}: {arg} must be an int or a pair of ints >= {low}, got {value!r}")
    return v


def conv_transpose2d(input, weight, bias=None, stride=1, padding=0, output_padding=0, groups=1, dilation=1):
    """Functional transposed convolution with MindSpore 2.10's (and PyTorch's) signature.

    Output size per axis: ``(H - 1) * stride - 2 * padding + dilation * (k - 1) + output_padding + 1``,
    values as torch.nn.functional.conv_transpose2d.

    Args:
        input: (N, C_in, H, W).
        weight: (C_in, C_out / groups, kh, kw).
        bias: None or (C_out,).
        stride, padding, dilation: int or (h, w) pair.
        output_padding: int or pair, extra rows/columns at the bottom/right; less than stride
            or, where dilation > stride, than dilation (as PyTorch and MindSpore).
        groups: channel groups; C_in must be divisible by it.

    Example:
        >>> ops.conv_transpose2d(Tensor(np.ones((1, 4, 5, 5))), Tensor(np.ones((4, 8, 3, 3)))).shape
        (1, 8, 7, 7)
    """
    op = "conv_transpose2d"
    shape, wshape = tuple(getattr(input, "shape", ())), tuple(getattr(weight, "shape", ()))
    if len(shape) != 4:
        raise ValueError(f"{op}: input must be 4-D (N, C_in, H, W), got shape {shape}")
    if len(wshape) != 4:
        raise ValueError(f"{op}: weight must be 4-D (C_in, C_out/groups, kh, kw), got shape {wshape}")
    if not _is_int(groups) or groups < 1:
        raise ValueError(f"{op}: groups must be a positive int, got {groups!r}")
    s, d = _two(op, "stride", stride, 1), _two(op, "dilation", dilation, 1)
    p, extra = _two(op, "padding", padding, 0), _two(op, "output_padding", output_padding, 0)
    if shape[1] != wshape[0] or shape[1] % groups:
        raise ValueError(f"{op}: input of shape {shape} has {shape[1]} channels; weight of shape {wshape} needs "
                         f"C_in = weight.shape[0] = {wshape[0]}, divisible by groups={groups}")
    for a in range(2):
        if extra[a] >= max(s[a], d[a]):
            raise ValueError(f"{op}: output_padding={output_padding!r} must be smaller than stride={stride!r} or "
                             f"dilation={dilation!r}")
    size = [shape[0], wshape[1] * groups]
    for a in range(2):
        size.append((shape[2 + a] - 1) * s[a] - 2 * p[a] + d[a] * (wshape[2 + a] - 1) + extra[a] + 1)
    if min(size[2:]) < 1:
        raise ValueError(f"{op}: input of shape {shape} gives an empty output {tuple(size)}: padding={padding!r} "
                         f"is too large")
    prim = Conv2DTranspose(wshape[0], wshape[2:], pad_mode="pad", pad=(p[0], p[0], p[1], p[1]), stride=s,
                           dilation=d, group=groups)
    y = transpose_with_output_padding(prim, input, weight, tuple(size), extra)
    return y if bias is None else BiasAdd()(y, bias)


def transpose_with_output_padding(prim, x, w, size, extra):
    """``prim`` (a Conv2DTranspose in 'pad' mode) on x and w to an output of ``size`` that has ``extra``
    output padding rows / columns at the bottom / right.

    An output_padding below the stride is the primitive's own business (the Conv2D it is the
    adjoint of maps ``size`` back to x's size). From the stride up (allowed where dilation >
    stride) no Conv2D maps ``size`` back, so it runs as a composite: the whole transposed
    convolution (no padding), cropped by the padding, with zero rows appended where the output
    reaches past it (no input touches them). Gradients come from the two primitives.
    """
    (sh, sw), pads = prim.stride, prim.pad
    if extra[0] < sh and extra[1] < sw:
        return prim(x, w, size)
    pt, pb, pl, pr = pads
    (kh, kw), (dh, dw) = prim.kernel_size, prim.dilation
    n, _, h, wd = x.shape
    whole = (n, size[1], (h - 1) * sh + (kh - 1) * dh + 1, (wd - 1) * sw + (kw - 1) * dw + 1)
    y = Conv2DTranspose(prim.out_channel, prim.kernel_size, pad_mode="valid", stride=prim.stride,
                        dilation=prim.dilation, group=prim.group)(x, w, whole)
    return pad(y, (-pl, extra[1] - pr, -pt, extra[0] - pb))


__all__ = ["Conv2D", "conv2d", "Conv2DTranspose", "conv_transpose2d"]
