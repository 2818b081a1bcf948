"""The central property: a sharded network computes what one device computes.

For a world of 1, 2, 4 or 8 thread-ranks, a random chain of operators with random shapes and
random valid strategies (or none: data-parallel defaults under SEMI_AUTO, propagation under
AUTO) gives, gathered, the single-device forward output, loss, input and parameter gradients,
and parameters after two Momentum steps (float64, 1e-10 relative).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from minidl_parallel.comm.threads import run_threads
from minidl_parallel.testing import compare_runs, init_arrays, layer_shapes, run_rank, run_single

WORLDS = (1, 2, 4, 8)
# The central property runs hundreds of examples even in CI (each takes ~20 ms on
# the threads backend): 25x the profile's count, i.e. 300 under the bounded 'ci' profile.
CHAIN_EXAMPLES = 25 * settings.default.max_examples
UNARY = ("relu", "tanh", "sigmoid", "exp", "neg", "square")


@st.composite
def _cuts(draw, sizes, n):
    """One cut per size: each divides its size, and their product divides n."""
    budget, out = n, []
    for s in sizes:
        options = [c for c in (1, 2, 4, 8) if budget % c == 0 and s % c == 0]
        c = draw(st.sampled_from(options))
        budget //= c
        out.append(c)
    return tuple(out)


@st.composite
def _layer(draw, n, batch, d):
    op = draw(st.sampled_from(["matmul", "matmul", "bias", "unary", "mul", "softmax", "transpose", "reshape"]))
    spec = {"op": op}
    explicit = draw(st.booleans())
    if op == "matmul":
        m = draw(st.sampled_from([4, 8]))
        b, k, c = draw(_cuts([batch, d, m], n))
        spec.update(out=m, transpose_b=draw(st.booleans()))
        strategy = ((b, k), (c, k) if spec["transpose_b"] else (k, c))
    elif op == "reshape":
        b, c = draw(_cuts([batch, d // 2], n))
        strategy = ((b, c),)
    else:
        b, c = draw(_cuts([batch, d], n))
        strategy = {"bias": ((b, c), (c,)), "mul": ((b, c), (b, c))}.get(op, ((b, c),))
        if op == "unary":
            spec["fn"] = draw(st.sampled_from(UNARY))
        if op == "softmax":
            spec["log"] = draw(st.booleans())
    spec["strategy"] = strategy if explicit else None
    return spec


@st.composite
def chains(draw, worlds=WORLDS):
    n = draw(st.sampled_from(worlds))
    batch = 8
    features = draw(st.sampled_from([4, 8]))
    layers, d = [], features
    for _ in range(draw(st.integers(1, 4))):
        spec = draw(_layer(n, batch, d))
        layers.append(spec)
        _, d = layer_shapes(layers, batch, features)
    kind = draw(st.sampled_from(["mse", "sum", "ce"]))
    b, c = draw(_cuts([batch, d], n))
    loss = {"loss": kind, "strategy": ((b, c), (b, c)) if draw(st.booleans()) else None}
    mode = draw(st.sampled_from(["auto_parallel", "semi_auto_parallel"]))
    dataset = draw(st.sampled_from(["data_parallel", "full_batch"]))
    return n, layers, loss, mode, dataset, features


def make_data(layers, loss, features, batch=8, seed=0):
    rng = np.random.default_rng(seed)
    _, out = layer_shapes(layers, batch, features)
    x = rng.standard_normal((batch, features))
    y = rng.standard_normal((batch, out))
    if loss["loss"] == "ce":
        y = np.exp(y) / np.exp(y).sum(axis=1, keepdims=True)  # probabilities
    return {"x": x, "y": y, "batch": batch, "features": features, "arrays": init_arrays(layers, features, seed)}


def check(n, layers, loss, mode, dataset, features):
    data = make_data(layers, loss, features)
    ref = run_single(layers, loss, data)
    results = run_threads(n, run_rank, layers, loss, data, mode, 2, 0.05, dataset)
    for rank, got in enumerate(results):
        try:
            compare_runs(got, ref)
        except AssertionError as e:
            raise AssertionError(f"rank {rank} of {n} ({mode}, {dataset}): {e}") from None


QUICKSTART = [{"op": "matmul", "out": 16, "strategy": ((2, 4), (4, 1))}, {"op": "bias", "strategy": None},
              {"op": "unary", "fn": "relu", "strategy": None}, {"op": "matmul", "out": 16, "strategy": None},
              {"op": "bias", "strategy": None}]


@pytest.mark.parametrize("mode", ["auto_parallel", "semi_auto_parallel"])
def test_quickstart_network_equals_single_device(mode):
    layers = [dict(spec) for spec in QUICKSTART]
    data = make_data(layers, {"loss": "mse"}, 32, batch=16)
    ref = run_single(layers, {"loss": "mse"}, data)
    for got in run_threads(8, run_rank, layers, {"loss": "mse"}, data, mode):
        compare_runs(got, ref)


@settings(max_examples=CHAIN_EXAMPLES, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@example(case=(8, [{"op": "matmul", "out": 8, "strategy": ((2, 4), (4, 1))}, {"op": "unary", "fn": "relu",
                                                                               "strategy": None}],
               {"loss": "mse", "strategy": None}, "auto_parallel", "data_parallel", 8))
@example(case=(4, [{"op": "softmax", "log": False, "strategy": ((1, 4),)}], {"loss": "ce", "strategy": ((2, 2), (2, 2))},
               "semi_auto_parallel", "full_batch", 8))
@given(case=chains())
def test_random_chain_equals_single_device(case):
    check(*case)
