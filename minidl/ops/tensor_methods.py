"""Python operators and methods on Tensor (``x + y``, ``x @ w``, ``x.sum()``, ``x[1:, 0]``).

They are thin calls of the functional ops, attached here so that tensor.py needs no op code
(the order of imports stays tensor -> ops, never back).
"""
from ..tensor import Tensor
from . import math as M
from . import linalg as MM


def _ops():
    import minidl.ops as ops
    return ops


def _matmul(x, y):
    # An array operand (``tensor @ ndarray``) is taken as a tensor, as NumPy does.
    x = x if isinstance(x, Tensor) or not hasattr(x, "ndim") else Tensor(x)
    y = y if isinstance(y, Tensor) or not hasattr(y, "ndim") else Tensor(y)
    return MM.matmul(x, y)


def _sum(self, axis=None, keepdims=False):
    return _ops().reduce_sum(self, () if axis is None else axis, keepdims)


def _max(self, axis=None, keepdims=False):
    return _ops().reduce_max(self, () if axis is None else axis, keepdims)


def _mean(self, axis=None, keepdims=False):
    return _ops().reduce_mean(self, () if axis is None else axis, keepdims)


def _argmax(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
    """As MindSpore's Tensor.argmax, which takes ops.argmax's (dim, keepdim) or (axis, keepdims)."""
    return _ops().argmax(self, dim if axis is None else axis, keepdim if keepdims is None else keepdims)


def _argmin(self, axis=None, keepdims=False, *, dim=None, keepdim=None):
    """As MindSpore's Tensor.argmin (int32, like ops.argmin), with (dim, keepdim) accepted too."""
    return _ops().argmin(self, axis if dim is None else dim, keepdims if keepdim is None else keepdim)


def _cumsum(self, axis=None, dtype=None):
    """As MindSpore's Tensor.cumsum: axis None sums the flattened tensor."""
    x = self if axis is not None else _ops().reshape(self, (-1,))
    return _ops().cumsum(x, 0 if axis is None else axis, dtype)


def _reshape(self, *shape):
    shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape
    return _ops().reshape(self, tuple(shape))


def _transpose(self, *perm):
    perm = perm[0] if len(perm) == 1 and isinstance(perm[0], (tuple, list)) else perm
    if not perm:
        perm = tuple(reversed(range(self.ndim)))
    return _ops().transpose(self, tuple(perm))


def install():
    """Attaches the operators to Tensor (called once by minidl.ops)."""
    T = Tensor
    T.__add__ = lambda a, b: M.add(a, b)
    T.__radd__ = lambda a, b: M.add(b, a)
    T.__sub__ = lambda a, b: M.sub(a, b)
    T.__rsub__ = lambda a, b: M.sub(b, a)
    T.__mul__ = lambda a, b: M.mul(a, b)
    T.__rmul__ = lambda a, b: M.mul(b, a)
    T.__truediv__ = lambda a, b: M.div(a, b)
    T.__rtruediv__ = lambda a, b: M.div(b, a)
    T.__pow__ = lambda a, b: M.pow(a, b)
    T.__rpow__ = lambda a, b: M.pow(b, a)
    T.__floordiv__ = lambda a, b: M.floor_div(a, b)
    T.__rfloordiv__ = lambda a, b: M.floor_div(b, a)
    T.__matmul__ = _matmul
    T.__rmatmul__ = lambda a, b: _matmul(b, a)
    T.__neg__ = lambda a: M.neg(a)
    T.__abs__ = lambda a: M.abs(a)
    T.__eq__ = lambda a, b: M.equal(a, b)
    T.__ne__ = lambda a, b: M.not_equal(a, b)
    T.__lt__ = lambda a, b: M.less(a, b)
    T.__le__ = lambda a, b: M.less_equal(a, b)
    T.__gt__ = lambda a, b: M.greater(a, b)
    T.__ge__ = lambda a, b: M.greater_equal(a, b)
    T.__hash__ = object.__hash__  # tensors stay usable as dict keys / set members by identity
    T.__getitem__ = lambda a, index: _ops().getitem(a, index)
    T.sum = _sum
    T.max = _max
    T.mean = _mean
    T.reshape = _reshape
    T.view = _reshape
    T.transpose = _transpose
    T.T = property(lambda a: _transpose(a))
    T.exp = lambda a: M.exp(a)
    T.log = lambda a: M.log(a)
    T.sqrt = lambda a: M.sqrt(a)
    T.abs = lambda a: M.abs(a)
    T.relu = lambda a: M.relu(a)
    T.flatten = lambda a: _ops().flatten(a)
    T.argmax = _argmax
    T.argmin = _argmin
    T.cumsum = _cumsum
    T.clamp = lambda a, min=None, max=None: _ops().clamp(a, min, max)  # noqa: A006 - MindSpore's names
    T.clip = T.clamp
