"""Optimizers against hand-written NumPy updates; learning-rate lists and schedules; groups;
state save/restore; in-place, allocation-free updates; errors."""
import math
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Parameter, Tensor
from minidl.optim import (SGD, Momentum, Optimizer, ExponentialDecayLR, CosineDecayLR, PolynomialDecayLR, WarmUpLR,
                          PiecewiseConstantLR, piecewise_constant_lr, exponential_decay_lr, cosine_decay_lr, warmup_lr)

SHAPES = [(3, 4), (4,), ()]


def make_params(rng, names=("fc.weight", "fc.bias", "scale"), dtype=np.float64):
    return [Parameter(rng.normal(size=s).astype(dtype), name=n) for n, s in zip(names, SHAPES)]


def make_grads(rng, steps, dtype=np.float64):
    return [[rng.normal(size=s).astype(dtype) for s in SHAPES] for _ in range(steps)]


def ref_sgd(p, grads, lrs, momentum=0.0, dampening=0.0, nesterov=False, wd=0.0, loss_scale=1.0):
    """PyTorch / MindSpore SGD, written out plainly."""
    p, v = p.copy(), None
    for g, lr in zip(grads, lrs):
        g = g / loss_scale + wd * p
        if momentum:
            v = g.copy() if v is None else momentum * v + (1 - dampening) * g
            g = g + momentum * v if nesterov else v
        p = p - lr * g
    return p


def ref_momentum(p, grads, lrs, momentum, nesterov=False, wd=0.0, loss_scale=1.0):
    """MindSpore ApplyMomentum, written out plainly."""
    p, v = p.copy(), np.zeros_like(p)
    for g, lr in zip(grads, lrs):
        g = g / loss_scale + wd * p
        v = momentum * v + g
        p = p - lr * (g + momentum * v if nesterov else v)
    return p


def tensors(*arrays):
    """Gradients as Tensors: they then live on the parameters' device (the suite also runs
    pinned to the GPU, where a NumPy gradient is a host array)."""
    return tuple(Tensor(a) for a in arrays)


def run(opt, params, grads, as_tensors=True):
    for gs in grads:
        # raw arrays of the parameters' device (NumPy on the CPU)
        opt(tuple(Tensor(g) for g in gs) if as_tensors else tuple(minidl.backend.to_device(g) for g in gs))


sgd_configs = st.fixed_dictionaries({
    "momentum": st.sampled_from([0.0, 0.5, 0.9]), "dampening": st.sampled_from([0.0, 0.3]),
    "nesterov": st.booleans(), "wd": st.sampled_from([0.0, 0.01]), "lr": st.sampled_from([0.1, 0.03]),
    "loss_scale": st.sampled_from([1.0, 128.0]), "steps": st.integers(1, 4), "seed": st.integers(0, 2**16)})


@given(cfg=sgd_configs)
def test_sgd_matches_reference(cfg):
    if cfg["nesterov"] and (cfg["momentum"] == 0 or cfg["dampening"]):
        cfg["nesterov"] = False
    rng = np.random.default_rng(cfg["seed"])
    params = make_params(rng)
    start = [p.asnumpy().copy() for p in params]
    grads = make_grads(rng, cfg["steps"])
    scaled = [[g * cfg["loss_scale"] for g in gs] for gs in grads]
    opt = SGD(params, learning_rate=cfg["lr"], momentum=cfg["momentum"], dampening=cfg["dampening"],
              weight_decay=cfg["wd"], nesterov=cfg["nesterov"], loss_scale=cfg["loss_scale"])
    run(opt, params, scaled)
    assert opt.global_step == cfg["steps"]
    for i, p in enumerate(params):
        expect = ref_sgd(start[i], [gs[i] * cfg["loss_scale"] for gs in grads], [cfg["lr"]] * cfg["steps"],
                         cfg["momentum"], cfg["dampening"], cfg["nesterov"], cfg["wd"], cfg["loss_scale"])
        np.testing.assert_allclose(p.asnumpy(), expect, rtol=1e-12, atol=1e-14)


