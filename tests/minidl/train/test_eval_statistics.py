"""Metrics as sufficient statistics: they add up over parts of a dataset, and Model.eval's
values do not depend on how the dataset is batched or padded."""
import numpy as np
import pytest

from minidl import Tensor
from minidl.dataset import NumpySlicesDataset
from minidl.train import Accuracy, Loss, Metric, Model, TopKCategoricalAccuracy
from minidl.train.metrics import has_statistics

from .helpers import blobs, ce_loss, mlp


def _metrics():
    return {"accuracy": Accuracy(), "loss": Loss(), "top2": TopKCategoricalAccuracy(2)}


def _eval(net, ds):
    return Model(net, ce_loss(), metrics=_metrics()).eval(ds)


def _ds(x, y, batch=None, **kw):
    ds = NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False, **kw)
    return ds if batch is None else ds.batch(batch)


def test_statistics_of_parts_add_up_to_the_whole():
    rng = np.random.default_rng(0)
    logits, labels = rng.standard_normal((10, 4)), rng.integers(0, 4, 10)
    for make in (Accuracy, lambda: TopKCategoricalAccuracy(2)):
        whole, a, b = make(), make(), make()
        whole.update(logits, labels)
        a.update(logits[:3], labels[:3])
        b.update(logits[3:], labels[3:])
        assert has_statistics(whole)
        assert whole.finish(a.statistics() + b.statistics()) == whole.eval()
        assert whole.statistics().dtype == np.float64 and whole.statistics().ndim == 1
    loss = Loss()
    loss.update(np.float64(2.0), rows=3)
    loss.update(np.array([1.0, 5.0]), rows=1)
    assert loss.statistics().tolist() == [9.0, 4.0] and loss.eval() == 9.0 / 4
    with pytest.raises(RuntimeError, match="number of samples is 0"):
        Loss().finish(np.zeros(2))
    with pytest.raises(ValueError, match="rows must be None or an int >= 0"):
        Loss().update(1.0, rows=-1)


def test_a_metric_without_statistics_says_so():
    class Custom(Metric):
        def clear(self):
            pass

    assert not has_statistics(Custom())
    with pytest.raises(NotImplementedError, match="Custom does not define statistics"):
        Custom().statistics()


def test_eval_does_not_depend_on_the_batching():
    # Loss is the mean loss per sample: a smaller last batch weighs by its rows.
    x, y = blobs(n=37)
    net = mlp()
    per_sample = float(ce_loss()(net(Tensor(x)), Tensor(y)).item())
    whole = _eval(net, _ds(x, y, 37))
    for batch in (1, 5, 8):
        got = _eval(net, _ds(x, y, batch))
        assert got["accuracy"] == whole["accuracy"] and got["top2"] == whole["top2"]
        assert got["loss"] == pytest.approx(whole["loss"], rel=1e-6)
    assert whole["loss"] == pytest.approx(per_sample, rel=1e-6)


def test_one_padded_shard_alone_counts_its_real_rows_once():
    x, y = blobs(n=7)
    net = mlp()
    padded = _eval(net, _ds(x, y, 3, num_shards=2, shard_id=1))  # rows 1 3 5, then 0 repeated
    exact = _eval(net, _ds(x, y, 3, num_shards=2, shard_id=1, shard_mode="exact"))
    assert padded == exact
