"""Sharding rules of ReduceSum, ReduceMean, ReduceMax and ReduceMin; Argmax, Argmin and CumSum.

The device matrix is the input's cuts. Reducing over a whole (uncut) axis is a plain local
reduction. Reducing over a cut axis leaves each rank with a part of the answer:

- ReduceSum: the local sums are a partial "sum" over the cut axes' device axes;
- ReduceMean: decomposed into ReduceSum (partial sum) divided by the GLOBAL count;
- ReduceMax: the local maxima are a partial "max". Its local backward would send gradient
  to each rank's local maximum, wrong on ranks that do not hold the global one, so when a
  gradient may be needed it is decomposed: m = the global max, computed without gradient,
  then ``sum(x where x == m) / count(x == m)``, which splits the gradient evenly among tied
  maxima exactly as the single-device op does;
- ReduceMin: ``-ReduceMax(-x)``.

Integer inputs of ReduceMean and ReduceMin over cut axes (where the float decompositions
would truncate or overflow differently) gather the reduced dimensions instead.

Argmax / Argmin (an index into the whole axis) and CumSum (a scan along it) need their axis
whole on every rank: a strategy must leave it cut 1; the other dimensions keep their cuts, and
propagation moves any cut or partial axis off it.
"""
from math import prod

import numpy

from minidl import ops
from minidl.ops.primitive import normalize_axis
from minidl.ops.array import Cast
from minidl.ops.math import Equal, Neg, RealDiv
from minidl.ops.reduce import ReduceMax, ReduceSum
from minidl.tensor import is_grad_enabled, no_grad

from ..layout import Layout
from .base import (Decomposed, OpSharding, Rule, StrategyError, check_strategy_shape, device_matrix_for, register,
                   tensor_specs)
from .elementwise import KeepWhere, dims_map, first_accepted, follow

__all__ = ["ReduceRule", "PartialReduceMax", "WholeAxisRule"]


class PartialReduceMax(ReduceMax):
    """ReduceMax whose rule leaves cut reduced axes as a partial "max" (used without gradient)."""


def _axes(prim, args, x):
    axis = args[1] if len(args) > 1 else ()
    return () if x.ndim == 0 else normalize_axis(prim.name, axis, x.ndim)


def _floating(spec):
    return numpy.dtype(spec.dtype).kind in "fc"


class _Plan:
    """One reduction call under a strategy: x, the reduced axes, and the cuts of input and output."""

    def __init__(self, prim, args, strategy):
        check_strategy_shape(strategy, args)
        (self.x,) = tensor_specs(args)
        self.axes = _axes(prim, args, self.x)
        self.s = tuple(strategy[0])
        kept = prim.keep_dims
        self.out_s = tuple(1 if d in self.axes else c for d, c in enumerate(self.s) if kept or d not in self.axes)
        self.cut_reduced = [d for d in self.axes if self.s[d] > 1]

    def sharding(self, prim, device_num, partial_op=None):
        """The local reduction; cut reduced axes left partial with ``partial_op``."""
        x, axes, s = self.x, self.axes, self.s
        dm, off, rep = device_matrix_for(s, device_num)
        out_map = tuple(() if d in axes else (off + d,) for d in range(x.ndim) if prim.keep_dims or d not in axes)
        partial = tuple((off + d, partial_op) for d in self.cut_reduced) if partial_op else ()
        return OpSharding((s,), (Layout(dm, dims_map(off, range(x.ndim))),), Layout(dm, out_map, partial), rep)

    def gathered(self, prim, why):
        """Decomposed: the same reduction with the reduced dimensions whole (the dispatcher gathers them)."""
        whole = tuple(1 if d in self.axes else c for d, c in enumerate(self.s))
        op = type(prim)(prim.keep_dims).shard((whole,))
        return Decomposed(lambda x, *rest: op(x, *rest),
                          f"{prim.name} of {why} over cut dimensions: gather them, then reduce locally with "
                          f"strategy ({whole},)")


class ReduceRule(Rule):
    """What the reductions share: data-parallel default, and propagation that keeps partial
    axes off the reduced dimensions (a cut there needs no further communication)."""

    def propagate(self, prim, args, layouts, device_num):
        (x,) = tensor_specs(args)
        return first_accepted(self, prim, args, device_num, [(follow(x, layouts[0], avoid=_axes(prim, args, x)),)])


@register(ReduceSum)
class ReduceSumRule(ReduceRule):
    def infer(self, prim, args, strategy, device_num):
        return _Plan(prim, args, strategy).sharding(prim, device_num, "sum")


@register(PartialReduceMax)
class PartialReduceMaxRule(ReduceRule):
    def infer(self, prim, args, strategy, device_num):
        return _Plan(prim, args, strategy).sharding(prim, device_num, "max")


