"""Passes on MKL's OpenMP team (minidl/kernels/cpu/team.py, team_jobs.py) against the same passes
on one thread and against NumPy, bit for bit: the Dense kernels' bias-and-ReLU sweep and masked
gradient sums, and ApplyMomentum's update (one parameter, and MultiApplyMomentum's several). ``team_min_bytes=0`` sends every size to the team,
shapes with fewer rows or columns than threads included."""
import os
import threading

import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import threads as intra_op
from minidl.kernels.cpu import dense, team

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("kernels_on"),
              pytest.mark.skipif(not team.available(), reason="needs the mkl and numba extras")]


@pytest.fixture(autouse=True)
def every_size_on_the_team():
    before = kernels.get_option("team_min_bytes")
    kernels.set_option("team_min_bytes", 0)
    try:
        yield
    finally:
        kernels.set_option("team_min_bytes", before)


def draw(rng, shape, dtype, specials=True):
    a = rng.standard_normal(shape).astype(dtype)
    if specials and a.size >= 4:
        a.flat[:4] = [-0.0, 0.0, np.nan, np.inf]
    return a


def same(a, b):
    return np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b))


shapes = st.tuples(st.integers(1, 70), st.integers(1, 70))
dtypes = st.sampled_from([np.float32, np.float64])


@given(shape=shapes, dtype=dtypes, relu=st.booleans(), seed=st.integers(0, 2**16))
def test_bias_relu_on_the_team_is_numpys_bit_for_bit(shape, dtype, relu, seed):
    rng = np.random.default_rng(seed)
    y, b = draw(rng, shape, dtype), draw(rng, shape[1:], dtype, specials=False)
    want = np.maximum(y + b, 0) if relu else y + b
    assert team.threads(y.nbytes) == intra_op.get_num_threads()
    got = dense.add_bias_relu(y.copy(), b, relu)
    assert same(got, want)
    kernels.set_option("team", False)
    try:
        assert team.threads(y.nbytes) == 1
        assert same(dense.add_bias_relu(y.copy(), b, relu), want)
    finally:
        kernels.set_option("team", None)


