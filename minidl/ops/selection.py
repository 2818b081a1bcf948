"""Choosing and bounding values: Select (``where``), Clamp (``clamp`` / ``clip``), and the
composites ``clip_by_value`` and ``clip_by_global_norm``.

Select and Clamp broadcast all their tensor operands together, as the binary ops do, and
promote their value operands with the same rule (``math.promote``): an integer operand never
widens a float one.
"""
import numbers

from ..backend import get_array_module
from ..runtime import get_runtime
from ..tensor import Tensor
from .array import Cast
from .math import Add, GreaterEqual, Maximum, Minimum, Mul, RealDiv, Sqrt, Square, _as_dtype, _grad_in, promote
from .primitive import Primitive, shape_of, sum_to_shape
from .reduce import ReduceSum


def _broadcast_shape(op, names, operands):
    """numpy's broadcast shape of the operands (scalars are shape ()), or a ValueError naming them."""
    out = ()
    for name, a in zip(names, operands):
        s = shape_of(a)
        nd = max(len(out), len(s))
        grown = []
        for i in range(nd):
            p = out[i - nd + len(out)] if i >= nd - len(out) else 1
            q = s[i - nd + len(s)] if i >= nd - len(s) else 1
            if p != q and p != 1 and q != 1:
                raise ValueError(f"{op}: {name} of shape {s} cannot be broadcast with shape {out} (dimensions {q} "
                                 f"and {p} differ and neither is 1)")
            grown.append(max(p, q) if 1 in (p, q) else p)
        out = tuple(grown)
    return out


class Select(Primitive):
    """``input`` where ``condition`` is true, ``other`` elsewhere; all three broadcast.

    The gradient flows to input through the mask and to other through its complement.
    ``input`` and ``other`` may be Python numbers; their dtypes promote as the binary ops do.

    Example:
        >>> ops.Select()(Tensor([True, False]), Tensor([1., 2.]), 0.0)       # [1., 0.]
    """

    n_inputs = 3
    n_tensor_inputs = (1, 3)  # a strategy covers the tensors among condition, input and other

    def forward(self, condition, x, y):
        if not hasattr(condition, "dtype") or isinstance(condition, bool) or condition.dtype != bool:
            got = f"dtype {condition.dtype}" if hasattr(condition, "dtype") else type(condition).__name__
            raise TypeError(f"{self.name}: condition must be a bool Tensor, got {got}")
        for name, a in (("input", x), ("other", y)):
            if not hasattr(a, "dtype") and not isinstance(a, numbers.Number):
                raise TypeError(f"{self.name}: {name} must be a Tensor or a number, got {type(a).__name__}")
        _broadcast_shape(self.name, ("condition", "input", "other"), (condition, x, y))
        self.x_shape, self.y_shape = shape_of(x), shape_of(y)
        dtype = promote(x, y)
        self.in_dtypes = (getattr(x, "dtype", None), getattr(y, "dtype", None))
        self.condition = condition
        xp = get_array_module(condition, x, y)
        # NOTE: scalars become 0-d arrays of the promoted dtype, so where() cannot widen them.
        x, y = (xp.asarray(_as_dtype(a, dtype), dtype) for a in (x, y))
        return xp.where(condition, x, y)

    def backward(self, gy):
        xp = get_array_module(gy)
        zero = gy.dtype.type(0)
        gx = gy2 = None
        if self.needs_grad[1]:
            gx = _grad_in(sum_to_shape(xp.where(self.condition, gy, zero), self.x_shape), self.in_dtypes[0])
        if self.needs_grad[2]:
            gy2 = _grad_in(sum_to_shape(xp.where(self.condition, zero, gy), self.y_shape), self.in_dtypes[1])
        return None, gx, gy2


