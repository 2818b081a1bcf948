"""One writer per log: rank 0 writes the metrics log (or each rank its own with "{rank}"), and
draws the progress bar; the rank is the runtime's when the file opens, not at construction.
The log's two step numbers: the global ``step`` and LossMonitor's ``step_in_epoch``."""
import io
import json
import re

import pytest

from minidl.train import CheckpointConfig, LossMonitor, Model, ModelCheckpoint, ProgressBar, latest_checkpoint
from minidl.train.progress import MetricsLogger

from .helpers import Rank, StopAt, blobs, ce_loss, mlp, momentum, slices


def _train(log_file, **kw):
    x, y = blobs(n=12)
    net = mlp()
    Model(net, ce_loss(), momentum(net)).train(2, slices((x, y), ["x", "y"], 4), log_file=log_file, **kw)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_only_rank_0_writes_the_log(tmp_path):
    log = tmp_path / "train.jsonl"
    with Rank(1):
        _train(log)
    assert not log.exists()
    with Rank(0):
        _train(log)
    assert [(r["epoch"], r["step"]) for r in _records(log)] == [(1, 1), (1, 2), (1, 3), (1, 3), (2, 4), (2, 5),
                                                                (2, 6), (2, 6)]


def test_a_rank_placeholder_gives_each_rank_its_own_file(tmp_path):
    for r in (0, 1):
        with Rank(r):
            _train(str(tmp_path / "train.{rank}.jsonl"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.0.jsonl", "train.1.jsonl"]
    for r in (0, 1):
        assert len(_records(tmp_path / f"train.{r}.jsonl")) == 8


def test_the_rank_is_asked_when_the_file_opens(tmp_path):
    log = tmp_path / "train.jsonl"
    logger = MetricsLogger(log)  # built on rank 0 (the local runtime) ...
    with Rank(1), logger:        # ... but opened on rank 1: it writes nothing
        logger._write({"step": 1})
    assert not log.exists()
    with logger:
        logger._write({"step": 1})
    assert _records(log) == [{"step": 1}]
    assert logger.rank_path(3) is None and MetricsLogger(tmp_path / "{rank}.jsonl").rank_path(3).endswith("3.jsonl")


def test_log_file_must_be_a_path():
    with pytest.raises(TypeError, match="MetricsLogger: path must be a str or a path-like object, got int"):
        MetricsLogger(3)


def test_progress_bar_only_on_rank_0():
    pytest.importorskip("tqdm")
    for r, drawn in ((1, False), (0, True)):
        buf = io.StringIO()
        with Rank(r):
            _train(None, callbacks=ProgressBar(file=buf, refresh_seconds=0))
        assert ("epoch 1/2" in buf.getvalue()) is drawn


def test_log_records_the_global_step_and_loss_monitors_step_in_epoch_also_when_resumed(tmp_path, capsys):
    log = tmp_path / "train.jsonl"
    x, y = blobs(n=12)
    ds = slices((x, y), ["x", "y"], 4)  # 3 steps per epoch
    net = mlp()
    ckpt = ModelCheckpoint("m", str(tmp_path), CheckpointConfig(save_checkpoint_steps=100))
    Model(net, ce_loss(), momentum(net)).train(2, ds, callbacks=[LossMonitor(), ckpt, StopAt(4)], log_file=str(log))
    net = mlp()  # stopped at epoch 2 step 1; resumed from its checkpoint
    Model(net, ce_loss(), momentum(net)).train(2, ds, callbacks=LossMonitor(), log_file=str(log),
                                               resume_from=latest_checkpoint(str(tmp_path), "m"))
    recs = _records(log)
    steps = [r for r in recs if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]  # across epochs (python -m minidl.plot's x axis)
    # within the epoch: the step LossMonitor printed for the same loss
    printed = re.findall(r"epoch: (\d+) step: (\d+), loss is (\S+)", capsys.readouterr().out)
    assert [(str(r["epoch"]), str(r["step_in_epoch"]), str(r["loss"])) for r in steps] == printed
    assert [r["step_in_epoch"] for r in steps] == [1, 2, 3, 1, 2, 3]
    # the records closing an epoch: the steps run in it so far (epoch 2 was stopped after 1, then finished)
    assert [(r["epoch"], r["step"], r["step_in_epoch"]) for r in recs if "epoch_time" in r] == \
        [(1, 3, 3), (2, 4, 1), (2, 6, 3)]
