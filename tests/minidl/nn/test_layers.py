"""Layers: forward against NumPy references with the layers' own parameters, gradients through
check_op, initialisation, modes and error messages."""
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl
from minidl import Tensor, nn, ops
from minidl.testing import check_op
from minidl.testing.strategies import arrays, distinct_arrays


def _bind(cell, **tensors):
    """Points the cell's parameter attributes at the given tensors for one call.

    check_op differentiates with respect to its own input Tensors, so the layer must read
    those rather than its Parameters; Cell.__setattr__ refuses a plain Tensor in a Parameter
    slot (on purpose), hence object.__setattr__ here.
    """
    for name, t in tensors.items():
        object.__setattr__(cell, name, t)
    return cell


def f32(a):
    return Tensor(np.asarray(a, np.float32))


# -- Dense -----------------------------------------------------------------------------

_ACT = {None: lambda y: y, "relu": lambda y: np.maximum(y, 0), "tanh": np.tanh,
        "sigmoid": lambda y: 1 / (1 + np.exp(-y)),
        "softmax": lambda y: np.exp(y - y.max(-1, keepdims=True)) / np.exp(y - y.max(-1, keepdims=True)).sum(-1, keepdims=True)}


@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), cin=st.integers(1, 4), cout=st.integers(1, 4),
       has_bias=st.booleans(), act=st.sampled_from(sorted(_ACT, key=str)), data=st.data())
def test_dense_forward_matches_numpy(lead, cin, cout, has_bias, act, data):
    x = data.draw(arrays(tuple(lead) + (cin,)))
    w = data.draw(arrays((cout, cin)))
    b = data.draw(arrays((cout,)))
    dense = nn.Dense(cin, cout, weight_init=w, bias_init=b if has_bias else None, has_bias=has_bias, activation=act,
                     dtype=np.float64)
    y = dense(Tensor(x))
    expected = _ACT[act](x @ w.T + (b if has_bias else 0))
    assert y.shape == expected.shape and y.dtype == np.float64
    np.testing.assert_allclose(y.asnumpy(), expected, rtol=1e-10, atol=1e-12)


@settings(max_examples=6)
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), cin=st.integers(1, 3), cout=st.integers(1, 3),
       data=st.data())
def test_dense_gradients(lead, cin, cout, data):
    x = data.draw(arrays(tuple(lead) + (cin,)))
    w = data.draw(arrays((cout, cin)))
    b = data.draw(arrays((cout,)))
    dense = nn.Dense(cin, cout, activation="tanh")
    check_op(lambda x, w, b: _bind(dense, weight=w, bias=b)(x), [x, w, b],
             reference=lambda x, w, b: np.tanh(x @ w.T + b))


def test_dense_parameters_and_default_init():
    dense = nn.Dense(100, 50)
    assert [n for n, _ in dense.parameters_and_names()] == ["weight", "bias"]
    assert dense.weight.shape == (50, 100) and dense.bias.shape == (50,)
    assert dense.weight.dtype == np.float32 and dense.weight.requires_grad
    # HeUniform(sqrt(5)) and the default bias both are U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
    bound = 1 / math.sqrt(100)
    w, b = dense.weight.asnumpy(), dense.bias.asnumpy()
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
    assert np.abs(b).max() <= bound
    np.testing.assert_allclose(w.std(), bound / math.sqrt(3), rtol=0.05)
    assert nn.Dense(3, 2, has_bias=False).bias is None
    assert [p.name for p in nn.Dense(3, 2, has_bias=False).trainable_params()] == ["weight"]


def test_dense_init_is_seeded():
    minidl.set_seed(7)
    a = nn.Dense(4, 3).weight.asnumpy()
    minidl.set_seed(7)
    np.testing.assert_array_equal(a, nn.Dense(4, 3).weight.asnumpy())


