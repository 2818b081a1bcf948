"""MaxPool2d and AvgPool2d over NCHW inputs."""
from ... import ops
from ..cell import Cell
from .conv import _pair

_PAD_MODES = ("valid", "same")


class _Pool2d(Cell):
    _op = None

    def __init__(self, kernel_size=1, stride=1, pad_mode="valid", data_format="NCHW"):
        super().__init__()
        who = type(self).__name__
        self.kernel_size = _pair(who, "kernel_size", kernel_size)
        self.stride = _pair(who, "stride", stride)
        if not isinstance(pad_mode, str) or pad_mode.lower() not in _PAD_MODES:
            raise ValueError(f"{who}: pad_mode must be 'valid' or 'same', got {pad_mode!r}")
        if data_format != "NCHW":
            raise ValueError(f"{who}: only data_format='NCHW' is supported, got {data_format!r}")
        self.pad_mode = pad_mode.lower()
        self.pool = getattr(ops, self._op)(kernel_size=self.kernel_size, strides=self.stride,
                                           pad_mode=self.pad_mode)

    def construct(self, x):
        if x.ndim != 4:
            raise ValueError(f"{type(self).__name__}: input of shape {tuple(x.shape)} must be (N, C, H, W)")
        return self.pool(x)

    def extend_repr(self):
        return f"kernel_size={self.kernel_size}, stride={self.stride}, pad_mode={self.pad_mode}"


class MaxPool2d(_Pool2d):
    """Maximum over kernel_size windows moved by stride.

    Args:
        kernel_size: int or (kh, kw).
        stride: int or (sh, sw).
        pad_mode: 'valid' (windows inside the input) or 'same' (output H = ceil(H / stride)).

    Example:
        >>> nn.MaxPool2d(2, 2)(minidl.Tensor(np.ones((1, 1, 4, 4), np.float32))).shape
        (1, 1, 2, 2)
    """

    _op = "MaxPool"


class AvgPool2d(_Pool2d):
    """Mean over kernel_size windows moved by stride; Args as MaxPool2d."""

    _op = "AvgPool"
