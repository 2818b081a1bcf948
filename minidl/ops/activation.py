"""Softmax and LogSoftmax over one axis (or several, jointly), computed stably.

Both subtract the maximum along the normalised axes before exponentiating, so inputs of any
magnitude (1e4, -1e4) give finite results; log-softmax is ``x - max - log(sum(exp(x - max)))``
and never takes the log of a softmax that may have underflowed to 0.
"""
import numpy

from ..backend import get_array_module
from .primitive import Primitive, normalize_axis


def _check_axis(op, axis):
    """MindSpore takes an int or a non-empty tuple of ints; anything else is a TypeError."""
    ok = isinstance(axis, int) and not isinstance(axis, bool)
    if isinstance(axis, (tuple, list)) and axis:
        ok = all(isinstance(a, int) and not isinstance(a, bool) for a in axis)
        axis = tuple(axis)
    if not ok:
        raise TypeError(f"{op}: axis must be an int or a non-empty tuple of ints, got {axis!r}")
    return axis


def _prepare(op, axis, x):
    """Checks x and axis; returns (x viewed as at least 1-D, the sorted axes)."""
    if not numpy.issubdtype(x.dtype, numpy.floating):
        raise TypeError(f"{op}: x must be a float tensor, got dtype {x.dtype}")
    if x.ndim == 0:
        # NOTE: a scalar is a one-element distribution; viewed as (1,) so that numpy's 0-d
        # arithmetic (which returns numpy scalars, not arrays) never reaches the in-place ops.
        return x.reshape(1), normalize_axis(op, axis, 1)
    return x, normalize_axis(op, axis, x.ndim)


def _shifted(x, axes):
    """x - max(x, axes): a new array whose maximum along ``axes`` is 0."""
    return x - x.max(axis=axes, keepdims=True)


class Softmax(Primitive):
    """exp(x) / sum(exp(x)) along ``axis``, stable for large |x|.

    Args:
        axis: int, or tuple of ints normalised jointly (default -1).

    Example:
        >>> ops.Softmax()(minidl.Tensor([[1.0, 2.0, 3.0]]))     # rows sum to 1
    """

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = _check_axis(self.name, axis)

    def forward(self, x):
        shape = x.shape
        x, self.axes = _prepare(self.name, self.axis, x)
        xp = get_array_module(x)
        if x.size == 0:
            self.out = x.copy()
            return self.out.reshape(shape)
        y = _shifted(x, self.axes)
        xp.exp(y, out=y)
        y /= y.sum(axis=self.axes, keepdims=True)
        self.out = y
        return y.reshape(shape)

    def backward(self, gy):
        y = self.out
        shape, gy = gy.shape, gy.reshape(y.shape)
        gx = gy * y
        # y * (gy - sum(gy * y)) rewritten to reuse the gy * y buffer.
        gx -= y * gx.sum(axis=self.axes, keepdims=True)
        return (gx.reshape(shape),)


class LogSoftmax(Primitive):
    """log(softmax(x)) along ``axis``, as ``x - max - log(sum(exp(x - max)))``.

    Args:
        axis: int, or tuple of ints normalised jointly (default -1).

    Example:
        >>> ops.LogSoftmax()(logits)      # exp of each row sums to 1
    """

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = _check_axis(self.name, axis)

    def forward(self, x):
        shape = x.shape
        x, self.axes = _prepare(self.name, self.axis, x)
        xp = get_array_module(x)
        if x.size == 0:
            self.out = x.copy()
            return self.out.reshape(shape)
        y = _shifted(x, self.axes)
        y -= xp.log(xp.exp(y).sum(axis=self.axes, keepdims=True))
        self.out = y
        return y.reshape(shape)

    def backward(self, gy):
        xp = get_array_module(gy)
        shape, gy = gy.shape, gy.reshape(self.out.shape)
        # exp(y) is the softmax; recomputing it is cheaper than keeping a second array alive.
        gx = xp.exp(self.out)
        gx *= gy.sum(axis=self.axes, keepdims=True)
        return ((gy - gx).reshape(shape),)


def softmax(x, axis=-1):
    """Softmax of x along axis (int or tuple of ints)."""
    return Softmax(axis)(x)


def log_softmax(x, axis=-1):
    """Log-softmax of x along axis (int or tuple of ints)."""
    return LogSoftmax(axis)(x)


__all__ = ['Softmax', 'LogSoftmax', 'softmax', 'log_softmax']
