"""Shape ops: Reshape, Transpose, ExpandDims, Squeeze, Flatten, Concat, Cast, OneHot,
ZerosLike, OnesLike (indexing lives in indexing.py).

Most forwards return views of their input; backwards reshape or transpose ``gy`` back
into x's shape.
"""
import numpy

from ..backend import get_array_module
from .primitive import Primitive, normalize_axis


def _check_int(op, name, value):
    if not isinstance(value, (int, numpy.integer)) or isinstance(value, (bool, numpy.bool_)):
        raise TypeError(f"{op}: {name} must be an int, got {value!r}")
    return int(value)


def _int_tuple(op, name, value):
    """A tuple of ints from an int, a sequence, or a 1-d integer array."""
    if isinstance(value, (int, numpy.integer)) and not isinstance(value, (bool, numpy.bool_)):
        return (int(value),)
    if hasattr(value, "tolist") and getattr(value, "ndim", 1) <= 1:
        value = value.tolist()
        value = [value] if isinstance(value, int) else value
    if not isinstance(value, (tuple, list)):
        raise TypeError(f"{op}: {name} must be a tuple of ints, got {value!r}")
    return tuple(_check_int(op, f"every entry of {name}", v) for v in value)


def _check_array(op, name, x):
    if not hasattr(x, "ndim"):
        raise TypeError(f"{op}: {name} must be a Tensor, got {type(x).__name__}")


def check_dtype(op, dtype):
    """``dtype`` as a numpy dtype, or a TypeError naming the op (None is refused: np.dtype(None)
    would quietly be float64)."""
    try:
        target = None if dtype is None else numpy.dtype(dtype)
    except TypeError:
        target = None
    if target is None:
        raise TypeError(f"{op}: dtype must be a dtype such as minidl.float32, got {dtype!r}")
    return target


def _scatter_add(a, index, values):
    """``a[index] += values`` in place, where repeated indices accumulate (plain ``+=`` does not).

    numpy has ``add.at``; CuPy has ``cupyx.scatter_add``. Both take the same index forms.
    """
    if get_array_module(a) is numpy:
        numpy.add.at(a, index, values)
    else:
        import cupyx
        cupyx.scatter_add(a, index, values)


class Reshape(Primitive):
    """Gives x a new shape with the same number of elements; one entry may be -1 (inferred).

    Example:
        >>> ops.Reshape()(x, (2, -1))
    """

    n_inputs = 2
    n_tensor_inputs = 1

    def forward(self, x, shape):
        _check_array(self.name, "x", x)
        shape = _int_tuple(self.name, "shape", shape)
        self.x_shape = tuple(x.shape)
        return x.reshape(_resolve_shape(self.name, self.x_shape, shape))

    def backward(self, gy):
        return gy.reshape(self.x_shape), None


