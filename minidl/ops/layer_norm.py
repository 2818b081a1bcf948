"""LayerNorm and GroupNorm: normalisation by the statistics of each sample, not of the batch.

Both normalise ``x`` over some of its axes, ``xhat = (x - mean) / sqrt(var + eps)``, and apply a
learnt scale and shift: LayerNorm over the trailing axes, GroupNorm over each group of channels
(and the spatial axes) of one sample. They share one forward and one fused backward
(``_normalize`` / ``_normalize_backward``), computed in the input's dtype; the variance is
``mean((x - mean) ** 2)``, never ``mean(x ** 2) - mean ** 2``, which cancels catastrophically
when |mean| >> std. Backward keeps only ``xhat`` and ``1 / std``:

    gx = rstd * (gxhat - mean(gxhat) - xhat * mean(gxhat * xhat))     (means over the normalised axes)

There are no running statistics: training and inference compute the same thing.
"""
import numpy

from ..backend import get_array_module
from ..tensor import Tensor
from .primitive import Primitive, sum_to_shape


def _check_eps(op, name, eps):
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{op}: {name} must be a float, got {eps!r}")
    if not eps > 0:
        raise ValueError(f"{op}: {name} must be positive, got {eps!r}")
    return float(eps)


def _check_axis(op, name, axis):
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"{op}: {name} must be an int, got {axis!r}")
    return axis


def _check_x(op, x, min_ndim=1):
    if not hasattr(x, "ndim"):
        raise TypeError(f"{op}: x must be a Tensor, got {type(x).__name__}")
    if not numpy.issubdtype(x.dtype, numpy.floating):
        raise TypeError(f"{op}: x must be a float tensor, got dtype {x.dtype}")
    if x.ndim < min_ndim:
        raise ValueError(f"{op}: x must have at least {min_ndim} dimension(s), got shape {tuple(x.shape)}")


def _check_param(op, name, a, shape, what):
    got = tuple(getattr(a, "shape", ()))
    if not hasattr(a, "shape") or got != tuple(shape):
        raise ValueError(f"{op}: {name} of shape {got if hasattr(a, 'shape') else type(a).__name__} must be "
                         f"{tuple(shape)}, {what}")


def _normalize(xp, x, axes, eps):
    """(xhat, rstd): x normalised over ``axes`` (keepdims statistics), in x's dtype."""
    xc = x - x.mean(axis=axes, keepdims=True)
    var = (xc * xc).mean(axis=axes, keepdims=True)
    rstd = 1 / xp.sqrt(var + eps)
    xc *= rstd  # xc is a new array: normalise it in place
    return xc, rstd


def _normalize_backward(gxhat, xhat, rstd, axes):
    """The gradient with respect to x of xhat = normalize(x), given the gradient of xhat."""
    gx = gxhat - gxhat.mean(axis=axes, keepdims=True)
    gx -= xhat * (gxhat * xhat).mean(axis=axes, keepdims=True)
    gx *= rstd
    return gx


