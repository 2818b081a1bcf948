"""The double's ``cupy.lib`` (only ``stride_tricks``, which minidl's im2col uses)."""
import types

import numpy.lib.stride_tricks

from . import names
from .functions import device_function
from .names import StrictNamespace


def _resolve(name):
    if name in ("as_strided", "sliding_window_view"):
        return device_function(getattr(numpy.lib.stride_tricks, name), name)
    raise names.not_modelled("cupy.lib.stride_tricks", name)


_stride_tricks = StrictNamespace("cupy.lib.stride_tricks", "cupy.lib.stride_tricks", _resolve)
_lib = types.ModuleType("cupy.lib")
_lib.stride_tricks = _stride_tricks


def lib_module():
    return _lib
