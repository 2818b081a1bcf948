"""MaxPool and AvgPool over NCHW inputs: MindSpore's 'valid' / 'same' padding, and PyTorch-style
explicit padding (pad_mode='pad'), ceil_mode, count_include_pad, divisor_override and, for
MaxPool, dilation.

Both loop over the kh*kw kernel offsets, never over pixels: the (i, j) plane of the window
view ``as_strided(x, (N, C, OH, OW, kh, kw))`` is the strided slice
``x[:, :, i*dh::sh, j*dw::sw]``, so each step is one whole-array NumPy/CuPy operation. This
measured 5-10x faster than arg-maxing over the short trailing window axes of
the 6-D view, where NumPy pays its per-row overhead for every 2- or 3-element row.

MaxPool keeps the arg-max offset per output (uint8) for backward, which routes each output
gradient to the first maximum of its window in row-major order when several elements tie,
as PyTorch and cuDNN do. With stride >= kernel the windows are disjoint, so backward
assigns into gx instead of adding, and when they tile the input exactly gx needs no zeroing.
(The reshape trick for stride == kernel, one broadcast ``where`` over a (N, C, OH, kh, OW, kw)
view of gx, measured 3x slower than these kh*kw strided assignments, for the same reason.)

Padding and ceil_mode. Windows start at ``i * s - pad_lo``. With ceil_mode the output rounds
up, so the last window may hang past the padded end; PyTorch's rule drops a last window that
would start in the bottom/right padding (every window then holds an input element). The
padded buffer reaches as far as the windows do: -inf for MaxPool, zeros for AvgPool, whose
divisor counts the padding (count_include_pad) but never the overhang past the padded end.
"""
from ..backend import get_array_module
from ..tensor import is_grad_enabled
from .im2col import _is_int, _pad_mode, _pair, _window_axis
from .primitive import Primitive

_PAD_MODES = ("valid", "same", "pad")


def _offsets(kh, kw):
    return [(i, j) for i in range(kh) for j in range(kw)]


def _pool_pad(op, pad, pad_mode):
    """An int, (pad_h, pad_w) or (top, bottom, left, right), as the 4-tuple; non-zero only with 'pad'."""
    if _is_int(pad):
        pads = (pad,) * 4
    elif isinstance(pad, (tuple, list)) and len(pad) == 2:
        pads = (pad[0], pad[0], pad[1], pad[1])
    elif isinstance(pad, (tuple, list)) and len(pad) == 4:
        pads = tuple(pad)
    else:
        raise ValueError(f"{op}: pad must be an int, a (pad_h, pad_w) pair or a (top, bottom, left, right) tuple, "
                         f"got {pad!r}")
    if not all(_is_int(p) and p >= 0 for p in pads):
        raise ValueError(f"{op}: pad values must be non-negative ints, got {pad!r}")
    if pad_mode != "pad" and any(pads):
        raise ValueError(f"{op}: pad={pad!r} needs pad_mode='pad', got pad_mode={pad_mode!r}")
    return pads


