"""Tensor parallelism under real mpirun (mpi backend): random chains and the quickstart example."""
import json
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_mpirun_training import ROOT, mpirun  # noqa: E402
from test_equivalence import chains  # noqa: E402

# mpirun starts fresh processes: they import the machine's own CuPy, not the device double.
pytestmark = pytest.mark.cpu_only


@pytest.mark.parametrize("n", [4, 8])
@settings(max_examples=1, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_random_chains_equal_single_device_under_mpirun(n, data, tmp_path_factory):
    cases = [data.draw(chains(worlds=(n,)))[1:] for _ in range(6)]
    path = tmp_path_factory.mktemp("chains") / "cases.json"
    path.write_text(json.dumps(cases))
    proc = mpirun(n, ROOT / "tests" / "mpi" / "tensor_parallel_chain.py", path, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == \
        [f"rank {r}: ok" for r in range(n)]


def _losses(text):
    return [float(v) for v in re.findall(r"loss is ([-0-9.e]+)", text)]


def test_quickstart_example_under_mpirun_8_equals_single_device():
    single = mpirun(1, ROOT / "examples" / "parallel_quickstart.py", "--single", timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    ref = _losses(single.stdout)
    assert len(ref) == 20  # 5 epochs of 4 steps
    proc = mpirun(8, ROOT / "examples" / "parallel_quickstart.py", "--explain", timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = _losses(proc.stdout)
    assert len(got) == 8 * 20  # every rank prints every step
    by_step = sorted(zip(re.findall(r"epoch: (\d+) step: (\d+), loss is", proc.stdout), got))
    for (_, value), expected in zip(by_step, [v for v in ref for _ in range(8)]):
        assert abs(value - expected) <= 1e-4 * max(1.0, abs(expected))
    assert "dense1.matmul" in proc.stdout and "((2, 4), (4, 1))" in proc.stdout


def test_megatron_example_under_mpirun_equals_one_process_with_one_allreduce_per_block():
    single = mpirun(1, ROOT / "examples" / "megatron_mlp.py", "--steps", "3", timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    proc = mpirun(2, ROOT / "examples" / "megatron_mlp.py", "--steps", "3", timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ref = _losses(single.stdout)
    got = _losses(proc.stdout)
    assert len(ref) == 3 and len(got) == 6
    for step, expected in enumerate(ref):
        values = [float(v) for v in re.findall(rf"rank \d: step {step + 1}, loss is ([-0-9.e]+)", proc.stdout)]
        assert len(values) == 2 and all(abs(v - expected) <= 1e-5 * max(1.0, abs(expected)) for v in values)
    # 2 blocks: one all-reduce per block in forward; in backward one per block whose input needs a gradient.
    assert "collectives per step: 2 all-reduce(s) in forward, 1 in backward, 3 in all (2 blocks, 2-way" in proc.stdout


def test_megatron_gpt_example_under_mpirun_equals_one_process_with_the_analytical_collectives():
    single = mpirun(1, ROOT / "examples" / "megatron_gpt.py", "--steps", "2", timeout=120)
    assert single.returncode == 0, single.stdout + single.stderr
    proc = mpirun(2, ROOT / "examples" / "megatron_gpt.py", "--steps", "2", timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ref = _losses(single.stdout)
    assert len(ref) == 2 and len(_losses(proc.stdout)) == 4
    for step, expected in enumerate(ref):
        values = [float(v) for v in re.findall(rf"rank \d: step {step + 1}, loss is ([-0-9.e]+)", proc.stdout)]
        assert len(values) == 2 and all(abs(v - expected) <= 1e-5 * max(1.0, abs(expected)) for v in values)
    assert ("collectives per step (2 blocks, 2-way tensor parallel): 8 in forward (analytical 8), "
            "10 in backward (analytical 10)") in proc.stdout
