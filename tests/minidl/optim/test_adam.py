"""Adam and AdamWeightDecay: hand-written NumPy updates (float64), values measured on MindSpore
2.10, PyTorch's Adam (the eps difference made explicit), schedules, groups, checkpoints, the
device double, data parallelism, errors."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Parameter, Tensor, nn
from minidl.io import load_checkpoint, save_checkpoint
from minidl.optim import Adam, AdamWeightDecay, ExponentialDecayLR
from minidl.testing import cupy_double
from optim_helpers import assert_data_parallel_equals_one_device, makers, run

SHAPES = [(3, 4), (4,), ()]
make_params, make_grads = makers(("fc.weight", "fc.bias", "scale"), SHAPES)


def ref_adam(w, grads, lrs, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, loss_scale=1.0, nesterov=False, amsgrad=False):
    """MindSpore's Adam kernel, written out plainly (eps outside the bias correction)."""
    w, m, v, vhat = w.copy(), 0.0, 0.0, 0.0
    for t, (g, lr) in enumerate(zip(grads, lrs), 1):
        g = g / loss_scale + wd * w
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        vhat = np.maximum(vhat, v)
        num = b1 * m + (1 - b1) * g if nesterov else m
        w = w - lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * num / (np.sqrt(vhat if amsgrad else v) + eps)
    return w


def ref_adamw(w, grads, lrs, b1=0.9, b2=0.999, eps=1e-6, wd=0.0):
    """MindSpore's AdamWeightDecay, written out plainly: no bias correction, decoupled decay."""
    w, m, v = w.copy(), 0.0, 0.0
    for g, lr in zip(grads, lrs):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        w = w - lr * (m / (np.sqrt(v) + eps) + wd * w)
    return w


adam_configs = st.fixed_dictionaries({
    "variant": st.sampled_from(["plain", "nesterov", "amsgrad"]), "wd": st.sampled_from([0.0, 0.1]),
    "loss_scale": st.sampled_from([1.0, 64.0]), "lr": st.sampled_from([0.01, [0.1, 0.03, 0.01]]),
    "betas": st.sampled_from([(0.9, 0.999), (0.5, 0.6)]), "eps": st.sampled_from([1e-8, 1e-2]),
    "steps": st.integers(1, 5), "seed": st.integers(0, 2**16)})


@given(cfg=adam_configs)
def test_adam_matches_the_reference(cfg):
    params = make_params(cfg["seed"])
    start = [p.asnumpy().copy() for p in params]
    grads = make_grads(cfg["seed"] + 1, cfg["steps"])
    b1, b2 = cfg["betas"]
    opt = Adam(params, learning_rate=cfg["lr"], beta1=b1, beta2=b2, eps=cfg["eps"], weight_decay=cfg["wd"],
               loss_scale=cfg["loss_scale"], use_nesterov=cfg["variant"] == "nesterov",
               use_amsgrad=cfg["variant"] == "amsgrad")
    run(opt, [[g * cfg["loss_scale"] for g in gs] for gs in grads])
    lrs = [cfg["lr"]] * cfg["steps"] if isinstance(cfg["lr"], float) else \
        [cfg["lr"][min(i, 2)] for i in range(cfg["steps"])]
    assert opt.global_step == cfg["steps"]
    for i, p in enumerate(params):
        want = ref_adam(start[i], [gs[i] * cfg["loss_scale"] for gs in grads], lrs, b1, b2, cfg["eps"], cfg["wd"],
                        cfg["loss_scale"], cfg["variant"] == "nesterov", cfg["variant"] == "amsgrad")
        np.testing.assert_allclose(p.asnumpy(), want, rtol=1e-12, atol=1e-14)
    state = opt.state_dict()
    assert state["beta1_power"].asnumpy()[0] == pytest.approx(b1 ** cfg["steps"], rel=1e-14)
    assert state["beta2_power"].asnumpy()[0] == pytest.approx(b2 ** cfg["steps"], rel=1e-14)