class LayerNorm(Primitive):
    """Normalises x over axes ``begin_norm_axis..-1``, then ``y = xhat * gamma + beta``.

    Args:
        begin_norm_axis: the first normalised axis (default 1: everything but the batch).
        begin_params_axis: gamma and beta have shape ``x.shape[begin_params_axis:]``.
        epsilon: added to the variance (default 1e-7, MindSpore's; PyTorch's is 1e-5).

    Inputs: x (float, any rank >= 1), gamma, beta (shape ``x.shape[begin_params_axis:]``).

    Returns only ``y``. MindSpore's primitive returns ``(y, mean, variance)``, the statistics
    being for its separate backward kernel; minidl's primitives have one output (the autograd
    node), this backward keeps what it needs on the node, and the statistics are two
    reductions away (``x.mean(axes)``, ``x.var(axes)``) when a caller wants them.

    Example:
        >>> ln = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1)
        >>> y = ln(x, gamma, beta)          # x (N, T, D), gamma and beta (D,)
    """

    n_inputs = 3

    def __init__(self, begin_norm_axis=1, begin_params_axis=1, epsilon=1e-7):
        super().__init__()
        self.begin_norm_axis = _check_axis(self.name, "begin_norm_axis", begin_norm_axis)
        self.begin_params_axis = _check_axis(self.name, "begin_params_axis", begin_params_axis)
        self.epsilon = _check_eps(self.name, "epsilon", epsilon)

    def axes(self, ndim):
        """(the normalised axes, the first parameter axis) for an input of rank ndim, checked."""
        for name, a in (("begin_norm_axis", self.begin_norm_axis), ("begin_params_axis", self.begin_params_axis)):
            if not -ndim <= a < ndim:
                raise ValueError(f"{self.name}: {name}={a} is out of range for x of rank {ndim} "
                                 f"(expected {-ndim} <= {name} < {ndim})")
        return tuple(range(self.begin_norm_axis % ndim, ndim)), self.begin_params_axis % ndim

    def forward(self, x, gamma, beta):
        _check_x(self.name, x)
        self.norm_axes, p = self.axes(x.ndim)
        shape = tuple(x.shape[p:])
        what = f"x.shape[begin_params_axis={self.begin_params_axis}:] of x of shape {tuple(x.shape)}"
        _check_param(self.name, "gamma", gamma, shape, what)
        _check_param(self.name, "beta", beta, shape, what)
        xp = get_array_module(x)
        self.xhat, self.rstd = _normalize(xp, x, self.norm_axes, self.epsilon)
        self.gamma = gamma
        return (self.xhat * gamma + beta).astype(x.dtype, copy=False)

    def backward(self, gy):
        gx = ggamma = gbeta = None
        shape = self.gamma.shape
        if self.needs_grad[0]:
            gx = _normalize_backward(gy * self.gamma, self.xhat, self.rstd, self.norm_axes)
        if self.needs_grad[1]:
            ggamma = sum_to_shape(gy * self.xhat, shape)
        if self.needs_grad[2]:
            gbeta = sum_to_shape(gy, shape)
        return gx, ggamma, gbeta


class GroupNorm(Primitive):
    """Normalises each group of ``C / num_groups`` channels of each sample (with its spatial
    axes), then scales and shifts per channel: ``y = xhat * gamma[c] + beta[c]``.

    Args:
        num_groups: G, which must divide the channels C.
        eps: added to the variance (default 1e-5, as MindSpore's and PyTorch's).

    Inputs: x of shape (N, C, *), gamma and beta of shape (C,). Returns y (x's shape); MindSpore's
    primitive also returns the group statistics (see LayerNorm).

    Example:
        >>> ops.GroupNorm(2)(x, gamma, beta)       # x (N, 4, H, W): channels {0, 1} and {2, 3}
    """

    n_inputs = 3

    def __init__(self, num_groups, eps=1e-5):
        super().__init__()
        if isinstance(num_groups, bool) or not isinstance(num_groups, int):
            raise TypeError(f"GroupNorm: num_groups must be an int, got {num_groups!r}")
        if num_groups < 1:
            raise ValueError(f"GroupNorm: num_groups must be at least 1, got {num_groups}")
        self.num_groups = num_groups
        self.eps = _check_eps(self.name, "eps", eps)

    def forward(self, x, gamma, beta):
        _check_x(self.name, x, min_ndim=2)
        n, c = x.shape[:2]
        g = self.num_groups
        if c % g:
            raise ValueError(f"GroupNorm: the channels C={c} of x of shape {tuple(x.shape)} must be divisible by "
                             f"num_groups={g}")
        what = f"one per channel of x of shape {tuple(x.shape)}"
        _check_param(self.name, "gamma", gamma, (c,), what)
        _check_param(self.name, "beta", beta, (c,), what)
        xp = get_array_module(x)
        self.x_shape = tuple(x.shape)
        # (N, G, C/G * prod(spatial)): one row per group of one sample
        xhat, self.rstd = _normalize(xp, x.reshape(n, g, -1), 2, self.eps)
        self.xhat = xhat.reshape(self.x_shape)
        self.gamma = gamma.reshape((c,) + (1,) * (x.ndim - 2))
        return (self.xhat * self.gamma + beta.reshape(self.gamma.shape)).astype(x.dtype, copy=False)

    def backward(self, gy):
        gx = ggamma = gbeta = None
        n, c = self.x_shape[:2]
        others = (0,) + tuple(range(2, len(self.x_shape)))  # every axis but the channels
        if self.needs_grad[0]:
            grouped = (n, self.num_groups, -1)
            gx = _normalize_backward((gy * self.gamma).reshape(grouped), self.xhat.reshape(grouped), self.rstd, 2)
            gx = gx.reshape(self.x_shape)
        if self.needs_grad[1]:
            ggamma = (gy * self.xhat).sum(axis=others)
        if self.needs_grad[2]:
            gbeta = gy.sum(axis=others)
        return gx, ggamma, gbeta


