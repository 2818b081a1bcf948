"""ApplyMomentum's and MultiApplyMomentum's compiled loops (minidl/kernels/cpu/updates.py) on the
calling thread (the default team_min_bytes keeps these small parameters off the team; test_team.py
runs them on it): the calls they must leave to the reference, which then gives its own values and
errors, and one parameter."""
import numpy as np
import pytest

from minidl import kernels, ops
from minidl.kernels.cpu.updates import ApplyMomentumLoop

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("kernels_on"),
              pytest.mark.skipif(not ApplyMomentumLoop.available, reason="needs the numba extra")]


def arrays(shape=(6, 5), dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


def momentum_runs(make, args, copies):
    """(kernels that ran, the arrays after) with the table on, then on the reference bodies."""
    out = []
    for reference in (False, True):
        state = copies()
        with kernels.reference_only(reference), kernels.tracking() as used:
            make()(*args(state))
        out.append(({k.name for k in used}, state))
    return out


def strided(shape, dtype):
    return [a[:, ::2] for a in arrays((shape[0], 2 * shape[1]), dtype)]


# (what, the op, its three arrays): calls the loop must leave to the reference body
STAND_ASIDE = [
    ("a gradient scale", lambda: ops.ApplyMomentum(gradient_scale=0.5), lambda: arrays()),
    ("a strided variable", ops.ApplyMomentum, lambda: [strided((6, 5), np.float32)[0]] + arrays()[1:]),
    ("a strided accumulation", ops.ApplyMomentum, lambda: arrays()[:1] + [strided((6, 5), np.float32)[1], arrays()[2]]),
    ("a float64 gradient", ops.ApplyMomentum, lambda: arrays()[:2] + [arrays(dtype=np.float64)[2]]),
    ("float16", ops.ApplyMomentum, lambda: arrays(dtype=np.float16)),
]


@pytest.mark.parametrize("what, make, make_arrays", STAND_ASIDE, ids=[c[0] for c in STAND_ASIDE])
def test_apply_momentum_loop_leaves_to_the_reference(what, make, make_arrays):
    (fast_used, fast), (_, ref) = momentum_runs(make, lambda s: (s[0], s[1], 0.05, s[2], 0.9), make_arrays)
    assert "ApplyMomentumLoop" not in fast_used, what
    for got, want in zip(fast, ref):
        np.testing.assert_array_equal(got, want, err_msg=what)
        assert got.dtype == want.dtype


def test_apply_momentum_with_another_gradient_shape_is_refused_by_the_reference():
    w, v, g = arrays((4,))
    with pytest.raises(ValueError, match=r"^ApplyMomentum: variable \(4,\), accumulation \(4,\) and gradient "
                                         r"\(2, 2\) must have one shape$"):
        ops.ApplyMomentum()(w, v, 0.05, g.reshape(2, 2), 0.9)


MULTI_ASIDE = [
    ("a strided variable", lambda: [[strided((6, 5), np.float32)[0]], [arrays()[1]], [arrays()[2]]]),
    ("a strided accumulation", lambda: [[arrays()[0]], [strided((6, 5), np.float32)[1]], [arrays()[2]]]),
    ("a strided gradient", lambda: [[arrays()[0]], [arrays()[1]], [strided((6, 5), np.float32)[2]]]),
    ("float16", lambda: [[a] for a in arrays(dtype=np.float16)]),
]


@pytest.mark.parametrize("what, make_lists", MULTI_ASIDE, ids=[c[0] for c in MULTI_ASIDE])
def test_multi_apply_momentum_loop_leaves_to_the_reference(what, make_lists):
    # The first parameter plain, the second as named: one such parameter is enough to stand aside.
    def lists():
        first = arrays(seed=1)
        return [[a] + rest for a, rest in zip(first, make_lists())]
    (fast_used, fast), (_, ref) = momentum_runs(
        ops.MultiApplyMomentum, lambda s: (s[0], s[1], 0.05, s[2], 0.9), lists)
    assert "MultiApplyMomentumLoop" not in fast_used, what
    for got, want in zip(sum(fast, []), sum(ref, [])):
        np.testing.assert_array_equal(got, want, err_msg=what)


def test_multi_apply_momentum_of_nothing_or_unpaired_lists():
    ops.MultiApplyMomentum()([], [], 0.05, [], 0.9)  # no parameters: nothing to do, no error
    w, v, g = arrays()
    with pytest.raises(ValueError, match=r"^MultiApplyMomentum: got 2 variables, 1 accumulations and 2 gradients; "
                                         r"they must pair up$"):
        ops.MultiApplyMomentum()([w, w.copy()], [v], 0.05, [g, g], 0.9)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("nesterov", [False, True])
def test_multi_apply_momentum_loop_on_one_parameter_is_the_references_bit_for_bit(dtype, nesterov):
    (fast_used, fast), (_, ref) = momentum_runs(
        lambda: ops.MultiApplyMomentum(use_nesterov=nesterov), lambda s: ([s[0]], [s[1]], 0.05, [s[2]], 0.9),
        lambda: arrays((33, 17), dtype))
    assert fast_used == {"MultiApplyMomentumLoop"}
    for got, want in zip(fast, ref):
        np.testing.assert_array_equal(got, want)


def test_multi_apply_momentum_loop_leaves_float16_parameters_to_the_reference():
    (fast_used, fast), (_, ref) = momentum_runs(
        ops.MultiApplyMomentum, lambda s: (s[0], s[1], 0.05, s[2], 0.9),
        lambda: [[a, b] for a, b in zip(arrays(dtype=np.float16), arrays((7,), np.float16, seed=1))])
    assert "MultiApplyMomentumLoop" not in fast_used
    for got, want in zip(sum(fast, []), sum(ref, [])):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.float16
