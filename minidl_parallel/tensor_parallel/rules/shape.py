"""Sharding rules of Transpose, Reshape, ExpandDims, Squeeze, Flatten, Pad, Tile and BroadcastTo.

These ops move no data between ranks: they rewrite the tensor map. Transpose permutes it,
ExpandDims and Squeeze insert or remove whole size-1 dimensions. Reshape keeps a cut only
where each rank's block stays a block of the new shape: dimensions of the two shapes fall
into groups of equal products, and within its group the cut dimension must be the MAJOR
input dimension (the others whole), with the group's leading output dimension divisible by
the cut. Then the block is a contiguous run of the group, which is the same cut of the
leading output dimension.

Example: x (8, 6) cut (2, 1) reshaped to (4, 2, 6): the group (8) -> (4, 2) leads with 4,
divisible by 2, so the output is cut (2, 1, 1) and each rank reshapes its (4, 6) block to
(2, 2, 6). With x cut (4, 1) and the target (2, 4, 6), the leading 2 is not divisible by 4:
a StrategyError.

Pad, Tile and BroadcastTo keep the cuts of the dimensions they leave alone: a padded
dimension (pads other than (0, 0)) and a tiled one (multiple other than 1) must be whole;
new leading dimensions (Tile's longer dims, BroadcastTo's longer shape) are whole. A
broadcast dimension (size 1 -> n) is whole by itself: no cut > 1 divides 1. BroadcastTo's
target shape becomes the local one. ``ops.split`` / ``ops.Split`` need no rule: they are
StridedSlices, whose rule keeps the split axis whole (indexing.py).
"""
import copy
from math import prod
from operator import index

import numpy

from minidl import ops
from minidl.ops.array import Reshape
from minidl.ops.primitive import normalize_axis

from ..layout import Layout
from .base import (Decomposed, OpSharding, Rule, StrategyError, check_strategy_shape, device_matrix_for, register,
                   tensor_specs)
from .elementwise import batch_cut, dims_map, first_accepted, follow

__all__ = ["TransposeRule", "ReshapeRule", "FlattenRule", "ExpandDimsRule", "SqueezeRule", "PadRule", "TileRule",
           "BroadcastToRule", "reshape_sources"]


def _single(strategy, args):
    check_strategy_shape(strategy, args)
    (x,) = tensor_specs(args)
    return x, tuple(strategy[0])


def _sharding(strategy, device_num, out_loops, localize=None):
    """OpSharding of a one-input op whose output dimension j is input dimension out_loops[j] (or None)."""
    s = tuple(strategy[0])
    dm, off, rep = device_matrix_for(s, device_num)
    x = Layout(dm, dims_map(off, range(len(s))))
    return OpSharding((s,), (x,), Layout(dm, dims_map(off, out_loops)), rep, localize=localize)


def _probe(prim, x, *rest):
    """The op's own forward on a stand-in for x: (the node that ran, the GLOBAL output shape).

    The stand-in has x's global shape and every stride 0, so it takes no memory and the shape
    ops make views of it. The op checks its other arguments with its own messages (a perm that
    is no permutation, a second -1) and resolves them against the global shape (Reshape's -1),
    so the rule and the op cannot disagree on what a call means.
    """
    node = copy.copy(prim)
    out = node.forward(numpy.broadcast_to(numpy.zeros((), dtype=bool), x.shape), *rest)
    return node, tuple(out.shape)


def reshape_sources(in_shape, out_shape, cuts):
    """For each output dimension, the input dimension whose cut it takes (None: whole).

    Raises StrategyError naming the first cut that does not survive the reshape.
    """
    in_shape, out_shape = tuple(in_shape), tuple(out_shape)
    src = [None] * len(out_shape)

    def lost(d):
        return StrategyError(f"the cut of dimension {d} ({cuts[d]}) does not survive reshape from {in_shape} to "
                             f"{out_shape}")
    if prod(in_shape) == 0:
        for d, c in enumerate(cuts):
            if c > 1:
                raise lost(d)
        return src
    ins = [d for d, n in enumerate(in_shape) if n != 1]
    outs = [j for j, n in enumerate(out_shape) if n != 1]
    i = j = 0
    while i < len(ins):
        group, lead = [ins[i]], outs[j]
        p_in, p_out = in_shape[ins[i]], out_shape[outs[j]]
        i, j = i + 1, j + 1
        while p_in != p_out:
            if p_in < p_out:
                group.append(ins[i])
                p_in *= in_shape[ins[i]]
                i += 1
            else:
                p_out *= out_shape[outs[j]]
                j += 1
        for d in group:
            c = cuts[d]
            if c == 1:
                continue
            if d != group[0] or out_shape[lead] % c:
                raise lost(d)
            src[lead] = d
    return src


