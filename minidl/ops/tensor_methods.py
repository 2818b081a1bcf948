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
    x_nd = x.ndim if isinstance(x, Tensor) else getattr(x, "ndim", 2)
    y_nd = y.ndim if isinstance(y, Tensor) else getattr(y, "ndim", 2)
    if x_nd == 2 and y_nd == 2:
        return MM.matmul(x, y)
    return MM.batch_matmul(x, y)


def _sum(self, axis=None, keepdims=False):
    return _ops().reduce_sum(self, () if axis is None else axis, keepdims)


def _max(self, axis=None, keepdims=False):
    return _ops().reduce_max(self, () if axis is None else axis, keepdims)


def _mean(self, axis=None, keepdims=False):
    return _ops().reduce_mean(self, () if axis is None else axis, keepdims)


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
