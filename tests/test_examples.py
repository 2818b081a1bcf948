"""The README's main example runs as a newcomer would run it (shortened)."""
import json
import os
import subprocess
import sys

import pytest

from cifar_files import write_cifar_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The checkout itself, so the examples import this minidl whether or not it is pip-installed.
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_resnet_cifar_example_runs_and_learns(tmp_path):
    log = tmp_path / "log.jsonl"
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--epochs", "2", "--num-samples", "128",
                          "--batch-size", "16", "--device", "CPU", "--log-file", str(log)], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "synthetic" in lines[0]
    losses = [float(l.split("loss is ")[1]) for l in lines if "loss is" in l]
    assert len(losses) >= 4
    assert losses[-1] < losses[0]
    assert sum("train accuracy:" in l for l in lines) == 1
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 17))  # 128 / 16 = 8 steps, 2 epochs


def test_example_rejects_bad_arguments():
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--batch-size", "0"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--batch-size must be positive" in out.stderr


def test_resnet_cifar_example_reads_cifar_binaries(tmp_path):
    data = tmp_path / "cifar-10-batches-bin"
    write_cifar_batches(data, records_per_file=16)
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--data-path", str(data), "--epochs", "1",
                          "--batch-size", "16", "--device", "CPU", "--ckpt-dir", str(tmp_path / "ckpt")],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "training resnet20 on CIFAR-10 from" in out.stdout.splitlines()[0]
    assert "5 steps per epoch" in out.stdout  # 5 files x 16 records / batch 16
    assert "accuracy" in out.stdout  # the test batch was evaluated
    assert list((tmp_path / "ckpt").glob("resnet20-1_5.ckpt"))


def test_example_reports_a_missing_data_path(tmp_path):
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--data-path", str(tmp_path / "nope")],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "nope" in out.stderr


@pytest.mark.cpu_only  # a fresh process: it would look for the machine's own CuPy, not the device double
def test_gpt_char_example_learns_and_samples():
    out = subprocess.run([sys.executable, "examples/gpt_char.py", "--steps", "40", "--eval-every", "20",
                          "--sample", "20"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    train = [float(l.split("train loss ")[1].split()[0]) for l in out.stdout.splitlines() if "train loss" in l]
    assert len(train) == 3 and train[-1] < train[0] - 0.5  # from ln(56) = 4.0 towards the text's statistics
    sample = out.stdout.split("--- sample ---\n")[1]
    assert sample.startswith("From fairest cre") and len(sample) == 16 + 20 + 1  # prompt, sample, print's newline
