"""Sharding rules of elementwise operators, and the helpers the other rule modules share.

Unary ops (Neg, Exp, ReLU, Cast, ...) keep their input's cuts. Broadcasting ops (the binary
ones, FloorDiv, and the three-operand Select and Clamp) broadcast as numpy does: dimensions
are aligned from the right, each output dimension is one loop of the device matrix, and every
input that has that dimension with size > 1 must cut it the same way; a size-1 dimension
broadcast against a larger one must stay whole (cut 1). Clamp's bounds given as numbers (or
None) are constants, so it is then unary in x.

Example (8 devices): ``Add`` of x (16, 32) and a bias (32,) with strategy ((2, 4), (4,))
runs on the device matrix [2, 4]: x is ``(a, b)``, the bias ``(b,)``, the output ``(a, b)``.
The bias's gradient is a partial sum over a, which the dispatcher reduces.

Constant arrays passed where a tensor could go (``ops.Mul()(x, numpy_array)``) are whole
on every rank; ``localize`` slices them to the rank's block of the output.
"""
from math import prod

import numpy

from minidl import ops
from minidl.backend import get_array_module
from minidl.ops.primitive import Primitive, shape_of, sum_to_shape

from ..layout import Layout
from .base import (OpSharding, Rule, StrategyError, TensorSpec, check_counts, check_strategy_shape, device_matrix_for,
                   largest_cut, register, tensor_specs)

__all__ = ["UnaryRule", "BroadcastRule", "KeepWhere", "UNARY_OPS", "BINARY_OPS", "BROADCAST_OPS"]



class KeepWhere(Primitive):
    """``x`` where ``mask`` is true, 0 elsewhere (broadcasting); the gradient flows to x through the mask.

    An internal primitive of the ReduceMax decomposition: unlike ``x * mask`` it gives 0,
    not NaN, where x is -inf and the mask false.
    """

    n_inputs = 2

    def forward(self, x, mask):
        self.x_shape, self.mask = shape_of(x), mask
        return get_array_module(x, mask).where(mask, x, x.dtype.type(0))

    def backward(self, gy):
        gx = sum_to_shape(gy * self.mask, self.x_shape) if self.needs_grad[0] else None
        return gx, None


UNARY_OPS = (ops.Neg, ops.Exp, ops.Log, ops.Sqrt, ops.Square, ops.Abs, ops.ReLU, ops.Sigmoid, ops.Tanh, ops.Cast,
             ops.ZerosLike, ops.OnesLike, ops.GeLU, ops.LeakyReLU, ops.SiLU)
BINARY_OPS = (ops.Add, ops.Sub, ops.Mul, ops.RealDiv, ops.Maximum, ops.Minimum, ops.Pow, ops.Equal, ops.NotEqual,
              ops.Less, ops.LessEqual, ops.Greater, ops.GreaterEqual, ops.FloorDiv, KeepWhere)
BROADCAST_OPS = BINARY_OPS + (ops.Select, ops.Clamp)  # any number of operands, broadcast together


# ---- helpers shared by the rule modules -----------------------------------------------------

def dims_map(offset, loops):
    """A tensor_map from one loop index per tensor dimension (None: not cut by any loop)."""
    return tuple(() if lp is None else (offset + lp,) for lp in loops)


def tensor_strategy(args, strategy):
    """The strategy restricted to tensor arguments.

    ``.shard()`` asks for one tuple per operand (MindSpore's form: ``Mul().shard(((2, 1), ()))``
    even when the second operand is a Python number). When the strategy has one tuple per
    operand rather than one per tensor, the tuples of non-tensor operands must cut nothing and
    are dropped.
    """
    strategy = tuple(tuple(s) for s in strategy)
    if len(strategy) == len(tensor_specs(args)) or len(strategy) != len(args):
        return strategy
    out = []
    for p, (a, s) in enumerate(zip(args, strategy)):
        if isinstance(a, TensorSpec):
            out.append(s)
        elif any(c != 1 for c in s):
            raise StrategyError(f"argument {p} is not a tensor (it is a constant), so its strategy must be () or "
                                f"all 1, got {s}")
    return tuple(out)


