"""Host synchronisations per training step on the GPU path, counted on the device double.

Each one stalls a real GPU's pipeline (issue 16, bug 8): a ResNet-20 step may make at most one
(today: the loss's label range check)."""
import numpy as np
import pytest

import minidl
from minidl import Tensor, backend, nn
from minidl.models.resnet import resnet20
from minidl.optim import Momentum
from minidl.testing import cupy_double


@pytest.fixture
def on_the_double(monkeypatch):
    """minidl's GPU path on the double, also in the normal (CPU) suite; restored afterwards."""
    if backend._cupy and backend._cupy is not cupy_double.cupy_module():
        pytest.skip("a real CuPy is in use: its arrays are not the double's")
    monkeypatch.setattr(backend, "_cupy", cupy_double.cupy_module())
    before = backend.get_device_target()
    backend.set_context("GPU")
    minidl.set_seed(0)
    yield
    backend.set_context(before)


def test_a_resnet20_training_step_syncs_the_host_at_most_once(on_the_double):
    net = resnet20()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = Momentum(net.trainable_params(), 0.01, 0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32))
    y = Tensor(np.array([1, 7], np.int32))
    assert isinstance(x.data, cupy_double.ndarray)  # the step really runs on the (double's) device
    for step in range(2):  # the first step also builds the optimizer's buffers
        with cupy_double.count_host_syncs() as syncs:
            loss, grads = grad_fn(x, y)
            opt(grads)
        assert syncs.total <= 1, f"step {step}: {syncs.by_reason}"
        assert syncs.uploads == 0, f"step {step}: {syncs.uploads} host -> device copies"
    assert np.isfinite(loss.asnumpy())
