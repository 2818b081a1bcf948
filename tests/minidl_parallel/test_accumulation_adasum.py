"""DistributedGradReducer's backward_passes_per_step (gradient accumulation) against one device
on the k-times larger batch, and Adasum against a NumPy reference and its two defining
properties, on the threads backend."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Parameter, Tensor, nn
from minidl_parallel import CommCounter, run_threads
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel.grad_reducer import DistributedGradReducer


def _mlp(seed):
    minidl.set_seed(seed)
    f64 = minidl.float64
    return nn.SequentialCell(nn.Dense(4, 6, dtype=f64), nn.Tanh(), nn.Dense(6, 2, dtype=f64))


def _train(net, batches, k, reducer=None):
    """Momentum steps; each step takes k micro-batches whose losses are scaled by 1/k."""
    loss_fn = nn.MSELoss(reduction="mean")
    opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y) / k, None, opt.parameters)
    reductions = 0
    for i, (x, y) in enumerate(batches):
        _, grads = grad_fn(Tensor(x), Tensor(y))
        if reducer is not None:
            with CommCounter() as counter:
                grads = reducer(grads)
            reductions += counter.count(phase="gradients")
            if grads is None:
                assert (i + 1) % k, f"pass {i}: the k-th pass must reduce"
                continue
        opt(grads)
    return {name: p.asnumpy() for name, p in net.parameters_and_names()}, reductions


@given(n=st.integers(1, 4), k=st.integers(1, 4), b=st.integers(1, 3), steps=st.integers(1, 3),
       seed=st.integers(0, 100))
def test_k_accumulated_passes_equal_one_device_on_the_k_times_larger_batch(n, k, b, steps, seed):
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal((steps * n * k * b, 4)), rng.standard_normal((steps * n * k * b, 2))
    want, _ = _train(_mlp(seed), [(x[s * n * k * b:(s + 1) * n * k * b], y[s * n * k * b:(s + 1) * n * k * b])
                                  for s in range(steps)], 1)

    def rank():
        r = resolve_communicator("test", None).rank
        net = _mlp(seed)
        # global step s, micro-batch j of rank r: rows [s*n*k*b + (j*n + r)*b, ... + b)
        batches = [(x[s * n * k * b + (j * n + r) * b:][:b], y[s * n * k * b + (j * n + r) * b:][:b])
                   for s in range(steps) for j in range(k)]
        reducer = DistributedGradReducer(net.trainable_params(), mean=True, backward_passes_per_step=k)
        return _train(net, batches, k, reducer)

    for got, reductions in run_threads(n, rank):
        bucket_count = 1  # float64 parameters, well under fusion_bytes: one bucket per reduction
        assert reductions == steps * bucket_count  # one per k passes, never one per pass
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.cpu_only  # (the caller's gradients include raw NumPy arrays: host data)
def test_accumulation_leaves_the_callers_gradients_unchanged():
    """The reducer sums into its own buffer: the arrays a caller passed (here still held, as a
    caller logging them would) keep their values through later passes, and each reduction is
    the mean over ranks of that step's k gradients."""
    n, k, steps = 2, 3, 2
    shapes = [(3,), (2, 2)]

    def rank():
        r = resolve_communicator("test", None).rank
        params = [Parameter(np.zeros(s), name=f"p{i}") for i, s in enumerate(shapes)]
        reducer = DistributedGradReducer(params, mean=True, backward_passes_per_step=k)
        rng = np.random.default_rng(r)
        passed, kept, reduced = [], [], []
        for _ in range(steps * k):
            grads = [rng.standard_normal(s) for s in shapes]
            passed.append(grads)
            kept.append([g.copy() for g in grads])
            out = reducer([grads[0], Tensor(grads[1])])  # a raw array and a Tensor around one
            if out is not None:
                reduced.append([t.asnumpy().copy() for t in out])
        for got, want in zip(passed, kept):
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)  # unchanged by the accumulation after it
        return kept, reduced

    results = run_threads(n, rank)
    for s in range(steps):
        for i in range(len(shapes)):
            want = sum(kept[j][i] for kept, _ in results for j in range(s * k, (s + 1) * k)) / n
            for _, reduced in results:
                assert len(reduced) == steps
                np.testing.assert_allclose(reduced[s][i], want, rtol=1e-12, atol=1e-14)


