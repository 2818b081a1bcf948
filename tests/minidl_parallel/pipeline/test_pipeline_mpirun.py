"""Pipelines whose stages are processes (mpirun): equal to one device, and their faults end the job
naming the stage and the action (tests/mpi/pipeline_train.py)."""
import time

import pytest

from comm.test_mpi import ROOT, mpirun  # tests/minidl_parallel/comm: the suite's mpirun runner

SCRIPT = ROOT / "tests" / "mpi" / "pipeline_train.py"


@pytest.mark.parametrize("n, kind, scheduler", [(2, "resnet", "1f1b"), (4, "gpt", "gpipe")])
def test_a_pipeline_of_processes_trains_as_one_device(n, kind, scheduler):
    proc = mpirun(n, SCRIPT, 180, ["train", kind, scheduler])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r}: ok" for r in range(n)], proc.stdout + proc.stderr


def test_a_pipeline_of_processes_times_data_parallel_trains_as_one_device_over_the_replicas_shards():
    """4 processes: 2 stages x 2 replicas; each stage's gradients averaged over its replicas (a float64 MLP,
    within 1e-10: see tests/mpi/pipeline_train.py)."""
    proc = mpirun(4, SCRIPT, 180, ["train_dp", "mlp64", "1f1b"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r}: ok" for r in range(4)], proc.stdout + proc.stderr


def test_a_stage_that_raises_ends_the_job_naming_the_stage_and_the_action():
    proc = mpirun(2, SCRIPT, 120, ["raise", "mlp", "1f1b"])
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "ValueError: the loss of stage 1 fails on purpose\n(in pipeline stage 1, F1: the forward of micro-batch 1)" \
        in proc.stderr, proc.stderr


def test_a_stage_that_stalls_ends_the_job_within_the_timeout_naming_what_its_neighbour_waits_for():
    start = time.monotonic()
    proc = mpirun(2, SCRIPT, 120, ["stall", "mlp", "1f1b"], MINIDL_COLLECTIVE_TIMEOUT="2")
    assert proc.returncode != 0 and time.monotonic() - start < 50, proc.stdout + proc.stderr
    assert ("minidl_parallel: rank 1 of 2 (mpi backend): recv #0 from rank 0 (tag 2, shape=(10,), dtype=int64) "
            "(pipeline stage 1, F0: the header from stage 0) timed out after 2.0 s; ranks that have not arrived: "
            "[0]") in proc.stderr, proc.stderr


def test_stages_cut_by_shard_strategies_over_processes_train_as_one_device():
    """4 processes: 2 stages of 2 ranks, each stage's Dense layers cut by shard() over its ranks."""
    proc = mpirun(4, ROOT / "tests" / "mpi" / "pipeline_tensor_parallel.py", 180, [])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r}: ok" for r in range(4)], proc.stdout + proc.stderr