@given(shape=shapes, dtype=dtypes, seed=st.integers(0, 2**16))
def test_masked_sums_on_the_team_are_numpys_bit_for_bit(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    gy, y = draw(rng, shape, dtype), draw(rng, shape, dtype)
    want = gy * (y > 0)
    g, gb = dense.relu_grad(gy, y)
    assert same(g, want) and same(gb, want.sum(axis=0))


@given(n=st.integers(1, 5000), dtype=dtypes, nesterov=st.booleans(), seed=st.integers(0, 2**16))
def test_momentum_on_the_team_is_the_references_bit_for_bit(n, dtype, nesterov, seed):
    rng = np.random.default_rng(seed)
    w, v, g = (draw(rng, (n,), dtype, specials=False) for _ in range(3))
    results = []
    for reference in (False, True):
        wt, vt = Tensor(w.copy()), Tensor(v.copy())
        with kernels.reference_only(reference):
            ops.ApplyMomentum(use_nesterov=nesterov)(wt, vt, 0.05, Tensor(g), 0.9)
        results.append((wt.asnumpy(), vt.asnumpy()))
    (w_team, v_team), (w_ref, v_ref) = results
    assert not np.array_equal(w_team, w)
    assert same(w_team, w_ref) and same(v_team, v_ref)


@given(shapes=st.lists(st.one_of(shapes, st.tuples(st.integers(1, 300))), min_size=1, max_size=5), dtype=dtypes,
       nesterov=st.booleans(), seed=st.integers(0, 2**16))
def test_multi_momentum_on_the_team_is_the_references_bit_for_bit(shapes, dtype, nesterov, seed):
    # Parameters of several shapes, 2-D ones as they are (the header takes their addresses, no flat views).
    rng = np.random.default_rng(seed)
    ws, vs, gs = ([draw(rng, s, dtype, specials=False) for s in shapes] for _ in range(3))
    results = []
    for reference in (False, True):
        wt, vt = [Tensor(w.copy()) for w in ws], [Tensor(v.copy()) for v in vs]
        with kernels.reference_only(reference):
            ops.MultiApplyMomentum(use_nesterov=nesterov)(wt, vt, 0.05, [Tensor(g) for g in gs], 0.9)
        results.append(([t.asnumpy() for t in wt], [t.asnumpy() for t in vt]))
    (w_team, v_team), (w_ref, v_ref) = results
    assert not any(np.array_equal(a, w) for a, w in zip(w_team, ws))
    assert all(same(a, b) for a, b in zip(w_team + v_team, w_ref + v_ref))


def test_threads_running_team_passes_at_once_each_get_their_own_result():
    # Thread-ranks (minidl_parallel's threads world) run kernels at once: each calling thread
    # gets a team of its own from OpenMP.
    rng = np.random.default_rng(3)
    inputs = [(draw(rng, (300, 200), np.float32), draw(rng, (200,), np.float32, specials=False)) for _ in range(4)]
    wants = [np.maximum(y + b, 0) for y, b in inputs]
    results, errors = [None] * 4, []

    def work(i):
        try:
            y, b = inputs[i]
            for _ in range(30):
                results[i] = dense.add_bias_relu(y.copy(), b, True)
                assert same(results[i], wants[i])
        except BaseException as e:  # reported by the main thread
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and all(same(r, w) for r, w in zip(results, wants))


@pytest.mark.skipif(intra_op.get_num_threads() < 2, reason="needs 2 intra-op threads")
def test_an_intra_op_thread_runs_its_pass_itself():
    assert intra_op.parallel_map(lambda i: team.threads(1 << 30), 2) == [intra_op.get_num_threads(), 1]


def test_a_forked_child_runs_team_passes():
    rng = np.random.default_rng(5)
    y, b = draw(rng, (64, 64), np.float32), draw(rng, (64,), np.float32, specials=False)
    want = dense.add_bias_relu(y.copy(), b, True)  # the team runs in the parent first
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's result is its exit status
        os._exit(0 if same(dense.add_bias_relu(y.copy(), b, True), want) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


@given(sizes=st.lists(st.integers(1, 3000), min_size=1, max_size=6), dtype=dtypes, nesterov=st.booleans(),
       seed=st.integers(0, 2**16))
def test_momentum_over_several_parameters_on_the_team_is_per_parameter_bit_for_bit(sizes, dtype, nesterov, seed):
    # MultiApplyMomentum's kernel makes the parameters one range, its chunks cutting across them.
    rng = np.random.default_rng(seed)
    ws, vs, gs = ([draw(rng, (n,), dtype, specials=False) for n in sizes] for _ in range(3))
    many = [w.copy() for w in ws], [v.copy() for v in vs]
    with kernels.tracking() as used:
        ops.MultiApplyMomentum(use_nesterov=nesterov)(*many[:1], many[1], 0.05, gs, 0.9)
    assert {k.name for k in used} == {"MultiApplyMomentumLoop"}
    with kernels.reference_only():
        for w, v, g in zip(ws, vs, gs):
            ops.ApplyMomentum(use_nesterov=nesterov)(w, v, 0.05, g, 0.9)
    for w, v, w_many, v_many in zip(ws, vs, *many):
        assert same(w_many, w) and same(v_many, v)


@pytest.mark.parametrize("layout", ["both strided", "gy strided", "y strided"])
def test_masked_sums_of_strided_arrays_are_numpys(layout):
    # The team's header holds addresses and sizes (C-contiguous arrays): strided ones take NumPy's passes.
    rng = np.random.default_rng(6)
    gy, y = (draw(rng, (40, 60), np.float32)[:, ::2] for _ in range(2))  # (40, 30) views
    if layout == "gy strided":
        y = y.copy()
    elif layout == "y strided":
        gy = gy.copy()
    want = gy * (y > 0)
    g, gb = dense.relu_grad(gy, y)
    assert same(g, want) and same(gb, want.sum(axis=0))


def test_the_pass_size_at_team_min_bytes_goes_to_the_team():
    before = intra_op.get_num_threads()
    intra_op.set_num_threads(2)
    kernels.set_option("team_min_bytes", 1000)
    try:
        assert team.threads(1000) == 2 and team.threads(999) == 1
    finally:
        intra_op.set_num_threads(before)


def test_the_runtime_found_afresh_runs_passes(monkeypatch):
    # As in a new process: the runtime and the jobs' module looked up at the first pass.
    monkeypatch.setattr(team, "_state", {})
    assert team.available()
    rng = np.random.default_rng(7)
    y, b = draw(rng, (64, 64), np.float32), draw(rng, (64,), np.float32, specials=False)
    assert same(dense.add_bias_relu(y.copy(), b, True), np.maximum(y + b, 0))


def test_without_the_openmp_runtime_there_is_no_team(monkeypatch):
    monkeypatch.setattr(team, "_state", {})
    monkeypatch.setattr(team, "_loaded_iomp", lambda: None)
    assert not team.available() and team.threads(1 << 30) == 1
    rng = np.random.default_rng(8)
    y, b = draw(rng, (64, 64), np.float32), draw(rng, (64,), np.float32, specials=False)
    assert same(dense.add_bias_relu(y.copy(), b, True), np.maximum(y + b, 0))
