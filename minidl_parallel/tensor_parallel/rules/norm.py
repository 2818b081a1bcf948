"""Sharding rules of BatchNorm, its synchronised op and the fused BatchNormReLU (batch and channel
cuts), and of LayerNorm and GroupNorm (per-sample statistics).

Strategy ``((n, c, 1, 1), (c,), (c,), (c,), (c,))`` for (x, scale, bias, mean, variance), as
MindSpore's; mean and variance may be absent (None) in training. The device matrix is
[n, c]; scale, bias and the running statistics are cut like the channels.

- Channels cut, batch whole, or inference: each rank normalises its block with its
  channels' statistics; no communication.
- Batch cut in training: the statistics must be those of the whole batch, or the sharded
  network would not be the single-device one. BatchNorm then runs as minidl_parallel's
  SyncBatchNormOp (BatchNorm whose per-channel sums are all-reduced) over the group of ranks
  that hold the other batch blocks of the same channels (2 small all-reduces forward, 1
  backward). The rule gets that group from the dispatcher's :class:`~.base.Site` (a callable
  ``local_attrs``). Scale and bias gradients are this block's sums, partial over the batch
  axis, which the dispatcher reduces as for any op.
- SyncBatchNormOp itself (a user's ``SyncBatchNorm`` cell): under (semi-)auto parallel the
  network means the single-device one, whose statistics are the whole logical batch's, so
  its group is always the rule's (the ranks of the other batch blocks), never the cell's;
  with the batch whole it runs as plain BatchNorm.
- BatchNormReLU, ``relu(batch_norm(x) + residual)``: BatchNorm's strategy, and the residual
  (when given) cut as x. Where BatchNorm runs on blocks, the fused op does too; with the
  batch cut in training it runs as the separate ops BatchNorm (synchronised as above), Add
  and ReLU, each with its own rule.

H and W cuts would need spatial statistics across blocks too and are refused.

LayerNorm and GroupNorm take each sample's statistics, so every dimension a statistic spans must
stay whole, and the others keep their cuts with no communication:

- LayerNorm ``(x, gamma, beta)``: the normalised dimensions (``begin_norm_axis`` on) whole; the
  batch and sequence dimensions before them cut freely. gamma and beta cover x's trailing
  dimensions from ``begin_params_axis`` and must be cut as x is there (whole, when they cover
  only normalised dimensions). Their gradients are sums over the rank's block, partial over the
  batch and sequence cuts, which the dispatcher reduces.
- GroupNorm ``(x, gamma, beta)``, x (N, C, *): spatial dimensions whole; the batch cut freely;
  the channels cut c only when c divides num_groups, so that each rank holds whole groups (it
  then runs num_groups / c groups); gamma and beta cut like the channels.
"""
from minidl import ops

from ...sync_batchnorm import SyncBatchNormOp
from ..layout import Layout
from .base import (Decomposed, OpSharding, Rule, StrategyError, TensorSpec, check_strategy_shape, device_matrix_for,
                   register, tensor_specs)
from .elementwise import batch_cut, dims_map, first_accepted, follow

__all__ = ["BatchNormRule", "SyncBatchNormRule", "BatchNormReLURule", "LayerNormRule", "GroupNormRule"]


def _has_residual(args):
    """BatchNormReLU's sixth argument, the residual, is given (a tensor)."""
    return len(args) > 5 and isinstance(args[5], TensorSpec)


def _split(args, strategy):
    """(BatchNorm's five arguments, their strategy, the residual's strategy or None).

    Mean and variance may be None, so the residual's tuple is found by position (the last
    one), not by count.
    """
    strategy = tuple(tuple(s) for s in strategy)
    if _has_residual(args):
        return args[:5], strategy[:-1], strategy[-1]
    return args[:5], strategy, None


def _layouts(prim, args, strategy, device_num):
    """(x's cuts, x's layout, a per-channel vector's layout, repeat axes, the batch's device axis)."""
    check_strategy_shape(strategy, args)
    specs = tensor_specs(args)
    x = specs[0]
    if x.ndim < 2:
        raise ValueError(f"{prim.name}: x must have at least 2 dimensions, got shape {x.shape}")
    axis = 1 if prim.data_format == "NCHW" else x.ndim - 1
    s_x = tuple(strategy[0])
    spatial = [d for d in range(1, x.ndim) if d != axis and s_x[d] > 1]
    if spatial:
        raise StrategyError(f"x's strategy {s_x} cuts dimension(s) {spatial}: only the batch (0) and the channels "
                            f"({axis}) of a BatchNorm input can be cut")
    c = s_x[axis]
    for i, s in enumerate(strategy[1:], start=1):
        if tuple(s) != (c,):
            raise StrategyError(f"input {i} (a per-channel vector) has strategy {tuple(s)}; it must be ({c},), the "
                                f"cut of x's channel dimension {axis}")
    dm, off, rep = device_matrix_for((s_x[0], c), device_num)
    a_n, a_c = off, off + 1
    x_map = tuple((a_n,) if d == 0 else (a_c,) if d == axis else () for d in range(x.ndim))
    return s_x, Layout(dm, x_map), Layout(dm, ((a_c,),)), rep, a_n