@given(momentum=st.sampled_from([0.0, 0.9]), nesterov=st.booleans(), wd=st.sampled_from([0.0, 1e-2]),
       steps=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_momentum_matches_reference(momentum, nesterov, wd, steps, seed):
    rng = np.random.default_rng(seed)
    params = make_params(rng)
    start = [p.asnumpy().copy() for p in params]
    grads = make_grads(rng, steps)
    opt = Momentum(params, learning_rate=0.05, momentum=momentum, weight_decay=wd, use_nesterov=nesterov)
    run(opt, params, grads, as_tensors=bool(seed % 2))  # raw arrays work as well as Tensors
    for i, p in enumerate(params):
        expect = ref_momentum(start[i], [gs[i] for gs in grads], [0.05] * steps, momentum, nesterov, wd)
        np.testing.assert_allclose(p.asnumpy(), expect, rtol=1e-12, atol=1e-14)


def test_sgd_first_step_is_undampened_then_dampened():
    p = Parameter(np.array([1.0]), name="w")
    opt = SGD([p], learning_rate=1.0, momentum=0.5, dampening=0.5)
    opt(tensors(np.array([1.0]),))  # v = g = 1
    assert p.asnumpy()[0] == pytest.approx(0.0)
    opt(tensors(np.array([1.0]),))  # v = 0.5 * 1 + 0.5 * 1 = 1
    assert p.asnumpy()[0] == pytest.approx(-1.0)
    opt(tensors(np.array([2.0]),))  # v = 0.5 * 1 + 0.5 * 2 = 1.5
    assert p.asnumpy()[0] == pytest.approx(-2.5)


def test_momentum_by_hand():
    p = Parameter(np.array([1.0]), name="w")
    opt = Momentum([p], learning_rate=0.1, momentum=0.9, use_nesterov=True)
    opt(tensors(np.array([1.0]),))  # v = 1; p -= 0.1 * (1 + 0.9)
    assert p.asnumpy()[0] == pytest.approx(0.81)
    opt(tensors(np.array([1.0]),))  # v = 1.9; p -= 0.1 * (1 + 1.71)
    assert p.asnumpy()[0] == pytest.approx(0.81 - 0.271)


@pytest.mark.parametrize("make", [lambda ps: SGD(ps, 0.1, momentum=0.9, weight_decay=0.1),
                                  lambda ps: Momentum(ps, 0.1, 0.9, weight_decay=0.1)])
def test_weight_decay_skips_beta_and_gamma_only(make):
    names = ["bn.gamma", "bn.beta", "fc.bias", "fc.weight"]
    params = [Parameter(np.ones(2), name=n) for n in names]
    opt = make(params)
    opt(tensors(*(np.zeros(2) for _ in names)))  # zero gradient: only decay moves a parameter
    moved = {n: not np.allclose(p.asnumpy(), 1.0) for n, p in zip(names, params)}
    assert moved == {"bn.gamma": False, "bn.beta": False, "fc.bias": True, "fc.weight": True}
    np.testing.assert_allclose(params[3].asnumpy(), 1 - 0.1 * 0.1)


def test_groups_apply_their_own_lr_and_weight_decay_to_every_member():
    gamma, w, b = (Parameter(np.ones(2), name=n) for n in ("bn.gamma", "w", "b"))
    opt = Momentum([{"params": [gamma, w], "weight_decay": 0.5, "lr": 0.2}, {"params": [b]}],
                   learning_rate=0.1, momentum=0.0, weight_decay=0.0)
    assert opt.parameters == (gamma, w, b)
    assert opt.get_lr() == (0.2, 0.1)
    assert opt.get_lr_parameter(b) == 0.1 and opt.get_lr_parameter([gamma, b]) == [0.2, 0.1]
    opt(tensors(np.ones(2), np.ones(2), np.ones(2)))
    # grouped: decay applies to gamma too (MindSpore); g = 1 + 0.5 * 1
    np.testing.assert_allclose(gamma.asnumpy(), 1 - 0.2 * 1.5)
    np.testing.assert_allclose(w.asnumpy(), 1 - 0.2 * 1.5)
    np.testing.assert_allclose(b.asnumpy(), 1 - 0.1)


def test_order_params_fixes_the_gradient_order():
    a, b = Parameter(np.zeros(2), name="a"), Parameter(np.zeros(3), name="b")
    opt = SGD([{"params": [a]}, {"params": [b], "lr": 1.0}, {"order_params": [b, a]}], learning_rate=0.5)
    assert opt.parameters == (b, a)
    opt(tensors(np.ones(3), np.ones(2)))
    np.testing.assert_allclose(a.asnumpy(), -0.5)
    np.testing.assert_allclose(b.asnumpy(), -1.0)
    with pytest.raises(ValueError, match="order_params must list exactly the grouped parameters"):
        SGD([{"params": [a, b]}, {"order_params": [a]}])


def test_dynamic_lr_list_holds_its_last_value():
    p = Parameter(np.zeros(1), name="w")
    opt = SGD([p], learning_rate=[1.0, 0.5, 0.25])
    seen = []
    for _ in range(5):
        seen.append(opt.get_lr())
        opt(tensors(np.ones(1),))
    assert seen == [1.0, 0.5, 0.25, 0.25, 0.25]
    assert p.asnumpy()[0] == pytest.approx(-2.25)
    for lr in (np.array([0.3, 0.1]), Tensor(np.array([0.3, 0.1])), (0.3, 0.1)):
        assert SGD([p], learning_rate=lr).get_lr() == pytest.approx(0.3)


def test_schedule_and_callable_learning_rates():
    p = Parameter(np.zeros(1), name="w")
    opt = Momentum([p], learning_rate=ExponentialDecayLR(0.1, 0.5, 2), momentum=0.0)
    for _ in range(4):
        opt(tensors(np.ones(1),))
    assert p.asnumpy()[0] == pytest.approx(-0.1 * sum(0.5 ** (i / 2) for i in range(4)))
    assert opt.get_lr() == pytest.approx(0.1 * 0.5 ** 2)
    opt = SGD([p], learning_rate=lambda step: 0.01 * (step + 1))
    opt(tensors(np.ones(1),))
    assert opt.get_lr() == pytest.approx(0.02)


def test_pytorch_style_step_and_zero_grad():
    a, b = Parameter(np.ones(2), name="a"), Parameter(np.ones(2), name="b")
    opt = SGD([a, b], learning_rate=0.5)
    a.grad = Tensor(np.full(2, 2.0))
    opt.step()  # b has no grad: left alone
    np.testing.assert_allclose(a.asnumpy(), 0.0)
    np.testing.assert_allclose(b.asnumpy(), 1.0)
    opt.zero_grad()
    assert a.grad is None and b.grad is None and opt.global_step == 1


def test_updates_happen_in_place():
    p = Parameter(np.ones((2, 2), np.float32), name="w")
    data, view = p.data, p.data[0]
    opt = Momentum([p], learning_rate=0.1, momentum=0.9, weight_decay=0.01, loss_scale=2.0)
    buf = opt.state_dict()["moments.w"]
    opt(tensors(np.ones((2, 2), np.float32),))
    assert p.data is data and p.data.dtype == np.float32
    assert view[0] != 1.0  # views of the parameter see the update
    assert opt.state_dict()["moments.w"] is buf and buf.data.dtype == np.float32


def test_float32_updates_stay_float32_and_match_float64():
    rng = np.random.default_rng(3)
    p64 = make_params(rng)
    p32 = [Parameter(p.data.astype(np.float32), name=p.name) for p in p64]
    grads = make_grads(rng, 3)
    run(SGD(p64, 0.1, momentum=0.9, nesterov=True, weight_decay=0.01), p64, grads)
    run(SGD(p32, 0.1, momentum=0.9, nesterov=True, weight_decay=0.01), p32,
        [[g.astype(np.float32) for g in gs] for gs in grads])
    for a, b in zip(p32, p64):
        assert a.data.dtype == np.float32
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make", [lambda ps: SGD(ps, 0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
                                  lambda ps: Momentum(ps, 0.1, 0.9, weight_decay=0.01, loss_scale=4.0)])
