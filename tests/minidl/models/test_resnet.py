"""ResNet definitions: shapes, parameter counts (as published), a training step."""
import numpy as np
import pytest

import minidl
from minidl import nn, Tensor
from minidl.models import resnet20, resnet18, resnet50, MLP


def _count(net):
    return sum(p.size for p in net.trainable_params())


@pytest.mark.parametrize("make, params", [(resnet20, 0.27e6), (resnet18, 11.17e6), (resnet50, 23.52e6)])
def test_parameter_counts_match_the_published_models(make, params):
    assert abs(_count(make()) - params) / params < 0.02


def test_resnet20_forward_backward_shapes():
    net = resnet20()
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32))
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    grad_fn = minidl.value_and_grad(lambda a, b: loss_fn(net(a), b), None, net.trainable_params())
    loss, grads = grad_fn(x, Tensor(np.array([1, 7])))
    assert loss.dtype == np.float32 and np.isfinite(loss.item())
    assert len(grads) == len(net.trainable_params())
    for g, p in zip(grads, net.trainable_params()):
        assert g.shape == p.shape and g.dtype == np.float32
    assert any(np.abs(g.asnumpy()).sum() > 0 for g in grads)


@pytest.mark.parametrize("make", [resnet18, resnet50])
def test_large_variants_forward(make):
    net = make()
    net.set_train(False)
    with minidl.no_grad():
        out = net(Tensor(np.zeros((1, 3, 32, 32), np.float32)))
    assert out.shape == (1, 10)


def test_parameter_names_follow_the_cell_tree():
    names = [name for name, _ in resnet20().parameters_and_names()]
    assert names[0] == "conv1.weight"
    assert "layers.1.0.down_sample.0.weight" in names
    assert names[-2:] == ["fc.weight", "fc.bias"]


def test_mlp_shapes_and_errors():
    assert MLP((784, 512, 512, 10))(Tensor(np.zeros((3, 784), np.float32))).shape == (3, 10)
    with pytest.raises(ValueError, match="MLP: sizes needs at least"):
        MLP((5,))