def _normalized_shape(op, normalized_shape, x_shape):
    """normalized_shape (an int or a sequence of ints) as a tuple that must end x's shape."""
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        normalized_shape = (normalized_shape,)
    if not isinstance(normalized_shape, (tuple, list)) or not all(
            isinstance(n, int) and not isinstance(n, bool) for n in normalized_shape):
        raise TypeError(f"{op}: normalized_shape must be an int or a tuple of ints, got {normalized_shape!r}")
    shape = tuple(normalized_shape)
    if not shape or len(shape) > len(x_shape) or tuple(x_shape[len(x_shape) - len(shape):]) != shape:
        raise ValueError(f"{op}: normalized_shape {shape} must be a non-empty trailing part of the input's shape "
                         f"{tuple(x_shape)}")
    return shape


def _constant(x, shape, value):
    """A constant Tensor (no gradient) of ``shape`` filled with value, on x's device, in x's dtype."""
    data = x.data if isinstance(x, Tensor) else x
    return Tensor._wrap(get_array_module(data).full(shape, value, dtype=data.dtype))


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):  # noqa: A002 - MindSpore's name
    """Layer normalisation over the trailing ``normalized_shape`` axes of input.

    Args:
        input: float tensor whose shape ends with normalized_shape.
        normalized_shape: int or tuple of ints.
        weight, bias: the scale (default ones) and shift (default zeros), of shape normalized_shape.
        eps: added to the variance (default 1e-5, as MindSpore's and PyTorch's function;
            ``nn.LayerNorm`` and the primitive default to 1e-7).

    Example:
        >>> ops.layer_norm(x, (x.shape[-1],))      # each row: mean 0, variance 1
    """
    _check_x("layer_norm", input)
    shape = _normalized_shape("layer_norm", normalized_shape, input.shape)
    axis = len(input.shape) - len(shape)
    weight = _constant(input, shape, 1) if weight is None else weight
    bias = _constant(input, shape, 0) if bias is None else bias
    return LayerNorm(axis, axis, eps)(input, weight, bias)


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):  # noqa: A002 - MindSpore's name
    """Group normalisation of input (N, C, *) in num_groups groups of channels.

    Args:
        weight, bias: per-channel scale (default ones) and shift (default zeros), shape (C,).

    Example:
        >>> ops.group_norm(x, 2)
    """
    _check_x("group_norm", input, min_ndim=2)
    c = input.shape[1]
    weight = _constant(input, (c,), 1) if weight is None else weight
    bias = _constant(input, (c,), 0) if bias is None else bias
    return GroupNorm(num_groups, eps)(input, weight, bias)


__all__ = ['LayerNorm', 'GroupNorm', 'layer_norm', 'group_norm']
