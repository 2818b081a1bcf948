"""Model.eval under data parallelism returns the whole dataset's metrics on every rank.

Each thread-rank evaluates its shard of 37 rows ("pad" repeats rows to even out the
shards, "exact" does not); the metrics' statistics are added over the ranks, leaving the
padding repeats out, and every rank must return exactly what one process returns on the
whole dataset: accuracy, top-k and the (per-sample) loss, in float64.
"""
import numpy as np
import pytest

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.runtime import Runtime
from minidl.train import Accuracy, Callback, Loss, Metric, Model, TopKCategoricalAccuracy
from minidl_parallel import get_group_size, get_rank, run_threads

F64 = minidl.float64
N_ROWS = 37


def _data(seed=0, classes=4):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N_ROWS, 3))
    y = rng.integers(0, classes, N_ROWS).astype(np.int32)
    return x, y


def _init(seed=3):
    minidl.set_seed(seed)
    return {name: p.data.copy() for name, p in _net().parameters_and_names()}


def _net():
    return nn.SequentialCell(nn.Dense(3, 6, dtype=F64), nn.Tanh(), nn.Dense(6, 4, dtype=F64))


def _model(init):
    net = _net()
    for name, p in net.parameters_and_names():
        p.set_data(init[name].copy())
    metrics = {"accuracy": Accuracy(), "loss": Loss(), "top2": TopKCategoricalAccuracy(2)}
    return Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), metrics=metrics)


def _dataset(x, y, batch, **shards):
    return NumpySlicesDataset({"x": x, "y": y}, shuffle=True, seed=5, **shards).batch(batch)


def _reference(x, y, batch, init):
    """One process, every row once: the values each rank must return."""
    return _model(init).eval(_dataset(x, y, batch))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("mode", ["pad", "exact"])
@pytest.mark.parametrize("batch", [3, 5, 37])
def test_sharded_eval_returns_the_whole_datasets_metrics_on_every_rank(n, mode, batch):
    x, y = _data()
    init = _init()
    want = _reference(x, y, batch, init)

    def rank_body():
        ds = _dataset(x, y, batch, num_shards=get_group_size(), shard_id=get_rank(), shard_mode=mode)
        return _model(init).eval(ds)

    results = run_threads(n, rank_body)
    for rank, got in enumerate(results):
        assert got.keys() == want.keys()
        assert got["accuracy"] == want["accuracy"], (rank, got, want)  # counts: exact
        assert got["top2"] == want["top2"], (rank, got, want)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12, abs=0), (rank, got, want)
        assert all(isinstance(v, float) for v in got.values())


def test_each_rank_alone_would_report_its_shard():
    # The defect this guards against: per-rank values differ from the dataset's.
    x, y = _data()
    init = _init()
    want = _reference(x, y, 37, init)["accuracy"]
    shard_values = [_model(init).eval(_dataset(x, y, 37, num_shards=2, shard_id=k))["accuracy"] for k in range(2)]
    assert any(v != want for v in shard_values)
    assert run_threads(2, lambda: _model(init).eval(
        _dataset(x, y, 37, num_shards=2, shard_id=get_rank()))["accuracy"]) == [want, want]


def test_fit_evaluates_the_sharded_validation_set_as_a_whole():
    x, y = _data()
    init = _init()
    want = _reference(x, y, 4, init)

    class Grab(Callback):
        def on_train_epoch_end(self, run_context):
            seen.append(run_context.original_args().metrics)

    seen = []

    def rank_body():
        model = _model(init)
        frozen = nn.Momentum(model.train_network.trainable_params(), learning_rate=0.0, momentum=0.0)
        model = Model(model.train_network, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), frozen,
                      metrics={"accuracy": Accuracy(), "loss": Loss()})
        shards = dict(num_shards=get_group_size(), shard_id=get_rank())
        model.fit(1, _dataset(x, y, 4, **shards), _dataset(x, y, 4, shard_mode="exact", **shards), callbacks=Grab())
        return True

    run_threads(2, rank_body)
    assert len(seen) == 2
    for got in seen:
        assert got["accuracy"] == want["accuracy"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-12, abs=0)


def test_a_rank_with_an_empty_shard_still_takes_part():
    x, y = _data()
    init = _init()
    want = _model(init).eval(_dataset(x[:2], y[:2], 5))

    def rank_body():
        ds = _dataset(x[:2], y[:2], 5, num_shards=3, shard_id=get_rank(), shard_mode="exact")
        return ds.get_dataset_size(), _model(init).eval(ds)

    results = run_threads(3, rank_body)
    assert [size for size, _ in results] == [1, 1, 0]
    for _, got in results:
        assert got["accuracy"] == want["accuracy"] and got["loss"] == pytest.approx(want["loss"], rel=1e-12)


class _World(Runtime):
    """A fake world of ``size`` ranks seen from rank 0: it records the collectives asked for."""

    def __init__(self, size):
        self.size = size
        self.sums = []

    def rank(self):
        return 0

    def group_size(self):
        return self.size

    def sum_over_ranks(self, values):
        self.sums.append(np.array(values))
        return values


def test_a_dataset_every_rank_reads_whole_is_not_summed():
    x, y = _data()
    init = _init()
    want = _reference(x, y, 5, init)
    with _World(2) as world:
        got = _model(init).eval(_dataset(x, y, 5))
    assert world.sums == [] and got == want


def test_shards_must_match_the_world():
    x, y = _data()
    init = _init()
    with _World(2), pytest.raises(ValueError, match=r"num_shards=3 shards, but the runtime has group_size\(\)=2"):
        _model(init).eval(_dataset(x, y, 5, num_shards=3, shard_id=0))


def test_two_ranks_reading_one_shard_is_an_error_on_every_rank():
    x, y = _data()
    init = _init()

    def rank_body():
        with pytest.raises(ValueError, match=r"each of the 2 shards must be read by exactly one rank.*\[2, 0\]"):
            _model(init).eval(_dataset(x, y, 5, num_shards=2, shard_id=0))
        return True

    assert run_threads(2, rank_body) == [True, True]


class _Median(Metric):
    """A metric without sufficient statistics."""

    def clear(self):
        self.values = []

    def update(self, logits, label):
        self.values += np.abs(logits.asnumpy()).max(axis=1).tolist()

    def eval(self):
        return float(np.median(self.values))


def test_a_metric_without_statistics_refuses_a_sharded_eval_before_any_batch():
    x, y = _data()
    init = _init()
    net = _model(init).train_network
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                  metrics={"median": _Median(), "accuracy": Accuracy()})
    with _World(2) as world, pytest.raises(TypeError, match=r"metric 'median' \(_Median\) cannot be combined over "
                                                            r"the 2 ranks"):
        model.eval(_dataset(x, y, 5, num_shards=2, shard_id=0))
    assert world.sums == []
    # unsharded, it evaluates as before
    with _World(2):
        assert model.eval(_dataset(x, y, 5))["median"] > 0