@register(ops.ReduceMean)
class ReduceMeanRule(ReduceRule):
    def infer(self, prim, args, strategy, device_num):
        plan = _Plan(prim, args, strategy)
        if not plan.cut_reduced:
            return plan.sharding(prim, device_num)
        if not _floating(plan.x):
            return plan.gathered(prim, f"dtype {numpy.dtype(plan.x.dtype)}")
        count = prod(plan.x.shape[d] for d in plan.axes)
        total = ReduceSum(prim.keep_dims).shard((plan.s,))
        divide = RealDiv().shard((plan.out_s, ()))

        def fn(x, *rest):
            # Divides (as numpy's mean does) rather than multiplying by 1/count: one rounding fewer.
            return divide(total(x, *rest), float(max(count, 1)))
        return Decomposed(fn, f"ReduceMean over cut dimensions: ReduceSum (a partial sum), then divide by the "
                              f"global count {count}")


@register(ReduceMax)
class ReduceMaxRule(ReduceRule):
    def infer(self, prim, args, strategy, device_num):
        plan = _Plan(prim, args, strategy)
        if not plan.cut_reduced:
            return plan.sharding(prim, device_num)
        x, s, out_s, kd = plan.x, plan.s, plan.out_s, prim.keep_dims
        # TensorSpec may say whether x requires a gradient; without that, assume it may.
        if not (_floating(x) and is_grad_enabled() and getattr(x, "requires_grad", True)):
            return plan.sharding(prim, device_num, "max")
        kept = tuple(1 if d in plan.axes else c for d, c in enumerate(s))
        peak = PartialReduceMax(keep_dims=True).shard((s,))
        is_peak = Equal().shard((s, kept))
        to_float = Cast().shard((s,))
        keep = KeepWhere().shard((s, s))
        count = ReduceSum(kd).shard((s,))
        total = ReduceSum(kd).shard((s,))
        divide = RealDiv().shard((out_s, out_s))

        def fn(x, *rest):
            with no_grad():
                # m is a partial max: Equal completes it (one all-reduce); the mask, cut like x,
                # then serves both sums without moving again.
                mask = is_peak(x, peak(x, *rest))
            n = count(to_float(mask, x.dtype), *rest)
            return divide(total(keep(x, mask), *rest), n)
        return Decomposed(fn, "ReduceMax over cut dimensions with a gradient: m = global max (partial max, no "
                              "gradient), mask = (x == m), then ReduceSum(x where mask) / ReduceSum(mask)")


@register(ops.ReduceMin)
class ReduceMinRule(ReduceRule):
    def infer(self, prim, args, strategy, device_num):
        plan = _Plan(prim, args, strategy)
        if not plan.cut_reduced:
            return plan.sharding(prim, device_num)
        if not _floating(plan.x):
            return plan.gathered(prim, f"dtype {numpy.dtype(plan.x.dtype)}")
        neg_in = Neg().shard((plan.s,))
        peak = ReduceMax(prim.keep_dims).shard((plan.s,))
        neg_out = Neg().shard((plan.out_s,))
        return Decomposed(lambda x, *rest: neg_out(peak(neg_in(x), *rest)),
                          "ReduceMin over cut dimensions: -ReduceMax(-x)")


@register(ops.Argmax, ops.Argmin, ops.CumSum)
class WholeAxisRule(Rule):
    """Argmax / Argmin (the axis is dropped from the output) and CumSum (same shape out): the axis
    stays whole, every other dimension keeps its cut."""

    @staticmethod
    def _axis(prim, args):
        (x,) = tensor_specs(args)
        axis = prim.axis if isinstance(prim, (ops.Argmax, ops.Argmin)) else args[1]
        return x, (normalize_axis(prim.name, axis, x.ndim)[0] if x.ndim else None)

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        x, axis = self._axis(prim, args)
        s = tuple(strategy[0])
        if axis is not None and s[axis] != 1:
            raise StrategyError(f"dimension {axis} of input 0 is the {prim.name} axis and is cut {s[axis]}; it must be "
                                f"whole (cut 1)")
        dm, off, rep = device_matrix_for(s, device_num)
        in_map = dims_map(off, range(x.ndim))
        keeps = isinstance(prim, ops.CumSum) or axis is None
        out_map = in_map if keeps else in_map[:axis] + in_map[axis + 1:]
        return OpSharding((s,), (Layout(dm, in_map),), Layout(dm, out_map), rep)

    def data_parallel(self, prim, args, device_num):
        x, axis = self._axis(prim, args)
        (s,) = super().data_parallel(prim, args, device_num)
        return (tuple(1 if d == axis else c for d, c in enumerate(s)),)

    def propagate(self, prim, args, layouts, device_num):
        x, axis = self._axis(prim, args)
        allowed = [d for d in range(x.ndim) if d != axis]
        return first_accepted(self, prim, args, device_num, [(follow(x, layouts[0], allowed=allowed),)])
