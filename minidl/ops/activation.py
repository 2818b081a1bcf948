"""Activations beyond the elementwise basics: Softmax and LogSoftmax over one axis (or several,
jointly), computed stably, and the smooth and leaky units of Transformers: GeLU, LeakyReLU, SiLU.

Softmax and LogSoftmax subtract the maximum along the normalised axes before exponentiating, so
inputs of any magnitude (1e4, -1e4) give finite results; log-softmax is
``x - max - log(sum(exp(x - max)))`` and never takes the log of a softmax that may have
underflowed to 0.

GeLU's exact form ``x * Phi(x)`` needs the normal CDF, i.e. erf, which NumPy lacks (and SciPy is
no dependency): ``_ndtr`` evaluates W. J. Cody's rational Chebyshev approximations of erf / erfc
(Math. Comp. 23, 1969; the ones SciPy's and R's ``pnorm`` descend from), plain polynomial
arithmetic in ``xp``, so one body serves NumPy and CuPy; relative error below 1e-15 in float64.
The left tail goes through erfc, so ``Phi(-10)`` is 7.6e-24, not 1 - 1 = 0.
"""
import numpy

from ..backend import get_array_module
from .primitive import Primitive, normalize_axis


def _check_axis(op, axis):
    """MindSpore takes an int or a non-empty tuple of ints; anything else is a TypeError."""
    ok = isinstance(axis, int) and not isinstance(axis, bool)
    if isinstance(axis, (tuple, list)) and axis:
        ok = all(isinstance(a, int) and not isinstance(a, bool) for a in axis)
        axis = tuple(axis)
    if not ok:
        raise TypeError(f"{op}: axis must be an int or a non-empty tuple of ints, got {axis!r}")
    return axis


def _prepare(op, axis, x):
    """Checks x and axis; returns (x viewed as at least 1-D, the sorted axes)."""
    if not numpy.issubdtype(x.dtype, numpy.floating):
        raise TypeError(f"{op}: x must be a float tensor, got dtype {x.dtype}")
    if x.ndim == 0:
        # NOTE: a scalar is a one-element distribution; viewed as (1,) so that numpy's 0-d
        # arithmetic (which returns numpy scalars, not arrays) never reaches the in-place ops.
        return x.reshape(1), normalize_axis(op, axis, 1)
    return x, normalize_axis(op, axis, x.ndim)


def _shifted(x, axes):
    """x - max(x, axes): a new array whose maximum along ``axes`` is 0."""
    return x - x.max(axis=axes, keepdims=True)


class Softmax(Primitive):
    """exp(x) / sum(exp(x)) along ``axis``, stable for large |x|.

    Args:
        axis: int, or tuple of ints normalised jointly (default -1).

    Example:
        >>> ops.Softmax()(minidl.Tensor([[1.0, 2.0, 3.0]]))     # rows sum to 1
    """

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = _check_axis(self.name, axis)

    def forward(self, x):
        shape = x.shape
        x, self.axes = _prepare(self.name, self.axis, x)
        xp = get_array_module(x)
        if x.size == 0:
            self.out = x.copy()
            return self.out.reshape(shape)
        y = _shifted(x, self.axes)
        xp.exp(y, out=y)
        y /= y.sum(axis=self.axes, keepdims=True)
        self.out = y
        return y.reshape(shape)

    def backward(self, gy):
        y = self.out
        shape, gy = gy.shape, gy.reshape(y.shape)
        gx = gy * y
        # y * (gy - sum(gy * y)) rewritten to reuse the gy * y buffer.
        gx -= y * gx.sum(axis=self.axes, keepdims=True)
        return (gx.reshape(shape),)


class LogSoftmax(Primitive):
    """log(softmax(x)) along ``axis``, as ``x - max - log(sum(exp(x - max)))``.

    Args:
        axis: int, or tuple of ints normalised jointly (default -1).

    Example:
        >>> ops.LogSoftmax()(logits)      # exp of each row sums to 1
    """

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = _check_axis(self.name, axis)

    def forward(self, x):
        shape = x.shape
        x, self.axes = _prepare(self.name, self.axis, x)
        xp = get_array_module(x)
        if x.size == 0:
            self.out = x.copy()
            return self.out.reshape(shape)
        y = _shifted(x, self.axes)
        y -= xp.log(xp.exp(y).sum(axis=self.axes, keepdims=True))
        self.out = y
        return y.reshape(shape)

    def backward(self, gy):
        xp = get_array_module(gy)
        shape, gy = gy.shape, gy.reshape(self.out.shape)
        # exp(y) is the softmax; recomputing it is cheaper than keeping a second array alive.
        gx = xp.exp(self.out)
        gx *= gy.sum(axis=self.axes, keepdims=True)
        return ((gy - gx).reshape(shape),)