@pytest.mark.cpu_only  # tracemalloc sees host memory only
def test_an_update_allocates_no_parameter_sized_memory(make):
    p = Parameter(np.ones(1 << 20, np.float32), name="w")  # 4 MiB
    g = np.ones(1 << 20, np.float32)
    opt = make([p])
    opt(tensors(g,))  # the first step makes the work buffers
    tracemalloc.start()
    try:
        opt(tensors(g,))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_state_round_trip_resumes_exactly():
    rng = np.random.default_rng(5)
    grads = make_grads(rng, 6)
    full = make_params(np.random.default_rng(1))
    opt = SGD(full, learning_rate=[0.1, 0.05], momentum=0.9, dampening=0.2)
    run(opt, full, grads)

    half = make_params(np.random.default_rng(1))
    first = SGD(half, learning_rate=[0.1, 0.05], momentum=0.9, dampening=0.2)
    run(first, half, grads[:3])
    state = {k: Parameter(v.data.copy(), name=k) for k, v in first.state_dict().items()}
    assert sorted(state) == ["accum.fc.bias", "accum.fc.weight", "accum.scale", "global_step",
                             "stat.fc.bias", "stat.fc.weight", "stat.scale"]
    resumed = SGD(half, learning_rate=[0.1, 0.05], momentum=0.9, dampening=0.2)
    assert resumed.load_state_dict(state) == []
    assert resumed.global_step == 3
    run(resumed, half, grads[3:])
    for a, b in zip(half, full):
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-14)
    with pytest.raises(ValueError, match="missing"):
        resumed.load_state_dict({"global_step": np.array([1], np.int32)})