class Clamp(Primitive):
    """x bounded to [min, max], as ``torch.clamp`` and MindSpore's ``ops.clamp``; None leaves a side open.

    Called as ``ops.Clamp()(x, min, max)``; the bounds are numbers, None or tensors that
    broadcast with x. The output keeps x's shape and dtype (MindSpore: an int tensor stays int;
    PyTorch would promote to the bounds' float dtype). When min > max every element is max.

    Gradients follow PyTorch's clamp: x gets gy where min <= x <= max (the bounds included),
    min where x < min (and min <= max), max where the result is max and x was not. (PyTorch gives
    no one the gradient where x < min == max; here min gets it.)

    Example:
        >>> ops.Clamp()(Tensor([-1., 0.5, 2.]), 0.0, 1.0)                    # [0., 0.5, 1.]
    """

    n_inputs = 3
    n_tensor_inputs = (1, 3)  # x, and the bounds that are tensors

    def forward(self, x, lo, hi):
        if not hasattr(x, "dtype"):
            raise TypeError(f"{self.name}: x must be a Tensor, got {type(x).__name__}")
        for name, b in (("min", lo), ("max", hi)):
            if b is not None and not hasattr(b, "dtype") and (not isinstance(b, numbers.Real) or isinstance(b, bool)):
                raise TypeError(f"{self.name}: {name} must be a number, a Tensor or None, got {type(b).__name__} "
                                f"{b!r}")
        if lo is None and hi is None:
            raise ValueError(f"{self.name}: min and max cannot both be None")
        out_shape = _broadcast_shape(self.name, ("x", "min", "max"), (x, lo, hi))
        if out_shape != tuple(x.shape):
            raise ValueError(f"{self.name}: the bounds must broadcast to x's shape {tuple(x.shape)}, but together "
                             f"they give {out_shape}")
        xp = get_array_module(x, *(b for b in (lo, hi) if b is not None))
        self.shapes = (shape_of(lo), shape_of(hi))
        self.in_dtypes = (x.dtype, getattr(lo, "dtype", None), getattr(hi, "dtype", None))
        y = x if lo is None else xp.maximum(x, lo)
        # Masks for backward (bools: a quarter of a float32 x). above: the result is max.
        self.below = None if lo is None else x < lo
        self.above = None if hi is None else y > hi
        if self.below is not None and hi is not None:
            self.below = self.below & (lo <= hi)  # min > max: max wins everywhere
        y = y if hi is None else xp.minimum(y, hi)
        return y.astype(x.dtype, copy=False)

    def backward(self, gy):
        xp = get_array_module(gy)
        zero = gy.dtype.type(0)
        below, above = self.below, self.above
        inside = None
        for m in (below, above):
            if m is not None:
                inside = ~m if inside is None else inside & ~m
        gx = glo = ghi = None
        if self.needs_grad[0]:
            gx = _grad_in(xp.where(inside, gy, zero), self.in_dtypes[0])
        if self.needs_grad[1]:
            glo = _grad_in(sum_to_shape(xp.where(below, gy, zero), self.shapes[0]), self.in_dtypes[1])
        if self.needs_grad[2]:
            ghi = _grad_in(sum_to_shape(xp.where(above, gy, zero), self.shapes[1]), self.in_dtypes[2])
        return gx, glo, ghi


def where(condition, input, other):  # noqa: A002 - MindSpore's parameter name
    """``input`` where ``condition`` is true, ``other`` elsewhere (see Select).

    Example:
        >>> ops.where(x > 0, x, 0.0)
    """
    return Select()(condition, input, other)


select = where


def clamp(input, min=None, max=None):  # noqa: A002 - MindSpore's parameter names
    """x bounded to [min, max], x's dtype kept; gradient 1 for x on the closed interval (see Clamp)."""
    return Clamp()(input, min, max)


clip = clamp