@given(wd=st.sampled_from([0.0, 0.05]), lr=st.sampled_from([0.01, [0.1, 0.02]]), eps=st.sampled_from([1e-6, 1e-2]),
       steps=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_adam_weight_decay_matches_the_reference(wd, lr, eps, steps, seed):
    params = make_params(seed)
    start = [p.asnumpy().copy() for p in params]
    grads = make_grads(seed + 1, steps)
    opt = AdamWeightDecay(params, learning_rate=lr, eps=eps, weight_decay=wd)
    run(opt, grads)
    lrs = [lr] * steps if isinstance(lr, float) else [lr[min(i, 1)] for i in range(steps)]
    for i, p in enumerate(params):
        want = ref_adamw(start[i], [gs[i] for gs in grads], lrs, eps=eps, wd=wd)
        np.testing.assert_allclose(p.asnumpy(), want, rtol=1e-12, atol=1e-14)


# Measured on MindSpore 2.10 (CPU, PyNative), Parameter(W0, name="w"), three calls with the rows
# of G. Hyperparameters are exact in float32, as MindSpore casts them to float32.
W0 = np.array([1.0, -2.0, 0.5, 3.0])
G = np.array([[0.125, -0.25, 0.0625, 0.375], [-0.0625, 0.0078125, 0.015625, 0.0078125],
              [0.0078125, 0.015625, -0.001953125, 0.00390625]])
B = dict(beta1=0.875, beta2=0.9990234375)
MINDSPORE = {
    "adam": (Adam, dict(learning_rate=0.125, eps=2.0 ** -10, **B),
             [0.8507672548294067, -1.7690322399139404, 0.2963305115699768, 2.7465288639068604]),
    "adam_nesterov": (Adam, dict(learning_rate=0.125, eps=2.0 ** -10, use_nesterov=True, **B),
                      [0.8001405596733093, -1.6939572095870972, 0.22473084926605225, 2.660226345062256]),
    "adam_amsgrad": (Adam, dict(learning_rate=0.125, beta1=0.875, beta2=0.5, eps=2.0 ** -10, use_amsgrad=True),
                     [0.8218877911567688, -1.7650874853134155, 0.22943681478500366, 2.7530269622802734]),
    "adam_wd": (Adam, dict(learning_rate=0.125, eps=2.0 ** -10, weight_decay=0.125, **B),
                [0.7096490859985352, -1.6697702407836914, 0.21662834286689758, 2.659506320953369]),
    "adamw": (AdamWeightDecay, dict(learning_rate=0.125, eps=2.0 ** -10, weight_decay=0.125, **B),
              [0.2886073887348175, -0.8079456090927124, -0.5193253755569458, 1.640404224395752]),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(MINDSPORE))
def test_values_measured_on_mindspore(case, dtype):
    cls, kwargs, want = MINDSPORE[case]
    p = Parameter(W0.astype(dtype), name="w")
    opt = cls([p], **kwargs)
    run(opt, [[g.astype(dtype)] for g in G])
    assert p.data.dtype == dtype
    # MindSpore computes in float32: its values carry float32 rounding (~1e-7 here).
    np.testing.assert_allclose(p.asnumpy(), want, rtol=0, atol=1e-6)


def test_the_bias_corrected_adamw_rule_is_not_mindspores():
    """AdamWeightDecay is not bias-corrected: the corrected rule misses MindSpore's value by far."""
    _, kwargs, want = MINDSPORE["adamw"]
    lr, b1, b2, eps, wd = (kwargs[k] for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay"))
    w, m, v = W0.copy(), 0.0, 0.0
    for t, g in enumerate(G, 1):
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        w = w - lr * ((m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps) + wd * w)
    assert np.abs(w - want).max() > 0.1


@pytest.mark.cpu_only  # PyTorch runs on the host
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_equals_pytorch_with_pytorchs_eps_rescaled_each_step(amsgrad):
    """torch.optim.Adam(weight_decay=...) step for step: MindSpore's eps at step t is PyTorch's
    eps / sqrt(1 - beta2 ** t) (set before each torch step); everything else agrees exactly."""
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    steps, lr, wd, eps, b1, b2 = 7, 0.05, 0.1, 1e-8, 0.9, 0.999
    params = make_params(3)
    grads = make_grads(4, steps)
    ours = Adam(params, learning_rate=lr, weight_decay=wd, eps=eps, use_amsgrad=amsgrad)
    tparams = [torch.tensor(p.asnumpy().copy(), dtype=torch.float64, requires_grad=True) for p in params]
    topt = torch.optim.Adam(tparams, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad)
    plain = [torch.tensor(p.asnumpy().copy(), dtype=torch.float64, requires_grad=True) for p in params]
    popt = torch.optim.Adam(plain, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=amsgrad)
    for t, gs in enumerate(grads, 1):
        run(ours, [gs])
        topt.param_groups[0]["eps"] = eps / math.sqrt(1 - b2 ** t)
        for tp, pp, g in zip(tparams, plain, gs):
            tp.grad, pp.grad = torch.from_numpy(g.copy()), torch.from_numpy(g.copy())
        topt.step()
        popt.step()
        for p, tp in zip(params, tparams):
            np.testing.assert_allclose(p.asnumpy(), tp.detach().numpy(), rtol=1e-12, atol=1e-12)
    # PyTorch's own eps (constant) is a different rule: the gap is far above rounding.
    gap = max(np.abs(p.asnumpy() - pp.detach().numpy()).max() for p, pp in zip(params, plain))
    assert gap > 1e-9


def test_adam_weight_decay_shrinks_weights_by_lr_wd_w_with_zero_gradients():
    w = Parameter(np.array([[1.0, -2.0], [4.0, 0.5]]), name="fc.weight")
    gamma = Parameter(np.array([1.0, 2.0]), name="ln.gamma")
    opt = AdamWeightDecay([w, gamma], learning_rate=0.1, weight_decay=0.01)
    start = w.asnumpy().copy()
    for k in range(1, 4):
        run(opt, [[np.zeros((2, 2)), np.zeros(2)]])
        np.testing.assert_allclose(w.asnumpy(), start * (1 - 0.1 * 0.01) ** k, rtol=1e-14)
    np.testing.assert_array_equal(gamma.asnumpy(), [1.0, 2.0])  # plain list: "gamma" is not decayed
    m = opt.state_dict()["adam_m.fc.weight"].asnumpy()
    np.testing.assert_array_equal(m, 0.0)  # decoupled: the decay never enters the moments


def test_adam_weight_decay_groups_as_in_mindspores_tutorial():
    w, b, ln = (Parameter(np.ones(3), name=n) for n in ("dense.weight", "dense.bias", "layernorm.gamma"))
    opt = AdamWeightDecay([{"params": [w], "weight_decay": 0.5}, {"params": [b, ln]}], learning_rate=0.1)
    run(opt, [[np.zeros(3)] * 3, [np.zeros(3)] * 3])
    np.testing.assert_allclose(w.asnumpy(), (1 - 0.1 * 0.5) ** 2)
    np.testing.assert_array_equal(b.asnumpy(), 1.0)
    np.testing.assert_array_equal(ln.asnumpy(), 1.0)


def test_adam_decays_all_but_beta_and_gamma_and_groups_decay_everyone():
    names = ["bn.gamma", "bn.beta", "fc.bias", "fc.weight"]
    params = [Parameter(np.ones(2), name=n) for n in names]
    run(Adam(params, learning_rate=0.1, weight_decay=0.1), [[np.zeros(2)] * 4])
    moved = {n: not np.allclose(p.asnumpy(), 1.0) for n, p in zip(names, params)}
    assert moved == {"bn.gamma": False, "bn.beta": False, "fc.bias": True, "fc.weight": True}
    gamma = Parameter(np.ones(2), name="bn.gamma")
    run(Adam([{"params": [gamma], "weight_decay": 0.1}], learning_rate=0.1), [[np.zeros(2)]])
    assert not np.allclose(gamma.asnumpy(), 1.0)


def test_schedules_lists_and_get_lr():
    p = Parameter(np.array([1.0, -1.0]), name="w")
    schedule = ExponentialDecayLR(0.1, 0.5, 1)
    opt = Adam([p], learning_rate=schedule)
    seen = []
    for _ in range(3):
        seen.append(opt.get_lr())
        run(opt, [[np.array([0.3, -0.2])]])
    assert seen == pytest.approx([0.1, 0.05, 0.025])
    want = ref_adam(np.array([1.0, -1.0]), [np.array([0.3, -0.2])] * 3, seen)
    np.testing.assert_allclose(p.asnumpy(), want, rtol=1e-12)
    opt = AdamWeightDecay([p], learning_rate=[0.2, 0.1])
    assert opt.get_lr() == 0.2
    run(opt, [[np.zeros(2)]] * 3)
    assert opt.get_lr() == 0.1 and opt.get_lr_parameter(p) == 0.1


@pytest.mark.parametrize("make", [
    lambda ps: Adam(ps, learning_rate=[0.05, 0.02], weight_decay=0.01, use_amsgrad=True, loss_scale=8.0),
    lambda ps: Adam(ps, learning_rate=0.05, use_nesterov=True),
    lambda ps: AdamWeightDecay(ps, learning_rate=ExponentialDecayLR(0.05, 0.9, 2), weight_decay=0.1)],
    ids=["adam_amsgrad", "adam_nesterov", "adamw"])
def test_checkpoint_resume_equals_an_uninterrupted_run(tmp_path, make):
    grads = make_grads(7, 6)
    full = make_params(1)
    run(make(full), grads)

    half = make_params(1)
    first = make(half)
    run(first, grads[:3])
    path = tmp_path / "opt.ckpt"
    save_checkpoint(first, path)
    fresh = make(half)  # the parameters carry on; the optimizer state comes from the file
    assert fresh.load_state_dict(load_checkpoint(path)) == []
    assert fresh.global_step == 3
    run(fresh, grads[3:])
    for a, b in zip(half, full):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())


def test_state_names_are_mindspores():
    params = make_params(0)
    names = [n for n, _ in Adam(params, use_amsgrad=True).parameters_and_names()]
    assert names == ["global_step"] + [f"{k}.{p.name}" for k in ("moment1", "moment2", "vhat") for p in params] + \
        ["beta1_power", "beta2_power"]
    names = [n for n, _ in AdamWeightDecay(params).parameters_and_names()]
    assert names == ["global_step"] + [f"{k}.{p.name}" for k in ("adam_m", "adam_v") for p in params]


def test_float32_stays_float32_in_place_and_matches_float64():
    p64 = make_params(2)
    p32 = [Parameter(p.data.astype(np.float32), name=p.name) for p in p64]
    data = [p.data for p in p32]
    grads = make_grads(3, 4)
    run(Adam(p64, 0.01, weight_decay=0.01, use_amsgrad=True), grads)
    opt = Adam(p32, 0.01, weight_decay=0.01, use_amsgrad=True)
    run(opt, [[g.astype(np.float32) for g in gs] for gs in grads])
    for a, b, d in zip(p32, p64, data):
        assert a.data is d and a.data.dtype == np.float32
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-5, atol=1e-6)
    assert all(v.data.dtype == np.float32 for k, v in opt.state_dict().items() if k.startswith("moment"))


