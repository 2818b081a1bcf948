"""A strict device double: a test-only stand-in for CuPy that runs on NumPy without a GPU.

Installed as ``sys.modules["cupy"]`` (``install()``), it lets minidl's GPU path run here and
fail where it would fail on a real GPU:

- implicit device -> host conversion is refused with CuPy's TypeError (``numpy.asarray(x)``);
- NumPy arrays as operands of device arithmetic and functions are refused with CuPy's
  TypeError ("Unsupported type <class 'numpy.ndarray'>");
- explicit conversions (``get()``, ``asnumpy``, ``float()``, ``item()``...) work and are counted
  as host synchronisations (``count_host_syncs()``);
- only names in CuPy 14.2.0's namespace exist (``cupy_names_14.txt``);
- random state is per device, seeded per device, as CuPy's is;
- ``x.data.ptr`` is a real, unique address; ``pointer_to_buffer`` finds the memory behind it.

It is a linter for the GPU path: it cannot see kernels, streams, memory limits or NCCL.
"""
import sys

from . import cuda, functions, random, stride_tricks, syncs
from .names import CUPY_VERSION, StrictNamespace
from .ndarray import ndarray, pointer_to_array, pointer_to_buffer
from .syncs import count_host_syncs, host_syncs, uploads

__all__ = ["install", "uninstall", "cupy_module", "cupyx_module", "ndarray", "count_host_syncs", "random",
           "host_syncs", "uploads", "reset_host_syncs", "pointer_to_array", "pointer_to_buffer",
           "CUPY_VERSION", "configure"]

_cupy = None


def _resolve(name):
    """Builds ``cupy.<name>``: the submodules here, functions and values in functions.py."""
    if name == "cuda":
        return cuda.module()
    if name == "random":
        return random.module()
    if name == "lib":
        return stride_tricks.lib_module()
    return functions.resolve(name)


def cupy_module():
    """The double's ``cupy`` module object (one per process)."""
    global _cupy
    if _cupy is None:
        _cupy = StrictNamespace("cupy", "cupy", _resolve)
        _cupy.__version__ = CUPY_VERSION + "+device-double"
        _cupy.__file__ = __file__
        _cupy.__path__ = []  # a package, so ``import cupy.cuda`` / ``from cupy.cuda import x`` work
    return _cupy


functions._namespace["cupy_module"] = cupy_module


def cupyx_module():
    from . import cupyx_double
    return cupyx_double.module()


def reset_host_syncs():
    syncs.reset()


def configure(device_count=1):
    """How many GPUs the double shows (``cupy.cuda.runtime.getDeviceCount()``)."""
    cuda.configure(device_count)


_INSTALLED = ("cupy", "cupy.cuda", "cupy.cuda.runtime", "cupy.random", "cupyx")


def install():
    """Makes ``import cupy`` (and ``cupy.cuda``, ``cupy.random``, ``cupyx``) give the double.

    Call before minidl's backend first imports CuPy (it caches the module). Returns the
    double's ``cupy`` module."""
    cupy = cupy_module()
    sys.modules["cupy"] = cupy
    sys.modules["cupy.cuda"] = cupy.cuda
    sys.modules["cupy.cuda.runtime"] = cupy.cuda.runtime
    sys.modules["cupy.random"] = cupy.random
    sys.modules["cupyx"] = cupyx_module()
    return cupy


def uninstall():
    """Removes the double from sys.modules (minidl's backend keeps what it already imported)."""
    for name in _INSTALLED:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) in (__file__, None) \
                and isinstance(module, StrictNamespace):
            del sys.modules[name]