def test_dense_named_initializers_and_activation_cell():
    dense = nn.Dense(3, 2, weight_init="ones", bias_init="zeros", activation=nn.Tanh())
    assert "activation" in dense.name_cells()
    y = dense(f32([[0.1, 0.2, 0.3]]))
    np.testing.assert_allclose(y.asnumpy(), np.tanh([[0.6, 0.6]]), rtol=1e-6)
    assert "input_channels=3, output_channels=2, has_bias=True" in repr(dense)


def test_dense_errors():
    dense = nn.Dense(3, 2)
    with pytest.raises(ValueError, match=r"Dense: input of shape \(4, 5\) must have its last dimension equal to "
                                         r"in_channels=3"):
        dense(f32(np.ones((4, 5))))
    with pytest.raises(ValueError, match=r"Dense: weight_init has shape \(3, 2\), expected \(2, 3\)"):
        nn.Dense(3, 2, weight_init=np.ones((3, 2)))
    with pytest.raises(ValueError, match="Dense: in_channels must be a positive int, got 0"):
        nn.Dense(0, 2)
    with pytest.raises(ValueError, match="Dense: unknown activation 'swishy'"):
        nn.Dense(3, 2, activation="swishy")
    with pytest.raises(TypeError, match="Dense: activation must be None, a str or a Cell, got int"):
        nn.Dense(3, 2, activation=3)


# -- Conv2d ----------------------------------------------------------------------------

def _same_pads(size, k, s, d):
    out = -(-size // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
    return total // 2, total - total // 2


def conv_ref(x, w, stride, pads, dilation, group):
    """Direct NCHW convolution (cross-correlation) with (top, bottom, left, right) padding."""
    x = np.pad(x, ((0, 0), (0, 0), (pads[0], pads[1]), (pads[2], pads[3])))
    n, _, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (dh, dw) = stride, dilation
    ho, wo = (h - (kh - 1) * dh - 1) // sh + 1, (wd - (kw - 1) * dw - 1) // sw + 1
    og = o // group
    out = np.zeros((n, o, ho, wo))
    for g in range(group):
        xs, ws = x[:, g * cg:(g + 1) * cg], w[g * og:(g + 1) * og]
        for i in range(kh):
            for j in range(kw):
                patch = xs[:, :, i * dh:i * dh + sh * (ho - 1) + 1:sh, j * dw:j * dw + sw * (wo - 1) + 1:sw]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch, ws[:, :, i, j])
    return out


@st.composite
def conv_cases(draw):
    group = draw(st.sampled_from([1, 1, 2]))
    cin, cout = group * draw(st.integers(1, 2)), group * draw(st.integers(1, 2))
    k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    dilation = (draw(st.integers(1, 2)), 1)
    pad_mode = draw(st.sampled_from(["valid", "same", "pad"]))
    padding = draw(st.integers(0, 1)) if pad_mode == "pad" else 0
    h = draw(st.integers((k[0] - 1) * dilation[0] + 1, 6))
    w = draw(st.integers(k[1], 6))
    has_bias = draw(st.booleans())
    return dict(cin=cin, cout=cout, k=k, stride=stride, dilation=dilation, pad_mode=pad_mode, padding=padding,
                group=group, hw=(h, w), has_bias=has_bias)


