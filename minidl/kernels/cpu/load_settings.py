"""Settings a native library reads from its environment once, when it loads, given to it for that
moment only.

OpenMP runtimes read their tuning (GNU OpenMP's ``GOMP_SPINCOUNT``, Intel OpenMP's
``KMP_BLOCKTIME``) from the environment when they start. Where the user opted in to such a
setting (``MINIDL_OMP_SPIN``, ``MINIDL_OMP_BLOCKTIME_MS``), minidl puts it into ``os.environ``
around the load and takes it out again: the library is configured, and neither this process's
later readers nor the children it starts inherit the value.
"""
import contextlib
import os

__all__ = ["environment_during"]


@contextlib.contextmanager
def environment_during(settings):
    """``os.environ`` with ``settings`` added (those the user did not set already: theirs hold) for
    the block, then exactly as before."""
    added = [k for k, v in settings.items() if v is not None and k not in os.environ]
    for k in added:
        os.environ[k] = settings[k]
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)
