"""Elementwise arithmetic and activations: Add, Sub, Mul, RealDiv, FloorDiv, Neg, Exp, Log, Sqrt,
Pow, Maximum, Minimum, ReLU, Sigmoid, Tanh, and comparisons (no gradient).

Binary ops broadcast as numpy does; their backward sums the gradient back to each input's
shape (``sum_to_shape``). Each op keeps only what its backward needs.

Mixed dtypes follow PyTorch's and MindSpore's promotion, not NumPy's (``promote``): an integer
or bool operand never widens a float one (float32 tensor + int64 tensor is float32, not
float64), and a Python scalar only sets the dtype when it is of a higher kind than the tensor
(int tensor * 2.5 is float32). ``_Binary`` casts the operands once, before ``compute``, and casts
each gradient back to its input's dtype.
"""
import contextlib

import numpy

from ..backend import get_array_module
from .primitive import Primitive, sum_to_shape, shape_of


def _check_broadcast(op, x, y):
    sx, sy = shape_of(x), shape_of(y)
    for a, b in zip(reversed(sx), reversed(sy)):
        if a != b and a != 1 and b != 1:
            raise ValueError(f"{op}: shapes {sx} and {sy} cannot be broadcast together "
                             f"(dimensions {a} and {b} differ and neither is 1)")


# ---- dtype promotion ------------------------------------------------------------------------
# Kinds, lowest first: bool < integer < float < complex. Within a kind NumPy's rule applies
# (int32 + int64 -> int64, float16 + float32 -> float32); across kinds the higher kind's dtype
# wins as it is, where NumPy would widen it (float16 + int64 -> float64 in NumPy, float16 here).
_KIND = {"b": 0, "u": 1, "i": 1, "f": 2, "c": 3}
_SCALAR_KIND = {bool: 0, int: 1, float: 2, complex: 3}
# What a Python scalar of a higher kind gives: the default dtype of its kind (MindSpore's and
# PyTorch's default float is float32).
_DEFAULT = {0: numpy.dtype(bool), 1: numpy.dtype(numpy.int64), 2: numpy.dtype(numpy.float32),
            3: numpy.dtype(numpy.complex64)}


def _highest(dtypes):
    """The promoted dtype of the dtypes of the highest kind among ``dtypes``."""
    top = max(_KIND.get(d.kind, 4) for d in dtypes)
    return numpy.result_type(*[d for d in dtypes if _KIND.get(d.kind, 4) == top])


def promote(*operands):
    """The dtype an elementwise op of ``operands`` computes in, as PyTorch and MindSpore 2.10 give it.

    Three tiers, strongest first: arrays of rank >= 1, 0-d arrays (0-d tensors), then Python and
    NumPy scalars. A weaker tier only changes the dtype when its kind is higher (float32 array *
    0-d float64 tensor -> float32; int32 array * 0-d float64 tensor -> float64); a scalar of a
    higher kind gives its kind's default dtype (int tensor * 2.5 -> float32). None when no operand
    has a dtype.

    Example:
        >>> promote(numpy.ones(2, numpy.float32), numpy.ones(2, numpy.int64))
        dtype('float32')
    """
    arrays, zero_d, scalar_kind = [], [], -1
    for a in operands:
        if isinstance(a, numpy.generic):
            scalar_kind = max(scalar_kind, _KIND.get(a.dtype.kind, -1))
        elif hasattr(a, "dtype"):
            (arrays if a.ndim else zero_d).append(a.dtype)
        elif type(a) in _SCALAR_KIND:
            scalar_kind = max(scalar_kind, _SCALAR_KIND[type(a)])
    dtype = _highest(arrays) if arrays else None
    if zero_d:
        z = _highest(zero_d)
        if dtype is None or _KIND.get(z.kind, 4) > _KIND.get(dtype.kind, 4):
            dtype = z
    if scalar_kind >= 0 and (dtype is None or scalar_kind > _KIND.get(dtype.kind, 4)):
        dtype = _DEFAULT[scalar_kind]
    return dtype


def _weak_fits(scalar, dtype):
    """Whether a Python scalar leaves an array of ``dtype`` as it is (no promotion needed)."""
    kind = _SCALAR_KIND.get(type(scalar))
    return kind is not None and kind <= _KIND.get(dtype.kind, 4)


