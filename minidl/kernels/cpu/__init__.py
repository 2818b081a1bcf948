"""CPU (NumPy) kernels; importing this package registers them (minidl/__init__.py does)."""
from . import conv  # noqa: F401  (registration)
from . import conv_onednn  # noqa: F401  (registration)
from . import dense  # noqa: F401  (registration)
from . import elementwise  # noqa: F401  (registration)
from . import loss  # noqa: F401  (registration)
from . import matmul  # noqa: F401  (registration)
from . import norm  # noqa: F401  (registration)
from . import updates  # noqa: F401  (registration)
