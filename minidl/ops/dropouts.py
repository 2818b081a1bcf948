"""Dropout: zero each element with probability 1 - keep_prob and scale the kept ones by 1/keep_prob.

The mask is drawn from the framework's generator (``minidl.backend.rng()``, seeded by
``minidl.set_seed``) for NumPy arrays and from ``minidl.backend.device_rng()`` for CuPy arrays
(CuPy's RandomState, reseeded from that same generator at each draw: every device and thread-rank
follows set_seed, and checkpoints resume it), so runs repeat exactly under a fixed seed. Nonzero ``seed0`` / ``seed1`` give the primitive its own
generator instead, as MindSpore's seeds do.
"""
import numpy

from .. import backend
from ..backend import get_array_module
from ..tensor import Tensor
from .math import Mul
from .primitive import Primitive


def _check_seed(name, seed):
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"Dropout: {name} must be a non-negative int, got {seed!r}")
    return seed


class Dropout(Primitive):
    """``x * mask / keep_prob`` with ``mask ~ Bernoulli(keep_prob)``: the mean is preserved.

    Args:
        keep_prob: probability of keeping an element, in (0, 1]; 1 returns x unchanged.
        seed0, seed1: when either is nonzero, the primitive draws from its own generator
            seeded by them; both 0 (default) use the global seed (``minidl.set_seed``).

    Attribute ``mask_window``: None, or ``(global_shape, index)`` to draw the mask of a larger
    logical tensor and keep ``mask[index]`` (set by tensor parallelism on each rank's block).

    Returns only the output (MindSpore's primitive also returns the mask). The gradient is
    ``gy * mask / keep_prob``, with the mask of the forward call.

    Example:
        >>> minidl.set_seed(0)
        >>> y = ops.Dropout(keep_prob=0.8)(x)      # about 20% zeros, the rest scaled by 1.25
    """

    def __init__(self, keep_prob=0.5, seed0=0, seed1=0):
        super().__init__()
        if isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float)) or not 0 < keep_prob <= 1:
            raise ValueError(f"Dropout: keep_prob must be in (0, 1], got {keep_prob!r}")
        self.keep_prob = float(keep_prob)
        self.seed0 = _check_seed("seed0", seed0)
        self.seed1 = _check_seed("seed1", seed1)
        # NOTE: a dict shared by every call's clone (the clone copies attributes by reference),
        # so a seeded primitive's stream advances across calls instead of restarting.
        self._generators = {}
        # (global_shape, index): draw the mask of a larger logical tensor and keep this window,
        # so that blocks of one tensor get the blocks of one mask (tensor parallelism: every
        # rank makes the same draws and keeps its own block). None: the mask has x's shape.
        self.mask_window = None

    def _random(self, xp, shape):
        """Uniform [0, 1) float32 samples of ``shape`` from the generator that owns xp's arrays."""
        seeded = self.seed0 or self.seed1
        if xp is numpy:
            if not seeded:
                return backend.rng().random(shape, dtype=numpy.float32)
            gen = self._generators.get("numpy")
            if gen is None:
                gen = self._generators["numpy"] = numpy.random.default_rng([self.seed0, self.seed1])
            return gen.random(shape, dtype=numpy.float32)
        if not seeded:
            return backend.device_rng().random_sample(shape, dtype=xp.float32)
        gen = self._generators.get("cupy")
        if gen is None:
            gen = self._generators["cupy"] = xp.random.RandomState(self.seed0 * 2**32 + self.seed1)
        return gen.random_sample(shape, dtype=xp.float32)

    def forward(self, x):
        if not numpy.issubdtype(getattr(x, "dtype", numpy.dtype(object)), numpy.floating):
            raise TypeError(f"Dropout: x must be a float tensor, got {getattr(x, 'dtype', type(x).__name__)}")
        if self.keep_prob == 1.0:
            self.mask = None
            return x
        xp = get_array_module(x)
        if self.mask_window is None:
            u = self._random(xp, x.shape)
        else:
            shape, index = self.mask_window
            u = self._random(xp, tuple(shape))[tuple(index)]
            if u.shape != x.shape:
                raise ValueError(f"Dropout: mask_window {tuple(index)} of a mask of shape {tuple(shape)} has shape "
                                 f"{u.shape}, but x has shape {tuple(x.shape)}")
        keep = u < self.keep_prob
        # The scaled mask in x's dtype: backward is then a single multiply.
        mask = keep.astype(x.dtype)
        mask *= 1.0 / self.keep_prob
        self.mask = mask
        return x * mask

    def backward(self, gy):
        if self.mask is None:
            return (gy,)
        return (gy * self.mask,)


def dropout(input, p=0.5, training=True, seed=None):  # noqa: A002 - MindSpore's name
    """Drops each element with probability ``p`` (MindSpore 2.x ``ops.dropout``: p DROPS).

    Args:
        input: float Tensor.
        p: drop probability in [0, 1]; p == 1 gives zeros (with a zero gradient).
        training: False (or p == 0) returns ``input`` itself.
        seed: optional int; the mask then depends only on it (the same for every call).

    Example:
        >>> y = ops.dropout(x, p=0.1)
    """
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
        raise ValueError(f"dropout: p (the drop probability) must be in [0, 1], got {p!r}")
    if not training or p == 0:
        return input
    if p == 1:
        x = input.data if isinstance(input, Tensor) else input
        return Mul()(input, get_array_module(x).zeros((), dtype=x.dtype))
    seed0 = 0 if seed is None else _check_seed("seed", seed)
    # NOTE: seed1 = 1 keeps a given seed 0 distinct from "no seed" (seed0 == seed1 == 0).
    return Dropout(1.0 - p, seed0, 0 if seed is None else 1)(input)


__all__ = ['Dropout', 'dropout']
