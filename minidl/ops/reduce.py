"""Reductions over axes: ReduceSum, ReduceMean, ReduceMax, ReduceMin; Argmax and Argmin (indices,
no gradient) and CumSum (a scan along one axis).

Called as MindSpore does: ``ops.ReduceSum(keep_dims=True)(x, axis)``, where axis is an int,
a tuple of ints (negative ones count from the end), or ``()`` / None for every axis.
The output keeps the input's dtype. Sum and mean send the gradient back as a broadcast
view of ``gy`` (no copy); max and min split it evenly among tied extrema.
"""
import numpy

from ..backend import get_array_module
from .array import Cast, ExpandDims, Reshape
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


def _check_axis(op, axis, ndim):
    """axis as an int in [0, ndim) (a 0-d tensor takes 0 or -1), or a TypeError / ValueError."""
    if not isinstance(axis, (int, numpy.integer)) or isinstance(axis, (bool, numpy.bool_)):
        raise TypeError(f"{op}: axis must be an int, got {type(axis).__name__} {axis!r}")
    n = max(ndim, 1)
    if not -n <= axis < n:
        raise ValueError(f"{op}: axis {axis} is out of range for a tensor of rank {ndim} "
                         f"(expected -{n} <= axis < {n})")
    return int(axis) % n


class _ArgExtreme(Primitive):
    """Argmax / Argmin: the index of the extreme along ``axis``; the first one at ties.

    Args:
        axis: the axis to search (default -1).
        output_type: int32 (default, as MindSpore's primitive) or int64.
    """

    def __init__(self, axis=-1, output_type=numpy.int32):
        super().__init__()
        if not isinstance(axis, int) or isinstance(axis, bool):
            raise TypeError(f"{self.name}: axis must be an int, got {type(axis).__name__} {axis!r}")
        try:
            dtype = numpy.dtype(output_type)
        except TypeError:
            dtype = None
        if dtype not in (numpy.dtype(numpy.int32), numpy.dtype(numpy.int64)):
            raise ValueError(f"{self.name}: output_type must be int32 or int64, got {output_type!r}")
        self.axis = axis
        self.output_type = dtype

    def forward(self, x):
        if not hasattr(x, "ndim"):
            raise TypeError(f"{self.name}: x must be a Tensor, got {type(x).__name__}")
        axis = _check_axis(self.name, self.axis, x.ndim)
        xp = get_array_module(x)
        if x.ndim == 0:
            return xp.zeros((), self.output_type)
        if x.shape[axis] == 0:
            raise ValueError(f"{self.name}: axis {self.axis} of x (shape {tuple(x.shape)}) has size 0: there is "
                             f"no {self._word} to index")
        return xp.asarray(self.search(x, axis=axis)).astype(self.output_type, copy=False)

    def backward(self, gy):  # integer output: apply() records no node, so this never runs
        return (None,)


class Argmax(_ArgExtreme):
    """Index of the maximum along ``axis`` (the first one at ties; NaN counts as the maximum).

    Example:
        >>> ops.Argmax(axis=1)(Tensor([[1., 3., 3.], [5., 0., 5.]]))      # [1, 0], int32
    """

    _word = "maximum"

    @staticmethod
    def search(x, axis):
        return get_array_module(x).argmax(x, axis=axis)


class Argmin(_ArgExtreme):
    """Index of the minimum along ``axis`` (the first one at ties; NaN counts as the minimum)."""

    _word = "minimum"

    @staticmethod
    def search(x, axis):
        return get_array_module(x).argmin(x, axis=axis)


def _cumsum(xp, x, axis, exclusive, reverse):
    """The (exclusive, reversed) running sum of x along axis, in x's dtype."""
    index = (slice(None),) * axis
    if reverse:
        x = xp.flip(x, axis)
    y = xp.cumsum(x, axis=axis, dtype=x.dtype)  # NumPy would widen small ints to int64
    if exclusive:  # shift by one: y[i] = sum of x[:i]
        head = xp.zeros(x.shape[:axis] + (1,) + x.shape[axis + 1:], y.dtype)
        y = xp.concatenate([head, y[index + (slice(0, -1),)]], axis=axis)
    return xp.flip(y, axis) if reverse else y


