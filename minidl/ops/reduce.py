"""Reductions over axes: ReduceSum, ReduceMean, ReduceMax, ReduceMin.

Called as MindSpore does: ``ops.ReduceSum(keep_dims=True)(x, axis)``, where axis is an int,
a tuple of ints (negative ones count from the end), or ``()`` / None for every axis.
The output keeps the input's dtype. Sum and mean send the gradient back as a broadcast
view of ``gy`` (no copy); max and min split it evenly among tied extrema.
"""
from ..backend import get_array_module
from .primitive import Primitive, normalize_axis


class _Reduce(Primitive):
    """Common part: axis handling, keep_dims, and the gradient reshaped to broadcast over x."""

    n_inputs = (1, 2)
    n_tensor_inputs = 1

    def __init__(self, keep_dims=False):
        super().__init__()
        if not isinstance(keep_dims, bool):
            raise TypeError(f"{self.name}: keep_dims must be a bool, got {keep_dims!r}")
        self.keep_dims = keep_dims

    def forward(self, x, axis=()):
        if not hasattr(x, "ndim"):
            raise TypeError(f"{self.name}: x must be a Tensor, got {type(x).__name__}")
        self.axes = normalize_axis(self.name, axis, x.ndim)
        if x.ndim == 0:
            self.axes = ()  # normalize_axis accepts axis 0 of a 0-d tensor: a no-op here
        self.x_shape = tuple(x.shape)
        xp = get_array_module(x)
        # NOTE: numpy turns a full reduction into a numpy scalar; Tensors hold ndarrays.
        return xp.asarray(self.compute(xp, x))

    def _kept_shape(self):
        """x's shape with the reduced axes set to 1: what gy broadcasts from."""
        return tuple(1 if i in self.axes else n for i, n in enumerate(self.x_shape))

    def _gy_kept(self, gy):
        return gy if self.keep_dims else gy.reshape(self._kept_shape())


class ReduceSum(_Reduce):
    """Sum over the given axes.

    Args:
        keep_dims: keep the reduced axes as size-1 dimensions.

    Example:
        >>> ops.ReduceSum(keep_dims=True)(x, 1)      # (N, C) -> (N, 1)
    """

    def compute(self, xp, x):
        # NOTE: numpy sums small ints into int64; the output keeps x's dtype instead (bool
        # is the exception: its sum is a count, an int64, as in numpy).
        dtype = None if x.dtype == bool else x.dtype
        return x.sum(axis=self.axes, keepdims=self.keep_dims, dtype=dtype)

    def backward(self, gy):
        xp = get_array_module(gy)
        # NOTE: a read-only broadcast view: the engine copies before accumulating into it.
        return (xp.broadcast_to(self._gy_kept(gy), self.x_shape),)


class ReduceMean(_Reduce):
    """Mean over the given axes. Integer inputs give an integer (truncated) mean, as MindSpore.

    Args:
        keep_dims: keep the reduced axes as size-1 dimensions.
    """

    def compute(self, xp, x):
        y = x.mean(axis=self.axes, keepdims=self.keep_dims)
        self.count = 1
        for a in self.axes:
            self.count *= self.x_shape[a]
        return y.astype(x.dtype, copy=False)

    def backward(self, gy):
        xp = get_array_module(gy)
        # NOTE: a Python float keeps gy's dtype (a numpy float64 scalar would upcast float32).
        scaled = self._gy_kept(gy) * (1.0 / max(self.count, 1))
        return (xp.broadcast_to(scaled, self.x_shape),)


class _ReduceExtreme(_Reduce):
    """Max / min. The gradient is split evenly among the elements equal to the extremum.

    At a tie the function has no derivative; the even split (as ``torch.amax``) keeps the
    total gradient equal to ``gy`` and is symmetric in the tied elements.
    """

    def compute(self, xp, x):
        if any(self.x_shape[a] == 0 for a in self.axes):
            raise ValueError(f"{self.name}: cannot reduce a tensor of shape {self.x_shape} with a "
                             f"zero-size axis (the {self._word} of no elements is undefined)")
        y = self.reduce(x, axis=self.axes, keepdims=self.keep_dims)
        self.x = x
        self.y_kept = y if self.keep_dims else y.reshape(self._kept_shape())
        return y

    def backward(self, gy):
        xp = get_array_module(gy)
        mask = xp.asarray(self.x == self.y_kept)
        count = mask.sum(axis=self.axes, keepdims=True, dtype=gy.dtype)
        return (xp.asarray(mask * (self._gy_kept(gy) / count)),)


class ReduceMax(_ReduceExtreme):
    """Maximum over the given axes; ties share the gradient evenly.

    Args:
        keep_dims: keep the reduced axes as size-1 dimensions.
    """

    _word = "maximum"

    @staticmethod
    def reduce(x, **kwargs):
        return x.max(**kwargs)


class ReduceMin(_ReduceExtreme):
    """Minimum over the given axes; ties share the gradient evenly.

    Args:
        keep_dims: keep the reduced axes as size-1 dimensions.
    """

    _word = "minimum"

    @staticmethod
    def reduce(x, **kwargs):
        return x.min(**kwargs)


def reduce_sum(x, axis=(), keep_dims=False):
    """Sum of x over axis (int, tuple, or ``()`` / None for all axes)."""
    return ReduceSum(keep_dims)(x, axis)


def reduce_mean(x, axis=(), keep_dims=False):
    """Mean of x over axis (int, tuple, or ``()`` / None for all axes)."""
    return ReduceMean(keep_dims)(x, axis)


def reduce_max(x, axis=(), keep_dims=False):
    """Maximum of x over axis; ties share the gradient evenly."""
    return ReduceMax(keep_dims)(x, axis)


def reduce_min(x, axis=(), keep_dims=False):
    """Minimum of x over axis; ties share the gradient evenly."""
    return ReduceMin(keep_dims)(x, axis)


# MindSpore's functional names, with its keyword spellings (positional order is the same).
def sum(x, dim=None, keepdim=False):  # noqa: A001 - MindSpore's name
    """``ops.sum(x, dim, keepdim)``: reduce_sum under MindSpore's functional name."""
    return ReduceSum(keepdim)(x, dim)


def mean(x, axis=None, keep_dims=False):
    """``ops.mean(x, axis, keep_dims)``: reduce_mean under MindSpore's functional name."""
    return ReduceMean(keep_dims)(x, axis)


def amax(x, axis=None, keepdims=False):
    """``ops.amax(x, axis, keepdims)``: reduce_max under MindSpore's functional name."""
    return ReduceMax(keepdims)(x, axis)


def amin(x, axis=None, keepdims=False):
    """``ops.amin(x, axis, keepdims)``: reduce_min under MindSpore's functional name."""
    return ReduceMin(keepdims)(x, axis)


__all__ = ['ReduceSum', 'ReduceMean', 'ReduceMax', 'ReduceMin',
           'reduce_sum', 'reduce_mean', 'reduce_max', 'reduce_min', 'sum', 'mean', 'amax', 'amin']
