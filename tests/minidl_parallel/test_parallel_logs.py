"""Data-parallel training on thread-ranks writes one metrics log: rank 0's, valid JSON lines, one set;
LossMonitor and TimeMonitor say which rank printed each line, or print on rank 0 alone."""
import json
import re

import numpy as np

from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.plot import read_log
from minidl.train import LossMonitor, Model, TimeMonitor
from minidl_parallel import ParallelMode, get_group_size, get_rank, run_threads, set_auto_parallel_context


def _fit(log_file, callbacks=None):
    set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True,
                              parameter_broadcast=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((20, 3)).astype(np.float32)
    y = rng.integers(0, 2, 20).astype(np.int32)
    shards = dict(num_shards=get_group_size(), shard_id=get_rank())
    train = NumpySlicesDataset({"x": x, "y": y}, **shards).batch(4)
    valid = NumpySlicesDataset({"x": x, "y": y}, shuffle=False, shard_mode="exact", **shards).batch(4)
    net = nn.SequentialCell(nn.Dense(3, 4), nn.ReLU(), nn.Dense(4, 2))
    model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
                  nn.Momentum(net.trainable_params(), 0.05, 0.9), metrics={"accuracy", "loss"})
    model.fit(2, train, valid, log_file=log_file, callbacks=callbacks)
    return model.eval(valid)


def _records(path):
    lines = path.read_text().splitlines()
    return [json.loads(line) for line in lines]  # every line is one JSON object


def test_data_parallel_fit_writes_one_valid_log(tmp_path):
    log = tmp_path / "train.jsonl"
    results = run_threads(2, _fit, str(log))
    recs = _records(log)
    # 20 rows, 2 shards of 10, batch 4: 3 steps per epoch, each logged once, then the epoch record.
    assert [(r["epoch"], r["step"], "loss" in r) for r in recs] == [
        (1, 1, True), (1, 2, True), (1, 3, True), (1, 3, False), (2, 4, True), (2, 5, True), (2, 6, True),
        (2, 6, False)]
    # the epoch records hold the whole validation set's metrics, the ones every rank returns
    assert recs[-1]["eval"] == results[0] == results[1]
    steps, losses, evals = read_log(str(log))  # what python -m minidl.plot reads
    assert steps == [1, 2, 3, 4, 5, 6] and len(evals) == 2


def test_a_rank_placeholder_gives_one_log_per_rank(tmp_path):
    run_threads(2, _fit, str(tmp_path / "train.{rank}.jsonl"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.0.jsonl", "train.1.jsonl"]
    for r in range(2):
        assert len(_records(tmp_path / f"train.{r}.jsonl")) == 8


def test_monitors_on_two_thread_ranks_prefix_each_line_with_its_rank(capsys):
    run_threads(2, lambda: _fit(None, [LossMonitor(), TimeMonitor()]))
    lines = capsys.readouterr().out.splitlines()
    # 2 epochs x (3 steps, the evaluation, the epoch time), on each rank
    for r in range(2):
        mine = [line for line in lines if line.startswith(f"[rank {r}] ")]
        assert [re.sub(r"[0-9.]+ ms|loss is \S+|metrics: .*", "_", line) for line in mine] == [
            f"[rank {r}] {what}" for e in (1, 2)
            for what in (f"epoch: {e} step: 1, _", f"epoch: {e} step: 2, _", f"epoch: {e} step: 3, _",
                         f"Eval result: epoch {e}, _", "epoch time: _, per step time: _")]
    assert len(lines) == 20


def test_rank0_only_monitors_print_once_for_the_two_thread_ranks(capsys):
    run_threads(2, lambda: _fit(None, [LossMonitor(rank0_only=True), TimeMonitor(rank0_only=True)]))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 10 and not any("rank" in line for line in lines), lines
    assert [line.split(",")[0] for line in lines[:3]] == ["epoch: 1 step: 1", "epoch: 1 step: 2", "epoch: 1 step: 3"]
