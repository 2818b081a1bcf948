"""examples/resnet_cifar.py under real mpirun: one valid metrics log, its summary printed once,
explicit shards, and evaluation over the whole test set on every rank."""
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: cifar_files
from cifar_files import write_cifar_batches  # noqa: E402
from test_mpirun_training import ROOT, mpirun  # noqa: E402

from minidl.plot import read_log  # noqa: E402
import pytest

# mpirun starts fresh processes: they import the machine's own CuPy, not the device double.
pytestmark = pytest.mark.cpu_only

EXAMPLE = ROOT / "examples" / "resnet_cifar.py"


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]  # each line one JSON object


def test_resnet_example_under_mpirun_writes_one_log_and_one_summary(tmp_path):
    log = tmp_path / "log.jsonl"
    proc = mpirun(2, EXAMPLE, "--epochs", "1", "--num-samples", "64", "--batch-size", "16", "--device", "CPU",
                  "--log-file", log, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # 64 samples, explicitly sharded in 2 shards of 32, batch 16: 2 steps per rank.
    assert out.count("data parallel on 2 ranks: batch 16 per rank, global batch 32") == 1
    assert out.count("2 steps per epoch") == 1 and out.count("synthetic") == 1
    # The example prints everything from rank 0 only (its monitors have rank0_only=True): unprefixed.
    assert out.count("epoch: 1 step: 1, loss is") == 1 and out.count("epoch: 1 step: 2, loss is") == 1
    assert out.count("epoch time:") == 1 and "[rank" not in out
    assert out.count("train accuracy:") == 1
    assert [(r["epoch"], r["step"], "loss" in r) for r in _records(log)] == [(1, 1, True), (1, 2, True),
                                                                              (1, 2, False)]
    steps, losses, _ = read_log(str(log))  # python -m minidl.plot accepts it
    assert steps == [1, 2]


def test_resnet_example_under_mpirun_evaluates_the_whole_test_set_on_every_rank(tmp_path):
    data = tmp_path / "cifar-10-batches-bin"
    write_cifar_batches(data, records_per_file=16)  # 80 training images, 16 test images (8 per rank)
    logs = tmp_path / "logs"
    logs.mkdir()
    proc = mpirun(2, EXAMPLE, "--data-path", data, "--epochs", "1", "--batch-size", "8", "--device", "CPU",
                  "--log-file", logs / "train.{rank}.jsonl", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.count("5 steps per epoch") == 1  # 80 images, 2 shards of 40, batch 8
    evals = re.findall(r"Eval result: epoch 1, metrics: (.*)", out)
    assert len(evals) == 1  # rank 0 prints it (every rank computed the same, whole-set, value: the logs below)
    recs = [_records(logs / f"train.{r}.jsonl") for r in range(2)]
    assert sorted(p.name for p in logs.iterdir()) == ["train.0.jsonl", "train.1.jsonl"]
    assert all(len(r) == 6 for r in recs) and recs[0][-1]["eval"] == recs[1][-1]["eval"]