@given(case=conv_cases(), data=st.data())
def test_conv2d_forward_matches_numpy(case, data):
    c = case
    x = data.draw(arrays((2, c["cin"]) + c["hw"]))
    w = data.draw(arrays((c["cout"], c["cin"] // c["group"]) + c["k"]))
    b = data.draw(arrays((c["cout"],)))
    conv = nn.Conv2d(c["cin"], c["cout"], c["k"], stride=c["stride"], pad_mode=c["pad_mode"], padding=c["padding"],
                     dilation=c["dilation"], group=c["group"], has_bias=c["has_bias"], weight_init=w,
                     bias_init=b if c["has_bias"] else None, dtype=np.float64)
    if c["pad_mode"] == "same":
        pads = _same_pads(c["hw"][0], c["k"][0], c["stride"][0], c["dilation"][0]) + \
            _same_pads(c["hw"][1], c["k"][1], c["stride"][1], c["dilation"][1])
    else:
        pads = (c["padding"],) * 4
    expected = conv_ref(x, w, c["stride"], pads, c["dilation"], c["group"])
    if c["has_bias"]:
        expected = expected + b[None, :, None, None]
    y = conv(Tensor(x))
    assert y.shape == expected.shape
    np.testing.assert_allclose(y.asnumpy(), expected, rtol=1e-10, atol=1e-10)


def test_conv2d_gradients():
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((1, 2, 4, 4)), rng.standard_normal((2, 1, 3, 3)), rng.standard_normal(2)
    conv = nn.Conv2d(2, 2, 3, stride=1, pad_mode="pad", padding=1, group=2, has_bias=True)
    check_op(lambda x, w, b: _bind(conv, weight=w, bias=b)(x), [x, w, b],
             reference=lambda x, w, b: conv_ref(x, w, (1, 1), (1,) * 4, (1, 1), 2) + b[None, :, None, None])


def test_conv2d_parameters_and_defaults():
    conv = nn.Conv2d(4, 6, 3, group=2)
    assert conv.pad_mode == "same" and not conv.has_bias and conv.bias is None  # MindSpore defaults
    assert [n for n, _ in conv.parameters_and_names()] == ["weight"]
    assert conv.weight.shape == (6, 2, 3, 3)
    bound = 1 / math.sqrt(2 * 3 * 3)
    assert np.abs(conv.weight.asnumpy()).max() <= bound
    y = conv(f32(np.ones((1, 4, 5, 5))))
    assert y.shape == (1, 6, 5, 5) and y.dtype == np.float32
    with_bias = nn.Conv2d(4, 6, (1, 3), has_bias=True, weight_init="he_normal")
    assert [n for n, _ in with_bias.parameters_and_names()] == ["weight", "bias"]
    assert with_bias.weight.shape == (6, 4, 1, 3)
    assert "kernel_size=(1, 3)" in repr(with_bias)


def test_conv2d_errors():
    with pytest.raises(ValueError, match="Conv2d: in_channels=3 and out_channels=4 must both be divisible by group=2"):
        nn.Conv2d(3, 4, 3, group=2)
    with pytest.raises(ValueError, match="Conv2d: padding=1 needs pad_mode='pad', got pad_mode='same'"):
        nn.Conv2d(3, 4, 3, padding=1)
    with pytest.raises(ValueError, match="Conv2d: pad_mode must be one of"):
        nn.Conv2d(3, 4, 3, pad_mode="full")
    with pytest.raises(ValueError, match="Conv2d: kernel_size must be a positive int or a pair"):
        nn.Conv2d(3, 4, 0)
    with pytest.raises(ValueError, match=r"Conv2d: input of shape \(1, 2, 5, 5\) must be \(N, C, H, W\) with "
                                         r"C = in_channels = 3"):
        nn.Conv2d(3, 4, 3)(f32(np.ones((1, 2, 5, 5))))


# -- BatchNorm -------------------------------------------------------------------------

def bn_ref(x, gamma, beta, mean, var, eps=1e-5):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return gamma.reshape(shape) * (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) + beta.reshape(shape)


def _batch_stats(x):
    axes = (0,) + tuple(range(2, x.ndim))
    n = x.size // x.shape[1]
    var = x.var(axis=axes)
    return x.mean(axis=axes), var, var * n / max(n - 1, 1)


@given(shape=st.sampled_from([(2, 3, 2, 2), (3, 1, 1, 2), (4, 2, 3, 1)]), data=st.data())
def test_batchnorm2d_training_and_inference(shape, data):
    x = data.draw(arrays(shape))
    gamma, beta = data.draw(arrays((shape[1],), 0.5, 2.0)), data.draw(arrays((shape[1],)))
    bn = nn.BatchNorm2d(shape[1], gamma_init=gamma, beta_init=beta, dtype=np.float64).set_train()
    mean, var, unbiased = _batch_stats(x)
    y = bn(Tensor(x))
    np.testing.assert_allclose(y.asnumpy(), bn_ref(x, gamma, beta, mean, var), rtol=1e-8, atol=1e-8)
    # MindSpore momentum: moving = 0.9 * moving + 0.1 * batch (the variance tracked unbiased).
    np.testing.assert_allclose(bn.moving_mean.asnumpy(), 0.1 * mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(bn.moving_variance.asnumpy(), 0.9 + 0.1 * unbiased, rtol=1e-10)
    mm, mv = bn.moving_mean.asnumpy().copy(), bn.moving_variance.asnumpy().copy()
    bn.set_train(False)
    y = bn(Tensor(x))
    np.testing.assert_allclose(y.asnumpy(), bn_ref(x, gamma, beta, mm, mv), rtol=1e-8, atol=1e-8)
    np.testing.assert_array_equal(bn.moving_mean.asnumpy(), mm)  # inference does not track


def test_batchnorm_use_batch_statistics_overrides_mode():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3, 2, 2)) * 3 + 1
    always = nn.BatchNorm2d(3, use_batch_statistics=True, momentum=0.5, dtype=np.float64)  # inference mode
    mean, var, _ = _batch_stats(x)
    np.testing.assert_allclose(always(Tensor(x)).asnumpy(), bn_ref(x, np.ones(3), np.zeros(3), mean, var), rtol=1e-8)
    np.testing.assert_allclose(always.moving_mean.asnumpy(), 0.5 * mean, rtol=1e-10)
    never = nn.BatchNorm2d(3, use_batch_statistics=False, dtype=np.float64).set_train()
    np.testing.assert_allclose(never(Tensor(x)).asnumpy(), x / np.sqrt(1 + 1e-5), rtol=1e-10)
    np.testing.assert_array_equal(never.moving_mean.asnumpy(), np.zeros(3))


def test_batchnorm_gradients_in_training():
    rng = np.random.default_rng(2)
    x, gamma, beta = rng.standard_normal((3, 2, 2, 2)), rng.uniform(0.5, 2, 2), rng.standard_normal(2)
    bn = nn.BatchNorm2d(2).set_train()

    def fn(x, g, b, mm, mv):
        return _bind(bn, gamma=g, beta=b, moving_mean=mm, moving_variance=mv)(x)

    def ref(x, g, b, mm, mv):
        mean, var, _ = _batch_stats(x)
        return bn_ref(x, g, b, mean, var)

    check_op(fn, [x, gamma, beta, np.zeros(2), np.ones(2)], reference=ref, positions=[0, 1, 2],
             fwd_rtol=1e-8, fwd_atol=1e-8)


def test_batchnorm_parameters():
    bn = nn.BatchNorm2d(4)
    assert [n for n, _ in bn.parameters_and_names()] == ["moving_mean", "moving_variance", "gamma", "beta"]
    assert [p.name for p in bn.trainable_params()] == ["gamma", "beta"]
    assert [p.name for p in bn.untrainable_params()] == ["moving_mean", "moving_variance"]
    np.testing.assert_array_equal(bn.moving_variance.asnumpy(), np.ones(4))
    assert bn.trainable_params()[0].dtype == np.float32
    frozen = nn.BatchNorm2d(4, affine=False)
    assert frozen.trainable_params() == []


def test_batchnorm1d():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3))
    bn = nn.BatchNorm1d(3, dtype=np.float64).set_train()
    mean, var, _ = _batch_stats(x)
    np.testing.assert_allclose(bn(Tensor(x)).asnumpy(), bn_ref(x, np.ones(3), np.zeros(3), mean, var), rtol=1e-8)
    x3 = rng.standard_normal((2, 3, 4))
    mean, var, _ = _batch_stats(x3)
    np.testing.assert_allclose(bn(Tensor(x3)).asnumpy(), bn_ref(x3, np.ones(3), np.zeros(3), mean, var), rtol=1e-8)
    with pytest.raises(ValueError, match=r"BatchNorm1d: input of shape \(5, 3, 2, 2\) must be \(N, C\) or "
                                         r"\(N, C, L\) with C = num_features = 3"):
        bn(Tensor(np.ones((5, 3, 2, 2))))