def clip_by_value(x, clip_value_min=None, clip_value_max=None):
    """x bounded to [clip_value_min, clip_value_max]; x may be a tuple or list of tensors.

    MindSpore 2.10's composite, so its gradients exactly: ``Minimum(Maximum(x, min), max)``,
    whose ties split the gradient evenly, so an element equal to a bound gets half of gy (ops.clamp
    and PyTorch's clamp give it all of it). When min > max every element is max. The output
    keeps x's dtype.

    Args:
        x: a Tensor, or a tuple / list of them (a tuple comes back).
        clip_value_min, clip_value_max: numbers, tensors or None; not both None.

    Example:
        >>> ops.clip_by_value(Tensor([-1., 0.5, 2.]), 0.0, 1.0)              # [0., 0.5, 1.]
    """
    if isinstance(x, (tuple, list)):
        return tuple(clip_by_value(t, clip_value_min, clip_value_max) for t in x)
    if not isinstance(x, Tensor):
        raise TypeError(f"clip_by_value: x must be a Tensor or a tuple / list of them, got {type(x).__name__}")
    for name, b in (("clip_value_min", clip_value_min), ("clip_value_max", clip_value_max)):
        if b is not None and not isinstance(b, Tensor) and (not isinstance(b, numbers.Real) or isinstance(b, bool)):
            raise TypeError(f"clip_by_value: {name} must be a number, a Tensor or None, got {type(b).__name__} {b!r}")
    if clip_value_min is None and clip_value_max is None:
        raise ValueError("clip_by_value: clip_value_min and clip_value_max cannot both be None")
    y = x
    if clip_value_min is not None:
        y = Maximum()(y, clip_value_min)
    if clip_value_max is not None:
        y = Minimum()(y, clip_value_max)
    return y if y.dtype == x.dtype else Cast()(y, x.dtype)


def clip_by_global_norm(x, clip_norm=1.0, use_norm=None):
    """Scales tensors so that their global L2 norm is at most ``clip_norm``.

    With ``g = sqrt(sum of every element squared)``, each tensor becomes
    ``t * clip_norm / max(g, clip_norm)`` (MindSpore's formula: unchanged when g <= clip_norm), in
    its own dtype. A composite of ops, so it differentiates (at g == clip_norm the gradient goes
    through g, as MindSpore's select). MindSpore sums the squares in float32; here they are summed
    in the tensors' promoted float dtype, so float64 stays float64.

    Args:
        x: a tuple or list of tensors.
        clip_norm: a number > 0.
        use_norm: must be None (as MindSpore: the global norm is always computed).

    Returns:
        A tuple of tensors.

    Example:
        >>> ops.clip_by_global_norm((Tensor([3., 4.]),), 1.0)               # ([0.6, 0.8],)
    """
    if not isinstance(x, (tuple, list)) or not all(isinstance(t, Tensor) for t in x) or not x:
        raise TypeError(f"clip_by_global_norm: x must be a non-empty tuple or list of Tensors, got {x!r}")
    if not isinstance(clip_norm, numbers.Real) or isinstance(clip_norm, bool):
        raise TypeError(f"clip_by_global_norm: clip_norm must be a number, got {type(clip_norm).__name__} "
                        f"{clip_norm!r}")
    if not clip_norm > 0:
        raise ValueError(f"clip_by_global_norm: clip_norm must be > 0, got {clip_norm}")
    if use_norm is not None:
        raise ValueError(f"clip_by_global_norm: use_norm must be None (the global norm is computed), got {use_norm!r}")
    dtype = promote(*(t.data for t in x), 1.0)  # the float dtype the norm is computed in
    parts = [ReduceSum()(Square()(t if t.dtype == dtype else Cast()(t, dtype)), ()) for t in x]
    runtime = get_runtime()
    held = [k for k, t in enumerate(x) if t.placement is not None]
    if held and not runtime.placing.intercepts_ops:
        # Ops ran on this rank's slices (optimizer parallelism): add the other ranks' squares, as a
        # constant (the norm's gradient with respect to this rank's elements is unchanged).
        sums = runtime.sum_over_slices([x[k] for k in held], [parts[k].data for k in held], "clip_by_global_norm")
        for k, total_k in zip(held, sums):
            parts[k] = Add()(parts[k], Tensor(total_k - parts[k].data))
    total = None
    for part in parts:
        total = part if total is None else Add()(total, part)
    norm = Sqrt()(total)
    clip = float(clip_norm)
    # max(norm, clip_norm) with the gradient to norm at a tie, as MindSpore's select.
    denom = Select()(GreaterEqual()(norm, clip), norm, clip)
    scale = RealDiv()(clip, denom)
    out = []
    for t in x:
        y = Mul()(t, scale)
        out.append(y if y.dtype == t.dtype else Cast()(y, t.dtype))
    return tuple(out)


__all__ = ['Select', 'Clamp', 'where', 'select', 'clamp', 'clip', 'clip_by_value', 'clip_by_global_norm']