def _survivors(in_shape, out_shape, cuts):
    """``cuts`` with those that do not survive the reshape set to 1."""
    keep = list(cuts)
    for d, c in enumerate(cuts):
        if c > 1:
            try:
                reshape_sources(in_shape, out_shape, [c if e == d else 1 for e in range(len(cuts))])
            except StrategyError:
                keep[d] = 1
    return tuple(keep)


class _ReshapeLike(Rule):
    """Reshape and Flatten: the target shape from the args, cuts through reshape_sources."""

    def target(self, prim, args, x):
        raise NotImplementedError

    def data_parallel(self, prim, args, device_num):
        (x,) = tensor_specs(args)
        if x.ndim == 0:
            return ((),)
        target = self.target(prim, args, x)
        c = batch_cut(x, device_num)
        for cut in range(c, 0, -1):
            if c % cut == 0:
                s = (cut,) + (1,) * (x.ndim - 1)
                try:
                    reshape_sources(x.shape, target, s)
                    return (s,)
                except StrategyError:
                    continue
        return ((1,) * x.ndim,)

    def propagate(self, prim, args, layouts, device_num):
        (x,) = tensor_specs(args)
        cuts = follow(x, layouts[0])
        target = self.target(prim, args, x)
        return first_accepted(self, prim, args, device_num, [(cuts,), (_survivors(x.shape, target, cuts),)])