def _in_layouts(args, x_layout, vec_layout):
    """The layouts of x, the per-channel vectors and the residual (laid out as x) when given."""
    n_vectors = len(tensor_specs(args[:5])) - 1
    return (x_layout,) + (vec_layout,) * n_vectors + ((x_layout,) if _has_residual(args) else ())


class _BatchNormBase(Rule):
    def data_parallel(self, prim, args, device_num):
        specs = tensor_specs(args[:5])
        x = specs[0]
        s_x = (batch_cut(x, device_num),) + (1,) * (x.ndim - 1)
        return _strategy(args, s_x, (1,), len(specs) - 1)

    def propagate(self, prim, args, layouts, device_num):
        specs = tensor_specs(args[:5])
        x = specs[0]
        axis = 1 if prim.data_format == "NCHW" else x.ndim - 1
        cuts = tuple(follow(x, layouts[0], allowed=(0, axis)))
        return first_accepted(self, prim, args, device_num, [_strategy(args, cuts, (cuts[axis],), len(specs) - 1)])


def _strategy(args, s_x, s_vec, n_vectors):
    """x's cuts, then each per-channel vector's, then the residual's (x's) when it is given."""
    return (s_x,) + (s_vec,) * n_vectors + ((s_x,) if _has_residual(args) else ())


@register(ops.BatchNorm)
class BatchNormRule(_BatchNormBase):
    """BatchNorm (see the module docstring)."""

    def infer(self, prim, args, strategy, device_num):
        s_x, x_lay, vec, rep, _ = _layouts(prim, args, strategy, device_num)
        strategy = tuple(tuple(s) for s in strategy)
        if prim.is_training and s_x[0] > 1:
            sync = SyncBatchNormOp(prim.epsilon, prim.momentum, prim.data_format).shard(strategy)
            return Decomposed(sync, f"BatchNorm with the batch cut in {s_x[0]}: SyncBatchNormOp, statistics over "
                                    f"the ranks of the other batch blocks")
        return OpSharding(strategy, _in_layouts(args, x_lay, vec), x_lay, rep)


@register(SyncBatchNormOp)
class SyncBatchNormRule(_BatchNormBase):
    """SyncBatchNormOp: BatchNorm's layouts, its statistics over the ranks of the other batch blocks."""

    def infer(self, prim, args, strategy, device_num):
        s_x, x_lay, vec, rep, a_n = _layouts(prim, args, strategy, device_num)
        strategy = tuple(tuple(s) for s in strategy)
        if s_x[0] == 1:  # every rank holds the whole batch of its channels: nothing to synchronise
            plain = ops.BatchNorm(True, prim.epsilon, prim.momentum, prim.data_format).shard(strategy)
            return Decomposed(plain, "SyncBatchNormOp with the batch whole: BatchNorm on each block")
        return OpSharding(strategy, _in_layouts(args, x_lay, vec), x_lay, rep,
                          local_attrs=_statistics_group(x_lay, a_n))


def _statistics_group(x_layout, batch_axis):
    """``local_attrs(site)``: the group of the ranks holding the other batch blocks of this rank's channels."""
    def local_attrs(site):
        return {"group": site.group(x_layout, (batch_axis,))}
    return local_attrs


