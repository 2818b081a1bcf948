"""Sharding rule of Dropout: any cuts, and every block masked by its block of ONE mask.

Ranks run the same program from the same seed (SPMD), so their generators make the same
draws. Each rank draws the mask of the whole logical tensor and keeps the window of its own
block (the primitive's ``mask_window``), so the sharded network drops exactly the elements
one device drops, whatever the cuts. Replicas along a repeat axis keep the same window.
The cost is a full-size draw on every rank; no communication.

Example (4 devices): x (8, 6) with strategy ((2, 2),): the rank at coordinates (1, 0) draws
an (8, 6) mask and multiplies its (4, 3) block by ``mask[4:8, 0:3]``.
"""
from minidl import ops

from ..layout import Layout
from .base import OpSharding, Rule, check_strategy_shape, device_matrix_for, register, tensor_specs
from .elementwise import batch_cut, dims_map, first_accepted, follow

__all__ = ["DropoutRule", "mask_window"]


def mask_window(layout, shape):
    """``local_attrs(site)`` of a tensor of global ``shape`` laid out as ``layout``: its mask window."""
    shape = tuple(shape)

    def local_attrs(site):
        return {"mask_window": (shape, layout.local_slices(layout.rank_of(site.coords), shape))}
    return local_attrs


@register(ops.Dropout)
class DropoutRule(Rule):
    """Dropout(x): one tuple of cuts of x, any dimension; the output keeps x's layout."""

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        (x,) = tensor_specs(args)
        s = tuple(strategy[0])
        dm, off, rep = device_matrix_for(s, device_num)
        lay = Layout(dm, dims_map(off, range(len(s))))
        # keep_prob 1 draws nothing; a whole tensor's window would be the whole mask anyway.
        attrs = None if prim.keep_prob == 1.0 or lay.is_replicated() else mask_window(lay, x.shape)
        return OpSharding((s,), (lay,), lay, rep, local_attrs=attrs)

    def data_parallel(self, prim, args, device_num):
        (x,) = tensor_specs(args)
        return ((batch_cut(x, device_num),) + (1,) * (x.ndim - 1),) if x.ndim else ((),)

    def propagate(self, prim, args, layouts, device_num):
        (x,) = tensor_specs(args)
        return first_accepted(self, prim, args, device_num, [(follow(x, layouts[0]),)])
