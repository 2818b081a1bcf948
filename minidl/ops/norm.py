"""BatchNorm: normalisation by per-channel statistics, with the running statistics updated in place.

Training normalises with the batch mean and biased variance and folds the batch statistics
into the running ``mean`` / ``variance`` arrays (the ``.data`` of non-trainable Parameters),
using the unbiased variance for the running one, as PyTorch and MindSpore do. Inference
normalises with the running statistics.

This is the reference body, written for reading: the maths on one screen each way, for NumPy
and CuPy alike. The fast CPU body (blocks of the batch on the intra-op threads, per-channel
operands laid out for NumPy's SIMD loops) is a kernel, minidl/kernels/cpu/norm.py, held to
this one by the differential tests. Per-channel sums go through ``einsum`` (``_channel_sum``).

Every per-channel sum over the batch (statistics forward, the input gradient's sums
backward) passes through one method, ``BatchNorm.sum_over_batch``, the identity here.
minidl_parallel's SyncBatchNormOp overrides only that method to all-reduce the sums over
its ranks, so synchronised BatchNorm is this body, not a copy of it. (The kernels table looks
up a primitive's exact class: a subclass runs this reference unless a kernel is registered for
it; the CPU kernel calls the same seams, so registering it for such a subclass is enough.)
"""
import numpy

from ..backend import get_array_module
from ..tensor import Tensor
from .primitive import Primitive

_FORMATS = ("NCHW", "NHWC")


