"""Hypothesis strategies shared by the op tests (imports hypothesis: for tests only)."""
import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


def shapes(min_dims=1, max_dims=4, min_side=1, max_side=5):
    """Array shapes small enough for finite differences."""
    return hnp.array_shapes(min_dims=min_dims, max_dims=max_dims, min_side=min_side, max_side=max_side)


def arrays(shape, low=-3.0, high=3.0, dtype=np.float64):
    """Float arrays with bounded, finite values (no NaN/inf: gradients must be defined)."""
    return hnp.arrays(dtype, shape, elements=st.floats(low, high, allow_nan=False, allow_infinity=False, width=64))


def distinct_arrays(shape, low=-3.0, high=3.0, gap=1e-3):
    """Arrays whose values are pairwise at least ``gap`` apart (for max/pool/relu finite differences)."""
    size = int(np.prod(shape))
    return st.integers(0, 2**32 - 1).map(lambda seed: _spread(seed, shape, size, low, high, gap))


def _spread(seed, shape, size, low, high, gap):
    rng = np.random.default_rng(seed)
    values = rng.permutation(size).astype(np.float64)
    values = low + (values + 0.5) * (high - low) / max(size, 1)
    values += rng.uniform(-0.25, 0.25, size) * (high - low) / max(size, 1)
    return values.reshape(shape)


def broadcastable_shapes(shape):
    """A shape that numpy broadcasts with ``shape``."""
    return hnp.broadcastable_shapes(shape, min_dims=0, max_dims=len(shape))
