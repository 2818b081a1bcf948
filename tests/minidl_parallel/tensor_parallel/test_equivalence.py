"""The central property: a sharded network computes what one device computes.

For a world of 1, 2, 4 or 8 thread-ranks, a random chain of operators with random shapes and
random valid strategies (or none: data-parallel defaults under SEMI_AUTO, propagation under
AUTO) gives, gathered, the single-device forward output, loss, input and parameter gradients,
and parameters after two Momentum steps (float64, 1e-10 relative).
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from minidl_parallel import run_threads
from minidl_parallel.testing import compare_runs, init_arrays, layer_shapes, run_rank, run_single

WORLDS = (1, 2, 4, 8)
# The central property runs hundreds of examples even in CI (each takes ~20 ms on
# the threads backend): 25x the profile's count, i.e. 300 under the bounded 'ci' profile.
CHAIN_EXAMPLES = 25 * settings.default.max_examples
UNARY = ("relu", "tanh", "sigmoid", "exp", "neg", "square", "gelu", "gelu_tanh", "silu", "leaky_relu")


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
    op = draw(st.sampled_from(["matmul", "matmul", "bias", "unary", "mul", "softmax", "transpose", "reshape",
                               "dropout", "layernorm", "clamp", "cumsum"]))
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
    elif op == "layernorm":  # the normalised features stay whole
        (b,) = draw(_cuts([batch], n))
        strategy = ((b, 1), (1,), (1,))
    elif op == "cumsum":  # the scanned features stay whole
        (b,) = draw(_cuts([batch], n))
        strategy = ((b, 1),)
        spec["reverse"] = draw(st.booleans())
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


def check(n, layers, loss, mode, dataset, features, dtype=np.float64):
    data = make_data(layers, loss, features)
    if dtype != np.float64:
        data = dict(data, x=data["x"].astype(dtype), y=data["y"].astype(dtype),
                    arrays={k: v.astype(dtype) for k, v in data["arrays"].items()})
    ref = run_single(layers, loss, data)
    results = run_threads(n, run_rank, layers, loss, data, mode, 2, 0.05, dataset)
    tolerance = (dict(rtol=1e-10, atol=1e-12) if dtype == np.float64
                 else dict(rtol=1e-5, atol=1e-6, relative_to_max=True))
    for rank, got in enumerate(results):
        try:
            compare_runs(got, ref, **tolerance)
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


@settings(max_examples=5 * settings.default.max_examples, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(case=chains())
def test_random_chain_in_float32_equals_single_device_to_1e_5(case):
    check(*case, dtype=np.float32)


# ---- a small CNN: Conv2d and Dense cells passing strategies to their primitives ----------------

def _cnn():
    import minidl
    from minidl import nn
    f64 = minidl.float64
    return nn.SequentialCell(nn.Conv2d(4, 4, 3, pad_mode="pad", padding=1, has_bias=True, dtype=f64), nn.ReLU(),
                             nn.MaxPool2d(2, 2), nn.Conv2d(4, 8, 1, has_bias=True, dtype=f64),
                             nn.BatchNorm2d(8, momentum=0.7, dtype=f64), nn.Tanh(), nn.Flatten(),
                             nn.Dense(32, 4, dtype=f64))


def _cnn_run(strategies, x, y, init, steps=2):
    """Two Momentum steps of the CNN; returns (losses, output of step 1, parameters by name), gathered."""
    import minidl
    from momentum_steps import momentum_steps
    net = _cnn()
    net.set_train(True)  # BatchNorm normalises with (and tracks) the statistics of the whole batch
    minidl.load_param_into_net(net, {k: v.copy() for k, v in init.items()})
    if strategies is not None:
        net[0].shard(strategies[0])
        net[3].shard(strategies[1])
        net[7].shard(strategies[2])
        if strategies[3] is not None:  # else SEMI_AUTO's default: the batch cut, statistics synchronised
            net[4].bn_train.shard(strategies[3])
    losses, first, state = momentum_steps(net, x, y, steps)  # state: the moving statistics too
    return losses, first, state, tuple(net[0].weight.data.shape)


@st.composite
def cnn_strategies(draw):
    n = draw(st.sampled_from([2, 4]))
    b, ci, co = draw(_cuts([8, 4, 4], n))
    b2, ci2, co2 = draw(_cuts([8, 4, 8], n))
    b3, k3, o3 = draw(_cuts([8, 32, 4], n))
    b4, c4 = draw(_cuts([8, 8], n))
    bn = ((b4, c4, 1, 1),) + ((c4,),) * 4 if draw(st.booleans()) else None
    return n, (((b, ci, 1, 1), (co, ci, 1, 1)), ((b2, ci2, 1, 1), (co2, ci2, 1, 1)), ((b3, k3), (o3, k3)), bn)


@settings(max_examples=2 * settings.default.max_examples, deadline=None)
@given(case=cnn_strategies())
def test_cnn_with_sharded_conv_and_dense_cells_equals_single_device(case):
    import minidl
    n, strategies = case
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 4, 4, 4)), rng.standard_normal((8, 4))
    minidl.set_seed(0)
    init = {name: p.asnumpy().copy() for name, p in _cnn().parameters_and_names()}
    ref = _cnn_run(None, x, y, init)

    def rank():
        import minidl_parallel as mp
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
        try:
            return _cnn_run(strategies, x, y, init)
        finally:
            mp.reset_auto_parallel_context()
    for losses, out, params, block in run_threads(n, rank):
        co, ci = strategies[0][1][:2]
        assert block == (4 // co, 4 // ci, 3, 3)  # each rank holds its block of the first kernel
        np.testing.assert_allclose(losses, ref[0], rtol=1e-10)
        np.testing.assert_allclose(out, ref[1], rtol=1e-10, atol=1e-12)
        for name, value in ref[2].items():
            np.testing.assert_allclose(params[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_resnet20_under_semi_auto_without_strategies_equals_single_device():
    """SEMI_AUTO with no strategy anywhere is data parallel, BatchNorm on the whole batch included."""
    import minidl
    from minidl import Tensor, nn
    from minidl.models import resnet20
    from minidl_parallel.tensor_parallel.dispatch import full_value
    from momentum_steps import host  # a NumPy copy from either array module
    # float64: the ranks' GEMMs see half the batch, so their rounding differs from the single
    # device's, and 2 steps of ResNet-20 amplify float32's to 1.4e-5 in the loss on some
    # OpenBLAS kernels (Haswell/Zen). In float64 that is far below the tolerances, so a wrong
    # reduction cannot hide behind rounding.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 32, 32))
    y = rng.integers(0, 10, 4).astype(np.int32)
    minidl.set_seed(0)
    init = {name: p.asnumpy().astype(np.float64) for name, p in resnet20().parameters_and_names()}

    def run(x, y):
        net = resnet20()
        for p in net.get_parameters():  # moving statistics too: they are Parameters without gradients
            p.data = p.data.astype(np.float64)
        minidl.load_param_into_net(net, {k: v.copy() for k, v in init.items()})
        net.set_train(True)
        loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        params = net.trainable_params()
        opt = nn.Momentum(params, 0.1, 0.9)
        grad_fn = minidl.value_and_grad(lambda a, b: loss_fn(net(a), b), None, params)
        losses = []
        for _ in range(2):
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            losses.append(float(loss.asnumpy()))
            opt(grads)
        return losses, {name: host(full_value(p)) for name, p in net.parameters_and_names()}

    ref = run(x, y)

    def rank():
        import minidl_parallel as mp
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
        r = mp.get_rank()
        try:
            with mp.CommCounter() as counter:
                out = run(x[2 * r:2 * r + 2], y[2 * r:2 * r + 2])
            return out, counter.count("allreduce", "forward")
        finally:
            mp.reset_auto_parallel_context()
    batchnorms = sum(isinstance(c, nn.BatchNorm2d) for _, c in resnet20().cells_and_names())
    for (losses, state), forward_allreduces in run_threads(2, rank):
        assert forward_allreduces >= 2 * 2 * batchnorms  # 2 steps, each BatchNorm: mean and variance over ranks
        np.testing.assert_allclose(losses, ref[0], rtol=1e-10)
        for name, value in ref[1].items():
            assert np.isfinite(value).all(), name  # else the tolerance below would be infinite
            assert state[name].dtype == np.float64, name
            scale = max(1e-3, float(np.abs(value).max()))  # measured: 4e-15 * scale at most
            np.testing.assert_allclose(state[name], value, rtol=1e-9, atol=1e-10 * scale, err_msg=name)
