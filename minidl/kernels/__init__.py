"""Fast paths for operators, apart from their reference bodies: cpu/ (NumPy) and cuda/ (CuPy).

A kernel is a ``Kernel`` subclass registered for one primitive class on one array module::

    @kernels.register
    class ReLURows(kernels.Kernel):
        op, backend = ops.ReLU, "numpy"
        ...

The table they register in, and the settings that steer it (``reference_only``, ``only``,
``tracking``, the tuning options), are minidl/kernel_table.py: a root module, because
``Primitive.apply`` (minidl/ops/) asks it at every call while the kernels here import the op
classes. This package re-exports the table's public names, the same objects (one table, one set
of settings), so ``minidl.kernels.register``, ``kernels.choose`` and the rest work from here.
"""
from ..kernel_table import (Kernel, choose, declare_option, get_option, is_reference_only, only, option,  # noqa: F401
                            options, reference_only, register, registered, set_option, set_reference_only, tracking)

__all__ = ["Kernel", "register", "choose", "registered", "set_reference_only", "reference_only", "is_reference_only",
           "declare_option", "set_option", "get_option", "option", "options", "tracking", "only"]
