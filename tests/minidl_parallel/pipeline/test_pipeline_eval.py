"""Model.eval and the LossMonitor through a pipeline: the metrics every rank returns and the loss rank 0
prints are those of one device on the same data."""
import re

import numpy as np
import pytest

import minidl_parallel as mp
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Accuracy, Callback, LossMonitor, Loss, Model, TopKCategoricalAccuracy
from minidl.train.metrics import Metric
from minidl_parallel.nn import PipelineCell
from minidl_parallel.pipeline.evaluation import PipelineEvalCell
from minidl_parallel.pipeline.stage_forward import PipelineError

from . import pipeline_models as models

ROWS = 21  # batches of 8: 8, 8, 5, the last cut into micro-batches of 1, 1, 1 and 2 rows


class _EvalNet(nn.Cell):
    """(loss, logits, label) of a WithLossCell's backbone and loss: what Model's default evaluation returns."""

    def __init__(self, with_loss, hidden=False):
        super().__init__()
        self.backbone, self.loss_fn, self.hidden = with_loss._backbone, with_loss._loss_fn, hidden

    def construct(self, x, y):
        if self.hidden:  # also the first layer's output, which lives on stage 0
            first = self.backbone[0](x)
            return self.loss_fn(self.backbone(x), y), first, y
        logits = self.backbone(x)
        return self.loss_fn(logits, y), logits, y


class _Rows(Metric):
    """The number of rows evaluated: a ratio hides a row counted twice, this does not."""

    def clear(self):
        self._rows = 0

    def update(self, logits, labels):
        self._rows += int(labels.shape[0])

    def statistics(self):
        return np.array([self._rows], dtype=np.float64)

    def finish(self, statistics):
        return int(statistics[0])

    def eval(self):
        return self.finish(self.statistics())


def _metrics():
    return {"acc": Accuracy(), "loss": Loss(), "top2": TopKCategoricalAccuracy(2), "rows": _Rows()}


def _data(kind="mlp"):
    rng = np.random.default_rng(7)
    shape = (ROWS, 6) if kind == "mlp" else (ROWS, 3, 8, 8)
    return rng.standard_normal(shape).astype(np.float32), rng.integers(0, 3, ROWS).astype(np.int32)


def _dataset(drop_remainder=False, kind="mlp", **shards):
    x, y = _data(kind)
    return NumpySlicesDataset({"x": x, "y": y}, shuffle=False, **shards).batch(8, drop_remainder=drop_remainder)


def _one_device(kind="mlp"):
    net = getattr(models, kind)(1)
    return Model(net._backbone, net._loss_fn, metrics=_metrics()).eval(_dataset(kind=kind))


def _pipeline_context(stages, scheduler="1f1b"):
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                 pipeline_config={"pipeline_scheduler": scheduler})


def _pipelined_model(net, micro=4, hidden=False):
    return Model(PipelineCell(net, micro), optimizer=models.optimizer(net), metrics=_metrics(),
                 eval_network=PipelineEvalCell(_EvalNet(net, hidden), micro), eval_indexes=[0, 1, 2])


def _assert_same(got, want):
    assert got.keys() == want.keys() and got["rows"] == want["rows"] == ROWS, (got, want)
    assert got["acc"] == want["acc"] and got["top2"] == want["top2"], (got, want)  # counts: exact
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=0), (got, want)  # float32 means


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
def test_eval_through_two_stages_returns_one_devices_metrics_on_every_rank(scheduler):
    want = _one_device()

    def body():
        _pipeline_context(2, scheduler)
        model = _pipelined_model(models.mlp(2))
        results = model.eval(_dataset())
        # Only the last stage holds the outputs; the batches' forwards sent one activation per micro-batch.
        log = model.eval_network.last_step
        return results, log.count("send", "activation")[0] + log.count("recv", "activation")[0]

    for rank, (got, activations) in enumerate(mp.run_threads(2, body, timeout=120)):
        _assert_same(got, want)
        assert activations == 4, rank  # the last batch, 5 rows in 4 micro-batches


def test_a_resnet_evaluates_through_two_stages_with_its_batchnorm_statistics():
    """BatchNorm in inference mode (its moving statistics: the cut into micro-batches changes nothing)
    and the glue between stages (the stem's with_relu, the global mean) run as in training."""
    want = _one_device("resnet")

    def body():
        _pipeline_context(2, "gpipe")
        return _pipelined_model(models.resnet(2)).eval(_dataset(kind="resnet"))

    for got in mp.run_threads(2, body, timeout=120):
        _assert_same(got, want)


