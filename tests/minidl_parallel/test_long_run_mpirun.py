"""What held before the reliability work, kept with a test: 6,000 data-parallel steps under
mpirun (timeouts on) leak no thread and no memory, and leave the ranks bit-identical."""
import re

from test_mpirun_training import ROOT, mpirun
import pytest

# mpirun starts fresh processes: they import the machine's own CuPy, not the device double.
pytestmark = pytest.mark.cpu_only

STEPS = 6000


def test_6000_data_parallel_steps_leak_nothing_and_keep_the_ranks_identical():
    proc = mpirun(2, ROOT / "tests" / "mpi" / "long_run.py", STEPS, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = re.findall(r"^rank (\d): threads (\d+) -> (\d+), rss_growth_mb ([0-9.-]+), identical (\w+)$",
                       proc.stdout, re.M)
    assert sorted(int(r) for r, *_ in lines) == [0, 1], out
    for rank, before, after, growth, identical in lines:
        assert before == after, f"rank {rank} leaked threads: {before} after epoch 1, {after} at the end"
        # Peak RSS after 5,950 more steps: a leak of even 1 KB per step would show as ~6 MB.
        assert float(growth) < 4.0, f"rank {rank}: peak memory grew {growth} MB"
        assert identical == "True", out
