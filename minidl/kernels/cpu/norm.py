"""BatchNorm and BatchNorm(+Add)+ReLU on large float NumPy arrays: two passes each way, in blocks.

The references (minidl/ops/norm.py, norm_relu.py) make whole-array NumPy passes: forward about
six over x's size (and a saved centred copy), backward about six more. These kernels compute
the same maths in two passes over the batch each way, each pass one ``intra_op.parallel_map``
(waking a pool thread measured ~60 us: never one call per block):

    forward   1. per channel, sum(x) and sum(x^2) (see _MAX_CANCELLATION)        reads x
              2. y = [relu](x * k + shift [+ residual])                         reads x (res.), writes y
    backward  1. g = gy [* (y > 0)]; sum(g) and sum(g * (x - mean))            reads gy (y), x
                 (or sum(g * x) - mean * sum(g), see _MAX_CANCELLATION_BACKWARD)
              2. gx = g * k - x * a + c                                         reads g, x, writes gx

A pass walks each thread's part of the batch in blocks (``batchnorm_block_bytes``: a quarter of
the L2, so a block and its scratch stay there between the NumPy calls on it; on several threads
half of it per block, since every NumPy call hands the GIL over and fewer, longer calls measured
faster). The batch is split over the threads from one L2 of x (``batchnorm_parallel_bytes``).
Per-channel operands are one contiguous image (1, C, H*W): NumPy's SIMD loops take an operand
that repeats along the outer axis only, where values repeated with stride 0 along a row measured
1.5-2x slower. Nothing the size of x is kept but x and y: backward recomputes ``x - mean``.

Numerics (float32). The variance comes from one pass of sums of x and x^2, each sample's in
x's dtype and the samples' in float64, while the cancellation in ``E[x^2] - E[x]^2`` is small
enough to leave the reference's accuracy (``mean^2 + var <= 8 var``, as in ResNet-20; see
_MAX_CANCELLATION); a channel further from zero (mean 1000, deviation 1: every float32 digit
would be lost) has x summed again about the mean so found. The sums go through the op's seams as
the reference's (``batch_mean`` with the sums of x, ``sum_over_batch`` with the centred squares
about the whole batch's mean), so SyncBatchNormOp's kernel all-reduces the same two vectors. The
affine maps are folded: ``y = x * k + (bias - mean * k)`` (the reference: ``(x - mean) * k +
bias``; PyTorch's CPU kernel folds it too) and ``gx = g * k - x * a + c``: folding rounds ``x *
k`` at ``eps * |x * k|``, the size of the change x's own float32 rounding makes, however large
its mean. Measured against float64, the kernels are as accurate as the reference body
(tests/minidl/kernels/test_norm_kernels.py), and more so on a large mean.

Bound. Blocks, per-sample sums and folding round differently from the reference's whole-array
einsums. On float32 ResNet activations (64x16x32x32 and 64x32x16x16, values ~N(1, 2), two
threads) the largest difference measured was 4.6e-7 relative to the output's scale (y, gx,
gscale, gbias; float64: 4.7e-15), and the kernels were as close to a float64 computation as the
reference. The per-channel sums behind gscale and gbias add 65536 terms: against float64 the
reference's own gscale is off by up to 1.2e-4 (on a scale of 141, the kernel cases' first
draw), the NumPy passes by 1.4e-4, the compiled passes (always centred) by 4.2e-5; so the stated
bound is rtol 2e-5 with atol 2e-4, a few float32 units of the sums' magnitude, not of each
(possibly small) sum. It holds for channels whose variance is not far below epsilon:
normalising a near-constant channel multiplies every rounding difference by up to
1 / sqrt(epsilon) (316 at 1e-5), in any blocked BatchNorm alike.
"""
import numpy

from . import buffers, threads as intra_op
from ...ops.norm import BatchNorm
from ...ops.norm_relu import BatchNormReLU
from .. import Kernel, declare_option, get_option, register
from . import norm_loops