def _as_dtype(a, dtype):
    """a in ``dtype``: arrays are cast (no copy when they already are), NumPy scalars converted;
    Python scalars stay as they are (NumPy and CuPy treat them as weak, so they take the array's
    dtype)."""
    if isinstance(a, numpy.generic):
        return dtype.type(a)
    if hasattr(a, "dtype"):
        return a.astype(dtype, copy=False)
    return a


def _quiet(xp):
    """A block without NumPy's floating-point warnings (CuPy does not warn)."""
    return numpy.errstate(divide="ignore", invalid="ignore") if xp is numpy else contextlib.nullcontext()


def _kind_of(a):
    """The kind rank (see _KIND) of an array or scalar operand."""
    if hasattr(a, "dtype"):
        return _KIND.get(a.dtype.kind, 4)
    return _SCALAR_KIND.get(type(a), 4)


class _Binary(Primitive):
    """Two broadcasting operands, promoted to one dtype (``promote``) before ``compute``.

    A subclass writes ``compute(x, y)`` and ``gradients(gy)``; ``backward`` casts each gradient
    back to its input's dtype when promotion changed it, and gives integer inputs none.
    """

    n_inputs = 2

    def forward(self, x, y):
        _check_broadcast(self.name, x, y)
        self.x_shape, self.y_shape = shape_of(x), shape_of(y)
        self.in_dtypes = None
        dx, dy = getattr(x, "dtype", None), getattr(y, "dtype", None)
        # NOTE: the common case (one dtype, or a float tensor and a Python number) skips promote().
        if dx != dy and not (dy is None and _weak_fits(y, dx)) and not (dx is None and _weak_fits(x, dy)):
            dtype = promote(x, y)
            if dtype is not None:
                self.in_dtypes = (dx, dy)
                x, y = _as_dtype(x, dtype), _as_dtype(y, dtype)
        return self.compute(x, y)

    def backward(self, gy):
        gx, gy2 = self.gradients(gy)
        if self.in_dtypes is not None:
            gx, gy2 = (_grad_in(g, d) for g, d in zip((gx, gy2), self.in_dtypes))
        return gx, gy2


def _grad_in(g, dtype):
    """The gradient of an input of ``dtype``: cast to it (floats), none (integers, bools, scalars)."""
    if g is None or dtype is None or dtype.kind not in "fc":
        return None
    return g.astype(dtype, copy=False)


class Add(_Binary):
    """x + y, with broadcasting."""

    def compute(self, x, y):
        return x + y

    def gradients(self, gy):
        return sum_to_shape(gy, self.x_shape), sum_to_shape(gy, self.y_shape)


class Sub(_Binary):
    """x - y, with broadcasting."""

    def compute(self, x, y):
        return x - y

    def gradients(self, gy):
        gx = sum_to_shape(gy, self.x_shape) if self.needs_grad[0] else None
        gy2 = -sum_to_shape(gy, self.y_shape) if self.needs_grad[1] else None
        return gx, gy2


class Mul(_Binary):
    """x * y, with broadcasting."""

    def compute(self, x, y):
        self.x, self.y = x, y
        return x * y

    def gradients(self, gy):
        gx = sum_to_shape(gy * self.y, self.x_shape) if self.needs_grad[0] else None
        gy2 = sum_to_shape(gy * self.x, self.y_shape) if self.needs_grad[1] else None
        return gx, gy2


class RealDiv(_Binary):
    """x / y, with broadcasting: true division, so integer operands give float32.

    As ``/`` and ``ops.div`` in MindSpore 2.10 and ``/`` in PyTorch (NumPy would give float64).
    MindSpore's ``ops.RealDiv()`` primitive keeps two int64 operands int64; here the primitive is
    what ``/`` runs, so it divides as ``/`` does.
    """

    def compute(self, x, y):
        if max(_kind_of(x), _kind_of(y)) < 2:
            self.in_dtypes = (getattr(x, "dtype", None), getattr(y, "dtype", None))
            x, y = _as_dtype(x, _DEFAULT[2]), _as_dtype(y, _DEFAULT[2])
        self.y = y
        self.out = x / y
        return self.out

    def gradients(self, gy):
        gx_full = gy / self.y
        gx = sum_to_shape(gx_full, self.x_shape) if self.needs_grad[0] else None
        gy2 = sum_to_shape(-gx_full * self.out, self.y_shape) if self.needs_grad[1] else None
        return gx, gy2


Div = RealDiv


