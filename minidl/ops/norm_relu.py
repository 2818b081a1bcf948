"""BatchNormReLU: ``relu(batch_norm(x) + residual)`` in one op, for the BN-ReLU pairs of ResNets.

Why fuse. On the CPU these are elementwise NumPy passes, each a full read and write of the
activation. Separately, BatchNorm, the residual Add and ReLU make a centred copy, the
BatchNorm output and the Add output, and keep two of them for backward. Fused, nothing the
size of x is kept but x itself (the convolution's output, alive anyway) and y (the next
layer's input), and the passes go over blocks of images small enough to stay in a core's
cache (``_BLOCK_BYTES``) between one pass and the next. Forward reads x three times (the
mean, the centred squares, the output) and writes y once. The whole ResNet-20 step gained
little on the 2-core machine of 2026-11-23 (README, Performance): there, NumPy's passes over
cached data were not much faster than over memory, so the number of passes counts more than
where their data comes from.

Numerics. The batch variance is not taken as E[x^2] - E[x]^2, which cancels in float32: it
is the two-pass formula, the mean first, then the squares of x - mean, centred one cached
block at a time. The backward sum of ``g * (x - mean)`` is centred the same way.

The op computes what BatchNorm followed by Add and ReLU compute (tests/minidl/ops/
test_norm_relu.py checks both, and finite differences). At a kink (``bn(x) + residual == 0``)
the gradient is 0, as ReLU's.
"""
import numpy

from .. import _intra_op as intra_op
from ..backend import get_array_module
from ..kernels.cpu.elementwise import relu_rows, rows_apply
from .norm import BatchNorm, _channel_sum, _per_channel

_BLOCK_BYTES = 256 << 10  # a block of images per step: it and its scratch stay in a core's L2


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

    def forward(self, x, scale, bias, mean, variance, residual=None):
        axis, channels = self._check(x, scale, bias, mean, variance)
        if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype):
            raise ValueError(f"{self.name}: residual of shape {tuple(residual.shape)} and dtype {residual.dtype} "
                             f"must match x: shape {tuple(x.shape)}, dtype {x.dtype}")
        xp = get_array_module(x)
        dtype = x.dtype
        self.kept = (1, channels) + (1,) * (x.ndim - 2)
        self.scale_dtype, self.bias_dtype = scale.dtype, bias.dtype
        scale = scale.astype(dtype, copy=False).reshape(self.kept)
        self.count = x.size // max(channels, 1)
        if self.is_training:
            if self.count < 2:
                raise ValueError(f"{self.name}: expected more than 1 value per channel when training, got input "
                                 f"of shape {tuple(x.shape)} (the batch variance is undefined)")
            self.mu, batch_var = _batch_moments(xp, x, self.kept)
            self._update_running(mean, variance, self.mu, batch_var, self.count)
        else:
            self.mu = mean.astype(dtype, copy=False).reshape(self.kept)
            batch_var = variance.astype(dtype, copy=False).reshape(self.kept)
        self.inv_std = 1.0 / xp.sqrt(batch_var + self.epsilon)
        self.k = scale * self.inv_std
        shift = _per_channel(xp, bias.astype(dtype, copy=False).reshape(self.kept) - self.mu * self.k, x)
        k_row = _per_channel(xp, self.k, x)
        y = xp.empty_like(x)

        def block(i, j, scratch):
            out = y[i:j]
            xp.multiply(x[i:j], k_row, out=out)
            out += shift
            if residual is not None:
                out += residual[i:j]
            relu_rows(out, out=out) if rows_apply(out) else xp.maximum(out, 0, out=out)
        _blocks(xp, x, block)
        self.x, self.y = x, y
        return y

    def backward(self, gy):
        xp = get_array_module(gy)
        need_x, need_scale, need_bias = self.needs_grad[:3]
        need_res = len(self.needs_grad) > 5 and self.needs_grad[5]
        x, y, k, inv_std = self.x, self.y, self.k, self.inv_std
        mu_row = _per_channel(xp, self.mu, x)
        # g = gy where the output is positive: the gradient below the ReLU, and the residual's.
        g = xp.empty_like(gy)

        def sums(i, j, scratch):
            gb = g[i:j]
            xp.multiply(gy[i:j], y[i:j] > 0, out=gb)
            xc = scratch[:j - i]
            xp.subtract(x[i:j], mu_row, out=xc)
            return _channel_sum(xp, 1, gb), _channel_sum(xp, 1, gb, xc)
        parts = _blocks(xp, x, sums)
        gbias, gxc = parts[0]  # sum(g) and sum(g * (x - mean)) per channel
        for pb, pc in parts[1:]:
            gbias, gxc = gbias + pb, gxc + pc
        gscale = gxc * inv_std.reshape(-1)
        gx = None
        if need_x:
            k_row = _per_channel(xp, k, x)
            if not self.is_training:
                gx = xp.multiply(g, k_row, out=None if need_res else g)
            else:
                # gx = k * (g - mean(g) - xhat * mean(g * xhat)), xhat = (x - mean) * inv_std
                inv_m = 1.0 / self.count
                a = (k * gxc.reshape(self.kept) * inv_std * inv_std * inv_m).astype(gy.dtype, copy=False)
                c = (self.mu * a - k * gbias.reshape(self.kept) * inv_m).astype(gy.dtype, copy=False)
                a, c = _per_channel(xp, a, x), _per_channel(xp, c, x)
                gx = g if not need_res else xp.empty_like(g)

                def grad(i, j, scratch):
                    t = scratch[:j - i]
                    xp.multiply(x[i:j], a, out=t)
                    xp.multiply(g[i:j], k_row, out=gx[i:j])
                    gx[i:j] -= t
                    gx[i:j] += c
                _blocks(xp, x, grad)
        channels = gscale.size
        gscale = self._cast(gscale.reshape(channels), self.scale_dtype) if need_scale else None
        gbias = self._cast(gbias.reshape(channels), self.bias_dtype) if need_bias else None
        grads = (gx, gscale, gbias, None, None)
        if len(self.needs_grad) > 5:
            grads += (g if need_res else None,)
        return grads