def _check_number(op, name, value, low, high, low_open):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{op}: {name} must be a number, got {value!r}")
    ok = (low < value if low_open else low <= value) and value <= high
    if not ok:
        raise ValueError(f"{op}: {name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return float(value)


def _channel_sum(xp, axis, a, b=None):
    """Per-channel sum of a (or of a * b) over every axis but ``axis``: a (C,) array.

    NOTE: ``einsum`` rather than ``sum(axis=(0, 2, 3))``: on NCHW float32 it measured 3.5x
    faster, and its two-operand form sums a product without writing the product out.
    """
    letters = "abcdefghijklmnopqrstuvwxyz"[:a.ndim]
    subscripts = f"{letters}->{letters[axis]}" if b is None else f"{letters},{letters}->{letters[axis]}"
    return xp.einsum(subscripts, a) if b is None else xp.einsum(subscripts, a, b)


class BatchNorm(Primitive):
    """Batch normalisation over the channel axis, ``y = (x - mean) / sqrt(var + eps) * scale + bias``.

    Args:
        is_training: use (and track) batch statistics; False uses ``mean`` and ``variance``.
        epsilon: added to the variance.
        momentum: weight of the NEW batch statistic in the running update,
            ``running = (1 - momentum) * running + momentum * batch`` (MindSpore's primitive
            and PyTorch; ``nn.BatchNorm2d`` passes ``1 - its momentum``).
        data_format: "NCHW" (channel axis 1) or "NHWC" (channel axis last).

    Inputs:
        x: (N, C) or (N, C, H, W) (any rank >= 2 works); scale, bias, mean, variance: (C,).
        In training, mean and variance are updated in place (pass None to skip the update).

    Returns only ``y`` (MindSpore's primitive also returns the batch statistics). Gradients
    flow to x, scale and bias; mean and variance get none.

    Example:
        >>> bn = ops.BatchNorm(is_training=True)
        >>> y = bn(x, gamma, beta, moving_mean, moving_variance)    # moving_* updated in place
    """

    n_inputs = 5
    n_tensor_inputs = (3, 5)  # a strategy's tuples: mean and variance may be None in training

    def __init__(self, is_training=False, epsilon=1e-5, momentum=0.1, data_format="NCHW"):
        super().__init__()
        if not isinstance(is_training, bool):
            raise TypeError(f"BatchNorm: is_training must be a bool, got {is_training!r}")
        if data_format not in _FORMATS:
            raise ValueError(f"BatchNorm: data_format must be one of {_FORMATS}, got {data_format!r}")
        self.is_training = is_training
        self.epsilon = _check_number("BatchNorm", "epsilon", epsilon, 0.0, 1.0, low_open=True)
        self.momentum = _check_number("BatchNorm", "momentum", momentum, 0.0, 1.0, low_open=False)
        self.data_format = data_format

    def _check(self, x, scale, bias, mean, variance):
        if getattr(x, "ndim", 0) < 2:
            raise ValueError(f"{self.name}: x must have at least 2 dimensions (N, C, ...), "
                             f"got shape {tuple(getattr(x, 'shape', ()))}")
        if not numpy.issubdtype(x.dtype, numpy.floating):
            raise TypeError(f"{self.name}: x must be a float tensor, got dtype {x.dtype}")
        axis = 1 if self.data_format == "NCHW" else x.ndim - 1
        channels = x.shape[axis]
        for name, a in (("scale", scale), ("bias", bias), ("mean", mean), ("variance", variance)):
            if a is None and name in ("mean", "variance") and self.is_training:
                continue
            if a is None:
                raise ValueError(f"{self.name}: {name} must be a ({channels},) tensor, got None "
                                 f"(only the running mean and variance may be None, and only in training)")
            if tuple(getattr(a, "shape", ())) != (channels,):
                raise ValueError(f"{self.name}: {name} of shape {tuple(getattr(a, 'shape', ()))} must be "
                                 f"({channels},), one per channel of x of shape {tuple(x.shape)} "
                                 f"({self.data_format})")
        if (mean is None) != (variance is None):
            raise ValueError(f"{self.name}: mean and variance must both be given or both be None")
        return axis, channels

    def forward(self, x, scale, bias, mean, variance):
        axis, channels = self._check(x, scale, bias, mean, variance)
        xp = get_array_module(x)
        dtype = x.dtype
        self.axis = axis
        self.axes = tuple(i for i in range(x.ndim) if i != axis)
        self.kept = tuple(channels if i == axis else 1 for i in range(x.ndim))  # per-channel broadcast shape
        self.scale_dtype, self.bias_dtype = scale.dtype, bias.dtype
        self.scale = scale.astype(dtype, copy=False).reshape(self.kept)
        bias = bias.astype(dtype, copy=False).reshape(self.kept)
        if not self.is_training:
            self.x, self.mu = x, mean.astype(dtype, copy=False).reshape(self.kept)
            self.inv_std = 1.0 / xp.sqrt(variance.astype(dtype, copy=False).reshape(self.kept) + self.epsilon)
            k = self.scale * self.inv_std
            y = x * k
            y += bias - self.mu * k
            return y

        batch_mean = self.batch_mean(x, _channel_sum(xp, axis, x))  # sets self.count
        # NOTE: the centred x is saved instead of xhat = xc * inv_std: backward folds inv_std into
        # its per-channel factors, which saves a full pass here at no cost there.
        self.xc = x - batch_mean
        # Two-pass variance (mean of centred squares): E[x^2] - E[x]^2 cancels badly in float32.
        batch_var = self.sum_over_batch(_channel_sum(xp, axis, self.xc, self.xc)).reshape(self.kept) / self.count
        self.inv_std = 1.0 / xp.sqrt(batch_var + self.epsilon)
        y = self.xc * (self.scale * self.inv_std) + bias
        self._update_running(mean, variance, batch_mean, batch_var, self.count)
        return y

    def batch_mean(self, x, sums):
        """The whole batch's per-channel mean (``kept``-shaped, x's dtype) from this call's
        per-channel ``sums`` of x; sets ``self.count``, the values per channel over the batch.

        The sums and the count travel in one vector, so that a synchronised op adds both in one
        all-reduce. float16 would round the count (and overflow the sums) past 2048 values per
        channel, so they are float32 there.
        """
        xp = get_array_module(x)
        channels = sums.size
        count = x.size // max(channels, 1)
        local = xp.empty(channels + 1, dtype=x.dtype if x.dtype.itemsize >= 4 else xp.dtype(xp.float32))
        local[:channels] = sums
        if xp is numpy:
            local[channels] = count
            total = self.sum_over_batch(local)
            if total is not local:  # summed over other blocks too: the count is theirs as well
                count = int(round(float(total[channels])))
        else:
            # On the GPU, reading a summed count back would stall the device at every
            # BatchNorm: the count is a host number, and it is summed on the host.
            local[channels] = 0
            total = self.sum_over_batch(local)
            count = self.count_over_batch(count)
        if count < 2:
            got = f"input of shape {tuple(x.shape)}"
            if total is not local:
                got = f"{count} over the ranks of its group, {got} on this rank"
            raise ValueError(f"{self.name}: expected more than 1 value per channel when training, got {got} "
                             f"(the batch variance is undefined)")
        self.count = count
        return (total[:channels] / count).astype(x.dtype, copy=False).reshape(self.kept)

    def count_over_batch(self, count):
        """The number of values per channel over the whole batch, from this call's ``count``
        (a host int); a call holds its whole batch here. The GPU path's seam for the count
        (see batch_mean): minidl_parallel's SyncBatchNormOp sums it over its group on the host."""
        return count

    def sum_over_batch(self, sums):
        """The per-channel ``sums`` of this call's block, summed over the whole batch.

        Here a call holds its whole batch, so they are returned as they are (the same array).
        This is the one seam of synchronised BatchNorm: minidl_parallel's SyncBatchNormOp
        overrides it with an all-reduce over the ranks of its group, and everything else
        (two-pass statistics, running update, gradients) is this class's. Training calls it
        three times, on every rank alike: forward with the sums and the count (C + 1 values),
        then with the sums of centred squares (C); backward with ``sum(gy * xhat)`` and
        ``sum(gy)`` (2C), even where x needs no gradient.

        Args:
            sums: a 1-d array of per-channel sums (and counts).

        Returns:
            The sums over the whole batch, same shape and dtype: ``sums`` itself, or a new array
            that leaves ``sums`` as it was (backward returns this block's part of it as the
            gradients of scale and bias).
        """
        return sums

    def _update_running(self, mean, variance, batch_mean, batch_var, count):
        """Folds the batch statistics into the running ones, in place (none when mean is None)."""
        if mean is not None:
            m = self.momentum
            unbiased = batch_var.reshape(mean.shape) * (count / (count - 1))
            mean[...] = (1.0 - m) * mean + m * batch_mean.reshape(mean.shape)
            variance[...] = (1.0 - m) * variance + m * unbiased

    def backward(self, gy):
        xp = get_array_module(gy)
        need_x, need_scale, need_bias = self.needs_grad[:3]
        inv_std, axis = self.inv_std, self.axis
        if not self.is_training:
            gx = gy * (self.scale * inv_std) if need_x else None
            gscale = _channel_sum(xp, axis, gy, self.x - self.mu) * inv_std.reshape(-1) if need_scale else None
            gbias = _channel_sum(xp, axis, gy) if need_bias else None
            return gx, self._cast(gscale, self.scale_dtype), self._cast(gbias, self.bias_dtype), None, None

        channels = inv_std.size
        # This block's sum(gy * xhat) and sum(gy): the gradients of scale and bias on its outputs
        # (a data-parallel grad reducer or the sharding dispatcher adds the other blocks').
        local = xp.empty(2 * channels, dtype=gy.dtype)
        local[:channels] = _channel_sum(xp, axis, gy, self.xc) * inv_std.reshape(channels)
        local[channels:] = _channel_sum(xp, axis, gy)
        total = self.sum_over_batch(local)  # gx needs the whole batch's
        gx = None
        if need_x:
            # gx = scale * inv_std * (gy - mean(gy) - xhat * mean(gy * xhat)), with xhat = xc * inv_std
            # folded into the per-channel factor a.
            inv_m = 1.0 / self.count
            a = total[:channels].reshape(self.kept) * inv_std * inv_m
            c = total[channels:].reshape(self.kept) * inv_m
            gx = (gy - (self.xc * a + c)) * (self.scale * inv_std)
        gscale = self._cast(local[:channels], self.scale_dtype) if need_scale else None
        gbias = self._cast(local[channels:], self.bias_dtype) if need_bias else None
        return gx, gscale, gbias, None, None

    @staticmethod
    def _cast(g, dtype):
        return None if g is None else g.astype(dtype, copy=False)


def batch_norm(input_x, running_mean, running_var, weight=None, bias=None, training=False,
               momentum=0.1, eps=1e-5):
    """Batch normalisation over axis 1, in MindSpore's ``ops.batch_norm`` argument order.

    Args:
        input_x: (N, C) or (N, C, H, W).
        running_mean, running_var: (C,) Tensors, updated in place when training.
        weight, bias: (C,) scale and shift (default ones and zeros).
        training: use batch statistics (and update the running ones).
        momentum: weight of the new batch statistic in the running update.
        eps: added to the variance.

    Example:
        >>> y = ops.batch_norm(x, moving_mean, moving_var, gamma, beta, training=True)
    """
    x = input_x.data if isinstance(input_x, Tensor) else input_x
    xp = get_array_module(x)
    channels = x.shape[1] if getattr(x, "ndim", 0) >= 2 else None
    if channels is not None:
        if weight is None:
            weight = xp.ones(channels, dtype=x.dtype)
        if bias is None:
            bias = xp.zeros(channels, dtype=x.dtype)
    return BatchNorm(bool(training), eps, momentum)(input_x, weight, bias, running_mean, running_var)


__all__ = ['BatchNorm', 'batch_norm']
