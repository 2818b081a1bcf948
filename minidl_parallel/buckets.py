"""Fused gradient buckets: the plan that groups parameters into flat per-dtype buffers, and the packing.

Gradients are packed into flat per-dtype buffers ("buckets") of at most ``fusion_bytes``,
filled with the parameters in REVERSE order, as PyTorch DDP does: backward produces the last
layers' gradients first, so the first bucket is the first one complete. One collective runs
per bucket, never one per parameter: small tensors cost one latency per bucket, not each.

Example:
    >>> [b.indices for b in plan_buckets([((2,), "float32"), ((3,), "float32")], fusion_bytes=1024)]
    [[1, 0]]
"""
import numpy

__all__ = ["Bucket", "plan_buckets", "numel", "DEFAULT_FUSION_BYTES"]

DEFAULT_FUSION_BYTES = 25 * 1024 * 1024  # PyTorch DDP's bucket_cap_mb default


class Bucket:
    """Parameters (indices) sharing one flat buffer of one dtype."""

    def __init__(self, dtype):
        self.dtype = dtype
        self.indices = []
        self.offsets = []
        self.sizes = []
        self.size = 0
        self.buffer = None
        self.wire = None  # the buffer on the wire when compressed (else the buffer itself)
        self.request = None

    def slots(self):
        """(parameter index, offset, element count) of each parameter in the buffer."""
        return zip(self.indices, self.offsets, self.sizes)

    def pack(self, xp, grads, scale):
        """Copies ``grads[i]`` of each parameter i into a fresh buffer, times ``scale`` (None: as
        they are); a None gradient packs as zeros. Returns the buffer."""
        # A fresh buffer each step: the returned gradients are views of it, which saves copying
        # them out and keeps them valid after the next step.
        buf = self.buffer = xp.empty(self.size, dtype=self.dtype)
        for i, off, n in self.slots():
            g = grads[i]
            if g is None:
                buf[off:off + n] = 0
            elif scale is None:
                buf[off:off + n] = g.reshape(-1)
            else:
                xp.multiply(g.reshape(-1), scale, out=buf[off:off + n])
        return buf


def plan_buckets(shapes_and_dtypes, fusion_bytes):
    """The buckets for parameters of these (shape, dtype), filled in reverse order: a bucket of
    one dtype takes parameters until the next would pass ``fusion_bytes`` (a larger parameter
    gets a bucket of its own)."""
    shapes_and_dtypes = list(shapes_and_dtypes)
    buckets, open_by_dtype = [], {}
    for i in reversed(range(len(shapes_and_dtypes))):
        shape, dtype = shapes_and_dtypes[i]
        dtype = numpy.dtype(dtype)
        n = numel(shape)
        bucket = open_by_dtype.get(dtype)
        if bucket is not None and bucket.size and (bucket.size + n) * dtype.itemsize > fusion_bytes:
            bucket = None
        if bucket is None:
            bucket = open_by_dtype[dtype] = Bucket(dtype)
            buckets.append(bucket)
        bucket.indices.append(i)
        bucket.offsets.append(bucket.size)
        bucket.sizes.append(n)
        bucket.size += n
    return buckets


def numel(shape):
    """The number of elements of an array of ``shape``."""
    n = 1
    for s in shape:
        n *= int(s)
    return n