@pytest.mark.parametrize("sharded", [True, False])
def test_eval_through_two_stages_of_two_replicas_counts_every_row_once(sharded):
    """Sharded: replica r (ranks r and 2 + r) reads shard r ("pad" repeats a row, left out); whole:
    both replicas read every row, and replica 0's alone are counted."""
    want = _one_device()

    def body():
        _pipeline_context(2)
        shards = dict(num_shards=2, shard_id=mp.get_rank() % 2) if sharded else {}
        return _pipelined_model(models.mlp(2)).eval(_dataset(**shards))

    for got in mp.run_threads(4, body, timeout=120):
        _assert_same(got, want)


def test_fit_evaluates_the_validation_set_through_the_pipeline():
    want = _one_device()

    def body():
        _pipeline_context(2)
        net = models.mlp(2)
        model = _pipelined_model(net)
        frozen = nn.Momentum(net.trainable_params(), learning_rate=0.0, momentum=0.0)
        model = Model(model.train_network, optimizer=frozen, metrics=_metrics(), eval_network=model.eval_network,
                      eval_indexes=[0, 1, 2])
        seen = []

        class Grab(Callback):
            def on_train_epoch_end(self, run_context):
                seen.append(run_context.original_args().metrics)

        model.fit(1, _dataset(drop_remainder=True), _dataset(), callbacks=Grab())  # (training: whole micro-batches)
        return seen

    for seen in mp.run_threads(2, body, timeout=120):
        assert len(seen) == 1
        _assert_same(seen[0], want)


@pytest.mark.parametrize("rank0_only", [True, False])
def test_the_loss_monitor_prints_the_last_stages_loss_as_one_device_computes_it(capsys, rank0_only):
    """The step's loss is the last stage's sum of the micro-batch losses (MindSpore's PipelineCell),
    broadcast to every stage: rank0_only prints it once; by default the first stage's ranks print it (one
    line per replica, with its rank), not every stage."""
    data = models.batches("mlp", 2, 8)
    xs = np.concatenate([x.asnumpy() for x, _ in data])
    ys = np.concatenate([y.asnumpy() for _, y in data])
    ref_losses, _ = models.reference(models.mlp, data, 4)

    def body():
        _pipeline_context(2)
        net = models.mlp(2)
        dataset = NumpySlicesDataset((xs, ys), column_names=["x", "y"], shuffle=False).batch(8)
        Model(PipelineCell(net, 4), optimizer=models.optimizer(net)).train(
            1, dataset, callbacks=[LossMonitor(rank0_only=rank0_only)])

    capsys.readouterr()
    mp.run_threads(2, body, timeout=120)
    lines = [line for line in capsys.readouterr().out.splitlines() if "loss is" in line]
    want = [f"epoch: 1 step: {k + 1}, loss is {str(loss)}" for k, loss in enumerate(ref_losses)]  # (str: as it prints)
    if rank0_only:
        assert lines == want
    else:
        assert lines == [f"[rank 0] {line}" for line in want]


def test_an_output_of_an_earlier_stage_is_refused_naming_it():
    def body():
        _pipeline_context(2)
        return _pipelined_model(models.mlp(2), hidden=True).eval(_dataset())

    with pytest.raises(PipelineError, match=re.escape("output 1 of the evaluation network is the output of cell "
                                                      "'backbone.0' (Dense), which lives on pipeline stage 0")):
        mp.run_threads(2, body, timeout=60)


def test_shards_that_do_not_match_the_replicas_are_refused_on_every_rank():
    def body():
        _pipeline_context(2)
        return _pipelined_model(models.mlp(2)).eval(_dataset(num_shards=2, shard_id=mp.get_rank()))

    with pytest.raises(ValueError, match=r"num_shards=2 shards, but the eval network PipelineEvalCell runs 1 "
                                         r"data-parallel replica\(s\) of 2 ranks"):
        mp.run_threads(2, body, timeout=60)