class Maximum(_Binary):
    """Elementwise max(x, y). On ties the gradient is split evenly between x and y."""

    def compute(self, x, y):
        self.x, self.y = x, y
        return get_array_module(x, y).maximum(x, y)

    def gradients(self, gy):
        x, y = self.x, self.y
        # NOTE: an even split at ties keeps gx + gy == upstream, like the subgradient PyTorch uses.
        # The half is in gy's dtype: a Python 0.5 times a bool array would make float32 grads float64.
        wx = (x > y) + gy.dtype.type(0.5) * (x == y)
        gx = sum_to_shape(gy * wx, self.x_shape) if self.needs_grad[0] else None
        gy2 = sum_to_shape(gy * (1 - wx), self.y_shape) if self.needs_grad[1] else None
        return gx, gy2


class Minimum(_Binary):
    """Elementwise min(x, y). On ties the gradient is split evenly."""

    def compute(self, x, y):
        self.x, self.y = x, y
        return get_array_module(x, y).minimum(x, y)

    def gradients(self, gy):
        x, y = self.x, self.y
        wx = (x < y) + gy.dtype.type(0.5) * (x == y)
        gx = sum_to_shape(gy * wx, self.x_shape) if self.needs_grad[0] else None
        gy2 = sum_to_shape(gy * (1 - wx), self.y_shape) if self.needs_grad[1] else None
        return gx, gy2


class Pow(_Binary):
    """x ** y, with broadcasting.

    Where the derivative is 0 * inf, the gradients follow PyTorch: d/dx is 0 where y == 0
    (0 ** -1 would give 0 * inf = NaN), and d/dy = x ** y * log x is 0 where x == 0 and y >= 0
    (the true limit; 0 * log 0 would be NaN). A negative x still gives NaN for d/dy (log x), and
    x == 0 with y < 0 gives -inf, as in PyTorch.
    """

    def compute(self, x, y):
        self.x, self.y = x, y
        self.out = x ** y
        return self.out

    def gradients(self, gy):
        xp = get_array_module(gy)
        x, y = self.x, self.y
        gx = gy2 = None
        # NOTE: 0 ** -1 and log 0 are infinite: NumPy warns, and the entries that matter are masked.
        with _quiet(xp):
            if self.needs_grad[0]:
                gx = sum_to_shape(gy * _zero_where(xp, y == 0, y * x ** (y - 1)), self.x_shape)
            if self.needs_grad[1]:
                if _is_array(x):
                    log_x = xp.log(x)
                else:
                    with _quiet(numpy):  # a host scalar base; a Python float stays weak (keeps gy's dtype)
                        log_x = float(numpy.log(x))
                gy2 = sum_to_shape(gy * _zero_where(xp, (x == 0) & (y >= 0), self.out * log_x), self.y_shape)
        return gx, gy2


def _is_array(a):
    return hasattr(a, "ndim") and not isinstance(a, numpy.generic)


def _zero_where(xp, mask, values):
    """values with 0 where mask holds; mask may be a host bool when it came from scalars."""
    if _is_array(mask):
        return xp.where(mask, values.dtype.type(0), values)
    return xp.zeros_like(values) if mask else values


class FloorDiv(_Binary):
    """floor(x / y), with broadcasting (Python's ``//``: rounds toward -inf, -7 // 2 == -4).

    Piecewise constant, so its gradient is zero for both inputs (MindSpore's FloorDiv gives
    zeros; PyTorch's floor_divide refuses to differentiate). Division by zero gives inf / -inf /
    NaN for floats and NumPy's 0 for integers (MindSpore gives INT_MAX / INT_MIN there).

    Example:
        >>> ops.floor_div(Tensor([-7.0, 7.0]), 2)          # [-4., 3.]
    """

    def compute(self, x, y):
        return get_array_module(x, y).floor_divide(x, y)

    def gradients(self, gy):
        xp = get_array_module(gy)
        gx = xp.zeros(self.x_shape, gy.dtype) if self.needs_grad[0] else None
        gy2 = xp.zeros(self.y_shape, gy.dtype) if self.needs_grad[1] else None
        return gx, gy2


class _Compare(_Binary):
    """Comparisons give bool tensors and stop the gradient."""

    def backward(self, gy):
        return None, None


class Equal(_Compare):
    def compute(self, x, y):
        return x == y


class NotEqual(_Compare):
    def compute(self, x, y):
        return x != y


class Less(_Compare):
    def compute(self, x, y):
        return x < y


class LessEqual(_Compare):
    def compute(self, x, y):
        return x <= y


class Greater(_Compare):
    def compute(self, x, y):
        return x > y


