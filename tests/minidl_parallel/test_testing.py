"""minidl_parallel.testing: the helper that judges a parallel run against one device must not be fooled.

A reference that overflowed (inf) or went NaN cannot judge anything: with ``relative_to_max``
its tolerance would be infinite, and ``assert_allclose`` counts matching infs and NaNs as
equal. Such a reference is rejected, never compared.
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.errors import Unsatisfiable

from minidl_parallel.testing import compare_runs


def results(output, loss=1.0):
    """A run's results with one parameter, ``w``."""
    output = np.asarray(output, dtype=np.float32)
    return {"losses": [loss, loss], "output": output, "grad_x": output, "grads": {"w": output},
            "params": {"w": output}}


REF_OVERFLOWED = results([[1.0, np.inf], [2.0, 3.0]])
WRONG = results([[1.0, np.inf], [-50.0, 7.0]])  # the inf matches, the finite values are wrong


@pytest.mark.parametrize("relative_to_max", [True, False])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_a_non_finite_reference_is_rejected_not_compared(relative_to_max, bad):
    ref = results([[1.0, bad], [2.0, 3.0]])
    wrong = results([[1.0, bad], [-50.0, 7.0]])
    with pytest.raises(ValueError, match=r"compare_runs: the single-device output is not finite \(1 of 4 values are "
                                         r"inf or NaN\)"):
        compare_runs(wrong, ref, rtol=1e-5, atol=1e-6, relative_to_max=relative_to_max)
    with pytest.raises(ValueError, match=r"compare_runs: the single-device losses is not finite \(2 of 2"):
        compare_runs(results([[0.0]], loss=2.0), results([[0.0]], loss=bad), relative_to_max=relative_to_max)


def test_inside_a_hypothesis_test_the_example_is_assumed_away():
    @settings(max_examples=5, database=None)
    @given(st.integers(0, 3))
    def always_overflows(_):
        compare_runs(WRONG, REF_OVERFLOWED, rtol=1e-5, atol=1e-6, relative_to_max=True)

    with pytest.raises(Unsatisfiable):  # every example rejected: none may pass
        always_overflows()


def test_a_finite_reference_still_judges_with_relative_to_max():
    ref = results([[1.0, 1e30], [2.0, 3.0]])
    compare_runs(results([[1.0, 1e30], [2.0, 3.0 + 1e20]]), ref, rtol=1e-5, atol=1e-6, relative_to_max=True)
    with pytest.raises(AssertionError, match="output"):
        compare_runs(results([[1.0, 1e30], [2.0, np.inf]]), ref, rtol=1e-5, atol=1e-6, relative_to_max=True)


def test_tolerances_are_checked():
    ref = results([[1.0]])
    with pytest.raises(ValueError, match="compare_runs: rtol must be a finite number >= 0, got inf"):
        compare_runs(ref, ref, rtol=np.inf)
    with pytest.raises(ValueError, match="compare_runs: atol must be a finite number >= 0, got nan"):
        compare_runs(ref, ref, atol=np.nan)
