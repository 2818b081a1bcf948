"""CuPy kernels; importing this package registers them (minidl/__init__.py does).

Importing them does not import CuPy: a kernel is only chosen for CuPy arrays, which exist only
where CuPy does.
"""
from . import conv  # noqa: F401  (registration)
