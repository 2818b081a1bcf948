"""Host synchronisations per training step on the GPU path, counted on the device double.

Each one stalls a real GPU's pipeline (issue 16, bug 8): a ResNet-20 step makes none with
either cross-entropy loss (the label range check is device-side: a bad label gives a NaN loss,
$MINIDL_CHECK_LABELS=1 checks on the host), SyncBatchNorm none (its count is summed on the host:
tests/minidl_parallel/test_sync_batchnorm.py), and Model.train with LossMonitor one per step:
the loss read once, however many callbacks (LossMonitor, the log_file's logger) look at it."""
import numpy as np
import pytest

import minidl
from minidl import Tensor, nn
from minidl.models.resnet import resnet20
from minidl.optim import Momentum
from minidl.testing import cupy_double


LOSSES = {"SoftmaxCrossEntropyWithLogits": lambda: nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
          "CrossEntropyLoss": lambda: nn.CrossEntropyLoss(),
          "CrossEntropyLoss smoothed": lambda: nn.CrossEntropyLoss(label_smoothing=0.1)}


@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_a_resnet20_training_step_never_syncs_the_host(on_the_double, loss_name):
    net = resnet20()
    loss_fn = LOSSES[loss_name]()
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
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                  Momentum(net.trainable_params(), 0.01, 0.9))
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


def test_the_opt_in_label_check_costs_syncs_and_raises_on_the_device(on_the_double, monkeypatch):
    """MINIDL_CHECK_LABELS=1 (read at each call) brings the host check back on the device: it
    names the bad label, at the price of reading the labels' range back every step."""
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    x = Tensor(np.zeros((2, 4), np.float32))
    with cupy_double.count_host_syncs() as syncs:
        loss_fn(x, Tensor(np.array([1, 3], np.int32)))
    assert syncs.by_reason.get("bool", 0) >= 1, syncs.by_reason  # the check really asked the device
    with pytest.raises(ValueError, match=r"SparseSoftmaxCrossEntropyWithLogits: label 4 is out of range for 4 "
                                         r"classes \(expected 0 <= label < 4\)"):
        loss_fn(x, Tensor(np.array([1, 4], np.int32)))
    monkeypatch.delenv("MINIDL_CHECK_LABELS")
    assert np.isnan(loss_fn(x, Tensor(np.array([1, 4], np.int32))).asnumpy())  # default: NaN, no raise


def test_callbacks_reading_the_same_loss_share_one_sync(on_the_double, tmp_path, capsys):
    """LossMonitor and the log_file's MetricsLogger both read each step's loss: one sync, not two."""
    import json
    from minidl.dataset import NumpySlicesDataset
    from minidl.train import LossMonitor, Model
    rng = np.random.default_rng(1)
    data = {"x": rng.standard_normal((8, 5)).astype(np.float32), "y": rng.integers(0, 3, 8).astype(np.int32)}
    net = nn.SequentialCell(nn.Dense(5, 3))
    model = Model(net, nn.CrossEntropyLoss(), Momentum(net.trainable_params(), 0.1, 0.9))
    ds = NumpySlicesDataset(data, column_names=["x", "y"], shuffle=False).batch(2)
    log = tmp_path / "log.jsonl"
    with cupy_double.count_host_syncs() as syncs:
        model.train(1, ds, callbacks=[LossMonitor()], log_file=str(log), progress=False)
    assert syncs.total <= 4, syncs.by_reason  # 4 steps
    printed = [line.rsplit(" ", 1)[1] for line in capsys.readouterr().out.splitlines() if "loss is" in line]
    logged = [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r and "epoch_time" not in r]
    assert len(printed) == len(logged) == 4
    np.testing.assert_allclose([float(p) for p in printed], logged, rtol=1e-6)  # each step's own loss, not a stale one
    assert len(set(logged)) == 4


def test_loss_value_reads_a_device_loss_once_and_never_goes_stale(on_the_double):
    from minidl.train.callbacks import loss_value
    a, b = Tensor(np.float32(1.5)), Tensor(np.float32(2.5))
    with cupy_double.count_host_syncs() as syncs:
        assert loss_value(a) == 1.5 and loss_value((a, None)) == 1.5
    assert syncs.total == 1, syncs.by_reason
    assert loss_value(b) == 2.5 and loss_value(a) == 1.5  # another Tensor: read again
    a.data = Tensor(np.float32(3.5)).data  # the same Tensor with new data: read again
    assert loss_value(a) == 3.5