def _pool_axis(op, size, k, s, d, mode, lo, hi, ceil_mode, what):
    """(out, lo, reach) along one axis: output size, padding before, and how far past the input's
    end the windows reach (beyond ``hi`` with ceil_mode; negative when they stop short of the end)."""
    ek = (k - 1) * d + 1
    if mode == "same" or not ceil_mode:
        out, lo, hi = _window_axis(op, size, k, s, d, mode, lo, hi, what)
    else:
        out = -(-(size + lo + hi - ek) // s) + 1
        if (out - 1) * s >= size + lo:
            out -= 1  # PyTorch's rule: the last window must start inside the input or its left padding
        if out < 1:
            raise ValueError(f"{op}: {what}: the input is too small for the window (kernel {k}, dilation {d}, "
                             f"stride {s}, padding ({lo}, {hi}) along an axis of size {size}, ceil_mode)")
    return out, lo, (out - 1) * s + ek - size - lo


class _Pool2D(Primitive):
    """Shared window geometry of MaxPool and AvgPool."""

    n_inputs = 1

    def __init__(self, kernel_size=1, strides=1, pad_mode="valid", data_format="NCHW", pad=0, dilation=1,
                 ceil_mode=False):
        super().__init__()
        op = self.name
        self.kernel_size = _pair(op, "kernel_size", kernel_size, allow_nchw4=True)
        self.strides = _pair(op, "strides", strides, allow_nchw4=True)
        self.pad_mode = _pad_mode(op, pad_mode, _PAD_MODES)
        if data_format != "NCHW":
            raise ValueError(f"{op}: data_format={data_format!r} is not supported; only 'NCHW' is")
        self.data_format = data_format
        self.pad = _pool_pad(op, pad, self.pad_mode)
        self.dilation = _pair(op, "dilation", dilation, allow_nchw4=True)
        if not isinstance(ceil_mode, bool):
            raise TypeError(f"{op}: ceil_mode must be a bool, got {ceil_mode!r}")
        self.ceil_mode = ceil_mode

    def _geometry(self, x):
        if x.ndim != 4:
            raise ValueError(f"{self.name}: x must be 4-D (N, C, H, W), got shape {tuple(x.shape)}")
        (kh, kw), (sh, sw), (dh, dw) = self.kernel_size, self.strides, self.dilation
        pt, pb, pl, pr = self.pad
        where = f"x of shape {tuple(x.shape)}"
        oh, pt, reach_h = _pool_axis(self.name, x.shape[2], kh, sh, dh, self.pad_mode, pt, pb, self.ceil_mode, where)
        ow, pl, reach_w = _pool_axis(self.name, x.shape[3], kw, sw, dw, self.pad_mode, pl, pr, self.ceil_mode, where)
        # The padded buffer ends where the last window does (or at the input's end, if that is later).
        self.x_shape, self.out_hw = tuple(x.shape), (oh, ow)
        self.pads = (pt, max(reach_h, 0), pl, max(reach_w, 0))

    def _plane(self, a, i, j):
        """The (i, j) kernel-offset plane of the windows over a (padded) array: (N, C, OH, OW)."""
        (sh, sw), (dh, dw), (oh, ow) = self.strides, self.dilation, self.out_hw
        return a[:, :, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]

    def _padded(self, xp, x, fill):
        pt, pb, pl, pr = self.pads
        if not any(self.pads):
            return x
        n, c, h, w = x.shape
        out = xp.full((n, c, h + pt + pb, w + pl + pr), fill, dtype=x.dtype)
        out[:, :, pt:pt + h, pl:pl + w] = x
        return out

    def _scatter(self, xp, parts, dtype):
        """gx from one (N, C, OH, OW) gradient per kernel offset (an iterable, in offset order)."""
        n, c, h, w = self.x_shape
        (kh, kw), (sh, sw), (dh, dw), (oh, ow) = self.kernel_size, self.strides, self.dilation, self.out_hw
        pt, pb, pl, pr = self.pads
        disjoint = sh >= (kh - 1) * dh + 1 and sw >= (kw - 1) * dw + 1
        tiled = disjoint and (sh, sw) == (kh, kw) and (oh * kh, ow * kw) == (h + pt + pb, w + pl + pr)
        g = (xp.empty if tiled else xp.zeros)((n, c, h + pt + pb, w + pl + pr), dtype=dtype)
        for (i, j), part in zip(_offsets(kh, kw), parts):
            if disjoint:
                self._plane(g, i, j)[...] = part
            else:
                self._plane(g, i, j)[...] += part
        if any(self.pads):
            g = xp.ascontiguousarray(g[:, :, pt:pt + h, pl:pl + w])
        return g




class MaxPool(_Pool2D):
    """Maximum over kernel_size windows moved by strides, on (N, C, H, W) inputs.

    Args:
        kernel_size: int, (kh, kw) or (1, 1, kh, kw).
        strides: int, (sh, sw) or (1, 1, sh, sw).
        pad_mode: 'valid' (windows inside the input), 'same' (output = ceil(input / stride), any
            odd pixel of padding at the bottom/right) or 'pad' (``pad``), case-insensitive.
            Padding is -inf: it never wins.
        data_format: 'NCHW' only.
        pad: int, (pad_h, pad_w) or (top, bottom, left, right); each at most half the kernel
            (as MindSpore and PyTorch); non-zero only with pad_mode='pad'.
        dilation: int or (dh, dw): the spacing of a window's taps.
        ceil_mode: round the output size up; a last window that would start in the padding
            is dropped, as PyTorch does.

    MindSpore's ops.MaxPool has only the first four arguments; pad, dilation and ceil_mode are
    those of its nn.MaxPool2d (which runs MaxPool3DWithArgmax for them) and ops.max_pool2d.
    The gradient goes to the first maximum of each window (row-major) when values tie.

    Example:
        >>> ops.MaxPool(kernel_size=2, strides=2)(Tensor(np.arange(16.).reshape(1, 1, 4, 4))).shape
        (1, 1, 2, 2)
        >>> ops.MaxPool(3, 2, pad_mode="pad", pad=1)(Tensor(np.ones((1, 1, 7, 7)))).shape
        (1, 1, 4, 4)
    """

    def __init__(self, kernel_size=1, strides=1, pad_mode="valid", data_format="NCHW", pad=0, dilation=1,
                 ceil_mode=False):
        super().__init__(kernel_size, strides, pad_mode, data_format, pad, dilation, ceil_mode)
        (pt, pb, pl, pr), (kh, kw) = self.pad, self.kernel_size
        if 2 * max(pt, pb) > kh or 2 * max(pl, pr) > kw:
            raise ValueError(f"{self.name}: pad={pad!r} must be at most half of kernel_size={self.kernel_size} "
                             f"(a window would lie in the padding)")

    def forward(self, x):
        xp = get_array_module(x)
        self._geometry(x)
        keep = is_grad_enabled()
        y, self.idx = self._max(xp, x, keep)
        return y

    def _max(self, xp, x, keep):
        """(y, idx): the window maxima and, if ``keep``, which kernel offset held each (row-major)."""
        kh, kw = self.kernel_size
        fill = -xp.inf if x.dtype.kind == "f" else xp.iinfo(x.dtype).min
        xpad = self._padded(xp, x, fill)
        planes = (self._plane(xpad, i, j) for i, j in _offsets(kh, kw))
        y = next(planes).copy()
        idx = xp.zeros(y.shape, dtype=xp.uint8 if kh * kw < 256 else xp.int32) if keep else None
        greater = xp.empty(y.shape, dtype=bool)
        for t, s in enumerate(planes, 1):
            if keep:
                # Strictly greater: on ties the earlier offset keeps the gradient.
                xp.greater(s, y, out=greater)
                # idx = where(greater, t, idx), without where's slower select.
                idx *= ~greater
                idx += greater.view(xp.uint8) * idx.dtype.type(t)
            xp.maximum(y, s, out=y)
        return y, idx

    def backward(self, gy):
        xp = get_array_module(gy)
        kh, kw = self.kernel_size
        zero = gy.dtype.type(0)
        parts = (xp.where(self.idx == t, gy, zero) for t in range(kh * kw))
        return (self._scatter(xp, parts, gy.dtype),)


class MaxPoolIndices(MaxPool):
    """Where MaxPool's maxima lie: the flat index into each (H, W) input plane, int64 (not
    differentiable). What ``max_pool2d(..., return_indices=True)`` returns beside the maxima;
    a second pass over the windows, so only callers that ask for indices pay for it."""

    def forward(self, x):
        xp = get_array_module(x)
        self._geometry(x)
        _, idx = self._max(xp, x, keep=True)
        (sh, sw), (dh, dw), (oh, ow) = self.strides, self.dilation, self.out_hw
        pt, _, pl, _ = self.pads
        kw, w = self.kernel_size[1], x.shape[3]
        i, j = idx.astype(xp.int64) // kw, idx.astype(xp.int64) % kw
        rows = xp.arange(oh, dtype=xp.int64)[:, None] * sh - pt + i * dh
        cols = xp.arange(ow, dtype=xp.int64)[None, :] * sw - pl + j * dw
        return rows * w + cols


class AvgPool(_Pool2D):
    """Mean over kernel_size windows moved by strides, on (N, C, H, W) inputs.

    Args:
        kernel_size, strides, pad_mode, data_format, pad, ceil_mode: as MaxPool, except that
            pad_top + pad_bottom may reach kh (and left + right kw), MindSpore's AvgPool3D rule.
        count_include_pad: whether the divisor counts the zero padding of pad_mode='pad'
            (True, as MindSpore and PyTorch). Windows that ceil_mode lets hang past the padded
            end never count that overhang. With pad_mode='same' the padding is never counted,
            as MindSpore and TensorFlow do.
        divisor_override: a positive int that replaces every window's divisor; None or 0
            (MindSpore's functional default) leaves it off.

    Example:
        >>> ops.AvgPool(kernel_size=2, strides=2)(Tensor(np.ones((1, 1, 4, 4)))).asnumpy()[0, 0]
        array([[1., 1.], [1., 1.]])
        >>> ops.AvgPool(3, 2, pad_mode="pad", pad=1, count_include_pad=False)(Tensor(np.ones((1, 1, 5, 5)))).shape
        (1, 1, 3, 3)
    """

    def __init__(self, kernel_size=1, strides=1, pad_mode="valid", data_format="NCHW", pad=0, ceil_mode=False,
                 count_include_pad=True, divisor_override=None):
        super().__init__(kernel_size, strides, pad_mode, data_format, pad, 1, ceil_mode)
        (pt, pb, pl, pr), (kh, kw) = self.pad, self.kernel_size
        if pt + pb > kh or pl + pr > kw or max(pt, pb) >= kh or max(pl, pr) >= kw:
            raise ValueError(f"{self.name}: pad={pad!r} is too large for kernel_size={self.kernel_size}: "
                             f"top + bottom must be at most kh and left + right at most kw, with no window "
                             f"entirely in the padding")
        if not isinstance(count_include_pad, bool):
            raise TypeError(f"{self.name}: count_include_pad must be a bool, got {count_include_pad!r}")
        if divisor_override is not None and (not _is_int(divisor_override) or divisor_override < 0):
            raise ValueError(f"{self.name}: divisor_override must be None or a positive int, got {divisor_override!r}")
        self.count_include_pad = count_include_pad
        self.divisor_override = divisor_override or None

    def forward(self, x):
        xp = get_array_module(x)
        self._geometry(x)
        if x.dtype.kind != "f":
            raise TypeError(f"{self.name}: x must be a float tensor, got {x.dtype}")
        kh, kw = self.kernel_size
        xpad = self._padded(xp, x, 0)
        planes = (self._plane(xpad, i, j) for i, j in _offsets(kh, kw))
        y = next(planes).copy()
        for s in planes:
            y += s
        self.scale = self._inverse_counts(xp, x.dtype)
        y *= self.scale
        return y

    def _inverse_counts(self, xp, dtype):
        """1 / divisor of each window: a scalar where all are equal, else (OH, OW)."""
        (kh, kw), (sh, sw), (oh, ow) = self.kernel_size, self.strides, self.out_hw
        if self.divisor_override:
            return dtype.type(1.0 / self.divisor_override)
        if not any(self.pads):
            return dtype.type(1.0 / (kh * kw))  # every window lies inside the input
        _, _, h, w = self.x_shape
        pt, pl = self.pads[0], self.pads[2]
        # The span of the input that windows count: with count_include_pad, the declared padding
        # (a ceil_mode overhang past it is never counted); otherwise only the input.
        counted = self.pad_mode == "pad" and self.count_include_pad
        pb, pr = (self.pad[1], self.pad[3]) if counted else (0, 0)
        # Per axis: (outputs, kernel, stride, padding before, first and one-past-last counted index).
        axes = [(oh, kh, sh, pt, -pt if counted else 0, h + pb), (ow, kw, sw, pl, -pl if counted else 0, w + pr)]
        # Whether every window counts kh*kw elements is decided on the host, from Python ints,
        # without reading the device; only partial windows need an (OH, OW) divisor array.
        if all(min(i * s - lo + k, end) - max(i * s - lo, first) == k
               for out, k, s, lo, first, end in axes for i in range(out)):
            return dtype.type(1.0 / (kh * kw))

        def counts(out, k, s, lo, first, end):
            start = xp.arange(out) * s - lo
            return xp.minimum(start + k, end) - xp.maximum(start, first)

        n = counts(*axes[0])[:, None] * counts(*axes[1])[None, :]
        return (1.0 / n).astype(dtype)

    def backward(self, gy):
        xp = get_array_module(gy)
        kh, kw = self.kernel_size
        g = gy * self.scale
        return (self._scatter(xp, (g for _ in range(kh * kw)), gy.dtype),)


def _pool_args(kernel_size, stride):
    return kernel_size, kernel_size if stride is None else stride


def _functional_mode(padding, pad_mode):
    """The primitive's pad_mode for a functional call: 'pad' where ``padding`` pads, unless given."""
    if pad_mode is not None:
        return pad_mode
    if _is_int(padding):
        return "pad" if padding else "valid"
    if isinstance(padding, (tuple, list)) and all(_is_int(p) for p in padding):
        return "pad" if any(padding) else "valid"
    return "pad"  # not an int or a tuple of ints: AvgPool / MaxPool refuse it, naming the value


def max_pool2d(x, kernel_size, stride=None, padding=0, dilation=1, return_indices=False, ceil_mode=False,
               pad_mode=None):
    """Functional MaxPool with MindSpore 2.10's signature; stride defaults to kernel_size.

    Args:
        padding: int or (pad_h, pad_w), -inf padding of at most half the kernel on each side.
        dilation: int or (dh, dw).
        return_indices: also return the flat index of each maximum within its (H, W) plane
            (int64), as a tuple ``(y, indices)``.
        ceil_mode: round the output size up (PyTorch's rule for the last window).
        pad_mode: minidl's extra: 'valid' or 'same' (MindSpore's primitive modes) instead of
            ``padding``; None follows ``padding``.

    MindSpore's positional order puts return_indices before ceil_mode; PyTorch's the other way.

    Example:
        >>> y, where = ops.max_pool2d(x, 3, 2, padding=1, return_indices=True)
    """
    k, s = _pool_args(kernel_size, stride)
    args = dict(kernel_size=k, strides=s, pad_mode=_functional_mode(padding, pad_mode), pad=padding,
                dilation=dilation, ceil_mode=ceil_mode)
    y = MaxPool(**args)(x)
    if not return_indices:
        return y
    return y, MaxPoolIndices(**args)(x)


def avg_pool2d(input_x, kernel_size=1, stride=1, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=0, pad_mode=None):
    """Functional AvgPool with MindSpore 2.10's signature and defaults (stride=1, not kernel_size).

    Args:
        padding: int, (pad_h, pad_w) or (top, bottom, left, right) zero padding.
        ceil_mode, count_include_pad: as AvgPool.
        divisor_override: a positive int replaces each window's divisor; 0 or None: not set.
        pad_mode: minidl's extra: 'valid' or 'same' instead of ``padding``; None follows ``padding``.

    Example:
        >>> ops.avg_pool2d(x, 3, 2, padding=1, count_include_pad=False)
    """
    stride = kernel_size if stride is None else stride
    return AvgPool(kernel_size=kernel_size, strides=stride, pad_mode=_functional_mode(padding, pad_mode),
                   pad=padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                   divisor_override=divisor_override)(input_x)


__all__ = ["MaxPool", "AvgPool", "MaxPoolIndices", "max_pool2d", "avg_pool2d"]
