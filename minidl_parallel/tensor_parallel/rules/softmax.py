"""Sharding rules of Softmax, LogSoftmax, the two softmax cross-entropies, NLLLoss and OneHot.

A softmax over whole (uncut) axes runs locally. Over a cut axis it is decomposed into
sharded primitives: the global max (a partial max, without gradient: softmax does not
depend on the shift), exp(x - max), its sum over the axis (a partial sum), then the ratio
or ``x - max - log(sum)``. The cross-entropies with the class dimension cut go through that
LogSoftmax, a Mul with the labels and a ReduceSum over the classes; the sparse one first
expands its labels with a OneHot cut like the logits.

NLLLoss(inputs, target, weight) keeps the class dimension whole (a rank picks each sample's
class from its own block) and the other dimensions cut as the strategy says, the target cut like
them and the weight whole. 'none' gives the per-sample loss cut like the target; 'sum' a partial
sum over the cut axes; 'mean' divides the sum by the summed weights of the counted targets of the
WHOLE batch, so with a cut batch it runs as two sharded 'sum' NLLLosses (the loss, and the same
op on log-probabilities of -1, whose sum is that denominator) and a division of the reduced scalars.

OneHot's strategy, as MindSpore's, gives the OUTPUT's cuts (``((n, c), (), ())`` for
indices (N,) and axis -1). With the classes cut in c, each rank builds its block of depth
``depth / c`` from indices shifted by its block's first class; indices outside the block
give off_value, as out-of-range indices do in minidl's OneHot.
"""
import numpy

from minidl import ops
from minidl.backend import get_array_module
from minidl.ops.activation import LogSoftmax
from minidl.ops.array import Cast, OneHot, OnesLike
from minidl.ops.loss import NLLLoss, SoftmaxCrossEntropyWithLogits, host_label_checks
from minidl.ops.math import Exp, Log, Mul, Neg, RealDiv, Sub
from minidl.ops.primitive import Primitive, normalize_axis
from minidl.ops.reduce import ReduceSum
from minidl.tensor import no_grad

from ..layout import Layout
from .base import (Decomposed, OpSharding, Rule, StrategyError, TensorSpec, check_strategy_shape,
                   device_matrix_for, largest_cut, register, tensor_specs)
from .elementwise import UnaryRule, dims_map, first_accepted, follow
from .reduce import PartialReduceMax

__all__ = ["SoftmaxRule", "SoftmaxCrossEntropyRule", "SparseSoftmaxCrossEntropyRule", "NLLLossRule", "OneHotRule"]


def _softmax_axes(prim, x):
    # Softmax and LogSoftmax check their axis when made (an int or a non-empty tuple of ints).
    return () if x.ndim == 0 else normalize_axis(prim.name, prim.axis, x.ndim)


def _plain(s, device_num):
    dm, off, rep = device_matrix_for(s, device_num)
    return Layout(dm, dims_map(off, range(len(s)))), rep