class GreaterEqual(_Compare):
    def compute(self, x, y):
        return x >= y


class Neg(Primitive):
    """-x."""

    def forward(self, x):
        return -x

    def backward(self, gy):
        return (-gy,)


class Exp(Primitive):
    """e ** x."""

    def forward(self, x):
        self.out = get_array_module(x).exp(x)
        return self.out

    def backward(self, gy):
        return (gy * self.out,)


class Log(Primitive):
    """Natural logarithm."""

    def forward(self, x):
        self.x = x
        return get_array_module(x).log(x)

    def backward(self, gy):
        return (gy / self.x,)


class Sqrt(Primitive):
    """Square root."""

    def forward(self, x):
        self.out = get_array_module(x).sqrt(x)
        return self.out

    def backward(self, gy):
        return (gy / (2 * self.out),)


class Square(Primitive):
    """x * x."""

    def forward(self, x):
        self.x = x
        return x * x

    def backward(self, gy):
        return (gy * 2 * self.x,)


class Abs(Primitive):
    """|x|; the gradient at 0 is 0."""

    def forward(self, x):
        self.x = x
        return get_array_module(x).abs(x)

    def backward(self, gy):
        return (gy * get_array_module(self.x).sign(self.x),)


class ReLU(Primitive):
    """max(x, 0). Keeps only its output: the gradient mask is out > 0.

    (minidl/kernels/cpu/elementwise.py runs large float arrays faster on the CPU.)"""

    def forward(self, x):
        self.out = get_array_module(x).maximum(x, 0)
        return self.out

    def backward(self, gy):
        return (gy * (self.out > 0),)


class Sigmoid(Primitive):
    """1 / (1 + e ** -x), computed without overflow for large |x|."""

    def forward(self, x):
        xp = get_array_module(x)
        # NOTE: tanh form is stable on both tails, where 1/(1+exp(-x)) overflows exp for x << 0.
        self.out = 0.5 * (xp.tanh(0.5 * x) + 1)
        return self.out.astype(x.dtype, copy=False)

    def backward(self, gy):
        return (gy * self.out * (1 - self.out),)


class Tanh(Primitive):
    """Hyperbolic tangent."""

    def forward(self, x):
        self.out = get_array_module(x).tanh(x)
        return self.out

    def backward(self, gy):
        return (gy * (1 - self.out * self.out),)


def add(x, y):
    return Add()(x, y)


def sub(x, y):
    return Sub()(x, y)


def mul(x, y):
    return Mul()(x, y)


def div(x, y):
    return RealDiv()(x, y)


def maximum(x, y):
    return Maximum()(x, y)


def minimum(x, y):
    return Minimum()(x, y)


def pow(x, y):  # noqa: A001 - MindSpore's name
    return Pow()(x, y)


def floor_div(x, y):
    """``x // y`` elementwise with broadcasting; its gradient is zero (see FloorDiv)."""
    return FloorDiv()(x, y)


def neg(x):
    return Neg()(x)


def exp(x):
    return Exp()(x)


def log(x):
    return Log()(x)


def sqrt(x):
    return Sqrt()(x)


def square(x):
    return Square()(x)


def abs(x):  # noqa: A001 - MindSpore's name
    return Abs()(x)


def relu(x):
    return ReLU()(x)


def sigmoid(x):
    return Sigmoid()(x)


def tanh(x):
    return Tanh()(x)


def equal(x, y):
    return Equal()(x, y)


def not_equal(x, y):
    return NotEqual()(x, y)


def less(x, y):
    return Less()(x, y)


def less_equal(x, y):
    return LessEqual()(x, y)


def greater(x, y):
    return Greater()(x, y)


def greater_equal(x, y):
    return GreaterEqual()(x, y)


__all__ = ['Add', 'Sub', 'Mul', 'RealDiv', 'Maximum', 'Minimum', 'Pow', 'FloorDiv', 'Equal', 'NotEqual', 'Less', 'LessEqual', 'Greater', 'GreaterEqual', 'Neg', 'Exp', 'Log', 'Sqrt', 'Square', 'Abs', 'ReLU', 'Sigmoid', 'Tanh', 'add', 'sub', 'mul', 'div', 'maximum', 'minimum', 'pow', 'floor_div', 'neg', 'exp', 'log', 'sqrt', 'square', 'abs', 'relu', 'sigmoid', 'tanh', 'equal', 'not_equal', 'less', 'less_equal', 'greater', 'greater_equal', 'Div']
