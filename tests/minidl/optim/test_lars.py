"""LARS around Momentum / SGD / Adam: hand-written NumPy updates (float64), MindSpore's documented
LARSUpdate example, the filter, the weight decay and loss scale it takes over, checkpoints, the
device double, data parallelism, errors."""
import types

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Parameter, Tensor, nn
from minidl.io import load_checkpoint, save_checkpoint
from minidl.optim import LARS, SGD, Adam, Momentum
from minidl.testing import cupy_double
from optim_helpers import assert_data_parallel_equals_one_device, makers, run

NAMES = ("fc.weight", "fc.bias", "bn.gamma", "LayerNorm.weight")
SHAPES = [(3, 4), (4,), (), (2,)]
make_params, make_grads = makers(NAMES, SHAPES)


def lars_grad(w, g, wd, lr, coefficient=0.001, epsilon=1e-5, use_clip=False):
    """MindSpore's LARSUpdate kernel, written out plainly."""
    w_norm, g_norm = np.sqrt(np.sum(w * w)), np.sqrt(np.sum(g * g))
    ratio = coefficient * w_norm / (g_norm + wd * w_norm + epsilon)
    if use_clip:
        ratio = min(max(ratio / lr, 0.0), 1.0)
    return ratio * (g + wd * w)


def ref_lars_momentum(w, grads, lrs, momentum, wd, loss_scale, lars_on, **lars):
    """LARS(Momentum): the filtered-out parameters get g / loss_scale, with no weight decay."""
    w, v = w.copy(), 0.0
    for g, lr in zip(grads, lrs):
        g = g / loss_scale
        if lars_on:
            g = lars_grad(w, g, wd, lr, **lars)
        v = momentum * v + g
        w = w - lr * v
    return w


lars_configs = st.fixed_dictionaries({
    "wd": st.sampled_from([0.0, 0.01]), "loss_scale": st.sampled_from([1.0, 32.0]),
    "use_clip": st.booleans(), "coefficient": st.sampled_from([0.001, 0.02, 10.0]),
    "epsilon": st.sampled_from([1e-5, 1e-8]), "lr": st.sampled_from([0.1, [0.5, 0.2, 0.05]]),
    "momentum": st.sampled_from([0.0, 0.9]), "steps": st.integers(1, 4), "seed": st.integers(0, 2**16)})


@given(cfg=lars_configs)
def test_lars_momentum_matches_the_reference(cfg):
    params = make_params(cfg["seed"])
    start = [p.asnumpy().copy() for p in params]
    grads = make_grads(cfg["seed"] + 1, cfg["steps"])
    inner = Momentum(params, cfg["lr"], cfg["momentum"], weight_decay=cfg["wd"], loss_scale=cfg["loss_scale"])
    opt = LARS(inner, epsilon=cfg["epsilon"], coefficient=cfg["coefficient"], use_clip=cfg["use_clip"])
    run(opt, [[g * cfg["loss_scale"] for g in gs] for gs in grads])
    lrs = [cfg["lr"]] * cfg["steps"] if isinstance(cfg["lr"], float) else \
        [cfg["lr"][min(i, 2)] for i in range(cfg["steps"])]
    assert opt.global_step == inner.global_step == cfg["steps"]
    lars_on = {"fc.weight": True, "fc.bias": False, "bn.gamma": True, "LayerNorm.weight": False}
    decayed = {"fc.weight": True, "fc.bias": True, "bn.gamma": False, "LayerNorm.weight": True}
    for i, p in enumerate(params):
        want = ref_lars_momentum(start[i], [gs[i] * cfg["loss_scale"] for gs in grads], lrs, cfg["momentum"],
                                 cfg["wd"] if decayed[p.name] else 0.0, cfg["loss_scale"], lars_on[p.name],
                                 coefficient=cfg["coefficient"], epsilon=cfg["epsilon"], use_clip=cfg["use_clip"])
        np.testing.assert_allclose(p.asnumpy(), want, rtol=1e-12, atol=1e-14, err_msg=p.name)


def test_mindspores_documented_larsupdate_example():
    """ops.LARSUpdate's example (wd 0, lr 1): its printed output is the scaled gradient, so
    LARS(SGD(lr=1)) moves the weight by exactly that."""
    weight = np.array([[0.5, 0.8, 0.2], [0.6, 0.4, 0.2]])
    gradient = np.array([[0.4, 0.4, 0.5], [0.2, 0.4, 0.3]])
    p = Parameter(weight.copy(), name="w")
    run(LARS(SGD([p], learning_rate=1.0)), [[gradient]])
    documented = np.array([[0.0005265, 0.0005265, 0.00065813], [0.00026325, 0.0005265, 0.00039488]])
    np.testing.assert_allclose(weight - p.asnumpy(), documented, rtol=2e-4)


