"""Which layout each tensor has: a side table, so that minidl's Tensor stays free of parallel state.

A Tensor made by a sharded operator holds this rank's block; the table maps it (by identity,
weakly) to its Layout and its global shape. A Tensor not in the table is whole on every rank
(replicated), except the inputs of the outermost Cell, which the dispatcher tags according to
``dataset_strategy``, and Parameters, which take their layout at their first sharded use
(minidl_parallel/tensor_parallel/parameters.py).
"""
import threading
import weakref

from .layout import Layout

__all__ = ["set_layout", "get_layout", "layout_of", "tag_input"]

_table = {}
_lock = threading.Lock()


def _forget(key):
    with _lock:
        _table.pop(key, None)


def set_layout(tensor, layout, shape):
    """Records that ``tensor`` holds its rank's block of a ``shape`` tensor laid out as ``layout``."""
    key = id(tensor)
    ref = weakref.ref(tensor, lambda _, key=key: _forget(key))
    with _lock:
        _table[key] = (ref, layout, tuple(shape))


def get_layout(tensor):
    """(layout, global shape) recorded for ``tensor``, or None."""
    entry = _table.get(id(tensor))
    if entry is None or entry[0]() is not tensor:  # an id reused after the first tensor died
        return None
    return entry[1], entry[2]


def layout_of(tensor, device_num):
    """(layout, global shape): the recorded one, or replicated for an untagged tensor."""
    entry = get_layout(tensor)
    if entry is not None:
        return entry
    return Layout.replicated(tensor.ndim, device_num), tuple(tensor.shape)


def tag_input(tensor, dataset_strategy, device_num):
    """Tags an untagged input of the outermost Cell: this rank's batch slice, or the full batch."""
    if get_layout(tensor) is not None:
        return
    if dataset_strategy == "data_parallel" and tensor.ndim > 0:
        layout = Layout.batch_split(tensor.ndim, device_num)
        set_layout(tensor, layout, layout.global_shape(tuple(tensor.shape)))
    else:
        set_layout(tensor, Layout.replicated(tensor.ndim, device_num), tuple(tensor.shape))
