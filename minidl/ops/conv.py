"""Conv2D: 2-D cross-correlation over NCHW inputs, by im2col and one large GEMM.

Layout. The column matrix is built channel-major, ``col[(c, i, j), (n, oh, q)]``, so the
forward is a single ``w2 @ col`` GEMM with an (O, K) x (K, N*OH*Q) shape: one large
matrix for BLAS instead of N small ones (batched per-image GEMMs measured up to 2.5x
slower on the 8x8 ResNet-20 stage). The (O, N, ...) result then needs one transposing copy
to NCHW, which costs output size only, and doubles as the crop described next.

Stride 1 (every 3x3 ResNet conv) uses "flat rows": the padded image is viewed as one long
row per (n, c), and the window at kernel offset (i, j) is the contiguous run that starts at
``i*dh*Wp + j*dw``, so ``q`` runs over the whole padded width Wp instead of OW. The last
``(kw-1)*dw`` columns of each output row are then garbage (they read across a row end) and
are dropped, but im2col and col2im copy contiguous runs of OH*Wp elements instead of
OW-element pieces, which is what makes them memory-bandwidth bound rather than loop bound.
Other strides use the plain 6-D ``as_strided`` window view.

A 1x1, stride-1, unpadded convolution is a pure GEMM on the input as it lies: no im2col.
"""
from ..backend import get_array_module
from ..tensor import is_grad_enabled
from .primitive import Primitive

_PAD_MODES = ("valid", "same", "pad")


def _as_strided(xp, a, shape, strides):
    return xp.lib.stride_tricks.as_strided(a, shape=shape, strides=strides)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _pair(op, arg, value, allow_nchw4=False):
    """An int, a pair, or (MindSpore style) a (1, 1, h, w) 4-tuple, as a pair of positive ints."""
    v = value
    if _is_int(v):
        v = (v, v)
    elif isinstance(v, (tuple, list)) and len(v) == 4 and allow_nchw4 and tuple(v[:2]) == (1, 1):
        v = tuple(v[2:])
    if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(_is_int(e) and e >= 1 for e in v):
        extra = " or a (1, 1, h, w) tuple" if allow_nchw4 else ""
        raise ValueError(f"{op}: {arg} must be a positive int, a pair of positive ints{extra}, got {value!r}")
    return tuple(v)


def _pad_mode(op, pad_mode, allowed):
    mode = pad_mode.lower() if isinstance(pad_mode, str) else pad_mode
    if mode not in allowed:
        raise ValueError(f"{op}: pad_mode must be one of {allowed} (case-insensitive), got {pad_mode!r}")
    return mode