def test_lazy_is_plain_adam_for_dense_gradients_and_none_skips_a_parameter():
    a, b = make_params(4), make_params(4)
    grads = make_grads(5, 3)
    run(Adam(a, 0.01, use_lazy=True), grads)
    run(Adam(b, 0.01), grads)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.asnumpy(), y.asnumpy())
    before = a[1].asnumpy().copy()
    opt = Adam(a, 0.01)
    opt((Tensor(grads[0][0]), None, Tensor(grads[0][2])))
    np.testing.assert_array_equal(a[1].asnumpy(), before)


def test_an_adam_step_never_syncs_the_host(on_the_double):
    net = nn.SequentialCell(nn.Dense(4, 3), nn.ReLU(), nn.Dense(3, 2))
    opts = [Adam(net.trainable_params(), 0.01, weight_decay=1e-4, use_amsgrad=True, loss_scale=4.0),
            Adam(net.trainable_params(), 0.01, use_nesterov=True),
            AdamWeightDecay(net.trainable_params(), 0.01, weight_decay=0.01)]
    x = Tensor(np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32))
    grad_fn = minidl.value_and_grad(lambda x: net(x).sum(), None, net.trainable_params())
    for opt in opts:
        for step in range(2):  # the first step also builds the work buffers
            _, grads = grad_fn(x)
            assert isinstance(grads[0].data, cupy_double.ndarray)
            with cupy_double.count_host_syncs() as syncs:
                opt(grads)
            assert syncs.total == 0, f"{type(opt).__name__} step {step}: {syncs.by_reason}"
            assert syncs.uploads == 0, f"{type(opt).__name__} step {step}: {syncs.uploads} uploads"
        assert all(isinstance(v.data, cupy_double.ndarray) for k, v in opt.state_dict().items()
                   if k.startswith(("moment", "vhat", "adam_")))


