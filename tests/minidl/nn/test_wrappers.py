"""nn.WithLossCell: MindSpore's backbone + loss wrapper trains as Model(net, loss_fn, opt) does."""
import numpy as np
import pytest

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Model


def blobs(n, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = 3.0 * rng.standard_normal((3, 4))[y] + 0.5 * rng.standard_normal((n, 4))
    return x.astype(np.float32), y.astype(np.int32)


def mlp():
    return nn.SequentialCell([nn.Dense(4, 16), nn.ReLU(), nn.Dense(16, 3)])


def ce_loss():
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def momentum(net):
    return nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)


def slices(data, column_names, batch_size):
    return NumpySlicesDataset(data, column_names=column_names, shuffle=False).batch(batch_size)


def _trained(with_wrapper):
    minidl.set_seed(3)
    net = mlp()
    x, y = blobs(n=24)
    ds = slices((x, y), ["x", "y"], 8)
    if with_wrapper:
        wrapped = nn.WithLossCell(net, ce_loss())
        Model(wrapped, None, momentum(wrapped)).train(2, ds)
    else:
        Model(net, ce_loss(), momentum(net)).train(2, ds)
    return {p.name: p.asnumpy() for p in net.trainable_params()}


def test_training_the_wrapper_equals_training_with_loss_fn():
    plain, wrapped = _trained(False), _trained(True)
    assert plain.keys() == wrapped.keys()
    minidl.set_seed(3)
    first = mlp()  # the initial parameters of both runs
    assert any(not np.array_equal(plain[p.name], p.asnumpy()) for p in first.trainable_params())  # it trained
    for name in plain:
        np.testing.assert_array_equal(wrapped[name], plain[name], err_msg=name)


def test_the_wrapper_keeps_the_backbones_names_and_computes_its_loss():
    net, loss = mlp(), ce_loss()
    wrapped = nn.WithLossCell(net, loss)
    assert wrapped.backbone_network is net
    assert [p.name for p in wrapped.trainable_params()] == [p.name for p in net.trainable_params()]
    x, y = blobs(n=8)
    want = loss(net(minidl.Tensor(x)), minidl.Tensor(y)).asnumpy()
    assert np.array_equal(wrapped(minidl.Tensor(x), minidl.Tensor(y)).asnumpy(), want)
    with pytest.raises(TypeError, match="WithLossCell: loss_fn must be a Cell or a callable, got str"):
        nn.WithLossCell(net, "cross_entropy")
    with pytest.raises(TypeError, match="WithLossCell: backbone must be a Cell or a callable, got NoneType"):
        nn.WithLossCell(None, loss)
