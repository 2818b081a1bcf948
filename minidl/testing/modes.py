"""The execution mode for a block of a test: ``with mode(minidl.GRAPH_MODE): ...``, then the one before."""
import contextlib

from .. import backend

__all__ = ["mode"]


@contextlib.contextmanager
def mode(m):
    """``set_context(mode=m)`` for the block; the mode in force before it afterwards (also on an error)."""
    before = backend.get_context("mode")
    backend.set_context(mode=m)
    try:
        yield
    finally:
        backend.set_context(mode=before)