@register(ops.Softmax, LogSoftmax)
class SoftmaxRule(Rule):
    """Softmax / LogSoftmax: local over whole axes, decomposed over cut ones (module docstring)."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        (x,) = tensor_specs(args)
        s = tuple(strategy[0])
        axes = _softmax_axes(prim, x)
        if not any(s[d] > 1 for d in axes):
            lay, rep = _plain(s, device_num)
            return OpSharding((s,), (lay,), lay, rep)
        log = prim.name == "LogSoftmax"
        kept = tuple(1 if d in axes else c for d, c in enumerate(s))
        peak = PartialReduceMax(keep_dims=True).shard((s,))
        shift = Sub().shard((s, kept))
        exp = Exp().shard((s,))
        total = ReduceSum(keep_dims=True).shard((s,))
        if log:
            log_total, finish = Log().shard((kept,)), Sub().shard((s, kept))
        else:
            finish = RealDiv().shard((s, kept))

        def fn(x):
            with no_grad():
                m = peak(x, axes)
            z = shift(x, m)
            e = exp(z)
            t = total(e, axes)
            return finish(z, log_total(t)) if log else finish(e, t)
        return Decomposed(fn, f"{prim.name} over cut dimensions {tuple(d for d in axes if s[d] > 1)}: global max "
                              f"(no gradient), exp(x - max), partial sum, then "
                              f"{'x - max - log(sum)' if log else 'exp / sum'}")

    def data_parallel(self, prim, args, device_num):
        (x,) = tensor_specs(args)
        axes = _softmax_axes(prim, x)
        c = 1 if 0 in axes or x.ndim == 0 or x.is_parameter else largest_cut(x.shape[0], device_num)
        return ((c,) + (1,) * (x.ndim - 1),) if x.ndim else ((),)

    def propagate(self, prim, args, layouts, device_num):
        (x,) = tensor_specs(args)
        return first_accepted(self, prim, args, device_num,
                              [(follow(x, layouts[0], avoid=_softmax_axes(prim, x)),)])


def _batch(specs, device_num):
    """The data-parallel cut of the batch, shared by logits and labels (unless both are Parameters)."""
    logits, labels = specs
    if logits.is_parameter and labels.is_parameter:
        return 1
    return largest_cut(logits.shape[0], device_num)


def _check_logits(prim, logits):
    if logits.ndim != 2:
        raise ValueError(f"{prim.name}: logits must be 2-D (N, C), got shape {logits.shape}")


@register(SoftmaxCrossEntropyWithLogits)
class SoftmaxCrossEntropyRule(Rule):
    """Dense labels (N, C), cut exactly like the logits; the loss (N,) is cut like the batch."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        logits, labels = tensor_specs(args)
        _check_logits(prim, logits)
        s_l, s_t = (tuple(s) for s in strategy)
        if s_l != s_t:
            raise StrategyError(f"logits and labels must be cut the same way, got {s_l} and {s_t}")
        n, c = s_l
        lay, rep = _plain(s_l, device_num)
        if c == 1:
            off = len(lay.device_matrix) - 2
            return OpSharding((s_l, s_t), (lay, lay), Layout(lay.device_matrix, ((off,),)), rep)
        log_softmax = LogSoftmax(axis=1).shard((s_l,))
        mul = Mul().shard((s_l, s_l))
        total = ReduceSum().shard((s_l,))
        neg = Neg().shard(((n,),))

        def fn(logits, labels):
            return neg(total(mul(log_softmax(logits), labels), 1))
        return Decomposed(fn, f"{prim.name} with the classes cut in {c}: -ReduceSum(LogSoftmax(logits) * labels, 1)")

    def data_parallel(self, prim, args, device_num):
        n = _batch(tensor_specs(args), device_num)
        return (n, 1), (n, 1)

    def propagate(self, prim, args, layouts, device_num):
        logits, labels = tensor_specs(args)
        pick = 0 if not logits.is_parameter or labels.is_parameter else 1
        cuts = follow((logits, labels)[pick], layouts[pick], avoid=(1,))
        return first_accepted(self, prim, args, device_num, [(cuts, cuts), ((cuts[0], 1), (cuts[0], 1))])


