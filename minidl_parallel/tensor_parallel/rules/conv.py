"""Sharding rules of Conv2D, Conv2DTranspose, MaxPool and AvgPool: batch and channel cuts only.

Conv2D's strategy is ((n, ci, h, w), (co, ci, kh, kw)) as MindSpore's. It runs on the
device matrix [n, ci, co]: x is cut (n, ci), w (co, ci), and the output (N, Co, OH, OW) is
cut (n, co), a partial sum over the ci axis when the input channels are cut. Each rank runs
the primitive with ``out_channel`` set to its block's Co / co.

Conv2DTranspose's strategy is ((n, o, h, w), (o, c, kh, kw)) for dout (N, O, H, W) and w
(O, C/group, kh, kw), O being the channels it sums over (the out_channel of the Conv2D whose
input gradient it is). It runs on the device matrix [n, o, c]: the output (N, C, Hi, Wi) is
cut (n, c), a partial sum over o. Each rank runs the primitive with its block's out_channel
and its block's input_size (N / n, C / c, Hi, Wi).

Pooling keeps H and W whole, whatever its padding or ceil_mode: strategy ((n, c, 1, 1),).

Cuts on H or W would need each block's neighbours' border rows (a halo exchange), which
is not implemented: such strategies are refused, as are cut kernels, and channel cuts of
grouped convolutions (each group's channels would have to stay on one block).
"""
from minidl import ops
from minidl.ops import MaxPoolIndices

from ..layout import Layout
from .base import OpSharding, Rule, StrategyError, check_strategy_shape, device_matrix_for, register, tensor_specs
from .elementwise import batch_cut, first_accepted, follow

__all__ = ["Conv2DRule", "Conv2DTransposeRule", "PoolRule"]


def _no_spatial_cut(what, s):
    if s[2] > 1 or s[3] > 1:
        raise StrategyError(f"{what} cuts H by {s[2]} and W by {s[3]}: a cut on H or W is not supported (no halo "
                            f"exchange); cut N or C instead")


