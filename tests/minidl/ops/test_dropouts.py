"""Dropout: reproducibility, kept fraction and mean, exact gradient, keep_prob edge cases, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import ops, Tensor
from minidl.testing.strategies import shapes, arrays

keep_probs = st.sampled_from([0.1, 0.5, 0.8, 0.999])


@given(shape=shapes(max_dims=3), keep_prob=keep_probs, seed=st.integers(0, 2**16),
       dtype=st.sampled_from([np.float32, np.float64]), data=st.data())
def test_forward_and_exact_gradient(shape, keep_prob, seed, dtype, data):
    x = data.draw(arrays(shape, 0.5, 3.0)).astype(dtype)  # nonzero: a zero output means dropped
    gy = data.draw(arrays(shape)).astype(dtype)
    minidl.set_seed(seed)
    t = Tensor(x, requires_grad=True)
    y = ops.Dropout(keep_prob)(t)
    y.backward(Tensor(gy))
    out = y.asnumpy()
    assert out.dtype == dtype and t.grad.dtype == dtype
    kept = out != 0
    scale = dtype(1 / keep_prob)
    np.testing.assert_array_equal(out, np.where(kept, x * scale, 0))
    # The gradient is gy * mask / keep_prob with the mask the forward used.
    np.testing.assert_array_equal(t.grad.asnumpy(), np.where(kept, gy * scale, 0))


@given(keep_prob=keep_probs, seed=st.integers(0, 2**16))
def test_same_seed_same_mask(keep_prob, seed):
    x = Tensor(np.ones((4, 5)))
    minidl.set_seed(seed)
    a = ops.dropout(x, p=1 - keep_prob).asnumpy()
    b = ops.dropout(x, p=1 - keep_prob).asnumpy()
    minidl.set_seed(seed)
    np.testing.assert_array_equal(ops.dropout(x, p=1 - keep_prob).asnumpy(), a)
    np.testing.assert_array_equal(ops.dropout(x, p=1 - keep_prob).asnumpy(), b)


@pytest.mark.parametrize("keep_prob", [0.2, 0.5, 0.9])
def test_kept_fraction_and_mean_are_preserved(keep_prob):
    n = 200_000
    y = ops.Dropout(keep_prob)(Tensor(np.ones(n, np.float32))).asnumpy()
    # Binomial standard deviation of the kept fraction is sqrt(p(1-p)/n) <= 0.0012: 5 sigma.
    sigma = np.sqrt(keep_prob * (1 - keep_prob) / n)
    assert abs((y != 0).mean() - keep_prob) < 5 * sigma
    assert abs(y.mean() - 1.0) < 5 * sigma / keep_prob
    np.testing.assert_allclose(np.unique(y), [0.0, np.float32(1 / keep_prob)])


def test_masks_differ_between_calls_and_elements():
    x = Tensor(np.ones((64, 64)))
    a, b = ops.dropout(x).asnumpy(), ops.dropout(x).asnumpy()
    assert (a != b).any()
    assert 0 < (a == 0).sum() < a.size


def test_seeded_primitive_has_its_own_stream():
    x = Tensor(np.ones((8, 8)))
    first = ops.Dropout(0.5, seed0=7, seed1=3)
    a1, a2 = first(x).asnumpy(), first(x).asnumpy()
    second = ops.Dropout(0.5, seed0=7, seed1=3)
    minidl.set_seed(123)  # the global seed does not touch a seeded primitive
    np.testing.assert_array_equal(second(x).asnumpy(), a1)
    np.testing.assert_array_equal(second(x).asnumpy(), a2)
    assert (a1 != a2).any()  # the stream advances across calls
    np.testing.assert_array_equal(ops.dropout(x, seed=5).asnumpy(), ops.dropout(x, seed=5).asnumpy())


def test_keep_prob_one_is_identity():
    t = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
    y = ops.Dropout(1.0)(t)
    np.testing.assert_array_equal(y.asnumpy(), t.asnumpy())
    y.backward(Tensor(np.full((2, 3), 2.0)))
    np.testing.assert_array_equal(t.grad.asnumpy(), np.full((2, 3), 2.0))


def test_dropout_function_edges():
    t = Tensor(np.arange(1.0, 7.0).reshape(2, 3), requires_grad=True)
    assert ops.dropout(t, p=0.5, training=False) is t
    assert ops.dropout(t, p=0.0) is t
    y = ops.dropout(t, p=1.0)
    np.testing.assert_array_equal(y.asnumpy(), np.zeros((2, 3)))
    y.sum().backward()
    np.testing.assert_array_equal(t.grad.asnumpy(), np.zeros((2, 3)))


def test_errors():
    for bad in (0, 0.0, 1.5, -0.1, True):
        with pytest.raises(ValueError, match=r"Dropout: keep_prob must be in \(0, 1\]"):
            ops.Dropout(bad)
    with pytest.raises(ValueError, match=r"dropout: p \(the drop probability\) must be in \[0, 1\], got 1.2"):
        ops.dropout(Tensor(np.ones(3)), p=1.2)
    with pytest.raises(ValueError, match=r"Dropout: seed0 must be a non-negative int, got -1"):
        ops.Dropout(0.5, seed0=-1)
    with pytest.raises(TypeError, match=r"Dropout: x must be a float tensor, got int64"):
        ops.Dropout(0.5)(Tensor(np.ones(3, np.int64)))
