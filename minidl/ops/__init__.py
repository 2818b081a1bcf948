"""Operators, as MindSpore has them: primitive classes made in ``Cell.__init__`` and called in
``construct`` (``self.matmul = ops.MatMul()``), and lowercase functions (``ops.matmul(x, w)``).

One module per family; each op's forward and backward sit side by side in its class.
"""
from .primitive import Primitive
from .math import *  # noqa: F401,F403
from .linalg import *  # noqa: F401,F403
from .reduce import *  # noqa: F401,F403
from .selection import *  # noqa: F401,F403
from .array import *  # noqa: F401,F403
from .indexing import *  # noqa: F401,F403
from .activation import *  # noqa: F401,F403
from .loss import *  # noqa: F401,F403
from .conv import *  # noqa: F401,F403
from .pool import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .layer_norm import *  # noqa: F401,F403
from .norm_relu import *  # noqa: F401,F403
from .dense import *  # noqa: F401,F403
from .dropouts import *  # noqa: F401,F403
from .manipulation import *  # noqa: F401,F403
from .updates import *  # noqa: F401,F403
from . import tensor_methods as _tensor_methods
from . import manipulation as _manipulation

_tensor_methods.install()
_manipulation.install()
