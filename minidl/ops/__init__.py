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
from .. import autograd as _autograd
from ..tensor import Tensor as _Tensor

_tensor_methods.install()
_manipulation.install()


# The two Tensor methods that need an op or the engine are attached here, as the operators are,
# so that tensor.py imports neither (the imports run ops -> autograd -> tensor, never back).
def _astype(self, dtype):
    """A copy converted to dtype (differentiable, as ops.Cast)."""
    return cast(self, dtype)  # noqa: F405 (from .array)


def _backward(self, gradient=None, retain_graph=False):
    """Accumulates d(self)/d(leaf) into ``.grad`` of every leaf that requires grad.

    As in PyTorch, the graph is freed on the way (the arrays its ops saved go back to the
    allocator), so a second backward through it raises RuntimeError.

    Args:
        gradient: the upstream gradient; may be omitted only for a one-element tensor.
        retain_graph: keep the graph, to call backward through it again.
    """
    _autograd.backward(self, gradient, retain_graph)


_astype.__name__, _astype.__qualname__ = "astype", "Tensor.astype"
_backward.__name__, _backward.__qualname__ = "backward", "Tensor.backward"
_Tensor.astype = _astype
_Tensor.backward = _backward
