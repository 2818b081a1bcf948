"""The differentiable collectives under MindSpore's names, for ``from minidl_parallel import ops``.

(They live here rather than in ``minidl.ops`` because minidl never imports this package.)
"""
from .collectives import AllReduce, AllGather, ReduceScatter, Broadcast  # noqa: F401

__all__ = ["AllReduce", "AllGather", "ReduceScatter", "Broadcast"]
