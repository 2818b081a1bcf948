"""Gradient compression on the wire: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``.

Horovod's names (``hvd.Compression.fp16``) and meaning: each bucket of gradients is cast to the
16-bit type, all-reduced in that type (half the bytes of float32: the collective itself sums
16-bit numbers, MPI's and NCCL's float16 sum adds two halves and rounds the result to half),
then cast back; the optimizer updates in the parameters' own dtype. SINGA's
``backward_and_update_half`` is the same with fp16.

bf16 has float32's range (no overflow where float32 has none) and 8 significant bits; fp16
has 11 bits but overflows above 65504. NumPy has no bfloat16: it comes from the ``ml_dtypes``
package (``pip install ml_dtypes``), on the CPU only (CuPy has no bfloat16 arrays).

Accuracy: each rank's value is rounded once to the 16-bit type (relative error at most
u = 2**-11 for fp16, 2**-8 for bf16), and each of the n - 1 additions of the reduction rounds
once more, so the reduced sum of n gradients g_i differs from the exact sum by at most about
n * u * sum |g_i| (plus n half-subnormal steps near zero). The tests check that bound.

A reduction that overflows (an inf or NaN in the 16-bit result) is never applied silently: the
reducer flags it on the device (see DistributedGradReducer.overflowed).
"""
import numpy

__all__ = ["Compression", "Compressor"]


class Compressor:
    """No compression: the wire type is the gradient's own."""

    name = "none"

    def wire_dtype(self, dtype, who):
        """The dtype the bucket travels in (raises for a dtype this compression cannot take)."""
        return numpy.dtype(dtype)

    def compress(self, xp, buf, who):
        """The bucket as it goes on the wire (buf itself when nothing changes)."""
        return buf

    def decompress(self, xp, wire, buf):
        """Writes the reduced wire values back into the bucket's buffer ``buf``."""
        if wire is not buf:
            buf[...] = wire

    def __repr__(self):
        return f"Compression.{self.name}"


class _Float16Compressor(Compressor):
    """Buckets of float32/float64 gradients travel as a 16-bit float type."""

    def _type(self, xp, who):
        raise NotImplementedError

    def wire_dtype(self, dtype, who):
        dtype = numpy.dtype(dtype)
        if dtype.kind != "f":
            raise TypeError(f"{who}: {self!r} compresses floating-point gradients, got a bucket of {dtype}; "
                            f"integer tensors cannot be compressed: use Compression.none")
        return numpy.dtype(self._type(numpy, who))

    def compress(self, xp, buf, who):
        return buf.astype(self._type(xp, who))

    def decompress(self, xp, wire, buf):
        buf[...] = wire.astype(buf.dtype)


class _FP16(_Float16Compressor):
    name = "fp16"

    def _type(self, xp, who):
        return numpy.float16


class _BF16(_Float16Compressor):
    name = "bf16"

    def _type(self, xp, who):
        if xp is not numpy:
            raise TypeError(f"{who}: Compression.bf16 needs NumPy arrays: CuPy has no bfloat16 dtype; use "
                            f"Compression.fp16 on the GPU")
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError(f"{who}: Compression.bf16 needs the ml_dtypes package (NumPy has no bfloat16): "
                              f"pip install ml_dtypes") from None
        return ml_dtypes.bfloat16


class Compression:
    """The compressions, by Horovod's names: ``none``, ``fp16``; and ``bf16``."""

    none = Compressor()
    fp16 = _FP16()
    bf16 = _BF16()

    @classmethod
    def resolve(cls, value, who):
        """A Compressor from a Compressor or a name ("none", "fp16", "bf16", None)."""
        if value is None:
            return cls.none
        if isinstance(value, Compressor):
            return value
        if isinstance(value, str) and value.lower() in ("none", "fp16", "bf16"):
            return getattr(cls, value.lower())
        raise ValueError(f"{who}: compression must be Compression.none, .fp16 or .bf16 (or their names), "
                         f"got {value!r}")
