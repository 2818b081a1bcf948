"""examples/dist_options.py (SINGA's CNN with --dist-option) runs alone and under mpirun, and learns."""
import json
import os
import subprocess
import sys

import pytest

from comm.test_mpi import ROOT, mpirun  # tests/minidl_parallel/comm: the mpirun runner of the suite

EXAMPLE = ROOT / "examples" / "dist_options.py"


def _accuracies(stdout):
    return [float(line.split("test accuracy ")[1].split(",")[0]) for line in stdout.splitlines() if "epoch" in line
            and "test accuracy" in line]


@pytest.mark.cpu_only  # a fresh process: the device double is not installed there
def test_one_process_learns():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("MINIDL_DEVICE", None)
    out = subprocess.run([sys.executable, str(EXAMPLE)], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    accuracies = _accuracies(out.stdout)
    assert len(accuracies) == 3 and accuracies[-1] > 0.9  # chance is 0.1


@pytest.mark.cpu_only
@pytest.mark.parametrize("option,n", [("fp16", 2), ("sparseTopK", 2), ("adasum", 2), ("fp16", 4)])
def test_under_mpirun_every_option_trains_and_reports_its_bytes(option, n, tmp_path):
    summary = tmp_path / "summary.jsonl"
    cmd_args = ["--dist-option", option, "--spars", "0.01", "--summary", str(summary)]
    if n == 4:
        cmd_args += ["--epochs", "1"]  # 4 ranks on 2 cores: one epoch shows the bytes
    proc = _mpirun_with_args(n, cmd_args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(summary.read_text().splitlines()[-1])
    assert result["ranks"] == n and (n == 4 or result["accuracy"] > 0.5)
    fp32_bytes = 4 * sum((20 * 25 + 20, 50 * 20 * 25 + 50, 800 * 500 + 500, 5010))  # the CNN's parameters
    ring = 2 * (n - 1) / n  # of the buffer, per rank, in a ring all-reduce
    ratio = {"fp16": 0.5 * ring, "adasum": (n - 1) / n * n}.get(option)  # adasum: an all-gather of every bucket
    if ratio is not None:
        assert result["bytes_per_step"] == ratio * fp32_bytes
    else:  # top 1% of the entries with their int64 indices, and the counts
        assert 0 < result["bytes_per_step"] < 0.05 * fp32_bytes


def _mpirun_with_args(n, args):
    """mpirun of the example with arguments (the suite's runner takes a script only)."""
    script = ROOT / "tests" / "mpi" / "run_dist_options.py"
    return mpirun(n, script, 300, DIST_OPTIONS_ARGS=json.dumps(args))


@pytest.mark.cpu_only
def test_under_the_launcher_without_mpirun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MINIDL_DEVICE"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run([sys.executable, "-m", "minidl_parallel.run", "--allow-run-as-root", "-n", "2", "--log-dir",
                          str(tmp_path / "logs"), str(EXAMPLE), "--dist-option", "partialUpdate", "--threshold",
                          "100000", "--epochs", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "partialUpdate on 2 rank(s)" in out.stdout and "epoch 1: loss" in out.stdout  # rank 0, streamed
    assert "epoch 1: loss" in (tmp_path / "logs" / "rank.0" / "stdout").read_text()
    assert (tmp_path / "logs" / "rank.1" / "stdout").exists()  # rank 1 prints nothing of its own here