def test_use_clip_caps_the_effective_rate_at_lr():
    w0, g = np.array([3.0, 4.0]), np.array([0.0, 1.0])  # ||w|| = 5, ||g|| = 1
    p = Parameter(w0.copy(), name="w")
    run(LARS(SGD([p], learning_rate=0.1), coefficient=1.0, epsilon=0.0, use_clip=True), [[g]])
    np.testing.assert_allclose(p.asnumpy(), w0 - 0.1 * g)  # ratio 5 > lr: the step is lr * g
    p = Parameter(w0.copy(), name="w")
    run(LARS(SGD([p], learning_rate=0.1), coefficient=0.01, epsilon=0.0, use_clip=True), [[g]])
    np.testing.assert_allclose(p.asnumpy(), w0 - 0.05 * g)  # ratio 0.05 < lr: the step is ratio * g
    p = Parameter(w0.copy(), name="w")
    run(LARS(SGD([p], learning_rate=0.0), coefficient=1.0, use_clip=True), [[g]])
    np.testing.assert_array_equal(p.asnumpy(), w0)  # lr 0: nothing moves (no 0 / 0)


def test_the_filter_and_a_zero_weight():
    """Default filter: names with "LayerNorm" or "bias" are skipped (BatchNorm's gamma is not).
    A kept parameter whose norm is 0 gets ratio 0 and never moves (MindSpore's kernel)."""
    names = ["fc.weight", "fc.bias", "LayerNorm.gamma", "bn.gamma", "zero.weight"]
    params = [Parameter(np.ones(2), name=n) for n in names[:4]] + [Parameter(np.zeros(2), name=names[4])]
    opt = LARS(SGD(params, learning_rate=1.0), coefficient=0.5, epsilon=0.0)
    assert opt.lars_flag == (True, False, False, True, True)
    run(opt, [[np.full(2, 2.0)] * 5])
    scaled = 1.0 - 0.5 * np.sqrt(2) / np.sqrt(8) * 2.0  # ratio = 0.5 * ||w|| / ||g|| = 0.25
    np.testing.assert_allclose([p.asnumpy()[0] for p in params], [scaled, -1.0, -1.0, scaled, 0.0])
    custom = LARS(SGD(params, learning_rate=1.0), lars_filter=lambda p: p.name.endswith("bias"))
    assert custom.lars_flag == (False, True, False, False, False)


def test_lars_takes_weight_decay_and_loss_scale_over():
    p = Parameter(np.array([3.0, 4.0]), name="w")
    inner = Momentum([p], 0.1, 0.0, weight_decay=0.5, loss_scale=4.0)
    opt = LARS(inner, coefficient=1.0, epsilon=0.0)
    assert inner.loss_scale == 1.0 and opt.loss_scale == 4.0
    run(opt, [[np.array([0.0, 4.0])]])  # g = (0, 1), ||w|| = 5: ratio = 5 / (1 + 2.5)
    np.testing.assert_allclose(p.asnumpy(), [3.0, 4.0] - 0.1 * 5 / 3.5 * (np.array([0, 1]) + 0.5 * np.array([3, 4])))
    # The decay is the wrapped optimizer's: grouped, per group, editable between steps.
    a, b = Parameter(np.ones(2), name="a"), Parameter(np.ones(2), name="b")
    inner = SGD([{"params": [a], "weight_decay": 1.0}, {"params": [b]}], learning_rate=0.1)
    opt = LARS(inner, coefficient=1.0, epsilon=0.0)
    inner.param_groups[1]["weight_decay"] = 1.0
    run(opt, [[np.zeros(2), np.zeros(2)]])
    # g = 0: ratio = ||w|| / (wd ||w||) = 1, g' = w: both moved by lr * w
    np.testing.assert_allclose(a.asnumpy(), 0.9)
    np.testing.assert_allclose(b.asnumpy(), 0.9)


def test_lars_around_adam_runs_adams_rule_on_the_scaled_gradient():
    w0, g = np.array([1.0, -2.0, 2.0]), np.array([0.3, 0.1, -0.2])
    p, q = Parameter(w0.copy(), name="w"), Parameter(w0.copy(), name="w")
    opt = LARS(Adam([p], 0.1), coefficient=0.02)
    run(opt, [[g], [g]])
    adam = Adam([q], 0.1)  # fed the scaled gradients by hand
    for _ in range(2):
        run(adam, [[lars_grad(q.asnumpy(), g, 0.0, 0.1, coefficient=0.02)]])
    np.testing.assert_allclose(p.asnumpy(), q.asnumpy(), rtol=1e-13)
    assert opt.state_dict()["beta1_power"].asnumpy()[0] == pytest.approx(0.9 ** 2)