@register(ops.Conv2D)
class Conv2DRule(Rule):
    """Conv2D (see the module docstring)."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        x, w = tensor_specs(args)
        if x.ndim != 4 or w.ndim != 4:
            raise ValueError(f"{prim.name}: x and w must be 4-D, got shapes {x.shape} and {w.shape}")
        s_x, s_w = (tuple(s) for s in strategy)
        n, ci, _, _ = s_x
        co, ci2, kh, kw = s_w
        _no_spatial_cut("x's strategy", s_x)
        if kh > 1 or kw > 1:
            raise StrategyError(f"w's strategy cuts the kernel ({kh}, {kw}); the kernel dimensions must have cut 1")
        if ci != ci2:
            raise StrategyError(f"the input channels are cut {ci} in x (dimension 1) but {ci2} in w (dimension 1); "
                                f"both must be cut the same way")
        if prim.group > 1 and (ci > 1 or co > 1):
            raise StrategyError(f"channel cuts of a grouped convolution (group={prim.group}) are not supported; "
                                f"cut only the batch")
        dm, off, rep = device_matrix_for((n, ci, co), device_num)
        a_n, a_ci, a_co = off, off + 1, off + 2
        x_lay = Layout(dm, ((a_n,), (a_ci,), (), ()))
        w_lay = Layout(dm, ((a_co,), (a_ci,), (), ()))
        out = Layout(dm, ((a_n,), (a_co,), (), ()), ((a_ci, "sum"),))
        attrs = {"out_channel": prim.out_channel // co} if co > 1 else None
        return OpSharding((s_x, s_w), (x_lay, w_lay), out, rep, local_attrs=attrs)

    def data_parallel(self, prim, args, device_num):
        x, w = tensor_specs(args)
        return (batch_cut(x, device_num), 1, 1, 1), (1,) * w.ndim

    def propagate(self, prim, args, layouts, device_num):
        x, w = tensor_specs(args)
        if x.ndim != 4 or w.ndim != 4:
            return self.data_parallel(prim, args, device_num)
        n, ci, _, _ = follow(x, layouts[0], allowed=(0, 1))
        return first_accepted(self, prim, args, device_num, [((n, ci, 1, 1), (1, ci, 1, 1)),
                                                             ((n, 1, 1, 1), (1, 1, 1, 1))])


@register(ops.Conv2DTranspose)
class Conv2DTransposeRule(Rule):
    """Conv2DTranspose (see the module docstring)."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        dout, w = tensor_specs(args)
        if dout.ndim != 4 or w.ndim != 4:
            raise ValueError(f"{prim.name}: dout and w must be 4-D, got shapes {dout.shape} and {w.shape}")
        s_d, s_w = (tuple(s) for s in strategy)
        n, o, _, _ = s_d
        o2, c, kh, kw = s_w
        _no_spatial_cut("dout's strategy", s_d)
        if kh > 1 or kw > 1:
            raise StrategyError(f"w's strategy cuts the kernel ({kh}, {kw}); the kernel dimensions must have cut 1")
        if o != o2:
            raise StrategyError(f"the summed channels are cut {o} in dout (dimension 1) but {o2} in w (dimension 0); "
                                f"both must be cut the same way")
        if prim.group > 1 and (o > 1 or c > 1):
            raise StrategyError(f"channel cuts of a grouped transposed convolution (group={prim.group}) are not "
                                f"supported; cut only the batch")
        dm, off, rep = device_matrix_for((n, o, c), device_num)
        a_n, a_o, a_c = off, off + 1, off + 2
        d_lay = Layout(dm, ((a_n,), (a_o,), (), ()))
        w_lay = Layout(dm, ((a_o,), (a_c,), (), ()))
        out = Layout(dm, ((a_n,), (a_c,), (), ()), ((a_o, "sum"),))
        attrs = {"out_channel": prim.out_channel // o} if o > 1 else None
        group = prim.group

        def localize(coords, local):
            # input_size names the output's shape: this rank's block of it, from its blocks of dout and w.
            d, wl, size = local
            return d, wl, (d.shape[0], wl.shape[1] * group) + tuple(size[2:])

        return OpSharding((s_d, s_w), (d_lay, w_lay), out, rep, localize=localize, local_attrs=attrs)

    def data_parallel(self, prim, args, device_num):
        dout, w = tensor_specs(args)
        return (batch_cut(dout, device_num), 1, 1, 1), (1,) * w.ndim

    def propagate(self, prim, args, layouts, device_num):
        dout, w = tensor_specs(args)
        if dout.ndim != 4 or w.ndim != 4:
            return self.data_parallel(prim, args, device_num)
        n, o, _, _ = follow(dout, layouts[0], allowed=(0, 1))
        return first_accepted(self, prim, args, device_num, [((n, o, 1, 1), (o, 1, 1, 1)),
                                                             ((n, 1, 1, 1), (1, 1, 1, 1))])


@register(ops.MaxPool, ops.AvgPool, MaxPoolIndices)
class PoolRule(Rule):
    """Pooling over H and W, which stay whole: strategy ((n, c, 1, 1),). MaxPool's indices
    (``max_pool2d(..., return_indices=True)``) index each whole (H, W) plane: the same on every block."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        (x,) = tensor_specs(args)
        if x.ndim != 4:
            raise ValueError(f"{prim.name}: x must be 4-D (N, C, H, W), got shape {x.shape}")
        s = tuple(strategy[0])
        _no_spatial_cut("the strategy", s)
        dm, off, rep = device_matrix_for(s[:2], device_num)
        lay = Layout(dm, ((off,), (off + 1,), (), ()))
        return OpSharding((s,), (lay,), lay, rep)

    def propagate(self, prim, args, layouts, device_num):
        (x,) = tensor_specs(args)
        if x.ndim != 4:
            return self.data_parallel(prim, args, device_num)
        n, c, _, _ = follow(x, layouts[0], allowed=(0, 1))
        return first_accepted(self, prim, args, device_num, [((n, c, 1, 1),)])
