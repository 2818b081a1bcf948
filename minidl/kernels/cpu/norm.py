"""BatchNorm and BatchNormReLU on large float NumPy arrays: blocks of the batch on the intra-op threads.

The references (minidl/ops/norm.py, norm_relu.py) make whole-array NumPy passes on one thread.
These kernels compute the same maths faster:

- the batch axis is cut into one block per intra-op thread from ``intra_op.min_parallel_bytes()``
  on (1.5x the L2; option ``batchnorm_parallel_bytes`` overrides it for these kernels:
  BatchNorm on 4 MB measured 1.5x faster on 2 threads, on 2 MB no faster), and the
  per-channel sums of the blocks are added in block order;
- a per-channel operand (C, 1, 1) is laid out as one contiguous image (1, C, H, W): as an
  operand that repeats along the batch axis only, NumPy runs its SIMD loops, where values
  repeated with stride 0 along the rows measured 1.5-2x slower (multiply, subtract);
- BatchNormReLU keeps nothing the size of x but x and y, and walks each thread's rows in
  blocks of about ``batchnorm_relu_block_bytes`` whose scratch stays in a core's L2 between
  passes: forward reads x three times (the mean, the centred squares, the output) and
  writes y once.

Bound. Blocked sums round differently from one einsum over the whole batch, and BatchNormReLU
computes ``x * k + (bias - mean * k)`` where the reference computes ``(x - mean) * k + bias``
(one pass less). On float32 ResNet activations (64x16x32x32, values ~N(1, 2), two threads) the
largest difference measured was 1.8e-6 relative to the output's scale (y, gx, gscale, gbias;
float64: 2e-15), so the stated bound is rtol = atol = 2e-5, the float32 tolerance the fused op
was held to against the separate ops before it became a kernel. It holds for channels whose
variance is not far below epsilon: normalising a constant channel multiplies the sums' last-bit
differences by 1 / sqrt(epsilon) (316 at 1e-5), in every blocked BatchNorm alike.
"""
import numpy

from ... import _intra_op as intra_op
from ...ops.norm import BatchNorm
from ...ops.norm_relu import BatchNormReLU
from .. import Kernel, declare_option, get_option, register
from .elementwise import relu_rows, rows_apply

__all__ = ["BatchNormBlocked", "BatchNormReLUBlocked"]

# Measured fwd+bwd in training, float32, 2-core Xeon, 2026-11: at 0.5 MB BatchNormBlocked 1.24x the
# reference, BatchNormReLUBlocked even; at 0.25 MB 1.0x and 0.9x; at 32 KB 0.7x (the per-channel
# images and the blocks cost more than they save). From 1 MB on, 1.2-1.7x. That machine's L2 is
# 2 MiB: the thresholds scale with this machine's L2 (sysfs, minidl/_intra_op.py).
declare_option("batchnorm_min_bytes", intra_op.l2_bytes() // 4,
               "training BatchNorm / BatchNormReLU inputs of at least this many bytes take the CPU kernels "
               "(smaller: the reference)")
declare_option("batchnorm_parallel_bytes", None,
               "BatchNorm kernels split the batch over the intra-op threads from this many bytes of x "
               "(None: the intra-op option parallel_min_bytes)")
declare_option("batchnorm_relu_block_bytes", intra_op.l2_bytes() // 8,
               "bytes of images per block of BatchNormReLU's CPU kernel (a block and its scratch stay in L2)")


def _applies(x):
    return (isinstance(x, numpy.ndarray) and x.dtype.kind == "f" and x.ndim >= 2
            and x.nbytes >= get_option("batchnorm_min_bytes"))


def _threads(x):
    least = get_option("batchnorm_parallel_bytes")
    if x.nbytes < (intra_op.min_parallel_bytes() if least is None else least):
        return 1
    return min(intra_op.get_num_threads(), x.shape[0])


