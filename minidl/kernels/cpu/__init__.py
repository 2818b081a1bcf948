"""CPU (NumPy) kernels; importing this package registers them (minidl/__init__.py does)."""
from . import elementwise  # noqa: F401  (registration)
