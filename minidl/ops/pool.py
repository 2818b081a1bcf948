"""MaxPool and AvgPool over NCHW inputs, with MindSpore's 'valid' / 'same' padding.

Both loop over the kh*kw kernel offsets, never over pixels: the (i, j) plane of the window
view ``as_strided(x, (N, C, OH, OW, kh, kw))`` is the strided slice
``x[:, :, i::sh, j::sw]``, so each step is one whole-array NumPy/CuPy operation. This
measured 5-10x faster than arg-maxing over the short trailing window axes of
the 6-D view, where NumPy pays its per-row overhead for every 2- or 3-element row.

MaxPool keeps the arg-max offset per output (uint8) for backward, which routes each output
gradient to the first maximum of its window in row-major order when several elements tie,
as PyTorch and cuDNN do. With stride >= kernel the windows are disjoint, so backward
assigns into gx instead of adding, and when they tile the input exactly gx needs no zeroing.
(The reshape trick for stride == kernel, one broadcast ``where`` over a (N, C, OH, kh, OW, kw)
view of gx, measured 3x slower than these kh*kw strided assignments, for the same reason.)
"""
from ..backend import get_array_module
from ..tensor import is_grad_enabled
from .im2col import _pad_mode, _pair, _window_axis
from .primitive import Primitive

_PAD_MODES = ("valid", "same")


def _offsets(kh, kw):
    return [(i, j) for i in range(kh) for j in range(kw)]


class _Pool2D(Primitive):
    """Shared window geometry of MaxPool and AvgPool."""

    n_inputs = 1

    def __init__(self, kernel_size=1, strides=1, pad_mode="valid", data_format="NCHW"):
        super().__init__()
        op = self.name
        self.kernel_size = _pair(op, "kernel_size", kernel_size, allow_nchw4=True)
        self.strides = _pair(op, "strides", strides, allow_nchw4=True)
        self.pad_mode = _pad_mode(op, pad_mode, _PAD_MODES)
        if data_format != "NCHW":
            raise ValueError(f"{op}: data_format={data_format!r} is not supported; only 'NCHW' is")
        self.data_format = data_format

    def _geometry(self, x):
        if x.ndim != 4:
            raise ValueError(f"{self.name}: x must be 4-D (N, C, H, W), got shape {tuple(x.shape)}")
        (kh, kw), (sh, sw) = self.kernel_size, self.strides
        where = f"x of shape {tuple(x.shape)}"
        oh, pt, pb = _window_axis(self.name, x.shape[2], kh, sh, 1, self.pad_mode, 0, 0, where)
        ow, pl, pr = _window_axis(self.name, x.shape[3], kw, sw, 1, self.pad_mode, 0, 0, where)
        self.x_shape, self.out_hw, self.pads = tuple(x.shape), (oh, ow), (pt, pb, pl, pr)

    def _plane(self, a, i, j):
        """The (i, j) kernel-offset plane of the windows over a (padded) array: (N, C, OH, OW)."""
        (sh, sw), (oh, ow) = self.strides, self.out_hw
        return a[:, :, i:i + sh * (oh - 1) + 1:sh, j:j + sw * (ow - 1) + 1:sw]

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
        (kh, kw), (sh, sw), (oh, ow) = self.kernel_size, self.strides, self.out_hw
        pt, pb, pl, pr = self.pads
        disjoint = sh >= kh and sw >= kw
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
        pad_mode: 'valid' (windows inside the input) or 'same' (output = ceil(input / stride),
            padded with -inf, any odd pixel of padding at the bottom/right), case-insensitive.
        data_format: 'NCHW' only.

    The gradient goes to the first maximum of each window (row-major) when values tie.

    Example:
        >>> ops.MaxPool(kernel_size=2, strides=2)(Tensor(np.arange(16.).reshape(1, 1, 4, 4))).shape
        (1, 1, 2, 2)
    """

    def forward(self, x):
        xp = get_array_module(x)
        self._geometry(x)
        kh, kw = self.kernel_size
        fill = -xp.inf if x.dtype.kind == "f" else xp.iinfo(x.dtype).min
        xpad = self._padded(xp, x, fill)
        planes = (self._plane(xpad, i, j) for i, j in _offsets(kh, kw))
        y = next(planes).copy()
        keep = is_grad_enabled()
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
        self.idx = idx
        return y

    def backward(self, gy):
        xp = get_array_module(gy)
        kh, kw = self.kernel_size
        zero = gy.dtype.type(0)
        parts = (xp.where(self.idx == t, gy, zero) for t in range(kh * kw))
        return (self._scatter(xp, parts, gy.dtype),)


class AvgPool(_Pool2D):
    """Mean over kernel_size windows moved by strides, on (N, C, H, W) inputs.

    Args:
        kernel_size, strides, pad_mode, data_format: as MaxPool. With pad_mode='same' each
            output averages only the elements of its window inside the input (padding is not
            counted), as MindSpore and TensorFlow do.

    Example:
        >>> ops.AvgPool(kernel_size=2, strides=2)(Tensor(np.ones((1, 1, 4, 4)))).asnumpy()[0, 0]
        array([[1., 1.], [1., 1.]])
    """

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
        """1 / (elements of each window inside the input): a scalar, or (OH, OW) with padding."""
        (kh, kw), (sh, sw), (oh, ow) = self.kernel_size, self.strides, self.out_hw
        if not any(self.pads):
            return dtype.type(1.0 / (kh * kw))
        _, _, h, w = self.x_shape
        pt, _, pl, _ = self.pads

        def counts(out, k, s, p, size):
            start = xp.arange(out) * s - p
            return xp.minimum(start + k, size) - xp.maximum(start, 0)

        n = counts(oh, kh, sh, pt, h)[:, None] * counts(ow, kw, sw, pl, w)[None, :]
        return (1.0 / n).astype(dtype)

    def backward(self, gy):
        xp = get_array_module(gy)
        kh, kw = self.kernel_size
        g = gy * self.scale
        return (self._scatter(xp, (g for _ in range(kh * kw)), gy.dtype),)


def _pool_args(kernel_size, stride):
    return kernel_size, kernel_size if stride is None else stride


def max_pool2d(x, kernel_size, stride=None, pad_mode="valid"):
    """Functional MaxPool; stride defaults to kernel_size (non-overlapping windows)."""
    k, s = _pool_args(kernel_size, stride)
    return MaxPool(kernel_size=k, strides=s, pad_mode=pad_mode)(x)


def avg_pool2d(x, kernel_size, stride=None, pad_mode="valid"):
    """Functional AvgPool; stride defaults to kernel_size (non-overlapping windows)."""
    k, s = _pool_args(kernel_size, stride)
    return AvgPool(kernel_size=k, strides=s, pad_mode=pad_mode)(x)


__all__ = ["MaxPool", "AvgPool", "max_pool2d", "avg_pool2d"]
