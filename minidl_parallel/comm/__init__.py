"""Communicators: one backend per module, imported only when asked for.

``create_communicator("mpi")`` imports mpi4py, ``"nccl"`` CuPy's NCCL; a missing library
breaks only its own backend, with an ImportError naming the extra to install.
"""
from .base import Communicator, Request, REDUCE_OPS, debug_enabled

__all__ = ["Communicator", "Request", "REDUCE_OPS", "BACKENDS", "create_communicator", "debug_enabled"]

BACKENDS = ("nccl", "mpi", "threads", "local")


def create_communicator(name, **kwargs):
    """The world communicator of backend ``name`` ("nccl", "mpi", "threads" or "local").

    Worlds of several thread-ranks are made by :func:`minidl_parallel.run_threads`
    (which starts the threads); here "threads" gives a threads world of one.

    Args:
        name: the backend.
        kwargs: passed to the backend's constructor (e.g. ``debug=True``).
    """
    if name == "mpi":
        from .mpi import MpiCommunicator
        return MpiCommunicator(**kwargs)
    if name == "nccl":
        from .nccl import NcclCommunicator
        return NcclCommunicator(**kwargs)
    if name == "local":
        from .local import LocalCommunicator
        return LocalCommunicator(**kwargs)
    if name == "threads":
        from .threads import ThreadsCommunicator, ThreadsWorld
        world = ThreadsWorld(1)
        return ThreadsCommunicator(world, world.group(("world",), [0]), 0, **kwargs)
    raise ValueError(f"create_communicator: unknown backend {name!r}; expected one of {BACKENDS}")