__all__ = ["BatchNormBlocked", "BatchNormReLUBlocked"]

# See "Bound" in the module docstring.
BOUND = {"float32": (2e-5, 2e-4), "float64": (1e-12, 1e-12)}

# Measured fwd+bwd in training, float32, 2-core Xeon (2 MiB L2), 2026-11: the reference's time over
# the kernels' 1.3-1.5x at 1 MB, 1.1-1.2x at 512 KB, 1.0-1.1x at 256 KB, 0.6x at 32 KB (the
# per-channel images and the Python around the passes cost more than they save).
# The thresholds scale with this machine's L2 (sysfs, threads.py).
declare_option("batchnorm_min_bytes", intra_op.l2_bytes() // 4,
               "training BatchNorm / BatchNormReLU inputs of at least this many bytes take the CPU kernels "
               "(smaller: the reference)")
declare_option("batchnorm_parallel_bytes", None,
               "BatchNorm kernels split the batch over the intra-op threads from this many bytes of x "
               "(None: this machine's L2, see _threads)")
declare_option("batchnorm_numba", norm_loops.available,
               "run each pass of the BatchNorm kernels as one loop compiled by Numba (norm_loops.py; needs "
               "pip install 'minidl[numba]'); False: the NumPy passes")
declare_option("batchnorm_block_bytes", None,
               "bytes of x per block of the BatchNorm kernels' passes (None: a quarter of the L2 on one "
               "thread, half of it per thread on several, see _Passes)")


def _applies(x):
    return (isinstance(x, numpy.ndarray) and x.dtype in (numpy.float32, numpy.float64) and x.ndim >= 2
            and x.size > 0 and x.nbytes >= get_option("batchnorm_min_bytes"))


def _threads(x):
    least = get_option("batchnorm_parallel_bytes")
    if least is None:
        # From one L2 of x, each thread's part fits its own core's L2 between the two passes. In
        # the training step (x fresh from the convolution, y to fresh memory), 2 MB on 2 threads
        # measured 1.1x faster than on one (2 MB L2; ResNet-20's BatchNorm time 3-4% less than
        # splitting from intra_op.min_parallel_bytes(), 1.5x the L2); with x hot in cache (bench_norm)
        # no faster: waking the other thread costs ~60 us per pass.
        least = intra_op.l2_bytes()
    if x.nbytes < least:
        return 1
    return min(intra_op.get_num_threads(), x.shape[0])