def test_unnamed_parameters_get_index_names():
    opt = Momentum([Parameter(np.ones(2)), Parameter(np.ones(3))], 0.1, 0.9)
    assert [n for n, _ in opt.parameters_and_names()] == ["global_step", "moments.param0", "moments.param1"]


def test_grad_errors_name_the_parameter():
    params = make_params(np.random.default_rng(0))
    opt = SGD(params, 0.1)
    with pytest.raises(ValueError, match=r"SGD: got 2 gradients for 3 parameters \('fc.weight', 'fc.bias'"):
        opt(tensors(np.ones((3, 4)), np.ones(4)))
    before = params[0].asnumpy().copy()
    with pytest.raises(ValueError, match=r"gradient 1 for parameter 'fc.bias' has shape \(5,\), "
                                         r"but the parameter has shape \(4,\)"):
        opt(tensors(np.ones((3, 4)), np.ones(5), np.ones(())))
    np.testing.assert_array_equal(params[0].asnumpy(), before)  # nothing moved
    assert opt.global_step == 0
    with pytest.raises(TypeError, match="grads must be a tuple"):
        opt(np.ones(3))


def test_construction_errors():
    p = Parameter(np.ones(2), name="w")
    cases = [
        (lambda: Momentum([p], 0.1, -0.9), ValueError, "Momentum: momentum must be >= 0, got -0.9"),
        (lambda: SGD([p], 0.1, momentum=-1.0), ValueError, "momentum must be >= 0"),
        (lambda: SGD([p], 0.1, momentum=0.0, nesterov=True), ValueError, "nesterov needs momentum > 0"),
        (lambda: SGD([p], 0.1, momentum=0.9, dampening=0.1, nesterov=True), ValueError, "dampening == 0"),
        (lambda: SGD([p], -0.1), ValueError, "learning_rate must be >= 0"),
        (lambda: SGD([p], [0.1, -1.0]), ValueError, "learning_rate values must be >= 0"),
        (lambda: SGD([p], [[0.1]]), ValueError, "non-empty 1-D"),
        (lambda: SGD([p], "fast"), TypeError, "learning_rate must be a number"),
        (lambda: SGD([p], 0.1, weight_decay=-1e-4), ValueError, "weight_decay must be >= 0"),
        (lambda: SGD([p], 0.1, loss_scale=0), ValueError, "loss_scale must be a number > 0"),
        (lambda: SGD([], 0.1), ValueError, "parameters is empty"),
        (lambda: SGD(p, 0.1), TypeError, "parameters must be a list"),
        (lambda: SGD([p, p], 0.1), ValueError, "appears more than once"),
        (lambda: SGD([p, Parameter(np.ones(1), name="w")], 0.1), ValueError, "both named 'w'"),
        (lambda: SGD([p, {"params": [p]}], 0.1), TypeError, "all Parameters or all group dicts"),
        (lambda: SGD([{"params": [p], "grad_centralization": True}]), ValueError, "unsupported keys"),
        (lambda: SGD([{"params": []}]), TypeError, "non-empty list of Parameters"),
    ]
    for make, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            make()


def test_base_class_needs_an_update_rule():
    opt = Optimizer(0.1, [Parameter(np.ones(1), name="w")])
    with pytest.raises(NotImplementedError, match="_update"):
        opt(tensors(np.ones(1),))


# ---- learning-rate schedules and lists (formulas and MindSpore's documented examples) ----

def test_exponential_decay():
    s = ExponentialDecayLR(0.1, 0.9, 4)
    assert s(2) == pytest.approx(0.1 * 0.9 ** 0.5)
    assert ExponentialDecayLR(0.1, 0.9, 4, is_stair=True)(7) == pytest.approx(0.1 * 0.9)
    assert s(Tensor(np.array(2))) == pytest.approx(s(2))


