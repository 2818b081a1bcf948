"""benchmarks/bench_train.py's two schedules run end to end (tiny: the figures are not checked,
only that each schedule's workers start, answer and report; PyTorch joins where installed)."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_train.py")
TORCH = importlib.util.find_spec("torch") is not None


def run_bench(*extra):
    cmd = [sys.executable, SCRIPT, "--model", "mlp", "--mode", "graph", "--steps", "2", "--warmup", "1",
           "--repeats", "1", "--threads", "1", "--gemm-size", "64", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("schedule", ["rounds", "interleave"])
def test_bench_train_prints_each_framework_row(schedule):
    extra = ("--interleave", "3") if schedule == "interleave" else ()
    text = run_bench(*extra)
    expected = "1 x 3 interleaved blocks of 2 steps" if extra else "2 steps per round, best of 1 rounds"
    assert expected in text
    rows = [line.split() for line in text.splitlines()
            if line.strip().startswith(("minidl mlp", "pytorch mlp")) and "was faster" not in line]
    assert [r[0] for r in rows] == (["minidl", "pytorch"] if TORCH else ["minidl"])
    assert all(float(r[2]) > 0 for r in rows)  # ms/step
    if extra and TORCH:
        won = [line for line in text.splitlines() if "was faster than pytorch in" in line]
        assert len(won) == 1 and "of 3 blocks; fastest block" in won[0]