def _blocks(xp, x, fn):
    """[fn(i, j, scratch) for blocks i:j of x's first axis], in order.

    On NumPy, the rows are split over the intra-op threads, and each thread walks its part in
    blocks of about ``_BLOCK_BYTES``, with a scratch array of one block; on other array
    modules, one block of all rows.
    """
    n = x.shape[0]
    if xp is not numpy:
        return [fn(0, n, xp.empty_like(x))]
    row = max(1, x.nbytes // max(n, 1))
    per_block = max(1, min(n, _BLOCK_BYTES // row))
    threads = min(intra_op.get_num_threads(), n) if x.nbytes >= intra_op.MIN_PARALLEL_BYTES else 1
    spans = intra_op.split(n, -(-n // threads), threads)

    def run(t):
        i0, i1 = spans[t]
        scratch = xp.empty((min(per_block, i1 - i0),) + x.shape[1:], dtype=x.dtype)
        return [fn(i, min(i + per_block, i1), scratch) for i in range(i0, i1, per_block)]
    out = []
    for part in intra_op.parallel_map(run, len(spans)):
        out.extend(part)
    return out


def _batch_moments(xp, x, kept):
    """(mean, biased variance) per channel, each (kept) shaped: the two-pass formula, the mean
    first, then the centred squares block by block, the centred block only in cache."""
    inv_count = 1.0 / (x.size // x.shape[1])
    mean = _channel_sum(xp, 1, x).reshape(kept) * inv_count
    mean_row = _per_channel(xp, mean, x)

    def centred_squares(i, j, scratch):
        xc = scratch[:j - i]
        xp.subtract(x[i:j], mean_row, out=xc)
        return _channel_sum(xp, 1, xc, xc)
    parts = _blocks(xp, x, centred_squares)
    m2 = parts[0]
    for p in parts[1:]:
        m2 = m2 + p
    return mean.astype(x.dtype, copy=False), (m2.reshape(kept) * inv_count).astype(x.dtype, copy=False)


def batch_norm_relu(x, running_mean, running_var, weight, bias, residual=None, training=False, momentum=0.1,
                    eps=1e-5):
    """``relu(batch_norm(x) + residual)`` in one op (see BatchNormReLU); arguments as ops.batch_norm.

    Example:
        >>> y = ops.batch_norm_relu(x, moving_mean, moving_var, gamma, beta, identity, training=True)
    """
    args = (x, weight, bias, running_mean, running_var) + (() if residual is None else (residual,))
    return BatchNormReLU(bool(training), eps, momentum)(*args)


__all__ = ["BatchNormReLU", "batch_norm_relu"]
