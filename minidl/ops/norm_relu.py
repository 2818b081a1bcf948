"""BatchNormReLU: ``relu(batch_norm(x) + residual)`` in one op, for the BN-ReLU pairs of ResNets.

Why one op. Separately, BatchNorm, the residual Add and ReLU each make a full pass over the
activation and keep their outputs for backward. As one op, a fast body can keep nothing the
size of x but x itself (the convolution's output, alive anyway) and y (the next layer's
input), and go over blocks of images that stay in a core's cache from one pass to the next:
that body is the CPU kernel in minidl/kernels/cpu/norm.py.

This is the reference: BatchNorm's own reference body, the residual added, then max(., 0);
backward masks the gradient with the output (where y > 0) and hands it to BatchNorm's
backward. It computes exactly what BatchNorm, Add and ReLU compute one after another
(tests/minidl/ops/test_norm_relu.py checks both, and finite differences). At a kink
(``bn(x) + residual == 0``) the gradient is 0, as ReLU's.
"""
from ..backend import get_array_module
from .norm import BatchNorm


class BatchNormReLU(BatchNorm):
    """``max(batch_norm(x, scale, bias, mean, variance) + residual, 0)``; residual is optional.

    Args:
        is_training, epsilon, momentum: as ops.BatchNorm (momentum weighs the NEW statistic).

    Inputs:
        x: (N, C, ...) with channels on axis 1; scale, bias, mean, variance: (C,);
        residual (optional): an array of x's shape, added before the ReLU.
        In training, mean and variance are updated in place (None skips the update).

    Gradients flow to x, scale, bias and residual.

    Example:
        >>> fused = ops.BatchNormReLU(is_training=True)
        >>> y = fused(x, gamma, beta, moving_mean, moving_variance, identity)   # ResNet's block end
    """

    n_inputs = (5, 6)
    n_tensor_inputs = (3, 6)  # a strategy's tuples: mean and variance may be None, the residual absent

    def __init__(self, is_training=False, epsilon=1e-5, momentum=0.1):
        super().__init__(is_training, epsilon, momentum, "NCHW")

    def check_residual(self, x, residual):
        if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype):
            raise ValueError(f"{self.name}: residual of shape {tuple(residual.shape)} and dtype {residual.dtype} "
                             f"must match x: shape {tuple(x.shape)}, dtype {x.dtype}")

    def forward(self, x, scale, bias, mean, variance, residual=None):
        self._check(x, scale, bias, mean, variance)
        self.check_residual(x, residual)
        z = super().forward(x, scale, bias, mean, variance)  # a new array: added to in place
        if residual is not None:
            z += residual
        self.y = get_array_module(z).maximum(z, 0, out=z)
        return self.y

    def backward(self, gy):
        g = gy * (self.y > 0)  # the gradient below the ReLU, and the residual's
        grads = super().backward(g)
        if len(self.needs_grad) > 5:
            grads += (g if self.needs_grad[5] else None,)
        return grads


def batch_norm_relu(x, running_mean, running_var, weight, bias, residual=None, training=False, momentum=0.1,
                    eps=1e-5):
    """``relu(batch_norm(x) + residual)`` in one op (see BatchNormReLU); arguments as ops.batch_norm.

    Example:
        >>> y = ops.batch_norm_relu(x, moving_mean, moving_var, gamma, beta, identity, training=True)
    """
    args = (x, weight, bias, running_mean, running_var) + (() if residual is None else (residual,))
    return BatchNormReLU(bool(training), eps, momentum)(*args)


__all__ = ["BatchNormReLU", "batch_norm_relu"]