def test_schedule_state_and_checkpoints_are_the_wrapped_optimizers(tmp_path):
    def make(params):
        return LARS(Momentum(params, [0.1, 0.05, 0.02], 0.9, weight_decay=1e-3), coefficient=0.02, use_clip=True)

    grads = make_grads(9, 6)
    full = make_params(1)
    run(make(full), grads)

    half = make_params(1)
    first = make(half)
    assert [n for n, _ in first.parameters_and_names()] == ["global_step"] + [f"moments.{n}" for n in NAMES]
    assert first.get_lr() == 0.1
    run(first, grads[:3])
    assert first.get_lr() == first.optimizer.get_lr() == 0.02
    path = tmp_path / "lars.ckpt"
    save_checkpoint(first, path)
    fresh = make(half)
    assert fresh.load_state_dict(load_checkpoint(path)) == []
    assert fresh.global_step == 3
    run(fresh, grads[3:])
    for a, b in zip(half, full):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    plain = Momentum(make_params(1), 0.1, 0.9)  # same state names: loads into the bare optimizer
    assert plain.load_state_dict(load_checkpoint(path)) == [] and plain.global_step == 3


def test_float32_stays_float32():
    params = make_params(2, dtype=np.float32)
    data = [p.data for p in params]
    run(LARS(Momentum(params, 0.1, 0.9, weight_decay=1e-3), coefficient=0.02), make_grads(3, 3, dtype=np.float32))
    assert all(p.data is d and p.data.dtype == np.float32 for p, d in zip(params, data))


def test_a_lars_step_never_syncs_the_host(on_the_double):
    net = nn.SequentialCell(nn.Dense(4, 3), nn.ReLU(), nn.Dense(3, 2))
    opt = LARS(Momentum(net.trainable_params(), 0.1, 0.9, weight_decay=1e-4, loss_scale=2.0), use_clip=True)
    x = Tensor(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32))
    grad_fn = minidl.value_and_grad(lambda x: net(x).sum(), None, net.trainable_params())
    for step in range(2):
        _, grads = grad_fn(x)
        assert isinstance(grads[0].data, cupy_double.ndarray)
        with cupy_double.count_host_syncs() as syncs:
            opt(grads)
        assert syncs.total == 0, f"step {step}: {syncs.by_reason}"
        assert syncs.uploads == 0, f"step {step}: {syncs.uploads} uploads"


def test_lars_under_the_distributed_optimizer_equals_one_device():
    from minidl_parallel import broadcast_optimizer_state
    assert_data_parallel_equals_one_device(
        lambda params: LARS(Momentum(params, 0.1, 0.9, weight_decay=1e-3), coefficient=0.05),
        after_wrap=lambda opt: broadcast_optimizer_state(opt, root_rank=0))


def test_a_sharded_parameter_is_refused_unless_filtered_out():
    w = Parameter(np.ones((2, 4)), name="fc.weight")
    w.placement = types.SimpleNamespace(shape=(4, 4))  # stands for one rank's block of a (4, 4) weight
    opt = LARS(SGD([w], 0.1))
    with pytest.raises(ValueError, match=r"LARS: parameter 'fc.weight' of shape \(4, 4\) is sharded .* block "
                                         r"of shape \(2, 4\).*exclude it with lars_filter"):
        run(opt, [[np.ones((2, 4))]])
    np.testing.assert_array_equal(w.asnumpy(), 1.0)
    run(LARS(SGD([w], 0.1), lars_filter=lambda p: False), [[np.ones((2, 4))]])
    np.testing.assert_allclose(w.asnumpy(), 0.9)


def test_construction_and_gradient_errors():
    p = Parameter(np.ones(2), name="w")
    inner = Momentum([p], 0.1, 0.9)
    LARS(inner)

    def fresh():
        return Momentum([p], 0.1, 0.9)

    cases = [
        (lambda: LARS(object()), TypeError, "LARS: optimizer must be a minidl Optimizer .*, got object"),
        (lambda: LARS(LARS(fresh())), TypeError, "LARS: optimizer is already a LARS"),
        (lambda: LARS(inner), ValueError, "LARS: this Momentum is already wrapped by a LARS"),
        (lambda: LARS(fresh(), epsilon="small"), TypeError, "LARS: epsilon must be a float, got 'small'"),
        (lambda: LARS(fresh(), epsilon=-1e-5), ValueError, "LARS: epsilon must be >= 0, got -1e-05"),
        (lambda: LARS(fresh(), coefficient=0.0), ValueError, "LARS: coefficient must be > 0, got 0.0"),
        (lambda: LARS(fresh(), coefficient=True), TypeError, "coefficient must be a float"),
        (lambda: LARS(fresh(), use_clip=1), TypeError, "LARS: use_clip must be a bool, got 1"),
        (lambda: LARS(fresh(), lars_filter="bias"), TypeError, "LARS: lars_filter must be a callable"),
    ]
    for make, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            make()
    opt = LARS(Momentum([p], 0.1, 0.9))
    with pytest.raises(ValueError, match=r"LARS: gradient 0 for parameter 'w' has shape \(3,\)"):
        opt((Tensor(np.ones(3)),))
    with pytest.raises(TypeError, match="LARS: grads must be a tuple"):
        opt(np.ones(2))
    assert opt.global_step == 0
