"""The benchmarks run end to end, tiny (the figures are not checked, only that the scripts run
and report): bench_train.py's two schedules (PyTorch joins where installed) and its coexistence
run (--with-torch), and bench_step_ab.py's A/B, in a change of each kind."""
import importlib.util
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
TORCH = importlib.util.find_spec("torch") is not None
# Fresh processes on the CPU: under MINIDL_TEST_DEVICE they would look for the machine's own CuPy.
pytestmark = pytest.mark.cpu_only


def run_script(name, *arguments):
    out = subprocess.run([sys.executable, os.path.join(BENCHMARKS, name), *arguments], capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


def run_bench(*extra):
    return run_script("bench_train.py", "--model", "mlp", "--mode", "graph", "--steps", "2", "--warmup", "1",
                      "--repeats", "1", "--threads", "1", "--gemm-size", "64", *extra)


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


@pytest.mark.skipif(not TORCH, reason='--with-torch needs PyTorch: pip install -e ".[bench]"')
def test_bench_train_with_torch_adds_the_worker_that_imported_torch_and_the_coexistence_ratio():
    text = run_bench("--interleave", "3", "--with-torch")
    rows = [line.split() for line in text.splitlines()
            if line.strip().startswith(("minidl mlp", "minidl+torch mlp", "pytorch mlp")) and "was faster" not in line]
    assert [r[0] for r in rows] == ["minidl", "minidl+torch", "pytorch"]
    assert all(float(r[2]) > 0 for r in rows)  # ms/step
    won = [line for line in text.splitlines() if "was faster than pytorch in" in line]
    assert [line.split()[0] for line in won] == ["minidl", "minidl+torch"]
    coexistence = [line for line in text.splitlines() if line.strip().startswith("coexistence, minidl mlp")]
    assert len(coexistence) == 1 and "of 3 blocks" in coexistence[0]
    # The ratio is the with-torch median step over the plain one (both printed, to 0.1 ms).
    ratio, with_torch, alone = re.search(r": ([\d.]+) step time \(([\d.]+) / ([\d.]+) ms", coexistence[0]).groups()
    # Each printed step is rounded to 0.05 ms at most, the ratio to 0.005: the quotient of the
    # printed steps is off by at most 0.05 * (1 + ratio) / (alone - 0.05), plus the ratio's own rounding.
    quotient, alone = float(with_torch) / float(alone), float(alone)
    assert float(ratio) == pytest.approx(quotient, abs=0.006 + 0.05 * (1 + quotient) / (alone - 0.05))


@pytest.mark.parametrize("problem, message", [
    ("no torch", 'pip install -e ".[bench]"'),
    ("no --interleave", "--with-torch needs --interleave BLOCKS"),
])
def test_bench_train_with_torch_refuses_what_it_cannot_measure(problem, message):
    # sys.modules["torch"] = None makes torch look absent to the script (find_spec returns None),
    # so the message is checked where torch is installed too; the script stops before any worker.
    arguments = ["--model", "mlp", "--with-torch"] + (["--interleave", "2"] if problem == "no torch" else [])
    hide_torch = "sys.modules['torch'] = None; " if problem == "no torch" else ""
    code = (f"import runpy, sys; {hide_torch}sys.argv = ['bench_train.py'] + {arguments!r}; "
            f"runpy.run_path({os.path.join(BENCHMARKS, 'bench_train.py')!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode != 0 and message in out.stderr, out.stderr


@pytest.mark.parametrize("change", [("--change", "none"), ("--change", "dense"), ("--option", "buffer_pool=False")])
def test_bench_step_ab_prints_both_variants_and_their_ratio(change):
    text = run_script("bench_step_ab.py", *change, "--model", "mlp", "--mode", "graph", "--rounds", "1",
                      "--steps", "2", "--warmup", "1", "--threads", "1")
    a = [line for line in text.splitlines() if line.startswith("A  minidl:")]
    b = [line for line in text.splitlines() if line.startswith("B  ")]
    assert len(a) == len(b) == 1 and "ms/step" in b[0]
    # paired steps of one process (each of these changes; --env runs processes of their own)
    assert all(re.search(r"ms/step \(median\), \d+ minor page faults per step$", line) for line in a + b)
    assert any(line.startswith("A is ") and "as fast as B" in line for line in text.splitlines())