@register(ops.BatchNormReLU)
class BatchNormReLURule(_BatchNormBase):
    """BatchNormReLU: fused on blocks, or the separate ops when the statistics span ranks (module docstring)."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        bn_args, bn_strategy, s_res = _split(args, strategy)
        s_x, x_lay, vec, rep, _ = _layouts(prim, bn_args, bn_strategy, device_num)
        if s_res is not None:
            x, residual = bn_args[0], args[5]
            if residual.shape != x.shape:
                raise ValueError(f"{prim.name}: residual of shape {residual.shape} must have x's shape {x.shape}")
            if s_res != s_x:
                raise StrategyError(f"input {len(strategy) - 1} (the residual) has strategy {s_res}; it must be cut "
                                    f"as x, {s_x}")
        strategy = tuple(tuple(s) for s in strategy)
        if prim.is_training and s_x[0] > 1:
            return Decomposed(_separate(prim, bn_strategy, s_x),
                              f"BatchNormReLU with the batch cut in {s_x[0]}: BatchNorm (synchronised), Add and ReLU")
        return OpSharding(strategy, _in_layouts(args, x_lay, vec), x_lay, rep)


def _separate(prim, bn_strategy, s_x):
    """``relu(batch_norm(x) + residual)`` as the ops BatchNorm, Add and ReLU, each sharded as x."""
    bn = ops.BatchNorm(prim.is_training, prim.epsilon, prim.momentum, prim.data_format).shard(bn_strategy)
    add = ops.Add().shard((s_x, s_x))
    relu = ops.ReLU().shard((s_x,))

    def fn(x, scale, bias, mean=None, variance=None, residual=None):
        y = bn(x, scale, bias, mean, variance)
        return relu(y if residual is None else add(y, residual))
    return fn


# ---- LayerNorm and GroupNorm ---------------------------------------------------------------------

@register(ops.LayerNorm)
class LayerNormRule(Rule):
    """LayerNorm: the normalised dimensions whole, gamma and beta cut as x's dimensions they cover."""

    @staticmethod
    def _axes(prim, args):
        x, gamma, beta = tensor_specs(args)
        norm_axes, p = prim.axes(x.ndim)
        for name, a in (("gamma", gamma), ("beta", beta)):
            if a.shape != x.shape[p:]:
                raise ValueError(f"{prim.name}: {name} of shape {a.shape} must be x.shape[begin_params_axis="
                                 f"{prim.begin_params_axis}:] = {x.shape[p:]} (x of shape {x.shape})")
        return x, norm_axes, p

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        x, norm_axes, p = self._axes(prim, args)
        s_x = tuple(strategy[0])
        cut = [d for d in norm_axes if s_x[d] > 1]
        if cut:
            raise StrategyError(f"x's strategy {s_x} cuts dimension(s) {cut}, which LayerNorm normalises "
                                f"(begin_norm_axis={prim.begin_norm_axis}); normalised dimensions must be whole")
        for i, name in ((1, "gamma"), (2, "beta")):
            if tuple(strategy[i]) != s_x[p:]:
                raise StrategyError(f"input {i} ({name}) has strategy {tuple(strategy[i])}; it must be {s_x[p:]}, "
                                    f"the cuts of the dimensions of x it covers (from {p})")
        dm, off, rep = device_matrix_for(s_x, device_num)
        x_lay = Layout(dm, dims_map(off, range(x.ndim)))
        p_lay = Layout(dm, dims_map(off, range(p, x.ndim)))
        return OpSharding(tuple(tuple(s) for s in strategy), (x_lay, p_lay, p_lay), x_lay, rep)

    def data_parallel(self, prim, args, device_num):
        x, norm_axes, p = self._axes(prim, args)
        s_x = tuple(batch_cut(x, device_num) if d == 0 and d not in norm_axes else 1 for d in range(x.ndim))
        return s_x, s_x[p:], s_x[p:]

    def propagate(self, prim, args, layouts, device_num):
        x, norm_axes, p = self._axes(prim, args)
        s_x = follow(x, layouts[0], allowed=[d for d in range(x.ndim) if d not in norm_axes])
        return first_accepted(self, prim, args, device_num, [(s_x, s_x[p:], s_x[p:])])


@register(ops.GroupNorm)
class GroupNormRule(Rule):
    """GroupNorm: batch cut freely, channels cut in whole groups, spatial dimensions whole."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        x = tensor_specs(args)[0]
        if x.ndim < 2:
            raise ValueError(f"{prim.name}: x must be (N, C, ...), got shape {x.shape}")
        s_x = tuple(strategy[0])
        spatial = [d for d in range(2, x.ndim) if s_x[d] > 1]
        if spatial:
            raise StrategyError(f"x's strategy {s_x} cuts dimension(s) {spatial}: the group statistics span the "
                                f"spatial dimensions, which must be whole")
        c, g = s_x[1], prim.num_groups
        if g % c:
            raise StrategyError(f"the channels are cut {c}, which does not divide num_groups={g}: each rank must "
                                f"hold whole groups")
        for i, name in ((1, "gamma"), (2, "beta")):
            if tuple(strategy[i]) != (c,):
                raise StrategyError(f"input {i} ({name}) has strategy {tuple(strategy[i])}; it must be ({c},), "
                                    f"the cut of x's channels")
        dm, off, rep = device_matrix_for(s_x, device_num)
        x_lay = Layout(dm, dims_map(off, range(x.ndim)))
        vec = Layout(dm, ((off + 1,),))
        return OpSharding(tuple(tuple(s) for s in strategy), (x_lay, vec, vec), x_lay, rep,
                          local_attrs={"num_groups": g // c} if c > 1 else None)

    def data_parallel(self, prim, args, device_num):
        x = tensor_specs(args)[0]
        return (batch_cut(x, device_num),) + (1,) * (x.ndim - 1), (1,), (1,)

    def propagate(self, prim, args, layouts, device_num):
        x = tensor_specs(args)[0]
        s_x = follow(x, layouts[0], allowed=(0, 1))
        whole_channels = (s_x[0], 1) + s_x[2:]
        return first_accepted(self, prim, args, device_num,
                              [(s_x, (s_x[1],), (s_x[1],)), (whole_channels, (1,), (1,))])
