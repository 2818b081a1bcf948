"""Sharding rule of BatchNorm: batch and channel cuts, statistics of the whole (logical) batch.

Strategy ``((n, c, 1, 1), (c,), (c,), (c,), (c,))`` for (x, scale, bias, mean, variance), as
MindSpore's; mean and variance may be absent (None) in training. The device matrix is
[n, c]; scale, bias and the running statistics are cut like the channels.

- Channels cut, batch whole, or inference: each rank normalises its block with its
  channels' statistics; no communication.
- Batch cut in training: the statistics must be those of the whole batch, or the sharded
  network would not be the single-device one. The op then runs as minidl_parallel's
  SyncBatchNormOp over the group of ranks that hold the other batch blocks of the same
  channels (2 small all-reduces forward, 1 backward). Its scale and bias gradients are this
  block's sums, partial over the batch axis, which the dispatcher reduces as for any op.

H and W cuts would need spatial statistics across blocks too and are refused.
"""
from ..layout import Layout
from .base import Decomposed, OpSharding, Rule, StrategyError, check_strategy_shape, device_matrix_for, register, \
    tensor_specs
from .elementwise import batch_cut, first_accepted, follow

__all__ = ["BatchNormRule", "SyncBatchNormRule"]


def _layouts(prim, args, strategy, device_num):
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
    x_lay = Layout(dm, x_map)
    vec = Layout(dm, ((a_c,),))
    return s_x, x_lay, vec, rep, a_n


class _BatchNormBase(Rule):
    def data_parallel(self, prim, args, device_num):
        specs = tensor_specs(args)
        x = specs[0]
        return ((batch_cut(x, device_num),) + (1,) * (x.ndim - 1),) + ((1,),) * (len(specs) - 1)

    def propagate(self, prim, args, layouts, device_num):
        specs = tensor_specs(args)
        x = specs[0]
        axis = 1 if prim.data_format == "NCHW" else x.ndim - 1
        cuts = follow(x, layouts[0], allowed=(0, axis))
        cand = (tuple(cuts),) + ((cuts[axis],),) * (len(specs) - 1)
        return first_accepted(self, prim, args, device_num, [cand])


@register("BatchNorm")
class BatchNormRule(_BatchNormBase):
    """BatchNorm (see the module docstring)."""

    def infer(self, prim, args, strategy, device_num):
        s_x, x_lay, vec, rep, a_n = _layouts(prim, args, strategy, device_num)
        n_specs = len(tensor_specs(args))
        if prim.is_training and s_x[0] > 1:
            return Decomposed(_synchronised(prim, tuple(tuple(s) for s in strategy), x_lay, a_n),
                              f"BatchNorm with the batch cut in {s_x[0]}: statistics over the ranks of the "
                              f"other batch blocks (SyncBatchNormOp)")
        return OpSharding(tuple(tuple(s) for s in strategy), (x_lay,) + (vec,) * (n_specs - 1), x_lay, rep)


@register("SyncBatchNormOp")
class SyncBatchNormRule(_BatchNormBase):
    """The synchronised op the BatchNorm rule runs as; its group is set by that rule."""

    def infer(self, prim, args, strategy, device_num):
        _, x_lay, vec, rep, _ = _layouts(prim, args, strategy, device_num)
        n_specs = len(tensor_specs(args))
        return OpSharding(tuple(tuple(s) for s in strategy), (x_lay,) + (vec,) * (n_specs - 1), x_lay, rep)


def _synchronised(prim, strategy, x_layout, batch_axis):
    def fn(x, scale, bias, mean=None, variance=None):
        from ...sync_batchnorm import SyncBatchNormOp
        from ..dispatch import group_along
        op = SyncBatchNormOp(prim.epsilon, prim.momentum, prim.data_format, group=group_along(x_layout, (batch_axis,)))
        return op.shard(strategy)(x, scale, bias, mean, variance)
    return fn
