"""A sharded tensor carries its layout: the Placement stored on the Tensor itself.

A Tensor made by a sharded operator holds this rank's block; its ``placement`` (a field of
minidl's Tensor, which the core reads only for the global ``shape``) is a :class:`Placement`:
the Layout and the global shape. So ``x.shape`` is the global shape and ``x.data.shape`` the
block's, both explicit, as in PyTorch's DTensor. A Tensor without a placement is whole on
every rank (replicated), except the inputs of the outermost Cell, which the dispatcher tags
according to ``dataset_strategy``, and Parameters, which take their layout at their first
sharded use (minidl_parallel/tensor_parallel/parameters.py).
"""
from dataclasses import dataclass, field

from .layout import Layout

__all__ = ["Placement", "set_layout", "get_layout", "layout_of", "tag_input"]


@dataclass(frozen=True)
class Placement:
    """Where a tensor's block sits: its ``layout`` and the ``shape`` of the whole tensor.

    ``placed_by`` names the operator that first cut a Parameter (for the shared-parameter error).
    """

    layout: Layout
    shape: tuple
    placed_by: str = field(default=None, compare=False)

    def __str__(self):
        return str(self.layout)


def set_layout(tensor, layout, shape, placed_by=None):
    """Records on ``tensor`` that it holds its rank's block of a ``shape`` tensor laid out as ``layout``."""
    tensor.placement = Placement(layout, tuple(shape), placed_by)


def get_layout(tensor):
    """(layout, global shape) of ``tensor``, or None when it is whole."""
    placement = tensor.placement
    return None if placement is None else (placement.layout, placement.shape)


def layout_of(tensor, device_num):
    """(layout, global shape): the tensor's own, or replicated for a whole tensor."""
    entry = get_layout(tensor)
    if entry is not None:
        return entry
    return Layout.replicated(tensor.ndim, device_num), tuple(tensor.data.shape)


def tag_input(tensor, dataset_strategy, device_num):
    """Tags a whole input of the outermost Cell by ``dataset_strategy``.

    "data_parallel": the rank was fed its slice of the global batch (global = local x ranks
    along dimension 0); "full_batch": every rank was fed the whole batch, and the operators
    slice it as they need.
    """
    if tensor.placement is not None:
        return
    if dataset_strategy == "data_parallel" and tensor.ndim > 0:
        layout = Layout.batch_split(tensor.ndim, device_num)
        set_layout(tensor, layout, layout.global_shape(tuple(tensor.data.shape)))
    else:
        set_layout(tensor, Layout.replicated(tensor.ndim, device_num), tuple(tensor.data.shape))