def _map_rows(x, fn):
    """[fn(i, j) for blocks i:j of x's batch axis], one block per intra-op thread (see _threads)."""
    threads = _threads(x)
    if threads <= 1:
        return [fn(0, x.shape[0])]
    spans = intra_op.split(x.shape[0], -(-x.shape[0] // threads), threads)
    return intra_op.parallel_map(lambda t: fn(*spans[t]), len(spans))


def _blocks(x, fn):
    """[fn(i, j, scratch) for blocks i:j of x's batch axis], in order: the rows split over the
    intra-op threads, each thread walking its part in blocks of about batchnorm_relu_block_bytes,
    with a scratch array of one block."""
    n = x.shape[0]
    row = max(1, x.nbytes // max(n, 1))
    per_block = max(1, min(n, get_option("batchnorm_relu_block_bytes") // row))
    threads = _threads(x)
    spans = intra_op.split(n, -(-n // threads), threads)

    def run(t):
        i0, i1 = spans[t]
        scratch = numpy.empty((min(per_block, i1 - i0),) + x.shape[1:], dtype=x.dtype)
        return [fn(i, min(i + per_block, i1), scratch) for i in range(i0, i1, per_block)]
    return [r for part in intra_op.parallel_map(run, len(spans)) for r in part]


def _in_order(parts):
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def _einsum_sum(axis, a, b=None):
    """Per-channel sum of a (or of a * b, never materialised) over every axis but ``axis``."""
    letters = "abcdefghijklmnopqrstuvwxyz"[:a.ndim]
    if b is None:
        return numpy.einsum(f"{letters}->{letters[axis]}", a)
    return numpy.einsum(f"{letters},{letters}->{letters[axis]}", a, b)


def _channel_sum(x, axis, a, b=None):
    """_einsum_sum over blocks of the batch axis on the intra-op threads, the blocks' sums added in order."""
    if b is None:
        return _in_order(_map_rows(x, lambda i, j: _einsum_sum(axis, a[i:j])))
    return _in_order(_map_rows(x, lambda i, j: _einsum_sum(axis, a[i:j], b[i:j])))


def _per_channel(v, x, axis=1):
    """A per-channel array (C on ``axis``, 1 elsewhere) as one contiguous image of x, (1, C, H, W),
    when the channels are axis 1 of an N-D x (see the module docstring); else v. Costs one image
    of writes."""
    if axis != 1 or x.ndim <= 2 or x[0, 0].size <= 1:
        return v
    return numpy.ascontiguousarray(numpy.broadcast_to(v, (1,) + x.shape[1:]))


@register
class BatchNormBlocked(Kernel):
    """ops.BatchNorm: the reference's maths and seams (batch_mean, sum_over_batch), blocked passes."""

    op, backend = BatchNorm, "numpy"
    bound = {"float32": (2e-5, 2e-5), "float64": (1e-12, 1e-12)}

    def applies(self, node, x, *rest):
        # Inference is one multiply and one add: the reference's whole-array passes serve.
        return node.is_training and _applies(x)

    def forward(self, node, x, scale, bias, mean, variance):
        axis, channels = node._check(x, scale, bias, mean, variance)
        dtype = x.dtype
        node.axis = axis
        node.axes = tuple(i for i in range(x.ndim) if i != axis)
        node.kept = tuple(channels if i == axis else 1 for i in range(x.ndim))
        node.scale_dtype, node.bias_dtype = scale.dtype, bias.dtype
        node.scale = scale.astype(dtype, copy=False).reshape(node.kept)
        bias = bias.astype(dtype, copy=False).reshape(node.kept)
        batch_mean = node.batch_mean(x, _channel_sum(x, axis, x))  # sets node.count
        xc = node.xc = numpy.empty_like(x)
        mean_row = _per_channel(batch_mean, x, axis)
        _map_rows(x, lambda i, j: numpy.subtract(x[i:j], mean_row, out=xc[i:j]))
        batch_var = node.sum_over_batch(_channel_sum(x, axis, xc, xc)).reshape(node.kept) / node.count
        node.inv_std = 1.0 / numpy.sqrt(batch_var + node.epsilon)
        y = numpy.empty_like(x)
        k, c = _per_channel(node.scale * node.inv_std, x, axis), _per_channel(bias, x, axis)

        def affine(i, j):
            numpy.multiply(xc[i:j], k, out=y[i:j])
            y[i:j] += c
        _map_rows(x, affine)
        node._update_running(mean, variance, batch_mean, batch_var, node.count)
        return y

    def backward(self, node, gy):
        need_x, need_scale, need_bias = node.needs_grad[:3]
        xc, axis, inv_std = node.xc, node.axis, node.inv_std
        channels = inv_std.size
        local = numpy.empty(2 * channels, dtype=gy.dtype)
        local[:channels] = _channel_sum(gy, axis, gy, xc) * inv_std.reshape(channels)
        local[channels:] = _channel_sum(gy, axis, gy)
        total = node.sum_over_batch(local)
        gx = None
        if need_x:
            inv_m = 1.0 / node.count
            a = _per_channel(total[:channels].reshape(node.kept) * inv_std * inv_m, gy, axis)
            c = _per_channel(total[channels:].reshape(node.kept) * inv_m, gy, axis)
            k = _per_channel(node.scale * inv_std, gy, axis)
            gx = numpy.empty_like(gy)

            def block(i, j):  # gx = (gy - (xc * a + c)) * k, in one buffer
                b = gx[i:j]
                numpy.multiply(xc[i:j], a, out=b)
                b += c
                numpy.subtract(gy[i:j], b, out=b)
                b *= k
            _map_rows(gy, block)
        gscale = node._cast(local[:channels], node.scale_dtype) if need_scale else None
        gbias = node._cast(local[channels:], node.bias_dtype) if need_bias else None
        return gx, gscale, gbias, None, None

    def cases(self):
        return batchnorm_cases(BatchNorm, with_residual=False, modes=(True,))


@register
class BatchNormReLUBlocked(Kernel):
    """ops.BatchNormReLU: x and y the only full-size arrays, blocks that stay in cache."""

    op, backend = BatchNormReLU, "numpy"
    bound = {"float32": (2e-5, 2e-5), "float64": (1e-12, 1e-12)}

    def applies(self, node, x, *rest):
        return _applies(x)

    def forward(self, node, x, scale, bias, mean, variance, residual=None):
        _, channels = node._check(x, scale, bias, mean, variance)
        node.check_residual(x, residual)
        dtype = x.dtype
        node.kept = (1, channels) + (1,) * (x.ndim - 2)
        node.scale_dtype, node.bias_dtype = scale.dtype, bias.dtype
        scale = scale.astype(dtype, copy=False).reshape(node.kept)
        node.count = x.size // max(channels, 1)
        if node.is_training:
            if node.count < 2:
                raise ValueError(f"{node.name}: expected more than 1 value per channel when training, got input "
                                 f"of shape {tuple(x.shape)} (the batch variance is undefined)")
            node.mu, batch_var = _batch_moments(x, node.kept)
            node._update_running(mean, variance, node.mu, batch_var, node.count)
        else:
            node.mu = mean.astype(dtype, copy=False).reshape(node.kept)
            batch_var = variance.astype(dtype, copy=False).reshape(node.kept)
        node.inv_std = 1.0 / numpy.sqrt(batch_var + node.epsilon)
        node.k = scale * node.inv_std
        shift = _per_channel(bias.astype(dtype, copy=False).reshape(node.kept) - node.mu * node.k, x)
        k_row = _per_channel(node.k, x)
        y = numpy.empty_like(x)

        def block(i, j, scratch):
            out = y[i:j]
            numpy.multiply(x[i:j], k_row, out=out)
            out += shift
            if residual is not None:
                out += residual[i:j]
            relu_rows(out, out=out) if rows_apply(out) else numpy.maximum(out, 0, out=out)
        _blocks(x, block)
        node.x, node.y = x, y
        return y

    def backward(self, node, gy):
        need_x, need_scale, need_bias = node.needs_grad[:3]
        need_res = len(node.needs_grad) > 5 and node.needs_grad[5]
        x, y, k, inv_std = node.x, node.y, node.k, node.inv_std
        mu_row = _per_channel(node.mu, x)
        g = numpy.empty_like(gy)  # gy where the output is positive: below the ReLU, and the residual's

        def sums(i, j, scratch):
            gb = g[i:j]
            numpy.multiply(gy[i:j], y[i:j] > 0, out=gb)
            xc = scratch[:j - i]
            numpy.subtract(x[i:j], mu_row, out=xc)
            return _einsum_sum(1, gb), _einsum_sum(1, gb, xc)
        parts = _blocks(x, sums)
        gbias, gxc = _in_order([p[0] for p in parts]), _in_order([p[1] for p in parts])  # sum(g), sum(g * xc)
        gscale = gxc * inv_std.reshape(-1)
        gx = None
        if need_x:
            k_row = _per_channel(k, x)
            if not node.is_training:
                gx = numpy.multiply(g, k_row, out=None if need_res else g)
            else:
                # gx = k * (g - mean(g) - xhat * mean(g * xhat)), xhat = (x - mean) * inv_std
                inv_m = 1.0 / node.count
                a = (k * gxc.reshape(node.kept) * inv_std * inv_std * inv_m).astype(gy.dtype, copy=False)
                c = (node.mu * a - k * gbias.reshape(node.kept) * inv_m).astype(gy.dtype, copy=False)
                a, c = _per_channel(a, x), _per_channel(c, x)
                gx = g if not need_res else numpy.empty_like(g)

                def grad(i, j, scratch):
                    t = scratch[:j - i]
                    numpy.multiply(x[i:j], a, out=t)
                    numpy.multiply(g[i:j], k_row, out=gx[i:j])
                    gx[i:j] -= t
                    gx[i:j] += c
                _blocks(x, grad)
        channels = gscale.size
        gscale = node._cast(gscale.reshape(channels), node.scale_dtype) if need_scale else None
        gbias = node._cast(gbias.reshape(channels), node.bias_dtype) if need_bias else None
        grads = (gx, gscale, gbias, None, None)
        if len(node.needs_grad) > 5:
            grads += (g if need_res else None,)
        return grads

    def cases(self):
        return batchnorm_cases(BatchNormReLU, with_residual=True, modes=(True, False))


def _batch_moments(x, kept):
    """(mean, biased variance) per channel, each (kept) shaped: the two-pass formula, the mean
    first, then the centred squares block by block, the centred block only in cache."""
    inv_count = 1.0 / (x.size // x.shape[1])
    mean = _channel_sum(x, 1, x).reshape(kept) * inv_count
    mean_row = _per_channel(mean, x)

    def centred_squares(i, j, scratch):
        xc = scratch[:j - i]
        numpy.subtract(x[i:j], mean_row, out=xc)
        return _einsum_sum(1, xc, xc)
    m2 = _in_order(_blocks(x, centred_squares))
    return mean.astype(x.dtype, copy=False), (m2.reshape(kept) * inv_count).astype(x.dtype, copy=False)


def batchnorm_cases(op, with_residual, modes, factory=None):
    """A ResNet-sized float32 activation (several blocks, both threads where there are two) and a
    float64 (N, C) one, in the given modes (is_training), for the differential test of a kernel of
    ``op``; ``factory(training)`` makes the primitive (default: op's own constructor)."""
    rng = numpy.random.default_rng(0)
    out = []
    for shape, dtype in (((64, 16, 32, 32), numpy.float32), ((4096, 16), numpy.float64)):
        c = shape[1]
        x = rng.normal(1.0, 2.0, shape).astype(dtype)
        vectors = [rng.normal(size=c).astype(dtype), rng.normal(size=c).astype(dtype)]
        stats = [rng.normal(size=c).astype(dtype), rng.uniform(0.5, 2.0, c).astype(dtype)]
        extra = [rng.normal(size=shape).astype(dtype)] if with_residual else []
        for training in modes:
            out.append((_maker(op, training, stats, factory), [x] + vectors + extra))
    return out


def _maker(op, training, stats, factory=None):
    """A callable that makes the primitive and binds fresh copies of the running statistics."""
    def make():
        if factory is not None:
            prim = factory(training)
        else:
            prim = op(training) if op is BatchNormReLU else op(training, 1e-5, 0.1)
        mean, variance = (s.copy() for s in stats)
        return lambda x, scale, bias, *res: prim(x, scale, bias, mean, variance, *res)
    return make
