"""The Dense kernels' compiled sweeps (minidl/kernels/cpu/dense_loops.py, called by dense.py)
against NumPy's passes, bit for bit, signed zeros, NaN and inf included, on hypothesis draws:
shapes of one row or column too."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl.kernels.cpu import dense

pytestmark = [pytest.mark.cpu_only,
              pytest.mark.skipif(not dense._numba, reason="the compiled sweeps need the numba extra")]

shapes = st.tuples(st.integers(1, 70), st.integers(1, 70))
dtypes = st.sampled_from([np.float32, np.float64])


def draw(rng, shape, dtype, specials=True):
    a = rng.standard_normal(shape).astype(dtype)
    if specials and a.size >= 4:
        a.flat[:4] = [-0.0, 0.0, np.nan, np.inf]
    return a


def same(a, b):
    return np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b))


@given(shape=shapes, dtype=dtypes, relu=st.booleans(), seed=st.integers(0, 2**16))
def test_bias_relu_sweep_is_numpys_bit_for_bit(shape, dtype, relu, seed):
    rng = np.random.default_rng(seed)
    y, b = draw(rng, shape, dtype), draw(rng, shape[1:], dtype, specials=False)
    want = np.maximum(y + b, 0) if relu else y + b  # maximum: NaN stays, -0.0 becomes 0.0
    got = y.copy()
    assert dense.add_bias_relu(got, b, relu, compiled=True) is got
    assert same(got, want)


@given(shape=shapes, dtype=dtypes, seed=st.integers(0, 2**16))
def test_masked_sums_sweep_is_numpys_bit_for_bit(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    gy, y = draw(rng, shape, dtype), draw(rng, shape, dtype)
    with np.errstate(invalid="ignore"):
        want = gy * (y > 0)
        g, gb = dense.relu_grad(gy, y, compiled=True)
        want_sums = want.sum(axis=0)
    assert g.dtype == gb.dtype == dtype
    assert same(g, want) and same(gb, want_sums)
