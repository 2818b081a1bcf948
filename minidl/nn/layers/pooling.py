"""MaxPool2d and AvgPool2d over NCHW inputs, with MindSpore 2.10's arguments."""
from ... import ops
from ...ops.pool import MaxPoolIndices
from ..cell import Cell
from .conv import _pair

_PAD_MODES = ("valid", "same", "pad")


def _pool_padding(who, padding, pad_mode):
    """MindSpore's padding: an int, or a tuple/list of one or two ints (rows, columns); only with 'pad'."""
    v = tuple(padding) if isinstance(padding, (tuple, list)) else (padding,)
    if len(v) == 1:
        v = v * 2
    if len(v) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in v):
        raise ValueError(f"{who}: padding must be a non-negative int or a tuple of one or two of them, got "
                         f"{padding!r}")
    if any(v) and pad_mode != "pad":
        raise ValueError(f"{who}: padding={padding!r} needs pad_mode='pad', got pad_mode={pad_mode!r} (as MindSpore; "
                         f"PyTorch's MaxPool2d(3, 2, padding=1) is {who}(3, 2, pad_mode='pad', padding=1) here)")
    return v


class _Pool2d(Cell):
    def __init__(self, kernel_size, stride, pad_mode, padding, ceil_mode, data_format):
        super().__init__()
        who = type(self).__name__
        self.kernel_size = _pair(who, "kernel_size", kernel_size)
        self.stride = _pair(who, "stride", stride)
        if not isinstance(pad_mode, str) or pad_mode.lower() not in _PAD_MODES:
            raise ValueError(f"{who}: pad_mode must be one of {_PAD_MODES}, got {pad_mode!r}")
        if data_format != "NCHW":
            raise ValueError(f"{who}: only data_format='NCHW' is supported, got {data_format!r}")
        self.pad_mode = pad_mode.lower()
        self.padding = _pool_padding(who, padding, self.pad_mode)
        if not isinstance(ceil_mode, bool):
            raise TypeError(f"{who}: ceil_mode must be a bool, got {ceil_mode!r}")
        self.ceil_mode = ceil_mode

    def construct(self, x):
        if x.ndim != 4:
            raise ValueError(f"{type(self).__name__}: input of shape {tuple(x.shape)} must be (N, C, H, W)")
        return self.pool(x)

    def extend_repr(self):
        s = f"kernel_size={self.kernel_size}, stride={self.stride}, pad_mode={self.pad_mode}"
        if self.pad_mode == "pad":
            s += f", padding={self.padding}"
        return s + (", ceil_mode=True" if self.ceil_mode else "")


class MaxPool2d(_Pool2d):
    """Maximum over kernel_size windows moved by stride.

    Args:
        kernel_size: int or (kh, kw).
        stride: int or (sh, sw).
        pad_mode: 'valid' (windows inside the input), 'same' (output H = ceil(H / stride)) or
            'pad' (``padding``).
        padding: int or (rows, columns) of -inf padding, at most half the kernel; only with
            pad_mode='pad'.
        dilation: int or (dh, dw), spacing of the window's taps; only with pad_mode='pad'.
        return_indices: also return, per output, the flat index of the maximum within its
            (H, W) input plane (int64); only with pad_mode='pad'.
        ceil_mode: round the output size up (a last window that would start in the padding is
            dropped, as PyTorch does); only with pad_mode='pad'.
        data_format: only 'NCHW'.

    As MindSpore 2.10, padding, dilation, return_indices and ceil_mode need pad_mode='pad'
    (PyTorch's MaxPool2d(3, 2, padding=1) is MaxPool2d(3, 2, pad_mode='pad', padding=1)); 4-D
    inputs only (MindSpore also takes an unbatched (C, H, W)).

    Example:
        >>> nn.MaxPool2d(2, 2)(minidl.Tensor(np.ones((1, 1, 4, 4), np.float32))).shape
        (1, 1, 2, 2)
        >>> nn.MaxPool2d(3, 2, pad_mode="pad", padding=1)(minidl.Tensor(np.ones((1, 1, 8, 8), np.float32))).shape
        (1, 1, 4, 4)
    """

    def __init__(self, kernel_size=1, stride=1, pad_mode="valid", padding=0, dilation=1, return_indices=False,
                 ceil_mode=False, data_format="NCHW"):
        super().__init__(kernel_size, stride, pad_mode, padding, ceil_mode, data_format)
        who = "MaxPool2d"
        self.dilation = _pair(who, "dilation", dilation)
        self.return_indices = bool(return_indices)
        if self.pad_mode != "pad" and (self.dilation != (1, 1) or self.return_indices or ceil_mode):
            raise ValueError(f"{who}: dilation={dilation!r}, return_indices={return_indices!r} and "
                             f"ceil_mode={ceil_mode!r} need pad_mode='pad' (as MindSpore), got {pad_mode!r}")
        args = dict(kernel_size=self.kernel_size, strides=self.stride, pad_mode=self.pad_mode, pad=self.padding,
                    dilation=self.dilation, ceil_mode=ceil_mode)
        self.pool = ops.MaxPool(**args)
        self.indices = MaxPoolIndices(**args) if self.return_indices else None

    def construct(self, x):
        y = super().construct(x)
        return (y, self.indices(x)) if self.return_indices else y


class AvgPool2d(_Pool2d):
    """Mean over kernel_size windows moved by stride.

    Args:
        kernel_size, stride, data_format: as MaxPool2d.
        pad_mode: 'valid', 'same' (the padding is never counted, as MindSpore and TensorFlow)
            or 'pad'.
        padding: int or (rows, columns) of zero padding, at most half the kernel; only with
            pad_mode='pad'.
        ceil_mode: round the output size up (PyTorch's rule for the last window).
        count_include_pad: whether the divisor counts the padding (windows hanging past the
            padded end in ceil_mode never count the overhang).
        divisor_override: a positive int that replaces every window's divisor, or None.

    Example:
        >>> pool = nn.AvgPool2d(3, 2, pad_mode="pad", padding=1, count_include_pad=False)
        >>> pool(minidl.Tensor(np.ones((1, 1, 8, 8), np.float32))).shape
        (1, 1, 4, 4)
    """

    def __init__(self, kernel_size=1, stride=1, pad_mode="valid", padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None, data_format="NCHW"):
        super().__init__(kernel_size, stride, pad_mode, padding, ceil_mode, data_format)
        if divisor_override is not None and (not isinstance(divisor_override, int) or divisor_override <= 0):
            raise ValueError(f"AvgPool2d: divisor_override must be None or a positive int, got {divisor_override!r}")
        self.count_include_pad = count_include_pad
        self.divisor_override = divisor_override
        self.pool = ops.AvgPool(kernel_size=self.kernel_size, strides=self.stride, pad_mode=self.pad_mode,
                                pad=self.padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                                divisor_override=divisor_override)