def _window_axis(op, size, k, s, d, mode, pad_lo, pad_hi, what):
    """(out, pad_lo, pad_hi) along one spatial axis; 'same' pads TF-style (extra at the end)."""
    ek = (k - 1) * d + 1  # extent of a dilated kernel
    if mode == "same":
        out = -(-size // s)
        total = max((out - 1) * s + ek - size, 0)
        pad_lo, pad_hi = total // 2, total - total // 2
    else:
        out = (size + pad_lo + pad_hi - ek) // s + 1
    if out < 1:
        raise ValueError(f"{op}: {what}: the input is too small for the window (kernel {k}, dilation {d}, "
                         f"stride {s}, padding ({pad_lo}, {pad_hi}) along an axis of size {size}); "
                         f"the output would have size {max(out, 0)}")
    return out, pad_lo, pad_hi


def _pad(xp, x, pt, pb, pl, pr, fill=0, extra_rows=0):
    """x (N, C, H, W) inside a ``fill``-valued (N, C, H+pt+pb+extra_rows, W+pl+pr) array."""
    n, c, h, w = x.shape
    out = xp.empty((n, c, h + pt + pb + extra_rows, w + pl + pr), dtype=x.dtype)
    # Only the border is filled: writing the whole buffer first would double the traffic.
    out[:, :, :pt] = fill
    out[:, :, pt + h:] = fill
    out[:, :, pt:pt + h, :pl] = fill
    out[:, :, pt:pt + h, pl + w:] = fill
    out[:, :, pt:pt + h, pl:pl + w] = x
    return out


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
        o, kh, kw = self.out_channel, *self.kernel_size
        (sh, sw), (dh, dw), g = self.stride, self.dilation, self.group
        pt, pb, pl, pr = self.pad
        oh, pt, pb = _window_axis(self.name, h, kh, sh, dh, self.pad_mode, pt, pb, f"x of shape {tuple(x.shape)}")
        ow, pl, pr = _window_axis(self.name, wd, kw, sw, dw, self.pad_mode, pl, pr, f"x of shape {tuple(x.shape)}")
        self.geometry = (n, c, h, wd, oh, ow, pt, pb, pl, pr)
        keep = is_grad_enabled()
        self.w = w if keep else None
        w3 = w.reshape(g, o // g, -1)
        if kh == kw == sh == sw == 1 and not any((pt, pb, pl, pr)):
            # 1x1 stride 1: already a (C, H*W) matrix per image; batched GEMM, no copies.
            self.layout = "direct"
            self.col = x if keep else None
            y = xp.matmul(w3, x.reshape(n, g, c // g, h * wd))
            return y.reshape(n, o, h, wd)
        col, self.q, self.layout = self._im2col(xp, x, oh, ow)
        self.col = col if keep else None
        y = xp.matmul(w3, col.reshape(g, col.shape[0] // g, -1))  # (G, O/G, N*OH*Q)
        y = y.reshape(o, n, oh, self.q)[..., :ow]
        return xp.ascontiguousarray(y.transpose(1, 0, 2, 3))

    def _im2col(self, xp, x, oh, ow):
        """Returns col (C*kh*kw, N*OH*Q), C-major, Q (the row length of its output grid), the layout."""
        n, c, h, wd, _, _, pt, pb, pl, pr = self.geometry
        kh, kw = self.kernel_size
        (sh, sw), (dh, dw) = self.stride, self.dilation
        if sh == sw == 1:
            # One spare row keeps the last garbage run of the flat view inside the buffer.
            xpad = _pad(xp, x, pt, pb, pl, pr, extra_rows=1)
            wp = xpad.shape[3]
            s_n, s_c, s_h, e = xpad.strides
            view = _as_strided(xp, xpad, (c, kh, kw, n, oh * wp), (s_c, dh * s_h, dw * e, s_n, e))
            return xp.ascontiguousarray(view).reshape(c * kh * kw, -1), wp, "flat"
        xpad = _pad(xp, x, pt, pb, pl, pr) if any((pt, pb, pl, pr)) else x
        s_n, s_c, s_h, s_w = xpad.strides
        view = _as_strided(xp, xpad, (c, kh, kw, n, oh, ow), (s_c, dh * s_h, dw * s_w, s_n, sh * s_h, sw * s_w))
        return xp.ascontiguousarray(view).reshape(c * kh * kw, -1), ow, "strided"

    def backward(self, gy):
        xp = get_array_module(gy)
        n, c, h, wd, oh, ow, pt, pb, pl, pr = self.geometry
        o, g = self.out_channel, self.group
        need_x, need_w = self.needs_grad
        gx = gw = None
        if self.layout == "direct":
            gy3 = gy.reshape(n, g, o // g, h * wd)
            if need_w:
                x3 = self.col.reshape(n, g, c // g, h * wd)
                gw = xp.matmul(gy3, x3.swapaxes(-1, -2)).sum(axis=0).reshape(o, c // g, 1, 1)
            if need_x:
                w3 = self.w.reshape(g, o // g, c // g)
                gx = xp.matmul(w3.swapaxes(-1, -2), gy3).reshape(n, c, h, wd)
            return gx, gw
        q = self.q
        if q == ow:
            gyt = xp.ascontiguousarray(gy.transpose(1, 0, 2, 3))
        else:
            # Zeros in the garbage columns: they keep gw exact and make col2im add nothing there.
            gyt = xp.zeros((o, n, oh, q), dtype=gy.dtype)
            gyt[..., :ow] = gy.transpose(1, 0, 2, 3)
        gyt = gyt.reshape(g, o // g, -1)
        if need_w:
            col = self.col.reshape(g, self.col.shape[0] // g, -1)
            gw = xp.matmul(gyt, col.swapaxes(-1, -2)).reshape((o, c // g) + self.kernel_size)
        if need_x:
            w3 = self.w.reshape(g, o // g, -1)
            gcol = xp.matmul(w3.swapaxes(-1, -2), gyt)  # (G, K/G, N*OH*Q)
            gx = self._col2im(xp, gcol.reshape(c, *self.kernel_size, n, oh, q))
        return gx, gw

    def _col2im(self, xp, gcol):
        """Adds the columns back onto the image, looping over the kh*kw kernel offsets only."""
        n, c, h, wd, oh, ow, pt, pb, pl, pr = self.geometry
        kh, kw = self.kernel_size
        (sh, sw), (dh, dw) = self.stride, self.dilation
        # Channel-major, like gcol: the final transposing copy to NCHW also drops the padding.
        if self.layout == "flat":
            wp = self.q
            hp = h + pt + pb + 1
            gpad = xp.zeros((c, n, hp * wp), dtype=gcol.dtype)
            run = oh * wp
            for i in range(kh):
                for j in range(kw):
                    off = i * dh * wp + j * dw
                    gpad[:, :, off:off + run] += gcol[:, i, j].reshape(c, n, run)
            gpad = gpad.reshape(c, n, hp, wp)
        else:
            gpad = xp.zeros((c, n, h + pt + pb, wd + pl + pr), dtype=gcol.dtype)
            for i in range(kh):
                for j in range(kw):
                    gpad[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw] += gcol[:, i, j]
        return xp.ascontiguousarray(gpad[:, :, pt:pt + h, pl:pl + wd].transpose(1, 0, 2, 3))


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
