"""Host synchronisations per training step on the GPU path, counted on the device double.

Each one stalls a real GPU's pipeline (issue 16, bug 8): a ResNet-20 step makes none (the
loss's label range check is device-side: a bad label gives a NaN loss, $MINIDL_CHECK_LABELS=1
checks on the host), SyncBatchNorm none (its count is summed on the host), and Model.train
with LossMonitor one per step: LossMonitor reading the loss."""
import numpy as np
import pytest

import minidl
from minidl import Tensor, nn
from minidl.models.resnet import resnet20
from minidl.optim import Momentum
from minidl.testing import cupy_double


def test_a_resnet20_training_step_never_syncs_the_host(on_the_double):
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
        assert syncs.total == 0, f"step {step}: {syncs.by_reason}"
        assert syncs.uploads == 0, f"step {step}: {syncs.uploads} host -> device copies"
    assert np.isfinite(loss.asnumpy())


def test_model_train_with_loss_monitor_syncs_once_per_step(on_the_double, capsys):
    """LossMonitor reads each step's loss (and checks it is finite): the one sync a step makes."""
    from minidl.dataset import NumpySlicesDataset
    from minidl.train import LossMonitor, Model
    rng = np.random.default_rng(0)
    data = {"image": rng.standard_normal((8, 3, 8, 8)).astype(np.float32),
            "label": rng.integers(0, 10, 8).astype(np.int32)}
    net = nn.SequentialCell(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dense(4 * 8 * 8, 10))
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), Momentum(net.trainable_params(), 0.01, 0.9))
    ds = NumpySlicesDataset(data, column_names=["image", "label"], shuffle=False).batch(2)
    model.train(1, ds, callbacks=[LossMonitor()], progress=False)  # the first run builds buffers
    with cupy_double.count_host_syncs() as syncs:
        model.train(1, ds, callbacks=[LossMonitor()], progress=False)
    assert syncs.total <= 4, syncs.by_reason  # 4 steps
    assert capsys.readouterr().out.count("loss is") == 8


def test_a_bad_label_on_the_gpu_stops_training_with_a_hint(on_the_double):
    from minidl.dataset import NumpySlicesDataset
    from minidl.train import LossMonitor, Model
    net = nn.SequentialCell(nn.Dense(3, 4))
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                  Momentum(net.trainable_params(), 0.01, 0.9))
    ds = NumpySlicesDataset({"x": np.ones((2, 3), np.float32), "y": np.array([1, 9], np.int32)}, shuffle=False)
    with pytest.raises(ValueError, match=r"Invalid loss nan, terminating training\. On the GPU a class label outside "
                                         r"\[0, classes\) also gives a NaN loss .* MINIDL_CHECK_LABELS=1"):
        model.train(1, ds.batch(2), callbacks=[LossMonitor()], progress=False)