class _Passes:
    """How the passes walk x: a 3-D view (N, A, B) with the channels on A (NCHW: (N, C, H*W)) or on B
    (channels last, and (N, C): (N, H*W, C)); the batch split into one span per thread, each span
    walked in blocks of ``rows`` samples."""

    def __init__(self, x, axis):
        n, c = x.shape[0], x.shape[axis]
        self.channels_last = axis == x.ndim - 1
        self.shape = (n, x.size // (n * c), c) if self.channels_last else (n, c, x.size // (n * c))
        self.reduce = "abc->ac" if self.channels_last else "abc->ab"  # per sample and channel
        self.per_sample = x.size // (n * c)  # values per channel in one sample
        self.dtype = x.dtype
        threads = _threads(x)
        block = get_option("batchnorm_block_bytes")
        if block is None:
            # A block and its scratch in L2 on one thread; threads take blocks of half an L2: each
            # NumPy call hands the GIL to the other thread, and fewer, longer calls measured faster
            # than blocks that stay in L2 (4 MB float32 on 2 threads, 2 MB L2: 1.1x).
            block = intra_op.l2_bytes() // (4 if threads == 1 else 2)
        self.rows = max(1, min(n, block // max(1, x.nbytes // n)))
        self.spans = intra_op.split(n, -(-n // threads), threads)
        # Compiled passes need no blocks (no temporaries to keep in cache): one call per span.
        self.compiled = (get_option("batchnorm_numba") and norm_loops.available and not self.channels_last
                         and x.flags.c_contiguous)
        if self.compiled:
            self.rows = n

    def view(self, a):
        return a.reshape(self.shape)

    def image(self, v):
        """C per-channel values (any shape) as one contiguous (1, A, B) sample of x's dtype."""
        image = numpy.empty((1,) + self.shape[1:], dtype=self.dtype)
        v = numpy.asarray(v).reshape(-1)
        image[0] = v if self.channels_last else v[:, None]
        return image

    def sum(self, a, b=None):
        """The per-channel sum of a block (of a * b, never materialised), in float64: each sample's
        sums in x's dtype (one SIMD einsum, as fast as the per-channel one), then the samples' in
        float64, so rounding grows with the values per sample, not per block."""
        if b is None:
            return numpy.einsum(self.reduce, a).sum(axis=0, dtype=numpy.float64)
        lhs, out = self.reduce.split("->")
        return numpy.einsum(f"{lhs},{lhs}->{out}", a, b).sum(axis=0, dtype=numpy.float64)

    def run(self, fn):
        """[fn(t, blocks, scratch) for each thread's span t], one parallel_map: ``blocks`` are the
        span's (i, j) of about batchnorm_block_bytes, ``scratch`` an array of one block."""
        def span(t):
            i0, i1 = self.spans[t]
            scratch = numpy.empty((min(self.rows, i1 - i0),) + self.shape[1:], dtype=self.dtype)
            return fn(t, [(i, min(i + self.rows, i1)) for i in range(i0, i1, self.rows)], scratch)
        return intra_op.parallel_map(span, len(self.spans))


# Sums of x and x^2 lose a channel's variance to rounding in proportion to the cancellation in
# E[x^2] - E[x]^2, f = (var + mean^2) / var (a float32 channel of mean 1000 and deviation 1: f = 1e6,
# every digit lost). Each sample's sums are taken in float32 (runs of H*W values, in SIMD lanes) and
# added over the samples in float64 (``_Passes.sum``); so measured, the variance's relative error
# for f up to 8 stays that of the reference's two-pass sums (float32 NCHW 64x{16,32,64}x{32,16,8}^2:
# 1e-7-4e-7, the reference 2e-7-4e-7). ResNet-20's BatchNorm inputs have f up to 6.4, so one pass
# over x serves; a channel beyond 8 has x summed again about the mean so found (f ~ 1).
_MAX_CANCELLATION = 8.0
# Backward sums g * x and subtracts mean * sum(g) where f <= 4, else sums g * (x - mean): the
# uncentred sum's rounding grows as |x| / deviation = sqrt(f), measured up to 2x the reference's
# error on gscale at f = 4 (all else within 1.2x); ResNet-20's inputs have f 2.4-6.4 per call.
_MAX_CANCELLATION_BACKWARD = 4.0


def _moments(p, x3, shift):
    """(count, sum, sum of squares) per channel of x - shift (per channel, x's dtype; None: x itself),
    in float64: one read of x, the shifted block summed and squared from L2."""
    if p.compiled:
        vector = numpy.zeros(x3.shape[1], x3.dtype) if shift is None else shift

        def span(t, blocks, scratch):
            s, q = numpy.zeros(x3.shape[1]), numpy.zeros(x3.shape[1])
            norm_loops.moments(x3[blocks[0][0]:blocks[-1][1]], vector, s, q)
            return s, q
    else:
        image = None if shift is None else p.image(shift)

        def span(t, blocks, scratch):
            s = q = 0.0
            for i, j in blocks:
                xs = x3[i:j] if image is None else numpy.subtract(x3[i:j], image, out=scratch[:j - i])
                s, q = s + p.sum(xs), q + p.sum(xs, xs)
            return s, q
    parts = p.run(span)
    return p.shape[0] * p.per_sample, sum(s for s, _ in parts), sum(q for _, q in parts)


def _statistics(node, p, x):
    """The batch's (mean, biased variance), ``node.kept``-shaped in x's dtype, through the op's seams
    as the reference (batch_mean with this call's sums, sum_over_batch with its centred squares), so
    a synchronised op all-reduces the same two vectors."""
    x3 = p.view(x)
    n, s, q = _moments(p, x3, None)
    shift = numpy.zeros(s.size)
    if not numpy.all(q <= _MAX_CANCELLATION * (q - s * s / n)):
        shift = (s / n).astype(x.dtype)
        n, s, q = _moments(p, x3, shift)
        shift = shift.astype(numpy.float64)
    mean = node.batch_mean(x, s + n * shift)  # the whole batch's (the seam); sets node.count
    d = mean.reshape(-1) - shift
    m2 = q - d * (2 * s - n * d)  # sum((x - mean)^2) over this call's values
    variance = node.sum_over_batch(m2.astype(x.dtype)).reshape(node.kept) / node.count
    return mean, variance.astype(x.dtype, copy=False)


def _forward(node, x, scale, bias, mean, variance, residual=None, relu=False):
    """y = [relu](x * k + (bias - mean * k) [+ residual]), the statistics first when training."""
    axis, channels = node._check(x, scale, bias, mean, variance)
    dtype = x.dtype
    node.axis = axis
    node.kept = tuple(channels if i == axis else 1 for i in range(x.ndim))
    node.scale_dtype, node.bias_dtype = scale.dtype, bias.dtype
    p = _Passes(x, axis)
    if node.is_training:
        node.mu, batch_var = _statistics(node, p, x)
        node._update_running(mean, variance, node.mu, batch_var, node.count)
    else:
        node.mu = mean.astype(dtype, copy=False).reshape(node.kept)
        batch_var = variance.astype(dtype, copy=False).reshape(node.kept)
    node.inv_std = 1.0 / numpy.sqrt(batch_var + node.epsilon)
    node.k = scale.astype(dtype, copy=False).reshape(node.kept) * node.inv_std
    k, shift = p.image(node.k), p.image(bias.astype(dtype, copy=False).reshape(node.kept) - node.mu * node.k)
    zero = p.image(numpy.zeros(channels)) if relu else None  # an operand like the others: max's SIMD loop
    y = buffers.empty(x.shape, dtype)
    x3, y3 = p.view(x), p.view(y)
    r3 = None if residual is None else p.view(residual)

    if p.compiled and (r3 is None or residual.flags.c_contiguous):
        k = node.k.reshape(-1)
        shift = (bias.astype(dtype, copy=False).reshape(node.kept) - node.mu * node.k).reshape(-1)
        none = numpy.empty((0, 0, 0), dtype)

        def affine(t, blocks, scratch):
            i, j = blocks[0][0], blocks[-1][1]
            norm_loops.affine(x3[i:j], k, shift, none if r3 is None else r3[i:j], relu, dtype.type(0), y3[i:j])
    else:
        def affine(t, blocks, scratch):
            for i, j in blocks:
                out = y3[i:j]
                numpy.multiply(x3[i:j], k, out=out)
                out += shift
                if r3 is not None:
                    out += r3[i:j]
                if relu:
                    numpy.maximum(out, zero, out=out)
    p.run(affine)
    node.x, node.y = x, (y if relu else None)
    return y


def _backward(node, gy, relu=False):
    """(gx, gscale, gbias, None, None[, gresidual]); training: the sums of g and g * (x - mean) in
    one pass (through sum_over_batch, as the reference), then gx = g * k - x * a + c."""
    need_x, need_scale, need_bias = node.needs_grad[:3]
    need_res = len(node.needs_grad) > 5 and node.needs_grad[5]
    x, k, inv_std = node.x, node.k, node.inv_std
    channels = inv_std.size
    p = _Passes(x, node.axis)
    x3, gy3 = p.view(x), p.view(gy)
    g = buffers.empty(gy.shape, gy.dtype) if relu else gy  # below the ReLU: the residual's gradient too
    g3, y3 = p.view(g), (p.view(node.y) if relu else None)
    # sum(g * (x - mean)) as sum(g * x) - mean * sum(g) where the cancellation is small
    f = 1.0 + node.mu * node.mu * (inv_std * inv_std)
    mu = None if node.is_training and numpy.all(f <= _MAX_CANCELLATION_BACKWARD) else p.image(node.mu)
    compiled = p.compiled and gy.flags.c_contiguous
    if compiled:
        mu = node.mu  # a compiled pass centres x for free: always the accurate sum
        mu_vector, one, none = node.mu.reshape(-1), gy.dtype.type(1), numpy.empty((0, 0, 0), gy.dtype)

        def sums(t, blocks, scratch):
            i, j = blocks[0][0], blocks[-1][1]
            s, d = numpy.zeros(channels), numpy.zeros(channels)
            norm_loops.grad_sums(gy3[i:j], y3[i:j] if relu else none, x3[i:j], mu_vector, relu, one,
                                 one - one, g3[i:j], s, d)
            return s, d
    else:
        def sums(t, blocks, scratch):
            s = d = 0.0
            for i, j in blocks:
                gb = g3[i:j]
                if relu:  # gy * (y > 0): the mask written as 1.0 / 0.0, a float operand for multiply's SIMD loop
                    numpy.greater(y3[i:j], 0, out=gb)
                    gb *= gy3[i:j]
                xc = x3[i:j] if mu is None else numpy.subtract(x3[i:j], mu, out=scratch[:j - i])
                s, d = s + p.sum(gb), d + p.sum(gb, xc)
            return s, d
    parts = p.run(sums)
    gsum, gdot = sum(s for s, _ in parts), sum(d for _, d in parts)
    if mu is None:
        gdot = gdot - node.mu.reshape(-1) * gsum
    local = numpy.empty(2 * channels, dtype=gy.dtype)  # this call's sum(g * xhat), sum(g): gscale, gbias
    local[:channels] = gdot * inv_std.reshape(channels)
    local[channels:] = gsum
    gx = None
    if need_x:
        gx = g if relu and not need_res else buffers.empty(gy.shape, gy.dtype)
        gx3 = p.view(gx)
        if node.is_training:
            # gx = k * (g - mean(g) - xhat * mean(g * xhat)), xhat = (x - mean) * inv_std, as
            # g * k - x * a + c: the whole batch's sums (the seam), folded into per-channel a and c.
            total = node.sum_over_batch(local)
            inv_m = 1.0 / node.count
            a = total[:channels].reshape(node.kept) * inv_std * inv_m * k
            c = node.mu * a - total[channels:].reshape(node.kept) * inv_m * k
            if compiled:
                vectors = [v.astype(gy.dtype, copy=False).reshape(-1) for v in (k, a, c)]

                def grad(t, blocks, scratch):
                    i, j = blocks[0][0], blocks[-1][1]
                    norm_loops.grad_apply(g3[i:j], x3[i:j], *vectors, gx3[i:j])
            else:
                k_, a, c = p.image(k), p.image(a), p.image(c)

                def grad(t, blocks, scratch):
                    for i, j in blocks:
                        out, xa = gx3[i:j], scratch[:j - i]
                        numpy.multiply(x3[i:j], a, out=xa)
                        numpy.multiply(g3[i:j], k_, out=out)
                        out -= xa
                        out += c
        else:
            k_ = p.image(k)

            def grad(t, blocks, scratch):
                for i, j in blocks:
                    numpy.multiply(g3[i:j], k_, out=gx3[i:j])
        p.run(grad)
    elif node.is_training:
        node.sum_over_batch(local)  # every rank of a synchronised op calls it alike
    gscale = node._cast(local[:channels], node.scale_dtype) if need_scale else None
    gbias = node._cast(local[channels:], node.bias_dtype) if need_bias else None
    grads = (gx, gscale, gbias, None, None)
    if len(node.needs_grad) > 5:
        grads += (g if need_res else None,)
    return grads


@register
class BatchNormBlocked(Kernel):
    """ops.BatchNorm in training: two passes each way (see the module docstring), through the
    reference's seams (batch_mean, sum_over_batch), so a subclass that changes only those
    (SyncBatchNormOp) may register it as it is."""

    op, backend = BatchNorm, "numpy"
    bound = BOUND

    def applies(self, node, x, *rest):
        # Inference is one multiply and one add: the reference's whole-array passes serve.
        return node.is_training and _applies(x)

    def forward(self, node, x, scale, bias, mean, variance):
        return _forward(node, x, scale, bias, mean, variance)

    def backward(self, node, gy):
        return _backward(node, gy)

    def cases(self):
        # (N, C) takes the channels-last route of NHWC (test_norm_kernels.py has NHWC itself).
        return batchnorm_cases(BatchNorm, with_residual=False, modes=(True,))


@register
class BatchNormReLUBlocked(Kernel):
    """ops.BatchNormReLU, training and inference: BatchNormBlocked's passes with the residual and the
    ReLU in the forward's second pass, the ReLU's mask in the backward's first."""

    op, backend = BatchNormReLU, "numpy"
    bound = BOUND

    def applies(self, node, x, *rest):
        return _applies(x)

    def forward(self, node, x, scale, bias, mean, variance, residual=None):
        node.check_residual(x, residual)
        return _forward(node, x, scale, bias, mean, variance, residual, relu=True)

    def backward(self, node, gy):
        return _backward(node, gy, relu=True)

    def cases(self):
        # Not far from zero: the ReLU's mask flips where a pre-activation is within rounding of 0,
        # and rounding grows with |x| (BatchNormBlocked's cases take those routes, the same code).
        return (batchnorm_cases(BatchNormReLU, with_residual=True, modes=(True, False), far_from_zero=False)
                + batchnorm_cases(BatchNormReLU, with_residual=False, modes=(True, False), shapes=[(64, 16, 16, 16)]))


def batchnorm_cases(op, with_residual, modes, factory=None, shapes=None, axis=1, far_from_zero=True):
    """ResNet-sized activations for the differential test of a kernel of ``op``, in the given modes
    (is_training): by default float32 (64, 16, 32, 32) values ~N(1, 2) (blocks on every thread), a
    float64 (N, C) one (the channels-last route), and with ``far_from_zero`` float32 (64, 32, 16, 16)
    values ~N(4, 1), for the second statistics pass and the centred backward sums; ``shapes``
    replaces them with float32 ~N(1, 2) activations of those shapes, whose channels are on ``axis``;
    ``factory(training)`` makes the primitive (default: op's own constructor)."""
    rng = numpy.random.default_rng(0)
    if shapes is None:
        draws = [((64, 16, 32, 32), numpy.float32, 1.0, 2.0), ((4096, 16), numpy.float64, 1.0, 2.0)]
        draws += [((64, 32, 16, 16), numpy.float32, 4.0, 1.0)] if far_from_zero else []
    else:
        draws = [(shape, numpy.float32, 1.0, 2.0) for shape in shapes]
    out = []
    for shape, dtype, loc, spread in draws:
        c = shape[axis]
        vectors = [rng.normal(size=c).astype(dtype), rng.normal(size=c).astype(dtype)]
        stats = [rng.normal(size=c).astype(dtype), rng.uniform(0.5, 2.0, c).astype(dtype)]
        # x after the vectors: drawn first from seed 0, x would be the harness's gy (seed 0) up to
        # an affine map, and BatchNorm's gx ~ 0.
        x = rng.normal(loc, spread, shape).astype(dtype)
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