def _resolve_shape(op, x_shape, shape):
    """shape with its -1 filled in, or a clear error naming both shapes."""
    size = 1
    for n in x_shape:
        size *= n
    if shape.count(-1) > 1:
        raise ValueError(f"{op}: at most one -1 is allowed in shape, got {shape}")
    if any(n < -1 for n in shape):
        raise ValueError(f"{op}: shape entries must be >= 0 or -1, got {shape}")
    known = 1
    for n in shape:
        known *= n if n != -1 else 1
    if -1 in shape:
        if known == 0 or size % known:
            why = "-1 is ambiguous next to a 0" if known == 0 else f"{size} is not a multiple of {known}"
            raise ValueError(f"{op}: cannot reshape a tensor of shape {x_shape} ({size} elements) "
                             f"into shape {shape}: {why}")
        return tuple(size // known if n == -1 else n for n in shape)
    if known != size:
        raise ValueError(f"{op}: cannot reshape a tensor of shape {x_shape} ({size} elements) "
                         f"into shape {shape} ({known} elements)")
    return shape


class Transpose(Primitive):
    """Permutes the dimensions: output dim i is input dim ``perm[i]`` (negative entries allowed).

    Example:
        >>> ops.Transpose()(x, (0, 2, 3, 1))     # NCHW -> NHWC
    """

    n_inputs = 2
    n_tensor_inputs = 1

    def forward(self, x, perm):
        _check_array(self.name, "x", x)
        perm = _int_tuple(self.name, "perm", perm)
        nd = x.ndim
        if len(perm) != nd or sorted(p % nd if -nd <= p < nd else p for p in perm) != list(range(nd)):
            raise ValueError(f"{self.name}: perm {perm} is not a permutation of range({nd}) "
                             f"for a tensor of shape {tuple(x.shape)}")
        self.perm = tuple(p % nd for p in perm)
        return x.transpose(self.perm)

    def backward(self, gy):
        inverse = [0] * len(self.perm)
        for i, p in enumerate(self.perm):
            inverse[p] = i
        return gy.transpose(inverse), None


class ExpandDims(Primitive):
    """Inserts a size-1 dimension at ``axis`` (-ndim-1 <= axis <= ndim)."""

    n_inputs = 2
    n_tensor_inputs = 1

    def forward(self, x, axis):
        _check_array(self.name, "x", x)
        axis = _check_int(self.name, "axis", axis)
        nd = x.ndim
        if not -nd - 1 <= axis <= nd:
            raise ValueError(f"{self.name}: axis {axis} is out of range for a tensor of rank {nd} "
                             f"(expected {-nd - 1} <= axis <= {nd})")
        axis %= nd + 1
        self.x_shape = tuple(x.shape)
        return x.reshape(self.x_shape[:axis] + (1,) + self.x_shape[axis:])

    def backward(self, gy):
        return gy.reshape(self.x_shape), None


class Squeeze(Primitive):
    """Removes size-1 dimensions: those in ``axis``, or all of them when axis is ``()``.

    Args:
        axis: int or tuple of ints; each named dimension must have size 1.
    """

    def __init__(self, axis=()):
        super().__init__()
        self.axis = () if axis is None else _int_tuple(self.name, "axis", axis)

    def forward(self, x):
        _check_array(self.name, "x", x)
        shape = tuple(x.shape)
        if self.axis == ():
            axes = tuple(i for i, n in enumerate(shape) if n == 1)
        else:
            axes = normalize_axis(self.name, self.axis, x.ndim)
            for a in axes:
                if shape[a] != 1:
                    raise ValueError(f"{self.name}: cannot squeeze axis {a} of a tensor of shape "
                                     f"{shape}: its size is {shape[a]}, not 1")
        self.x_shape = shape
        return x.reshape(tuple(n for i, n in enumerate(shape) if i not in axes))

    def backward(self, gy):
        return (gy.reshape(self.x_shape),)


class Flatten(Primitive):
    """(N, d1, d2, ...) -> (N, d1 * d2 * ...); a 1-d (N,) becomes (N, 1)."""

    def forward(self, x):
        _check_array(self.name, "x", x)
        if x.ndim == 0:
            raise ValueError(f"{self.name}: x must have at least 1 dimension (N, ...), got a 0-d tensor")
        self.x_shape = tuple(x.shape)
        rest = 1
        for n in self.x_shape[1:]:
            rest *= n
        return x.reshape(self.x_shape[0], rest)

    def backward(self, gy):
        return (gy.reshape(self.x_shape),)


class Concat(Primitive):
    """Joins a tuple of tensors along an existing axis; they must agree on every other dim.

    Called with one tuple, as MindSpore's: ``ops.Concat(1)((x1, x2, x3))``. The tensors
    become separate positional inputs, so each gets its own gradient (and shard strategy).
    """

    n_inputs = None

    def __init__(self, axis=0):
        super().__init__()
        self.axis = _check_int(self.name, "axis", axis)

    def __call__(self, *args):
        if len(args) == 1 and isinstance(args[0], (tuple, list)):
            args = tuple(args[0])
        if not args:
            raise ValueError(f"{self.name}: needs at least one tensor, got an empty tuple")
        return super().__call__(*args)

    def forward(self, *xs):
        for i, x in enumerate(xs):
            _check_array(self.name, f"input {i}", x)
        x0 = xs[0]
        if x0.ndim == 0:
            raise ValueError(f"{self.name}: cannot concatenate 0-d tensors (input 0 has shape ())")
        axis = normalize_axis(self.name, self.axis, x0.ndim)[0]
        for i, x in enumerate(xs[1:], 1):
            if x.ndim != x0.ndim:
                raise ValueError(f"{self.name}: input {i} has rank {x.ndim} but input 0 has rank {x0.ndim} "
                                 f"(shapes {tuple(x.shape)} and {tuple(x0.shape)})")
            if x.dtype != x0.dtype:
                raise TypeError(f"{self.name}: input {i} has dtype {x.dtype} but input 0 has dtype {x0.dtype}")
            for d in range(x0.ndim):
                if d != axis and x.shape[d] != x0.shape[d]:
                    raise ValueError(f"{self.name}: input {i} of shape {tuple(x.shape)} and input 0 of shape "
                                     f"{tuple(x0.shape)} differ in dimension {d} ({x.shape[d]} vs "
                                     f"{x0.shape[d]}); only axis {axis} may differ")
        self.axis_ = axis
        self.sizes = [x.shape[axis] for x in xs]
        return get_array_module(*xs).concatenate(xs, axis=axis)

    def backward(self, gy):
        lead = (slice(None),) * self.axis_
        grads, start = [], 0
        for i, n in enumerate(self.sizes):
            grads.append(gy[lead + (slice(start, start + n),)] if self.needs_grad[i] else None)
            start += n
        return tuple(grads)


class Cast(Primitive):
    """Converts x to ``dtype``. The gradient is cast back to x's dtype; none flows through
    a cast from or to an integer or bool dtype.
    """

    n_inputs = 2
    n_tensor_inputs = 1

    def forward(self, x, dtype):
        _check_array(self.name, "x", x)
        target = check_dtype(self.name, dtype)
        self.x_dtype = x.dtype
        self.differentiable = x.dtype.kind in "fc" and target.kind in "fc"
        return x.astype(target, copy=False)

    def backward(self, gy):
        if not self.differentiable:
            return None, None
        return gy.astype(self.x_dtype, copy=False), None


class OneHot(Primitive):
    """One-hot encoding: ``on_value`` where ``indices == k``, ``off_value`` elsewhere.

    Called as MindSpore's: ``OneHot(axis)(indices, depth, on_value, off_value)``. on/off
    may be Tensors (scalars; they get gradients) or Python numbers; the output has
    on_value's dtype (float32 when both are Python numbers). An index outside
    [0, depth) gives a row of off_value, as MindSpore does (no error).

    Args:
        axis: where the new dimension of size depth goes (-1: last).
    """

    n_inputs = (2, 4)
    n_tensor_inputs = 3  # indices, on_value, off_value: MindSpore's strategy shape

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = _check_int(self.name, "axis", axis)

    def forward(self, indices, depth, on_value=1.0, off_value=0.0):
        op = self.name
        _check_array(op, "indices", indices)
        if indices.dtype.kind not in "iu":
            raise TypeError(f"{op}: indices must be an integer tensor, got dtype {indices.dtype}")
        if hasattr(depth, "ndim") and depth.ndim == 0:
            depth = depth.item()
        depth = _check_int(op, "depth", depth)
        if depth < 0:
            raise ValueError(f"{op}: depth must be >= 0, got {depth}")
        if not -1 <= self.axis <= indices.ndim:
            raise ValueError(f"{op}: axis {self.axis} is out of range for indices of rank {indices.ndim} "
                             f"(expected -1 <= axis <= {indices.ndim})")
        dtype = _one_hot_dtype(op, on_value, off_value)
        xp = get_array_module(indices)
        self.indices, self.depth = indices, depth
        self.shapes = (getattr(on_value, "shape", ()), getattr(off_value, "shape", ()))
        on = xp.asarray(on_value, dtype=dtype).reshape(())
        off = xp.asarray(off_value, dtype=dtype).reshape(())
        return xp.where(self._mask(xp), on, off)

    def _mask(self, xp):
        # NOTE: arange in its default int64: in indices' own dtype (uint8...) a big depth would wrap.
        mask = self.indices[..., None] == xp.arange(self.depth)
        if self.axis not in (-1, self.indices.ndim):
            mask = xp.moveaxis(mask, -1, self.axis)
        return mask

    def backward(self, gy):
        xp = get_array_module(gy)
        g_on = g_off = None
        if self.needs_grad[2] or (len(self.needs_grad) > 3 and self.needs_grad[3]):
            on_sum = xp.where(self._mask(xp), gy, 0).sum(keepdims=True)
            g_on = on_sum.reshape(self.shapes[0])
            g_off = (gy.sum(keepdims=True) - on_sum).reshape(self.shapes[1])
        return (None, None, g_on, g_off)[:len(self.needs_grad)]


def _one_hot_dtype(op, on_value, off_value):
    for name, v in (("on_value", on_value), ("off_value", off_value)):
        if hasattr(v, "dtype"):
            if v.size != 1:
                raise ValueError(f"{op}: {name} must be a scalar, got shape {tuple(v.shape)}")
        elif not isinstance(v, (int, float)) or isinstance(v, bool):
            raise TypeError(f"{op}: {name} must be a Tensor or a Python number, got {v!r}")
    if hasattr(on_value, "dtype") and hasattr(off_value, "dtype") and on_value.dtype != off_value.dtype:
        raise TypeError(f"{op}: on_value ({on_value.dtype}) and off_value ({off_value.dtype}) "
                        f"must have the same dtype")
    for v in (on_value, off_value):
        if hasattr(v, "dtype"):
            return v.dtype
    return numpy.dtype(numpy.float32)


class ZerosLike(Primitive):
    """Zeros of x's shape and dtype (no gradient)."""

    def forward(self, x):
        _check_array(self.name, "x", x)
        return get_array_module(x).zeros_like(x)

    def backward(self, gy):
        return (None,)


class OnesLike(Primitive):
    """Ones of x's shape and dtype (no gradient)."""

    def forward(self, x):
        _check_array(self.name, "x", x)
        return get_array_module(x).ones_like(x)

    def backward(self, gy):
        return (None,)


def reshape(x, shape):
    return Reshape()(x, shape)


def transpose(x, perm):
    return Transpose()(x, perm)


permute = transpose


def expand_dims(x, axis):
    return ExpandDims()(x, axis)


def squeeze(x, axis=()):
    return Squeeze(axis)(x)


def flatten(x):
    return Flatten()(x)


def concat(tensors, axis=0):
    """Joins tensors (a tuple or list) along an existing axis."""
    return Concat(axis)(tensors)


cat = concat


def stack(tensors, axis=0):
    """Joins same-shape tensors along a new axis (-ndim-1 <= axis <= ndim)."""
    if not isinstance(tensors, (tuple, list)) or not tensors:
        raise ValueError(f"stack: expected a non-empty tuple or list of tensors, got {tensors!r}")
    shapes = [tuple(getattr(t, "shape", ())) for t in tensors]
    for i, s in enumerate(shapes[1:], 1):
        if s != shapes[0]:
            raise ValueError(f"stack: all tensors must have the same shape; input {i} has shape {s}, "
                             f"input 0 has shape {shapes[0]}")
    nd = len(shapes[0])
    axis = _check_int("stack", "axis", axis)
    if not -nd - 1 <= axis <= nd:
        raise ValueError(f"stack: axis {axis} is out of range for tensors of rank {nd} "
                         f"(expected {-nd - 1} <= axis <= {nd})")
    axis %= nd + 1
    return Concat(axis)(tuple(expand_dims(t, axis) for t in tensors))


def cast(x, dtype):
    return Cast()(x, dtype)


def one_hot(indices, depth, on_value=1.0, off_value=0.0, axis=-1):
    return OneHot(axis)(indices, depth, on_value, off_value)


def zeros_like(x):
    return ZerosLike()(x)


def ones_like(x):
    return OnesLike()(x)


__all__ = ['Reshape', 'Transpose', 'ExpandDims', 'Squeeze', 'Flatten', 'Concat',
           'Cast', 'OneHot', 'ZerosLike', 'OnesLike',
           'reshape', 'transpose', 'permute', 'expand_dims', 'squeeze', 'flatten', 'concat', 'cat', 'stack',
           'cast', 'one_hot', 'zeros_like', 'ones_like']