@register(ops.SparseSoftmaxCrossEntropyWithLogits)
class SparseSoftmaxCrossEntropyRule(Rule):
    """Class indices (N,) cut like the logits' batch; a class cut goes through OneHot + the dense path."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        logits, labels = tensor_specs(args)
        _check_logits(prim, logits)
        s_l, s_t = (tuple(s) for s in strategy)
        n, c = s_l
        if s_t != (n,):
            raise StrategyError(f"the labels' cut {s_t[0]} must equal the cut {n} of the logits' batch dimension")
        lay, rep = _plain(s_l, device_num)
        off = len(lay.device_matrix) - 2
        if c == 1:
            batch = Layout(lay.device_matrix, ((off,),))
            return OpSharding((s_l, s_t), (lay, batch), batch, rep)
        depth = logits.shape[1]
        one_hot = OneHot().shard((s_l, (), ()))
        cast = Cast().shard((s_l,))
        dense = SoftmaxCrossEntropyWithLogits().shard((s_l, s_l))
        validity = LabelValidity(depth).shard(((n,),))
        column = ops.ExpandDims().shard(((n,),))
        poison = Mul().shard((s_l, (n, 1)))

        def fn(logits, labels):
            target = cast(one_hot(labels, depth, 1.0, 0.0), logits.dtype)
            if isinstance(labels.data, numpy.ndarray) or host_label_checks():
                _check_labels(prim, labels, depth)
            else:  # device labels: a bad one makes its sample's loss NaN, with no host sync (ops/loss.py)
                target = poison(target, column(validity(labels), 1))
            return dense(logits, target)
        return Decomposed(fn, f"{prim.name} with the classes cut in {c}: OneHot(labels) cut like the logits, then "
                              f"the dense SoftmaxCrossEntropyWithLogits")

    def data_parallel(self, prim, args, device_num):
        n = _batch(tensor_specs(args), device_num)
        return (n, 1), (n,)

    def propagate(self, prim, args, layouts, device_num):
        logits, labels = tensor_specs(args)
        if logits.is_parameter and not labels.is_parameter:
            cuts = (follow(labels, layouts[1])[0], 1)
        else:
            cuts = follow(logits, layouts[0], avoid=(1,))
        return first_accepted(self, prim, args, device_num, [(cuts, (cuts[0],)), ((cuts[0], 1), (cuts[0],))])


class LabelValidity(Primitive):
    """1.0 where a label lies in [0, depth), NaN elsewhere (float32): multiplied into the one-hot
    target of the class-split cross-entropy, it makes a bad device label's loss NaN, as the fused
    op does (minidl/ops/loss.py host_label_checks), where the one-hot alone would give a silent 0."""

    def __init__(self, depth):
        super().__init__()
        self.depth = depth

    def forward(self, labels):
        xp = get_array_module(labels)
        bad = (labels < 0) | (labels >= self.depth)
        return xp.where(bad, numpy.float32("nan"), numpy.float32(1.0))

    def backward(self, gy):
        return (None,)


register(LabelValidity)(UnaryRule)


def _check_labels(prim, labels, depth):
    """The range check the fused op makes, which the OneHot path would skip (giving a zero loss)."""
    y = labels.data if hasattr(labels, "data") else labels
    if y.size and bool(((y < 0) | (y >= depth)).any()):
        first = int(y[(y < 0) | (y >= depth)].reshape(-1)[0])
        raise ValueError(f"{prim.name}: label {first} is out of range for {depth} classes "
                         f"(expected 0 <= label < {depth})")


@register(NLLLoss)
class NLLLossRule(Rule):
    """NLLLoss: classes whole, other dimensions cut; 'mean' over a cut batch decomposed (module docstring)."""

    @staticmethod
    def _class_dim(args):
        return 0 if tensor_specs(args)[0].ndim == 1 else 1

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        specs = tensor_specs(args)
        x = specs[0]
        k = self._class_dim(args)
        strategy = tuple(tuple(s) for s in strategy)
        s_x, s_t = strategy[:2]
        if s_x[k] > 1:
            raise StrategyError(f"the class dimension {k} of the log-probabilities is cut {s_x[k]}; NLLLoss needs "
                                f"whole classes")
        batch = s_x[:k] + s_x[k + 1:]
        if s_t != batch:
            raise StrategyError(f"the target's strategy {s_t} must be {batch}, the cuts of the log-probabilities' "
                                f"dimensions other than the classes")
        if len(strategy) > 2 and strategy[2] != (1,):
            raise StrategyError(f"the weight's strategy {strategy[2]} must be (1,): class weights stay whole")
        cut = any(c > 1 for c in batch)
        if prim.reduction == "mean" and cut:
            return Decomposed(self._mean(prim, strategy), f"{prim.name} 'mean' over a batch cut {batch}: the sharded "
                                                          f"sum of the losses over the sharded sum of the weights")
        dm, off, rep = device_matrix_for(s_x, device_num)
        x_lay = Layout(dm, dims_map(off, range(x.ndim)))
        t_lay = Layout(dm, dims_map(off, [d for d in range(x.ndim) if d != k]))
        in_layouts = (x_lay, t_lay) + ((Layout(dm, ((),)),) if len(specs) > 2 else ())
        if prim.reduction == "none":
            out = t_lay
        else:  # a scalar: each rank's sum over its block
            out = Layout(dm, (), tuple((off + d, "sum") for d, c in enumerate(s_x) if c > 1))
        return OpSharding(strategy, in_layouts, out, rep)

    @staticmethod
    def _mean(prim, strategy):
        s_x = strategy[0]
        total = NLLLoss("sum", prim.ignore_index, prim.label_smoothing).shard(strategy)
        count = NLLLoss("sum", prim.ignore_index).shard(strategy)
        ones, neg = OnesLike().shard((s_x,)), Neg().shard((s_x,))
        div = RealDiv().shard(((), ()))

        def fn(x, target, *weight):
            with no_grad():
                # -weight[t] * (-1) summed over the counted targets: the mean's denominator
                denominator = count(neg(ones(x)), target, *weight)
            return div(total(x, target, *weight), denominator)
        return fn

    def data_parallel(self, prim, args, device_num):
        specs = tensor_specs(args)
        x, k = specs[0], self._class_dim(args)
        c = 1 if k == 0 or (x.is_parameter and specs[1].is_parameter) else largest_cut(x.shape[0], device_num)
        s_x = tuple(c if d == 0 and k != 0 else 1 for d in range(x.ndim))
        return (s_x, s_x[:k] + s_x[k + 1:]) + (((1,),) if len(specs) > 2 else ())

    def propagate(self, prim, args, layouts, device_num):
        specs = tensor_specs(args)
        x, k = specs[0], self._class_dim(args)
        s_x = follow(x, layouts[0], allowed=[d for d in range(x.ndim) if d != k])
        w = ((1,),) if len(specs) > 2 else ()
        return first_accepted(self, prim, args, device_num, [(s_x, s_x[:k] + s_x[k + 1:]) + w])


@register(OneHot)
class OneHotRule(Rule):
    """OneHot(indices, depth, on_value, off_value); the strategy is the output's (module docstring)."""

    @staticmethod
    def _class_dim(prim, indices):
        return indices.ndim if prim.axis == -1 else prim.axis

    def infer(self, prim, args, strategy, device_num):
        strategy = tuple(tuple(s) for s in strategy)
        indices = args[0]
        if not isinstance(indices, TensorSpec):
            raise StrategyError("indices must be a tensor")
        if len(args) > 1 and isinstance(args[1], TensorSpec):
            raise StrategyError("depth must be a Python int when OneHot runs sharded, got a tensor")
        extra = [i for i in (2, 3) if i < len(args) and isinstance(args[i], TensorSpec)]
        if len(strategy) not in (3, 1 + len(extra)):
            raise StrategyError(f"the strategy has {len(strategy)} tuple(s); OneHot takes 3 (the output's cuts, "
                                f"then () for on_value and () for off_value)")
        rest = strategy[1:]
        for i, s in enumerate(rest):
            if s:
                raise StrategyError(f"on_value and off_value are scalars: their strategies must be (), got {s}")
        depth = int(args[1])
        if not -1 <= prim.axis <= indices.ndim:
            raise ValueError(f"OneHot: axis {prim.axis} is out of range for indices of rank {indices.ndim} "
                             f"(expected -1 <= axis <= {indices.ndim})")
        k = self._class_dim(prim, indices)
        out_shape = indices.shape[:k] + (depth,) + indices.shape[k:]
        s = strategy[0]
        if len(s) != len(out_shape):
            raise StrategyError(f"OneHot's strategy describes its output of rank {len(out_shape)} (shape "
                                f"{out_shape}), but {s} has {len(s)} cut(s)")
        for d, (n, c) in enumerate(zip(out_shape, s)):
            if n % c:
                what = f"depth {depth}" if d == k else f"dimension {d} of the output (size {n})"
                raise StrategyError(f"{what} is not divisible by its cut {c}")
        dm, off, rep = device_matrix_for(s, device_num)
        out = Layout(dm, dims_map(off, range(len(s))))
        idx = Layout(dm, dims_map(off, [d for d in range(len(s)) if d != k]))
        scalar = Layout(dm, ())
        in_layouts = (idx,) + (scalar,) * len(extra)
        c = s[k]
        local_depth, axis = depth // c, off + k

        def localize(coords, args):
            args = list(args)
            xp = get_array_module(args[0])
            # int64 first: shifting a small unsigned dtype would wrap around into the block.
            args[0] = args[0].astype(xp.int64) - coords[axis] * local_depth
            args[1] = local_depth
            return args
        return OpSharding(strategy, in_layouts, out, rep, localize=localize if c > 1 else None)

    def data_parallel(self, prim, args, device_num):
        indices = args[0]
        k = self._class_dim(prim, indices)
        nd = indices.ndim + 1
        c = 1 if indices.ndim == 0 or indices.is_parameter else largest_cut(indices.shape[0], device_num)
        batch = 1 if k == 0 else 0
        return (tuple(c if d == batch and indices.ndim else 1 for d in range(nd)), (), ())

    def propagate(self, prim, args, layouts, device_num):
        indices = args[0]
        k = self._class_dim(prim, indices)
        cuts = list(follow(indices, layouts[0]))
        cuts.insert(k, 1)
        return first_accepted(self, prim, args, device_num, [(tuple(cuts), (), ())])