@register(Reshape)
class ReshapeRule(_ReshapeLike):
    """Reshape(x, shape): the target shape (its -1 resolved with the GLOBAL size) becomes the local one."""

    def target(self, prim, args, x):
        return _probe(prim, x, args[1])[1]

    def infer(self, prim, args, strategy, device_num):
        x, s = _single(strategy, args)
        target = self.target(prim, args, x)
        src = reshape_sources(x.shape, target, s)
        local = tuple(n if d is None else n // s[d] for n, d in zip(target, src))

        def localize(coords, args):
            return [args[0], local] + list(args[2:])
        return _sharding(strategy, device_num, src, localize if local != target else None)


@register(ops.Flatten)
class FlattenRule(_ReshapeLike):
    """(N, d1, d2, ...) -> (N, d1 * d2 * ...): a Reshape that needs no localize (it reads local shapes)."""

    def target(self, prim, args, x):
        if x.ndim == 0:
            raise ValueError(f"{prim.name}: x must have at least 1 dimension (N, ...), got a 0-d tensor")
        return (x.shape[0], prod(x.shape[1:]))

    def infer(self, prim, args, strategy, device_num):
        x, s = _single(strategy, args)
        target = self.target(prim, args, x)
        return _sharding(strategy, device_num, reshape_sources(x.shape, target, s))


@register(ops.Transpose)
class TransposeRule(Rule):
    """Transpose(x, perm): output dimension i has the cut of input dimension perm[i]."""

    def infer(self, prim, args, strategy, device_num):
        x, s = _single(strategy, args)
        node, _ = _probe(prim, x, args[1])  # checks perm; the op keeps it normalised (no negative entries)
        return _sharding(strategy, device_num, list(node.perm))

    def propagate(self, prim, args, layouts, device_num):
        (x,) = tensor_specs(args)
        return first_accepted(self, prim, args, device_num, [(follow(x, layouts[0]),)])


@register(ops.ExpandDims)
class ExpandDimsRule(Rule):
    """ExpandDims(x, axis): a whole size-1 dimension inserted."""

    def infer(self, prim, args, strategy, device_num):
        x, s = _single(strategy, args)
        _probe(prim, x, args[1])  # checks axis: an int with -ndim-1 <= axis <= ndim
        nd = x.ndim
        loops = list(range(nd))
        loops.insert(index(args[1]) % (nd + 1), None)
        return _sharding(strategy, device_num, loops)

    def propagate(self, prim, args, layouts, device_num):
        (x,) = tensor_specs(args)
        return first_accepted(self, prim, args, device_num, [(follow(x, layouts[0]),)])


@register(ops.Squeeze)
class SqueezeRule(Rule):
    """Squeeze: size-1 dimensions (never cut) removed."""

    def infer(self, prim, args, strategy, device_num):
        x, s = _single(strategy, args)
        x_shape = x.shape
        if prim.axis == ():
            axes = tuple(d for d, n in enumerate(x.shape) if n == 1)
        else:
            axes = normalize_axis(prim.name, prim.axis, x.ndim)
            for a in axes:
                if x.shape[a] != 1:
                    raise ValueError(f"{prim.name}: cannot squeeze axis {a} of a tensor of shape {x.shape}: its "
                                     f"size is {x.shape[a]}, not 1")
        if not axes and any(c > 1 for c in s):
            # Nothing to squeeze, but Squeeze() run on a block cut down to size 1 would drop that
            # dimension: a Reshape to the same shape instead.
            same = Reshape().shard((s,))
            return Decomposed(lambda x: same(x, x_shape), "Squeeze of no dimension: Reshape to the same shape")
        sh = _sharding(strategy, device_num, [d for d in range(x.ndim) if d not in axes])
        # Squeeze() drops every size-1 dimension: a block cut down to size 1 must not lose it too.
        return OpSharding(sh.strategy, sh.in_layouts, sh.out_layout, sh.repeat_axes, local_attrs={"axis": axes})

    def propagate(self, prim, args, layouts, device_num):
        (x,) = tensor_specs(args)
        return first_accepted(self, prim, args, device_num, [(follow(x, layouts[0]),)])


class _KeepUntouched(Rule):
    """A one-input op that must keep some dimensions of x whole and keeps the others' cuts.

    Subclasses give ``whole(prim, args, x)``: {dimension of x: why it must be whole}, checking
    the op's arguments with the op's own messages; and ``out_loops(prim, args, x)``: for each
    output dimension, the dimension of x it continues, or None for a new (whole) one.
    """

    def whole(self, prim, args, x):
        raise NotImplementedError

    def out_loops(self, prim, args, x):
        return list(range(x.ndim))

    def infer(self, prim, args, strategy, device_num):
        x, s = _single(strategy, args)
        for d, why in self.whole(prim, args, x).items():
            if s[d] > 1:
                raise StrategyError(f"dimension {d} of x is cut {s[d]} but {why}; it must be whole (cut 1)")
        return _sharding(strategy, device_num, self.out_loops(prim, args, x))

    def data_parallel(self, prim, args, device_num):
        (x,) = tensor_specs(args)
        if x.ndim == 0:
            return ((),)
        c = 1 if 0 in self.whole(prim, args, x) else batch_cut(x, device_num)
        return ((c,) + (1,) * (x.ndim - 1),)

    def propagate(self, prim, args, layouts, device_num):
        (x,) = tensor_specs(args)
        whole = self.whole(prim, args, x)
        cuts = follow(x, layouts[0], allowed=[d for d in range(x.ndim) if d not in whole])
        return first_accepted(self, prim, args, device_num, [(cuts,)])


@register(ops.Pad)
class PadRule(_KeepUntouched):
    """Pad(paddings)(x): padded dimensions whole, the others keep their cuts (their pads are (0, 0))."""

    def whole(self, prim, args, x):
        prim.windows(x.shape)  # checks the paddings against the global shape
        return {d: f"padded by {p}" for d, p in enumerate(prim.paddings) if p != (0, 0)}


@register(ops.Tile)
class TileRule(_KeepUntouched):
    """Tile(x, dims): dimensions tiled more than once (or 0 times) whole; new leading ones whole."""

    def whole(self, prim, args, x):
        dims, _ = prim.aligned(x.shape, args[1])
        lead = len(dims) - x.ndim
        return {d: f"tiled {m} times" for d, m in enumerate(dims[lead:]) if m != 1}

    def out_loops(self, prim, args, x):
        dims, _ = prim.aligned(x.shape, args[1])
        return [None] * (len(dims) - x.ndim) + list(range(x.ndim))


@register(ops.BroadcastTo)
class BroadcastToRule(_KeepUntouched):
    """BroadcastTo(shape)(x): x's dimensions keep their cuts (a broadcast one has size 1, so cut 1);
    the target shape becomes the rank's block of it."""

    def whole(self, prim, args, x):
        prim.target(x.shape)  # checks shape against x's global shape
        return {}  # a broadcast dimension has size 1: no cut > 1 divides it, so it is whole already

    def out_loops(self, prim, args, x):
        return [None] * (len(prim.shape) - x.ndim) + list(range(x.ndim))

    def infer(self, prim, args, strategy, device_num):
        sh = super().infer(prim, args, strategy, device_num)
        x, s = _single(strategy, args)
        if all(c == 1 for c in s):
            return sh
        target = prim.target(x.shape)
        lead = len(target) - x.ndim
        local = target[:lead] + tuple(n // c for n, c in zip(target[lead:], s))
        return OpSharding(sh.strategy, sh.in_layouts, sh.out_layout, sh.repeat_axes, local_attrs={"shape": local})