def softmax(x, axis=-1):
    """Softmax of x along axis (int or tuple of ints)."""
    return Softmax(axis)(x)


def log_softmax(x, axis=-1):
    """Log-softmax of x along axis (int or tuple of ints)."""
    return LogSoftmax(axis)(x)


def _check_float(op, x):
    if not numpy.issubdtype(x.dtype, numpy.floating):
        raise TypeError(f"{op}: x must be a float tensor, got dtype {x.dtype}")


# W. J. Cody's coefficients (CALERF). erf(t) = t * A(t^2) / B(t^2) for |t| <= 0.46875;
# erfc(y) = exp(-y^2) * C(y) / D(y) for 0.46875 < y <= 4;
# erfc(y) = exp(-y^2) / y * (1/sqrt(pi) - P(1/y^2) / (y^2 Q(1/y^2))) for y > 4.
_A = (3.16112374387056560e00, 1.13864154151050156e02, 3.77485237685302021e02, 3.20937758913846947e03,
      1.85777706184603153e-1)
_B = (2.36012909523441209e01, 2.44024637934444173e02, 1.28261652607737228e03, 2.84423683343917062e03)
_C = (5.64188496988670089e-1, 8.88314979438837594e00, 6.61191906371416295e01, 2.98635138197400131e02,
      8.81952221241769090e02, 1.71204761263407058e03, 2.05107837782607147e03, 1.23033935479799725e03,
      2.15311535474403846e-8)
_D = (1.57449261107098347e01, 1.17693950891312499e02, 5.37181101862009858e02, 1.62138957456669019e03,
      3.29079923573345963e03, 4.36261909014324716e03, 3.43936767414372164e03, 1.23033935480374942e03)
_P = (3.05326634961232344e-1, 3.60344899949804439e-1, 1.25781726111229246e-1, 1.60837851487422766e-2,
      6.58749161529837803e-4, 1.63153871373020978e-2)
_Q = (2.56852019228982242e00, 1.87295284992346725e00, 5.27905102951428412e-1, 6.05183413124413191e-2,
      2.33520497626869185e-3)
_SMALL = 0.46875  # Cody's first break point


def _ratio(z, num_coefs, den_coefs, n):
    """Cody's nested form: (((c[n] z + c0) z + c1) z ...) over ((z + d0) z + d1) z ..., n steps."""
    num, den = num_coefs[-1] * z, z
    for i in range(n):
        num = (num + num_coefs[i]) * z
        den = (den + den_coefs[i]) * z
    return num, den


def _erf_small(t):
    """erf(t) for |t| <= 0.46875 (accurate relative to erf itself near 0)."""
    num, den = _ratio(t * t, _A, _B, 3)
    return t * (num + _A[3]) / (den + _B[3])


def _erfc_large(xp, y):
    """erfc(y) for y > 0.46875 (elsewhere a finite value that callers discard)."""
    z = y * y
    num, den = _ratio(y, _C, _D, 7)
    mid = (num + _C[7]) / (den + _D[7])
    # NOTE: the clamps keep the unused branch finite (no divide-by-zero warnings at y = 0).
    w = 1 / xp.maximum(z, 16.0)
    num, den = _ratio(w, _P, _Q, 4)
    far = (5.6418958354775628695e-1 - w * (num + _P[4]) / (den + _Q[4])) / xp.maximum(y, 4.0)
    return xp.exp(-z) * xp.where(y <= 4.0, mid, far)


def _erf(xp, x):
    """erf(x), elementwise, in x's dtype."""
    y = xp.abs(x)
    return xp.where(y <= _SMALL, _erf_small(x), xp.sign(x) * (1 - _erfc_large(xp, y)))


def _ndtr(xp, x):
    """The standard normal CDF Phi(x) = erfc(-x / sqrt(2)) / 2, accurate in both tails."""
    t = x * 0.7071067811865476
    y = xp.abs(t)
    tail = 0.5 * _erfc_large(xp, y)
    return xp.where(y <= _SMALL, 0.5 + 0.5 * _erf_small(t), xp.where(t > 0, 1 - tail, tail))