def test_adam_under_the_distributed_optimizer_equals_one_device():
    assert_data_parallel_equals_one_device(lambda params: Adam(params, 0.01, weight_decay=0.01))


def test_construction_errors():
    p = Parameter(np.ones(2), name="w")
    cases = [
        (lambda: Adam([p], beta1=1.0), ValueError, r"Adam: beta1 must be in the open interval \(0.0, 1.0\), got 1.0"),
        (lambda: Adam([p], beta2=0.0), ValueError, "beta2 must be in the open interval"),
        (lambda: Adam([p], eps=0.0), ValueError, "Adam: eps must be > 0, got 0.0"),
        (lambda: Adam([p], beta1="0.9"), TypeError, "Adam: beta1 must be a float, got '0.9'"),
        (lambda: Adam([p], use_nesterov=1), TypeError, "Adam: use_nesterov must be a bool, got 1"),
        (lambda: Adam([p], use_amsgrad=None), TypeError, "use_amsgrad must be a bool"),
        (lambda: Adam([p], use_locking="no"), TypeError, "use_locking must be a bool"),
        (lambda: Adam([p], use_amsgrad=True, use_nesterov=True), ValueError,
         "use_nesterov=True cannot be combined with use_amsgrad=True"),
        (lambda: Adam([p], use_offload=True), NotImplementedError, "use_offload=True .* is not supported"),
        (lambda: Adam([p], use_lazy=True, use_offload=True), ValueError, "cannot both be True"),
        (lambda: Adam([p], use_lazy=True, use_amsgrad=True), ValueError, "use_amsgrad=True cannot be combined"),
        (lambda: Adam([p], use_fast=True), TypeError, r"unexpected keyword arguments \['use_fast'\]"),
        (lambda: Adam([p], weight_decay=-0.1), ValueError, "Adam: weight_decay must be >= 0"),
        (lambda: Adam([p], loss_scale=0.0), ValueError, "Adam: loss_scale must be a number > 0"),
        (lambda: AdamWeightDecay([p], beta2=1.5), ValueError, "AdamWeightDecay: beta2 must be in the open interval"),
        (lambda: AdamWeightDecay([p], eps=-1e-6), ValueError, "AdamWeightDecay: eps must be > 0"),
        (lambda: AdamWeightDecay([p], learning_rate=-1e-3), ValueError, "learning_rate must be >= 0"),
    ]
    for make, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            make()


def test_bad_gradients_change_nothing():
    params = make_params(0)
    opt = Adam(params, 0.1)
    before = [p.asnumpy().copy() for p in params]
    with pytest.raises(ValueError, match=r"Adam: gradient 1 for parameter 'fc.bias' has shape \(5,\)"):
        opt((Tensor(np.ones((3, 4))), Tensor(np.ones(5)), Tensor(np.ones(()))))
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p.asnumpy(), b)
    assert opt.global_step == 0 and opt.state_dict()["beta1_power"].asnumpy()[0] == 1.0