def test_batchnorm_errors():
    with pytest.raises(ValueError, match=r"BatchNorm2d: input of shape \(2, 3, 4, 4\) must be \(N, C, H, W\) with "
                                         r"C = num_features = 4"):
        nn.BatchNorm2d(4)(f32(np.ones((2, 3, 4, 4))))
    with pytest.raises(ValueError, match=r"BatchNorm2d: momentum must be in \[0, 1\]"):
        nn.BatchNorm2d(4, momentum=1.5)
    with pytest.raises(ValueError, match="BatchNorm2d: eps must be a positive number"):
        nn.BatchNorm2d(4, eps=0)


# -- pooling, activations, flatten, dropout, identity ----------------------------------

def pool_ref(x, k, s, reduce):
    n, c, h, w = x.shape
    ho, wo = (h - k[0]) // s[0] + 1, (w - k[1]) // s[1] + 1
    out = np.empty((n, c, ho, wo))
    for i in range(ho):
        for j in range(wo):
            out[:, :, i, j] = reduce(x[:, :, i * s[0]:i * s[0] + k[0], j * s[1]:j * s[1] + k[1]], axis=(2, 3))
    return out


@given(k=st.integers(1, 3), s=st.integers(1, 3), hw=st.tuples(st.integers(3, 6), st.integers(3, 6)), data=st.data())
def test_pooling_forward(k, s, hw, data):
    x = data.draw(distinct_arrays((2, 2) + hw))
    np.testing.assert_allclose(nn.MaxPool2d(k, s)(Tensor(x)).asnumpy(), pool_ref(x, (k, k), (s, s), np.max))
    np.testing.assert_allclose(nn.AvgPool2d((k, 1), (s, 1))(Tensor(x)).asnumpy(),
                               pool_ref(x, (k, 1), (s, 1), np.mean), rtol=1e-12)
    # 'same' reaches the primitive with the layer's configuration.
    same = nn.MaxPool2d(k, s, pad_mode="same")(Tensor(x))
    assert same.shape == (2, 2, -(-hw[0] // s), -(-hw[1] // s))
    np.testing.assert_array_equal(same.asnumpy(), ops.MaxPool(k, s, "same")(Tensor(x)).asnumpy())


def test_pooling_errors():
    with pytest.raises(ValueError, match=r"MaxPool2d: pad_mode must be one of \('valid', 'same', 'pad'\), "
                                         r"got 'full'"):
        nn.MaxPool2d(2, 2, pad_mode="full")
    with pytest.raises(ValueError, match=r"AvgPool2d: input of shape \(2, 3\) must be \(N, C, H, W\)"):
        nn.AvgPool2d(2)(f32(np.ones((2, 3))))


@given(x=distinct_arrays((3, 4)))
def test_activation_cells(x):
    t = Tensor(x)
    np.testing.assert_allclose(nn.ReLU()(t).asnumpy(), np.maximum(x, 0))
    np.testing.assert_allclose(nn.Sigmoid()(t).asnumpy(), 1 / (1 + np.exp(-x)), rtol=1e-12)
    np.testing.assert_allclose(nn.Tanh()(t).asnumpy(), np.tanh(x), rtol=1e-12)
    for axis in (-1, 0):
        e = np.exp(x - x.max(axis, keepdims=True))
        np.testing.assert_allclose(nn.Softmax(axis)(t).asnumpy(), e / e.sum(axis, keepdims=True), rtol=1e-12)
        np.testing.assert_allclose(nn.LogSoftmax(axis)(t).asnumpy(), np.log(e / e.sum(axis, keepdims=True)),
                                   rtol=1e-12, atol=1e-12)


def test_get_activation():
    assert isinstance(nn.get_activation("ReLU"), nn.ReLU)
    assert isinstance(nn.get_activation("log_softmax"), nn.LogSoftmax)
    assert nn.get_activation(None) is None
    with pytest.raises(ValueError, match="get_activation: unknown activation 'gelu2'; expected one of 'relu'"):
        nn.get_activation("gelu2")


def test_flatten():
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    assert nn.Flatten()(Tensor(x)).shape == (2, 60)
    np.testing.assert_array_equal(nn.Flatten()(Tensor(x)).asnumpy(), x.reshape(2, 60))
    assert nn.Flatten(0, 1)(Tensor(x)).shape == (6, 4, 5)
    assert nn.Flatten(2, 3)(Tensor(x)).shape == (2, 3, 20)
    np.testing.assert_array_equal(nn.Flatten(1, 2)(Tensor(x)).asnumpy(), x.reshape(2, 12, 5))
    with pytest.raises(ValueError, match="Flatten: start_dim=3 and end_dim=1 do not select"):
        nn.Flatten(3, 1)(Tensor(x))


def test_dropout_inference_is_identity_and_training_drops():
    x = Tensor(np.ones((200, 50), np.float32))
    drop = nn.Dropout(p=0.2)
    assert drop.keep_prob == pytest.approx(0.8)
    assert drop(x) is x  # a new Cell is in inference mode
    drop.set_train()
    y = drop(x).asnumpy()
    kept = y != 0
    assert 0.75 < kept.mean() < 0.85
    np.testing.assert_allclose(y[kept], 1 / 0.8, rtol=1e-6)  # survivors scaled by 1 / keep_prob
    assert y.dtype == np.float32
    drop.set_train(False)
    assert drop(x) is x
    # keep_prob (MindSpore 1.x) works too, and p takes precedence over it.
    assert nn.Dropout(keep_prob=0.3).keep_prob == pytest.approx(0.3)
    assert nn.Dropout(keep_prob=0.3, p=0.5).keep_prob == pytest.approx(0.5)
    assert nn.Dropout(p=0.0).set_train()(x) is x


def test_dropout_gradient_uses_the_same_mask():
    drop = nn.Dropout(p=0.5).set_train()
    x = Tensor(np.ones((20, 20), np.float32), requires_grad=True)
    y = drop(x)
    y.sum().backward()
    np.testing.assert_allclose(x.grad.asnumpy(), y.asnumpy())  # gradient = mask / keep_prob = y for x = 1


def test_dropout_errors():
    with pytest.raises(ValueError, match=r"Dropout: p \(the drop probability\) must be in \[0, 1\), got 1"):
        nn.Dropout(p=1)
    with pytest.raises(ValueError, match=r"Dropout: keep_prob must be in \(0, 1\], got 0"):
        nn.Dropout(keep_prob=0)


def test_identity():
    x = f32([1.0, 2.0])
    assert nn.Identity()(x) is x


def test_small_network_trains_in_both_modes():
    """Conv -> BN -> ReLU -> pool -> Flatten -> Dropout -> Dense: gradients reach every parameter."""
    net = nn.SequentialCell(nn.Conv2d(1, 2, 3, has_bias=True), nn.BatchNorm2d(2), nn.ReLU(), nn.MaxPool2d(2, 2),
                            nn.Flatten(), nn.Dropout(p=0.1), nn.Dense(8, 3))
    assert [p.name for p in net.trainable_params()] == ["0.weight", "0.bias", "1.gamma", "1.beta", "6.weight",
                                                        "6.bias"]
    x = f32(np.random.default_rng(0).standard_normal((4, 1, 4, 4)))
    net.set_train()
    _, grads = minidl.value_and_grad(lambda x: net(x).sum(), None, net.trainable_params())(x)
    assert all(g.shape == p.shape for g, p in zip(grads, net.trainable_params()))
    assert np.abs(grads[0].asnumpy()).sum() > 0
    assert np.abs(net[1].moving_mean.asnumpy()).sum() > 0  # training tracked statistics
    net.set_train(False)
    np.testing.assert_array_equal(net(x).asnumpy(), net(x).asnumpy())  # inference is deterministic