class CumSum(Primitive):
    """Running sum along ``axis``, called as ``ops.CumSum(exclusive, reverse)(x, axis)``.

    The gradient is the running sum of gy in the other direction (same ``exclusive``).
    The output keeps x's dtype (int8 stays int8, as MindSpore; NumPy would give int64).

    Args:
        exclusive: y[i] sums x[:i] (y[0] is 0) instead of x[:i + 1].
        reverse: sum from the end: y[i] sums x[i:].

    Example:
        >>> ops.CumSum(exclusive=True)(Tensor([1., 2., 3.]), 0)           # [0., 1., 3.]
    """

    n_inputs = 2
    n_tensor_inputs = 1

    def __init__(self, exclusive=False, reverse=False):
        super().__init__()
        for name, v in (("exclusive", exclusive), ("reverse", reverse)):
            if not isinstance(v, bool):
                raise TypeError(f"CumSum: {name} must be a bool, got {v!r}")
        self.exclusive, self.reverse = exclusive, reverse

    def forward(self, x, axis):
        if not hasattr(x, "ndim"):
            raise TypeError(f"CumSum: x must be a Tensor, got {type(x).__name__}")
        if x.dtype == bool:
            raise TypeError("CumSum: x must be a number tensor, got dtype bool; cast it first")
        if x.ndim == 0:
            raise ValueError("CumSum: x must have rank >= 1, got a 0-d tensor")
        self.axis = _check_axis("CumSum", axis, x.ndim)
        return _cumsum(get_array_module(x), x, self.axis, self.exclusive, self.reverse)

    def backward(self, gy):
        return _cumsum(get_array_module(gy), gy, self.axis, self.exclusive, not self.reverse), None


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


def argmax(input, dim=None, keepdim=False):  # noqa: A002 - MindSpore's parameter name
    """Indices of the maxima along ``dim`` as int64 (the first at ties); ``dim=None`` searches the
    flattened tensor and gives a 0-d index (keepdim then changes nothing, as MindSpore 2.10).

    PyTorch gives keepdim=True with dim=None shape (1, ..., 1); MindSpore gives a 0-d index.

    Example:
        >>> ops.argmax(Tensor([[1., 3., 3.], [5., 0., 5.]]), 1, keepdim=True)   # [[1], [0]]
    """
    return _arg_extreme(Argmax, input, dim, keepdim, numpy.int64)


def argmin(input, axis=None, keepdims=False):  # noqa: A002 - MindSpore's parameter name
    """Indices of the minima along ``axis`` as int32 (the first at ties); ``axis=None`` searches
    the flattened tensor.

    MindSpore 2.10's argmin gives int32 where its argmax gives int64 (and names its arguments
    axis / keepdims where argmax has dim / keepdim); both are copied here. PyTorch gives int64.
    """
    return _arg_extreme(Argmin, input, axis, keepdims, numpy.int32)


def _arg_extreme(cls, x, axis, keep, dtype):
    if axis is None:
        return cls(0, dtype)(Reshape()(x, (-1,)) if getattr(x, "ndim", 1) != 1 else x)
    y = cls(axis, dtype)(x)
    return ExpandDims()(y, axis % max(x.ndim, 1)) if keep and x.ndim else y


def cumsum(x, axis, dtype=None):
    """Running sum of x along ``axis``, after casting x to ``dtype`` when one is given.

    Example:
        >>> ops.cumsum(Tensor([[1., 2., 3.]]), 1)                        # [[1., 3., 6.]]
    """
    if dtype is not None:
        x = Cast()(x, dtype)
    return CumSum()(x, axis)


__all__ = ['ReduceSum', 'ReduceMean', 'ReduceMax', 'ReduceMin', 'Argmax', 'Argmin', 'CumSum',
           'reduce_sum', 'reduce_mean', 'reduce_max', 'reduce_min', 'sum', 'mean', 'amax', 'amin',
           'argmax', 'argmin', 'cumsum']