def test_cosine_decay():
    s = CosineDecayLR(0.01, 0.1, 4)
    assert s(0) == pytest.approx(0.1)
    assert s(2) == pytest.approx(0.055)
    assert s(4) == s(10) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="max_lr must be greater than min_lr"):
        CosineDecayLR(0.1, 0.1, 4)


def test_polynomial_warmup_and_piecewise():
    assert PolynomialDecayLR(0.1, 0.01, 4, 0.5)(2) == pytest.approx(0.09 * math.sqrt(0.5) + 0.01)
    assert PolynomialDecayLR(0.1, 0.01, 4, 1.0)(9) == pytest.approx(0.01)
    assert PolynomialDecayLR(0.1, 0.01, 4, 1.0, update_decay_steps=True)(6) == pytest.approx(0.09 * 0.25 + 0.01)
    assert [WarmUpLR(0.1, 2)(i) for i in range(4)] == pytest.approx([0.0, 0.05, 0.1, 0.1])
    s = PiecewiseConstantLR([2, 5, 10], [0.1, 0.05, 0.01])
    assert [s(i) for i in range(12)] == piecewise_constant_lr([2, 5, 10], [0.1, 0.05, 0.01]) + [0.01, 0.01]


def test_list_builders_match_mindspore_examples():
    assert piecewise_constant_lr([2, 5, 10], [0.1, 0.05, 0.01]) == \
        [0.1, 0.1, 0.05, 0.05, 0.05, 0.01, 0.01, 0.01, 0.01, 0.01]
    assert exponential_decay_lr(0.1, 0.9, 6, 2, 1) == pytest.approx([0.1, 0.1, 0.09, 0.09, 0.081, 0.081])
    assert exponential_decay_lr(0.1, 0.9, 6, 2, 2, is_stair=True) == pytest.approx([0.1] * 4 + [0.09] * 2)
    assert cosine_decay_lr(0.01, 0.1, 6, 2, 2) == pytest.approx([0.1, 0.1, 0.055, 0.055, 0.01, 0.01])
    assert warmup_lr(0.1, 6, 2, 2) == pytest.approx([0.0, 0.0, 0.05, 0.05, 0.1, 0.1])


def test_schedule_argument_errors():
    with pytest.raises(ValueError, match="decay_steps must be >= 1"):
        ExponentialDecayLR(0.1, 0.9, 0)
    with pytest.raises(TypeError, match="decay_steps must be an int"):
        CosineDecayLR(0.0, 0.1, 2.5)
    with pytest.raises(ValueError, match="strictly increasing"):
        piecewise_constant_lr([5, 2], [0.1, 0.2])
    with pytest.raises(ValueError, match="equal length"):
        PiecewiseConstantLR([2, 5], [0.1])
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        ExponentialDecayLR(0.0, 0.9, 2)


def test_momentum_updates_plain_gradients_in_one_call_and_the_rest_one_by_one():
    # Without weight decay or loss scale a parameter's gradient is its own array: nn.Momentum
    # hands those to one MultiApplyMomentum per learning rate; a decayed one takes ApplyMomentum.
    rng = np.random.default_rng(4)
    params = [Parameter(rng.standard_normal(s), name=n) for s, n in (((3, 2), "w"), ((2,), "b"), ((4,), "gamma"))]
    grads = [rng.standard_normal(p.shape) for p in params]
    start = [p.asnumpy().copy() for p in params]
    opt = Momentum([{"params": params[:2], "weight_decay": 0.0}, {"params": params[2:], "weight_decay": 0.1}],
                   learning_rate=0.05, momentum=0.9)
    calls = []
    for name in ("_apply_momentum", "_apply_momentum_many"):
        op = getattr(opt, name)
        op.apply = (lambda apply, name: lambda *a: calls.append(name) or apply(*a))(op.apply, name)
    opt(tensors(*grads))
    assert calls == ["_apply_momentum", "_apply_momentum_many"]
    for i, p in enumerate(params):
        expect = ref_momentum(start[i], [grads[i]], [0.05], 0.9, wd=0.1 if i == 2 else 0.0)
        np.testing.assert_allclose(p.asnumpy(), expect, rtol=1e-12, atol=1e-14)