def test_accumulation_settings_are_checked():
    p = [Parameter(np.zeros(2), name="w")]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="backward_passes_per_step must be an int >= 1"):
            DistributedGradReducer(p, backward_passes_per_step=bad)


# ---- Adasum ----------------------------------------------------------------------------

def _reference_adasum(vectors):
    """Horovod's pairwise rule written out, the tree level by level (independent of minidl)."""
    def pair(a, b):
        dot = float(a @ b)
        ca = 1 - dot / (2 * float(a @ a)) if float(a @ a) >= 1e-8 else 1.0
        cb = 1 - dot / (2 * float(b @ b)) if float(b @ b) >= 1e-8 else 1.0
        return ca * a + cb * b
    while len(vectors) > 1:
        vectors = [pair(vectors[i], vectors[i + 1]) for i in range(0, len(vectors), 2)]
    return vectors[0]


def _adasum(values, **kwargs):
    """values[rank]: a list of per-parameter gradients; returns each rank's combined ones."""
    shapes = [np.shape(v) for v in values[0]]

    def body():
        params = [Parameter(np.zeros(s), name=f"p{i}") for i, s in enumerate(shapes)]
        reducer = DistributedGradReducer(params, adasum=True, **kwargs)
        mine = values[resolve_communicator("test", None).rank]
        return [g.asnumpy() for g in reducer(tuple(Tensor(np.asarray(v, np.float64)) for v in mine))]
    return run_threads(len(values), body)


@given(n=st.sampled_from([1, 2, 4, 8]), seed=st.integers(0, 1000), fusion=st.sampled_from([16, 1 << 20]))
def test_adasum_matches_the_reference_per_tensor_on_every_rank(n, seed, fusion):
    rng = np.random.default_rng(seed)
    values = [[rng.standard_normal(5), rng.standard_normal((2, 3))] for _ in range(n)]
    for out in _adasum(values, fusion_bytes=fusion):
        for t in range(2):
            want = _reference_adasum([np.ravel(v[t]) for v in values]).reshape(np.shape(values[0][t]))
            np.testing.assert_allclose(out[t], want, rtol=1e-12, atol=1e-12)


def test_adasum_adds_orthogonal_gradients_and_averages_identical_ones():
    e = np.eye(4)
    for out in _adasum([[e[0]], [e[1]], [e[2]], [2 * e[3]]]):
        np.testing.assert_allclose(out[0], [1, 1, 1, 2], atol=1e-15)
    g = np.array([0.5, -2.0, 3.0])
    for out in _adasum([[g], [g], [g], [g]]):
        np.testing.assert_allclose(out[0], g, rtol=1e-15)


def test_a_gradient_under_horovods_threshold_keeps_coefficient_one_for_its_partner():
    """|g|^2 < 1e-8: the formula would divide by almost zero, so that term keeps coefficient 1
    (Horovod's rule); from |g|^2 = 1e-8 on, the formula applies (the threshold is inclusive)."""
    big = np.array([3.0, 4.0, 0.0])
    for tiny_norm2 in (1e-10, 1e-8):
        tiny = np.array([np.sqrt(tiny_norm2), 0.0, 0.0])
        dot = tiny @ big
        c_tiny = 1.0 if tiny_norm2 < 1e-8 else 1.0 - dot / tiny_norm2 / 2
        want = c_tiny * tiny + (1.0 - dot / 25.0 / 2) * big
        for first, second in ((tiny, big), (big, tiny)):  # either side of the pair
            for out in _adasum([[first], [second]]):
                np.testing.assert_allclose(out[0], want, rtol=1e-15, atol=0, err_msg=f"|tiny|^2 = {tiny_norm2}")


def test_adasum_on_a_world_that_is_not_a_power_of_two_is_a_clear_error_on_every_rank():
    with pytest.raises(ValueError, match=r"Adasum needs a power-of-two number of ranks .* got a world of 3"):
        _adasum([[np.ones(2)]] * 3)
    with pytest.raises(ValueError, match="gradient_predivide_factor applies to an average, not to Adasum"):
        DistributedGradReducer([Parameter(np.zeros(2), name="w")], adasum=True, gradient_predivide_factor=2.0)