def is_const_array(a):
    """A raw ndarray passed as an operand (not a Tensor): whole on every rank."""
    return (not isinstance(a, (TensorSpec, type, numpy.dtype)) and hasattr(a, "shape") and hasattr(a, "dtype")
            and len(a.shape) > 0)


def preference(ndim, avoid=(), allowed=None):
    """Dimensions in the order a partial axis should move onto them: last first, ``avoid`` last."""
    dims = [d for d in reversed(range(ndim)) if allowed is None or d in allowed]
    return [d for d in dims if d not in avoid] + [d for d in dims if d in avoid]


def follow(spec, layout, avoid=(), allowed=None):
    """The cuts of ``layout``, with each partial axis moved onto a whole dimension it divides.

    The consumer then needs the tensor cut there, and the dispatcher turns the partial values
    into that cut with a reduce-scatter. Dimensions outside ``allowed`` are left whole.
    """
    cuts = [c if allowed is None or d in allowed else 1 for d, c in enumerate(layout.cuts())]
    for axis, _ in layout.partial:
        p = layout.device_matrix[axis]
        for d in preference(spec.ndim, avoid, allowed):
            if cuts[d] == 1 and spec.shape[d] % p == 0:
                cuts[d] = p
                break
    return tuple(cuts)


def first_accepted(rule, prim, args, device_num, candidates):
    """The first candidate strategy ``rule.infer`` accepts, else the data-parallel default."""
    for cand in candidates:
        if cand is None:
            continue
        try:
            rule.infer(prim, args, cand, device_num)
            return tuple(tuple(s) for s in cand)
        except StrategyError:
            continue
    return rule.data_parallel(prim, args, device_num)


def batch_cut(spec, device_num):
    """Data-parallel cut of dimension 0: largest_cut of the batch, 1 for Parameters and 0-d tensors."""
    if spec.ndim == 0 or spec.is_parameter:
        return 1
    return largest_cut(spec.shape[0], device_num)


def broadcast_shape(op, shapes):
    """numpy's broadcast of ``shapes``, or a ValueError naming the operator."""
    nd = max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        for j, n in enumerate(s, nd - len(s)):
            if n != 1:
                if out[j] not in (1, n):
                    raise ValueError(f"{op}: shapes {tuple(tuple(t) for t in shapes)} cannot be broadcast together")
                out[j] = n
    return tuple(out)


def broadcast_cuts(shapes, strategy, out_shape, names=None):
    """The cut of each output dimension, checking that the inputs agree (broadcasting rules).

    Args:
        shapes: the shapes of the tensor inputs, aligned with ``out_shape`` from the right.
        strategy: one tuple of cuts per shape.
        names: how messages call the inputs (default "input i").
    """
    names = names or [f"input {i}" for i in range(len(shapes))]
    nd = len(out_shape)
    cuts = [None] * nd
    owner = [None] * nd
    for i, (shape, s) in enumerate(zip(shapes, strategy)):
        lead = nd - len(shape)
        for d, (n, c) in enumerate(zip(shape, s)):
            j = lead + d
            if n == 1:
                if c != 1 and out_shape[j] != 1:
                    raise StrategyError(f"dimension {d} of {names[i]} has size 1 and is broadcast against size "
                                        f"{out_shape[j]}; a broadcast dimension must have cut 1, got {c}")
                continue
            if cuts[j] is None:
                cuts[j], owner[j] = c, i
            elif cuts[j] != c:
                raise StrategyError(f"dimension {j} of the output (size {out_shape[j]}) is cut {cuts[j]} in "
                                    f"{names[owner[j]]} but {c} in {names[i]}; inputs sharing a dimension must cut "
                                    f"it the same way")
    return tuple(1 if c is None else c for c in cuts)


def aligned_map(shape, offset, nd):
    """The map of an input of ``shape`` broadcast into an ``nd``-d output whose dim j is loop j."""
    lead = nd - len(shape)
    return dims_map(offset, [None if n == 1 else lead + d for d, n in enumerate(shape)])


