"""ApplyMomentum's and MultiApplyMomentum's compiled loops (minidl/kernels/cpu/updates.py,
updates_loops.py): the calls they must leave to the reference, which then gives its own values and
errors, and their updates against the reference's, bit for bit."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

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


@given(n=st.integers(1, 5000), f32=st.booleans(), nesterov=st.booleans(), seed=st.integers(0, 2**16))
def test_apply_momentum_loop_is_the_references_bit_for_bit(n, f32, nesterov, seed):
    (fast_used, fast), (_, ref) = momentum_runs(
        lambda: ops.ApplyMomentum(use_nesterov=nesterov), lambda s: (s[0], s[1], 0.05, s[2], 0.9),
        lambda: arrays((n,), np.float32 if f32 else np.float64, seed))
    assert fast_used == {"ApplyMomentumLoop"}
    for got, want in zip(fast, ref):
        np.testing.assert_array_equal(got, want)


@given(shapes=st.lists(st.one_of(st.tuples(st.integers(1, 70), st.integers(1, 70)), st.tuples(st.integers(1, 300))),
                       min_size=1, max_size=5),
       f32=st.booleans(), nesterov=st.booleans(), seed=st.integers(0, 2**16))
def test_multi_apply_momentum_loop_over_several_parameters_is_per_parameter_bit_for_bit(shapes, f32, nesterov, seed):
    dtype = np.float32 if f32 else np.float64
    ws, vs, gs = ([arrays(s, dtype, seed + k)[i] for k, s in enumerate(shapes)] for i in range(3))
    many = [w.copy() for w in ws], [v.copy() for v in vs]
    with kernels.tracking() as used:
        ops.MultiApplyMomentum(use_nesterov=nesterov)(many[0], many[1], 0.05, gs, 0.9)
    assert {k.name for k in used} == {"MultiApplyMomentumLoop"}
    with kernels.reference_only():
        for w, v, g in zip(ws, vs, gs):
            ops.ApplyMomentum(use_nesterov=nesterov)(w, v, 0.05, g, 0.9)
    for w, v, w_many, v_many in zip(ws, vs, *many):
        assert not np.shares_memory(w, w_many)
        np.testing.assert_array_equal(w_many, w)
        np.testing.assert_array_equal(v_many, v)