def test_stages_of_one_replica_reading_different_shards_are_refused():
    """Stage 0 (ranks 0, 1) reads shard 0 and stage 1 (ranks 2, 3) shard 1: each pipeline would pair one
    shard's data with the other's labels."""
    def body():
        _pipeline_context(2)
        return _pipelined_model(models.mlp(2)).eval(_dataset(num_shards=2, shard_id=mp.get_rank() // 2))

    with pytest.raises(ValueError, match=r"the 2 ranks of each replica must read one shard together .* but "
                                         r"replica 0: shard 0 by 1 rank\(s\), shard 1 by 1 rank\(s\)"):
        mp.run_threads(4, body, timeout=60)


def test_a_metric_without_statistics_is_refused_under_a_pipeline():
    class Median(Accuracy):  # (a metric whose value cannot be finished from sums)
        statistics, finish = Metric.statistics, Metric.finish

    def body():
        _pipeline_context(2)
        net = models.mlp(2)
        model = Model(PipelineCell(net, 2), optimizer=models.optimizer(net), metrics={"median": Median()},
                      eval_network=PipelineEvalCell(_EvalNet(net), 2), eval_indexes=[0, 1, 2])
        return model.eval(_dataset())

    with pytest.raises(TypeError, match=r"metric 'median' \(Median\) cannot be combined over the 2 ranks of an "
                                        r"evaluation whose outputs live on some ranks \(a pipeline's last stage\): it "
                                        r"defines no statistics\(\) and finish\(statistics\) \(see "
                                        r"minidl.train.metrics.Metric\); define them$"):
        mp.run_threads(2, body, timeout=60)


def test_micro_size_and_inputs_are_checked():
    with pytest.raises(ValueError, match=r"micro_size must be an int >= 1, got 0"):
        PipelineEvalCell(models.mlp(1), 0)
    with pytest.raises(TypeError, match=r"network must be a Cell, got int"):
        PipelineEvalCell(3, 2)


def test_the_first_stages_ranks_report_the_loss_one_per_replica():
    from minidl.runtime import get_runtime

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)
        return get_runtime().reports_loss()

    assert mp.run_threads(4, body, timeout=60) == [True, True, False, False]  # (stage 0: ranks 0 and 1)


@pytest.mark.parametrize("dataset_strategy", ["data_parallel", "full_batch"])
def test_eval_through_stages_cut_by_shard_strategies_returns_one_devices_metrics(dataset_strategy):
    """2 stages of 2 ranks, each stage's Dense layers cut by shard(): each last-stage rank keeps the rows it
    was fed (its shard, or with "full_batch" the whole batch, counted once), as a replica would."""
    from .test_pipeline_tensor_parallel import BATCH, COLUMN, ROW
    rng = np.random.default_rng(8)
    x, y = rng.standard_normal((16, 6)), rng.integers(0, 4, 16).astype(np.int32)
    build = lambda stages: models.mlp_cut(stages, (COLUMN, ROW, BATCH, COLUMN))  # noqa: E731

    def dataset(**shards):
        return NumpySlicesDataset({"x": x, "y": y}, shuffle=False, **shards).batch(4)

    one = build(1)
    want = Model(one._backbone, one._loss_fn, metrics=_metrics()).eval(dataset())

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                                     dataset_strategy=dataset_strategy)
        shards = dict(num_shards=2, shard_id=mp.get_rank() % 2) if dataset_strategy == "data_parallel" else {}
        return _pipelined_model(build(2), micro=2).eval(dataset(**shards))

    for rank, got in enumerate(mp.run_threads(4, body, timeout=120)):
        assert got["rows"] == want["rows"] == 16 and got["acc"] == want["acc"] and got["top2"] == want["top2"], rank
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-10, abs=0), (rank, got, want)  # float64


def test_two_replicas_reading_one_shard_are_refused_naming_each_replicas_reads():
    """Each replica's ranks agree on their shard, but both replicas read shard 0: its rows would count twice."""
    def body():
        _pipeline_context(2)
        return _pipelined_model(models.mlp(2)).eval(_dataset(num_shards=2, shard_id=0))

    with pytest.raises(ValueError, match=r"each of the 2 shards one replica, but replica 0: shard 0 by 2 rank\(s\); "
                                         r"replica 1: shard 0 by 2 rank\(s\); pass each rank's replica as shard_id$"):
        mp.run_threads(4, body, timeout=60)


class _Batches:
    """A dataset with only the contract's methods (no num_shards, no padding marks): every rank reads it whole."""

    def __init__(self):
        self.x, self.y = _data()

    def get_col_names(self):
        return ["x", "y"]

    def get_dataset_size(self):
        return 3

    def epoch_iterator(self, epoch, skip_batches=0, output_numpy=False):
        for start in range(8 * skip_batches, ROWS, 8):
            yield self.x[start:start + 8], self.y[start:start + 8]


def test_a_dataset_of_the_contract_alone_is_read_whole_and_counted_once_per_replica():
    want = _one_device()

    def body():
        _pipeline_context(2)
        return _pipelined_model(models.mlp(2)).eval(_Batches())

    for got in mp.run_threads(4, body, timeout=120):
        _assert_same(got, want)