def slicer(out_layout, out_shape, positions):
    """localize() that slices the constant arrays at ``positions`` to the rank's output block."""
    def localize(coords, args):
        args = list(args)
        nd = len(out_shape)
        for p in positions:
            a = args[p]
            index = []
            for d, n in enumerate(a.shape):
                j = nd - a.ndim + d
                axes = out_layout.tensor_map[j]
                if n == 1 or not axes:
                    index.append(slice(None))
                    continue
                c = prod(out_layout.device_matrix[x] for x in axes)
                block = 0
                for x in axes:
                    block = block * out_layout.device_matrix[x] + coords[x]
                size = n // c
                index.append(slice(block * size, (block + 1) * size))
            args[p] = a[tuple(index)]
        return args
    return localize


# ---- rules ----------------------------------------------------------------------------------

@register(*UNARY_OPS)
class UnaryRule(Rule):
    """One tensor in, the same shape out, element by element: the output keeps the input's cuts."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        (s,) = strategy
        dm, off, rep = device_matrix_for(s, device_num)
        lay = Layout(dm, dims_map(off, range(len(s))))
        return OpSharding(tuple(strategy), (lay,), lay, rep)

    def propagate(self, prim, args, layouts, device_num):
        (spec,) = tensor_specs(args)
        return first_accepted(self, prim, args, device_num, [(follow(spec, layouts[0]),)])


@register(*BROADCAST_OPS)
class BroadcastRule(Rule):
    """Elementwise ops whose operands broadcast together, however many (see the module docstring).

    Operands that are not tensors (numbers, None) take no part; constant arrays are sliced to
    each rank's block of the output.
    """

    def infer(self, prim, args, strategy, device_num):
        strategy = tensor_strategy(args, strategy)
        specs = check_counts(strategy, args)
        consts = [p for p, a in enumerate(args) if is_const_array(a)]
        shapes = [a.shape for a in args if isinstance(a, TensorSpec) or is_const_array(a)]
        out_shape = broadcast_shape(prim.name, shapes)
        names = [f"input {i}" for i in range(len(specs))]
        cuts = broadcast_cuts([s.shape for s in specs], strategy, out_shape, names)
        check_strategy_shape(strategy, args)
        dm, off, rep = device_matrix_for(cuts, device_num)
        nd = len(out_shape)
        in_layouts = tuple(Layout(dm, aligned_map(s.shape, off, nd)) for s in specs)
        out = Layout(dm, dims_map(off, range(nd)))
        localize = None
        if consts and any(c > 1 for c in cuts):
            localize = slicer(out, out_shape, consts)
        return OpSharding(tuple(strategy), in_layouts, out, rep, localize=localize)

    def data_parallel(self, prim, args, device_num):
        specs = tensor_specs(args)
        shapes = [a.shape for a in args if isinstance(a, TensorSpec) or is_const_array(a)]
        out_shape = broadcast_shape(prim.name, shapes)
        nd = len(out_shape)
        # The batch is output dimension 0, when an activation (not a Parameter) carries it.
        has_batch = any(not s.is_parameter and s.ndim == nd and nd and s.shape[0] != 1 for s in specs)
        c = largest_cut(out_shape[0], device_num) if has_batch else 1
        return tuple(tuple(c if d == 0 and s.ndim == nd and n != 1 else 1 for d, n in enumerate(s.shape))
                     for s in specs)

    def propagate(self, prim, args, layouts, device_num):
        specs = tensor_specs(args)
        shapes = [a.shape for a in args if isinstance(a, TensorSpec) or is_const_array(a)]
        out_shape = broadcast_shape(prim.name, shapes)
        nd = len(out_shape)
        followed = [follow(s, lay) for s, lay in zip(specs, layouts)]
        pool = [i for i, s in enumerate(specs) if not s.is_parameter] or list(range(len(specs)))
        primary = max(pool, key=lambda i: (prod(specs[i].shape), -i))

        def out_cuts(order):
            cuts = [None] * nd
            for i in order:
                lead = nd - specs[i].ndim
                for d, n in enumerate(specs[i].shape):
                    if n != 1 and cuts[lead + d] is None:
                        cuts[lead + d] = followed[i][d]
            return [1 if c is None else c for c in cuts]

        def strategy_of(cuts):
            return tuple(tuple(1 if n == 1 else cuts[nd - s.ndim + d] for d, n in enumerate(s.shape)) for s in specs)

        merged = out_cuts([primary] + [i for i in pool if i != primary])
        alone = out_cuts([primary])
        return first_accepted(self, prim, args, device_num, [strategy_of(merged), strategy_of(alone)])

