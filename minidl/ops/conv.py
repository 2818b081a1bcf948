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

Chunks. On the CPU the batch goes through in chunks of images whose columns fit in the
last-level cache (``_CACHE_BYTES``); padding, im2col and GEMM of a chunk then stay in cache,
which halved the time of the 16- and 32-channel convs against one whole-batch im2col. No
column matrix is saved: backward keeps x and rebuilds what it needs. On a GPU one chunk
holds the whole batch.

Backward (stride 1). gx is gy correlated with the flipped kernel: the forward path again.
gw comes from the same columns of gy (offset (kh-1-i, kw-1-j) of gy meets offset (i, j)
of x), so x needs no second im2col. Strided convs left on the 6-D view use gy @ columns
for gw and column gradients + col2im (a loop over the kh*kw offsets only) for gx. 1x1,
stride-1, unpadded convs (strided 1x1 ones after their phase split, a subsampling) are
pure GEMMs on the input as it lies.
"""
import numpy

from ..backend import get_array_module
from ..tensor import is_grad_enabled
from .primitive import Primitive

_PAD_MODES = ("valid", "same", "pad")
_CACHE_BYTES = 4 << 20  # column bytes per chunk of images on the CPU (see _Windows.workspace)


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
        what = ("a positive int, a pair of positive ints or a (1, 1, h, w) tuple" if allow_nchw4
                else "a positive int or a pair of positive ints")
        raise ValueError(f"{op}: {arg} must be {what}, got {value!r}")
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


def _images_per_chunk(xp, n, column_bytes_per_image):
    """How many images share one im2col + GEMM step (see _Windows.workspace)."""
    if xp is not numpy:
        return n
    return max(1, min(n, _CACHE_BYTES // column_bytes_per_image))


class _Windows:
    """Where the windows of one convolution lie, and the im2col / col2im moves over them.

    ``flat`` (stride 1): flat rows, Q = Wp (see the module docstring); else Q = OW.
    """

    def __init__(self, x_shape, kernel, stride, dilation, pads, out_hw):
        self.n, self.c, self.h, self.w = x_shape
        self.kernel, self.stride, self.dilation, self.pads = kernel, stride, dilation, pads
        self.oh, self.ow = out_hw
        self.flat = stride == (1, 1)
        pl, pr = pads[2:]
        # Row pitch of the padding buffer. Flat rows share one zero gap between neighbouring
        # rows: the right padding of a row doubles as the left padding of the next (see the
        # module docstring), so every GEMM and im2col has max(pl, pr) garbage columns, not pl + pr.
        self.pitch = self.w + pl + pr
        if self.flat and pl >= 0 and pr >= 0 and min(pl, pr) <= (kernel[1] - 1) * dilation[1]:
            self.pitch = self.w + max(pl, pr)
        self.q = self.pitch if self.flat else self.ow
        self.k = self.c * kernel[0] * kernel[1]

    def workspace(self, xp, dtype):
        """Chunks of images and the buffers one chunk needs: (chunks, padded images, columns).

        The padding buffer's border is zeroed once; each chunk only rewrites its interior.
        """
        per_image = self.k * self.oh * self.q
        nb = _images_per_chunk(xp, self.n, per_image * dtype.itemsize)
        chunks = [(n0, min(n0 + nb, self.n)) for n0 in range(0, self.n, nb)]
        xpad = None
        if self.flat or any(self.pads):
            # Flat rows need one spare row: the garbage runs of the last row end inside it.
            rows = self.h + sum(self.pads[:2]) + (1 if self.flat else 0)
            xpad = xp.zeros((nb, self.c, rows, self.pitch), dtype=dtype)
        return chunks, xpad, xp.empty(per_image * nb, dtype=dtype)

    def columns(self, xp, x, n0, n1, xpad, buf):
        """Columns of images n0:n1, channel-major: (C*kh*kw, (n1-n0)*OH*Q), copied into buf."""
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        part = x[n0:n1]
        if xpad is not None:
            # A negative pad crops (the input-gradient correlation needs it when the forward
            # padding exceeds the kernel's reach).
            pt, pb, pl, pr = self.pads
            src = part[:, :, max(-pt, 0):self.h - max(-pb, 0), max(-pl, 0):self.w - max(-pr, 0)]
            t, l = max(pt, 0), max(pl, 0)
            part = xpad[:n1 - n0]
            part[:, :, t:t + src.shape[2], l:l + src.shape[3]] = src
        s_n, s_c, s_h, s_w = part.strides
        if self.flat:
            shape, strides = (self.c, kh, kw, n1 - n0, self.oh * self.q), (s_c, dh * s_h, dw * s_w, s_n, s_w)
        else:
            shape = (self.c, kh, kw, n1 - n0, self.oh, self.ow)
            strides = (s_c, dh * s_h, dw * s_w, s_n, sh * s_h, sw * s_w)
        col = buf[:self.k * (n1 - n0) * self.oh * self.q].reshape(shape)
        xp.copyto(col, _as_strided(xp, part, shape, strides))
        return col.reshape(self.k, -1)

    def col2im(self, xp, gcol):
        """Sums a chunk of column gradients (C, kh, kw, n, OH, OW) back onto its images.

        Strided windows only (stride 1 takes its input gradient by correlation). Loops over
        the kh*kw kernel offsets only; returns an (n, C, H, W) view with the padding cropped,
        for the caller to copy into gx.
        """
        assert not self.flat
        (kh, kw), (sh, sw), (dh, dw) = self.kernel, self.stride, self.dilation
        pt, pb, pl, pr = self.pads
        oh, ow = self.oh, self.ow
        gpad = xp.zeros((self.c, gcol.shape[3], self.h + pt + pb, self.w + pl + pr), dtype=gcol.dtype)
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
    """
    n, o, oh, ow, q = win.n, w.shape[0], win.oh, win.ow, win.q
    w3 = w.reshape(group, o // group, -1)
    y = xp.empty((n, o, oh, ow), dtype=x.dtype)
    chunks, xpad, cols = win.workspace(xp, x.dtype)
    per_chunk = cols.size // win.k
    outs = xp.empty(o * per_chunk, dtype=x.dtype)
    acc = None
    if times is not None:
        ct = times.shape[1]
        # Q is the innermost axis, so the garbage columns of flat rows sit at the same buffer
        # positions in every chunk: zeroed once, they stay zero and add nothing to acc.
        tbuf = (xp.zeros if q != ow else xp.empty)(ct * per_chunk, dtype=x.dtype)
        acc = xp.zeros((group, win.k // group, ct // group), dtype=x.dtype)
    for n0, n1 in chunks:
        col = win.columns(xp, x, n0, n1, xpad, cols)
        m = col.shape[1]
        col = col.reshape(group, -1, m)
        out = outs[:o * m].reshape(group, o // group, m)
        xp.matmul(w3, col, out=out)
        # One transposing copy to NCHW, which also drops the garbage columns of flat rows.
        y[n0:n1] = out.reshape(o, n1 - n0, oh, q)[..., :ow].transpose(1, 0, 2, 3)
        if times is not None:
            t = tbuf[:ct * m].reshape(ct, n1 - n0, oh, q)
            t[..., :ow] = times[n0:n1].transpose(1, 0, 2, 3)
            # (K, m) @ (m, C): BLAS measured this orientation ~1.7x faster than (C, m) @ (m, K).
            acc += xp.matmul(col, t.reshape(group, ct // group, m).swapaxes(-1, -2))
    return y if times is None else (y, acc)


class _Phases:
    """A strided convolution as a stride-1 one over the stride phases of x (space-to-depth).

    With stride (sh, sw), kernel row i meets input rows ``sh * r + i``: phase ``i % sh`` of
    the padded input at row ``r + i // sh``. Stacking the phases as channels, ``(p, q, c)``,
    turns the conv into a stride-1, unpadded one with a ceil(kh/sh) x ceil(kw/sw) kernel,
    zero where a phase has no tap; phases no tap reaches (stride > kernel) are left out.
    That runs the flat-row im2col and the input gradient by correlation instead of 6-D window
    copies and col2im. Conv2D uses it only where no tap is zero (``exact``): a 1x1 strided
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
        self.phases = None
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
        chunks, xpad, cols = win.workspace(xp, gy.dtype)
        # Zeros in the garbage columns of flat rows keep gw exact. Q is the innermost axis, so
        # those columns sit at the same buffer positions in every chunk: zeroing once suffices.
        gys = (xp.zeros if q != ow else xp.empty)(o * (cols.size // k), dtype=gy.dtype)
        w3 = w.reshape(g, o // g, -1)
        gw_t = xp.zeros((g, k // g, o // g), dtype=gy.dtype) if need_w else None
        gx = None
        if need_x:
            gx = xp.empty((n, c, win.h, win.w), dtype=gy.dtype)
        for n0, n1 in chunks:
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
        gw = gw_t.swapaxes(-1, -2).reshape(w.shape) if need_w else None
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