_GELU_FORMS = ("none", "tanh")
_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT_2PI = 0.3989422804014327


class GeLU(Primitive):
    """Gaussian error linear unit: ``x * Phi(x)``, or its tanh approximation.

    Args:
        approximate: 'tanh' (default, what MindSpore's GeLU primitive computes):
            ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))``; 'none': the exact
            ``0.5 * x * (1 + erf(x / sqrt(2)))``. (MindSpore's primitive takes no argument; the
            function ``ops.gelu`` defaults to 'none', as MindSpore's and PyTorch's.)

    Example:
        >>> ops.GeLU()(minidl.Tensor([-1.0, 0.0, 2.0]))      # [-0.1588, 0, 1.9546]
    """

    def __init__(self, approximate="tanh"):
        super().__init__()
        if approximate not in _GELU_FORMS:
            raise ValueError(f"GeLU: approximate must be one of {_GELU_FORMS}, got {approximate!r}")
        self.approximate = approximate

    def forward(self, x):
        _check_float(self.name, x)
        xp = get_array_module(x)
        self.x = x
        if self.approximate == "tanh":
            self.t = xp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x))
            return 0.5 * x * (1 + self.t)
        self.cdf = _ndtr(xp, x)
        return x * self.cdf

    def backward(self, gy):
        xp, x = get_array_module(gy), self.x
        if self.approximate == "tanh":
            t = self.t
            du = _SQRT_2_OVER_PI * (1 + 3 * 0.044715 * x * x)
            return (gy * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * du),)
        pdf = _INV_SQRT_2PI * xp.exp(-0.5 * x * x)
        return (gy * (self.cdf + x * pdf),)


class LeakyReLU(Primitive):
    """``x`` where x > 0, ``alpha * x`` elsewhere (any alpha: for alpha <= 1 this is MindSpore's
    ``max(alpha * x, x)``, for alpha > 1 its ``min``). The gradient at 0 is alpha.

    Args:
        alpha: the slope for x <= 0 (default 0.2, MindSpore's; PyTorch's negative_slope is 0.01).

    Example:
        >>> ops.LeakyReLU(0.2)(minidl.Tensor([-1.0, 3.0]))     # [-0.2, 3.0]
    """

    def __init__(self, alpha=0.2):
        super().__init__()
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            raise TypeError(f"LeakyReLU: alpha must be a float or an int, got {alpha!r}")
        self.alpha = float(alpha)

    def forward(self, x):
        _check_float(self.name, x)
        xp = get_array_module(x)
        self.positive = x > 0  # a bool mask: all backward needs
        return xp.where(self.positive, x, self.alpha * x)

    def backward(self, gy):
        return (get_array_module(gy).where(self.positive, gy, self.alpha * gy),)


class SiLU(Primitive):
    """Sigmoid linear unit (swish): ``x * sigmoid(x)``, finite for any x.

    Example:
        >>> ops.SiLU()(minidl.Tensor([-1.0, 0.0, 2.0]))        # [-0.2689, 0, 1.7616]
    """

    def forward(self, x):
        _check_float(self.name, x)
        xp = get_array_module(x)
        # NOTE: the tanh form of the sigmoid, as Sigmoid's: 1 / (1 + exp(-x)) overflows exp for x << 0.
        self.x, self.s = x, 0.5 * (xp.tanh(0.5 * x) + 1)
        return x * self.s

    def backward(self, gy):
        s = self.s
        return (gy * (s * (1 + self.x * (1 - s))),)


def gelu(input, approximate="none"):  # noqa: A002 - MindSpore's name
    """GeLU of input: approximate 'none' (default: the exact erf form) or 'tanh'.

    Example:
        >>> ops.gelu(x, approximate="tanh")
    """
    if approximate not in _GELU_FORMS:
        raise ValueError(f"gelu: approximate must be one of {_GELU_FORMS}, got {approximate!r}")
    return GeLU(approximate)(input)


def leaky_relu(input, alpha=0.2):  # noqa: A002 - MindSpore's name
    """LeakyReLU of input with slope alpha below 0 (MindSpore's default 0.2)."""
    return LeakyReLU(alpha)(input)


def silu(input):  # noqa: A002 - MindSpore's name
    """x * sigmoid(x), elementwise."""
    return SiLU()(input)


__all__ = ['Softmax', 'LogSoftmax', 'softmax', 'log_softmax', 'GeLU', 'LeakyReLU', 'SiLU', 'gelu',
           'leaky_relu', 'silu']
