"""Agreement checks and uneven inputs under real mpirun: every rank raises a message, none crashes or hangs."""
from test_mpirun_training import ROOT, mpirun
import pytest

# mpirun starts fresh processes: they import the machine's own CuPy, not the device double.
pytestmark = pytest.mark.cpu_only


def test_differing_models_and_uneven_data_raise_on_every_rank_under_mpirun():
    proc = mpirun(2, ROOT / "tests" / "mpi" / "agreement_checks.py", timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = proc.stdout.splitlines()
    for r in range(2):
        assert f"rank {r}: ok" in lines, out
        assert any(line.startswith(f"rank {r}: models: raised: DistributedGradReducer") for line in lines), out
        assert any(line.startswith(f"rank {r}: uneven: raised: Model.train") for line in lines), out
        assert f"rank {r}: join: same parameters" in lines, out
    assert "MPI_ERR" not in out
