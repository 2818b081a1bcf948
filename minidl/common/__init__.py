"""Parameter initializers (``minidl.common.initializer``, as ``mindspore.common.initializer``)."""
from . import initializer  # noqa: F401  (the module; its function is initializer.initializer)
from .initializer import (Initializer, Normal, Uniform, Zero, One, Constant, HeNormal, HeUniform,  # noqa: F401
                          XavierUniform, XavierNormal, TruncatedNormal)

__all__ = ["initializer", "Initializer", "Normal", "Uniform", "Zero", "One", "Constant", "HeNormal",
           "HeUniform", "XavierUniform", "XavierNormal", "TruncatedNormal"]
