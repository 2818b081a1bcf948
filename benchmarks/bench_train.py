"""Training-step throughput: minidl vs PyTorch (CPU), same model, same batch, same threads.

    python benchmarks/bench_train.py                  # ResNet-20 twice (ours, user-written), MLP
    python benchmarks/bench_train.py --model resnet20_user --steps 20 --threads 1
    python benchmarks/bench_train.py --model mlp --mode graph   # minidl under set_context(mode=GRAPH_MODE)
    python benchmarks/bench_train.py --model mlp --mode graph --interleave 20   # the two taking turns (below)
    python benchmarks/bench_train.py --model mlp --mode graph --interleave 20 --with-torch   # coexistence (below)

Models: ``resnet20`` is minidl.models.resnet20 (its blocks call the fused
``BatchNorm2d.with_relu``); ``resnet20_user`` the same network written as a user writes it,
with separate Conv2d, BatchNorm2d and ReLU cells (benchmarks/models_minidl.py); both batch 64
on 3x32x32. ``mlp`` is 784-512-512-10 at batch 256. PyTorch 2.13 CPU (``pip install
torch==2.13.0``; skipped when absent) runs the twin of each (benchmarks/models_torch.py).

Per model it prints:
- ms per step and images/s, and the throughput ratio minidl / PyTorch;
- the fraction of the machine's limit: the step's convolution and linear FLOPs (forward and
  backward, counted from the layers by benchmarks/flops.py: 15.62 GFLOP for ResNet-20 at
  batch 64) over the step time, divided by the sgemm rate measured in this run (a 2048^3
  float32 matmul with the same thread count, in NumPy's OpenBLAS and in PyTorch, each in its
  own process; the faster is the limit);
- peak memory: the peak resident set (VmHWM) of the worker after its steps, and its resident
  set after importing its framework, before the model was built.

Every measurement runs in its own worker process that imports only its own framework (the
driver imports neither): in one process the spin-waiting threads of OpenBLAS (NumPy) and
OpenMP (PyTorch) take the cores from each other, and peak memory would mix the two. The
workers alternate for ``--repeats`` rounds; each round reports the median step time of its
``--steps`` steps (a few steps slowed by a neighbour do not move it), and the best round of
each is kept. Finally the framework overhead of one tiny op is printed.

``--interleave BLOCKS`` times the models another way, for ratios on a noisy machine: this
project's machines slow down for seconds at a time, so the best of a few rounds can catch one
framework in a fast second and the other in a slow one, and the ratio moves by 20% from one run
to the next. Here each framework keeps one long-lived worker, and the driver has them take turns:
BLOCKS blocks each, of one untimed step (it wakes the thread pools) and ``--steps`` timed ones,
the order reversed every other block, after a pause of PAUSE_S with every worker idle (so the
other's spinning threads have gone to sleep). Blocks a few tens of milliseconds apart see the
same machine, so the ratio compares like with like. A process can also be slow for its whole
life (where its memory landed), so this is done ``--repeats`` times with fresh workers. It
prints the median over all the blocks of each block's median step (ms/step and the ratio), in
how many blocks minidl was the faster, and each one's fastest block. The order of the workers
rotates by one every block, so each goes first equally often.

``--with-torch`` (with ``--interleave``) measures coexistence with PyTorch in one process: one more
long-lived worker per minidl model imports ``torch`` and runs two tiny torch ops (a matmul and a parallel add, so
PyTorch's MKL and OpenMP runtimes are loaded and their threads started) BEFORE it imports minidl,
then trains exactly as the plain minidl worker: a user's process that loads data, compares
results or a pretrained model with PyTorch looks like this, and whichever runtime loads first
decides which OpenMP and BLAS minidl's native kernels share the cores with. All the workers take
turns in the same blocks. Per model it adds the row ``minidl+torch MODEL`` and prints the
coexistence ratio, the median step with torch imported over the median step without (issue 30
asks for <= 1.10 in both modes), in how many blocks each minidl was the faster, and each one's
ratio to PyTorch. It needs PyTorch installed: ``pip install -e ".[bench]"``.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # minidl from this checkout; HERE is already on the path

# model -> the architecture both frameworks build, its batch and input
MODELS = {
    "resnet20": dict(arch="resnet20", batch=64, input=(3, 32, 32), classes=10),
    "resnet20_user": dict(arch="resnet20", batch=64, input=(3, 32, 32), classes=10),
    "mlp": dict(arch="mlp", batch=256, input=(784,), classes=10),
}
GEMM_REPS = 10
PAUSE_S = 0.02  # --interleave: idle time before each block (OpenMP's spin-waits end within it)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=list(MODELS) + ["all"], default="all",
                   help="all: resnet20, resnet20_user and mlp")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="BLAS / intra-op threads for both frameworks and the sgemm")
    p.add_argument("--repeats", type=int, default=3,
                   help="alternating timing rounds, the best kept (with --interleave: fresh pairs of workers)")
    p.add_argument("--interleave", type=int, default=0, metavar="BLOCKS",
                   help="time the models in BLOCKS alternating blocks of --steps steps, one long-lived worker "
                        "per framework (see above); 0: the --repeats rounds")
    p.add_argument("--with-torch", action="store_true",
                   help="with --interleave: one more minidl worker, in a process that imported torch first (see above)")
    p.add_argument("--mode", choices=["pynative", "graph"], default="pynative",
                   help="minidl's execution mode: set_context(mode=PYNATIVE_MODE or GRAPH_MODE)")
    p.add_argument("--gemm-size", type=int, default=2048, help="n of the n x n x n sgemm that measures the limit")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    parsed = p.parse_args()
    if parsed.with_torch and not parsed.interleave:
        # The rounds' best-of compares luckier seconds, not processes: 20% noise hides a 10% limit.
        p.error("--with-torch needs --interleave BLOCKS (e.g. --interleave 20): the coexistence ratio is "
                "measured in blocks that the workers run in turn")
    return parsed


args = parse_args()
# Thread counts must be fixed before NumPy's BLAS or PyTorch is loaded (in the workers).
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)


# ---- workers: each runs in its own process and prints one JSON line ----

def memory_mib():
    """(resident, peak resident) of this process in MiB: VmRSS and VmHWM from /proc/self/status,
    or (None, ru_maxrss) where there is no /proc."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return None, peak / (1024 * 1024 if sys.platform == "darwin" else 1024)


def step_times(step, x, y, steps):
    """The seconds of each of ``steps`` steps."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - t0)
    return times


def time_steps(step, x, y, steps):
    """The median seconds of ``steps`` steps."""
    times = sorted(step_times(step, x, y, steps))
    return times[len(times) // 2]


def start_torch_first():
    """Imports torch and runs two tiny ops before minidl is imported, as a user's data loading would:
    the matmul loads PyTorch's BLAS (MKL), the add over 2^20 elements (above PyTorch's grain size
    of 32768) starts its OpenMP thread team, so minidl meets both runtimes already running."""
    import torch
    a = torch.ones(64, 64)
    (a @ a).sum().item()
    torch.ones(1 << 20).add_(1.0).sum().item()


def training_setup(framework, model):
    """(step, x, y, resident MiB after the framework's import) of ``model`` in ``framework``
    ("minidl-torch": minidl in a process that started torch first)."""
    import numpy as np
    spec = MODELS[model]
    if framework == "minidl-torch":
        start_torch_first()
    if framework in ("minidl", "minidl-torch"):
        import minidl
        import models_minidl
        minidl.set_context(mode=minidl.GRAPH_MODE if args.mode == "graph" else minidl.PYNATIVE_MODE)
        after_import = memory_mib()[0]
        step, convert = models_minidl.step_fn(model), minidl.Tensor
    else:
        import torch
        import models_torch
        torch.set_num_threads(args.threads)
        after_import = memory_mib()[0]
        step, convert = models_torch.step_fn(spec["arch"]), torch.from_numpy
    rng = np.random.default_rng(0)
    x = convert(rng.standard_normal((spec["batch"],) + spec["input"]).astype(np.float32))
    y = convert(rng.integers(0, spec["classes"], spec["batch"]).astype(np.int64))
    return step, x, y, after_import


def train_worker(framework, model):
    """Times one round of training steps of ``model`` in ``framework``; reports time and memory."""
    step, x, y, after_import = training_setup(framework, model)
    time_steps(step, x, y, args.warmup)
    seconds = time_steps(step, x, y, args.steps)
    return {"seconds": seconds, "peak_mib": memory_mib()[1], "import_mib": after_import}


def serve_blocks(framework, model):
    """--interleave's worker: after the warm-up prints {"ready": true}; then for each line n on
    stdin, one untimed step and n timed ones, printing {"times": [...]}; at the end of stdin,
    returns its memory as train_worker does."""
    step, x, y, after_import = training_setup(framework, model)
    time_steps(step, x, y, args.warmup)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        step(x, y)
        print(json.dumps({"times": step_times(step, x, y, int(line))}), flush=True)
    return {"peak_mib": memory_mib()[1], "import_mib": after_import}


def sgemm_worker(framework):
    """The best GFLOP/s of an n x n x n float32 matmul, n = --gemm-size, on --threads threads."""
    n = args.gemm_size
    if framework == "numpy":
        import numpy as np
        rng = np.random.default_rng(0)
        a, b = rng.random((n, n), dtype=np.float32), rng.random((n, n), dtype=np.float32)
        out = np.empty((n, n), np.float32)
        matmul = lambda: np.matmul(a, b, out=out)  # noqa: E731
    else:
        import torch
        torch.set_num_threads(args.threads)
        a, b, out = torch.rand(n, n), torch.rand(n, n), torch.empty(n, n)
        matmul = lambda: torch.mm(a, b, out=out)  # noqa: E731
    matmul()
    best = float("inf")
    for _ in range(GEMM_REPS):
        t0 = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - t0)
    return {"gflops": 2 * n ** 3 / best / 1e9}


def overhead_worker():
    """The cost of minidl's Python layer around a 1-element NumPy add (printed, not returned)."""
    import numpy as np
    from minidl import ops, Tensor
    a, b = Tensor(np.ones(1, np.float32)), Tensor(np.ones(1, np.float32))
    na, nb = a.data, b.data
    n = 20000

    def timeit(fn):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n * 1e6
    raw = min(timeit(lambda: na + nb) for _ in range(3))
    ours = min(timeit(lambda: ops.add(a, b)) for _ in range(3))
    ar = Tensor(np.ones(1, np.float32), requires_grad=True)
    rec = min(timeit(lambda: ops.add(ar, b)) for _ in range(3))
    return {"line": f"tiny-op overhead: numpy add {raw:.2f} us; minidl ops.add {ours:.2f} us (+{ours - raw:.2f}); "
                    f"recorded for backward {rec:.2f} us (+{rec - raw:.2f})"}


def worker(kind):
    if kind in ("minidl", "minidl-torch", "pytorch"):
        return train_worker(kind, args.model)
    if kind in ("minidl-blocks", "minidl-torch-blocks", "pytorch-blocks"):
        return serve_blocks(kind[:-len("-blocks")], args.model)
    if kind.startswith("sgemm-"):
        return sgemm_worker(kind[len("sgemm-"):])
    if kind == "overhead":
        return overhead_worker()
    raise ValueError(f"bench_train: unknown worker {kind!r}")


# ---- driver: imports no framework ----

def worker_command(kind, model):
    return [sys.executable, os.path.abspath(__file__), "--worker", kind, "--model", model, "--mode", args.mode,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
           "--gemm-size", str(args.gemm_size)]


def run_worker(kind, model="mlp"):
    out = subprocess.run(worker_command(kind, model), capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"bench_train: worker {kind} {model} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def installed(package):
    import importlib.util
    return importlib.util.find_spec(package) is not None


def version(package):
    import importlib.metadata
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine():
    """The CPU's model name and vector extensions (from /proc/cpuinfo), and the cores we may use."""
    name, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    name = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        import platform
        name = platform.processor() or platform.machine()
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{name} ({isa}), {len(os.sched_getaffinity(0))} cores"


def bench(arch, models, torch_ok):
    """Every minidl model of ``arch`` and its PyTorch twin, in alternating rounds (or blocks, with
    --interleave), and the sgemm; one table."""
    runs = [("minidl", m) for m in models] + ([("minidl-torch", m) for m in models] if args.with_torch else []) \
        + ([("pytorch", arch)] if torch_ok else [])
    gemms = ["numpy"] + (["pytorch"] if torch_ok else [])
    gemm = {g: 0.0 for g in gemms}
    if args.interleave:
        results = {}
        for _ in range(args.repeats):  # fresh workers each time: a process can be slow all its life
            for g in gemms:
                gemm[g] = max(gemm[g], run_worker(f"sgemm-{g}")["gflops"])
            for run, r in interleaved(runs).items():
                merged = results.setdefault(run, {"blocks": [], "peak_mib": 0.0, "import_mib": 0.0})
                merged["blocks"] += r["blocks"]
                merged["peak_mib"] = max(merged["peak_mib"], r["peak_mib"])
                merged["import_mib"] = max(merged["import_mib"], r["import_mib"])
        for r in results.values():
            r["seconds"] = statistics.median(r["blocks"])
        print_table(arch, MODELS[models[0]], results, gemm)
        return
    best = {r: {"seconds": float("inf"), "peak_mib": 0.0, "import_mib": 0.0} for r in runs}
    for _ in range(args.repeats):
        for g in gemms:
            gemm[g] = max(gemm[g], run_worker(f"sgemm-{g}")["gflops"])
        for framework, model in runs:
            r, b = run_worker(framework, model), best[(framework, model)]
            b["seconds"] = min(b["seconds"], r["seconds"])
            b["peak_mib"] = max(b["peak_mib"], r["peak_mib"])  # the worst round: memory should not vary
            b["import_mib"] = max(b["import_mib"], r["import_mib"] or 0.0)
    print_table(arch, MODELS[models[0]], best, gemm)


def interleaved(runs):
    """{run: {"blocks", "peak_mib", "import_mib"}}: the median step of each of --interleave blocks
    that each run's long-lived worker ran in turn."""
    import tempfile
    workers = {}
    try:
        for framework, model in runs:
            errors = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty worker cannot block on it
            proc = subprocess.Popen(worker_command(f"{framework}-blocks", model), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=errors, text=True)
            workers[(framework, model)] = (proc, errors)
        for run in runs:
            read_reply(run, workers[run])
        blocks = {run: [] for run in runs}
        for b in range(args.interleave):
            first = b % len(runs)  # rotate: each worker goes first, and in each place, equally often
            for run in runs[first:] + runs[:first]:
                time.sleep(PAUSE_S)
                proc = workers[run][0]
                proc.stdin.write(f"{args.steps}\n")
                proc.stdin.flush()
                blocks[run].append(statistics.median(read_reply(run, workers[run])["times"]))
        out = {}
        for run in runs:
            proc = workers[run][0]
            proc.stdin.close()
            memory = read_reply(run, workers[run])
            proc.wait(timeout=60)
            out[run] = {"blocks": blocks[run], "peak_mib": memory["peak_mib"], "import_mib": memory["import_mib"] or 0.0}
        return out
    finally:
        for proc, errors in workers.values():
            if proc.poll() is None:
                proc.kill()
            errors.close()


def read_reply(run, worker):
    """The next JSON line of a --interleave worker; its stderr in the error when it died."""
    proc, errors = worker
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        errors.seek(0)
        raise RuntimeError(f"bench_train: worker {run[0]} {run[1]} exited ({proc.returncode}):\n{errors.read()}")
    return json.loads(line)


def print_table(arch, spec, results, gemm):
    import flops
    step_flop = flops.step_flops(flops.ARCHITECTURES[arch](), spec["batch"])[1]
    limit = max(gemm.values())
    print(f"\n{arch}, batch {spec['batch']}: conv + linear {step_flop / 1e9:.2f} GFLOP per step (forward + backward); "
          f"sgemm {args.gemm_size}^3 on {args.threads} thread(s): "
          + ", ".join(f"{g} {v:.0f}" for g, v in gemm.items()) + f" GFLOP/s; limit {limit:.0f} GFLOP/s")
    labels = {run: run_label(run, arch) for run in results}
    width = max([22] + [len(label) for label in labels.values()])
    print(f"  {'run':{width}s} {'ms/step':>8s} {'img/s':>8s} {'vs torch':>8s} {'GFLOP/s':>8s} {'of limit':>8s} "
          f"{'peak RSS':>9s} {'at import':>9s}")
    torch_run = results.get(("pytorch", arch), {})
    torch_s = torch_run.get("seconds")
    for (framework, model), b in results.items():
        t = b["seconds"]
        ratio = f"{torch_s / t:8.2f}" if torch_s and framework != "pytorch" else f"{'':8s}"
        print(f"  {labels[(framework, model)]:{width}s} {t * 1e3:8.1f} {spec['batch'] / t:8.1f} {ratio} "
              f"{step_flop / t / 1e9:8.1f} {step_flop / t / 1e9 / limit:8.2f} {b['peak_mib']:5.0f} MiB "
              f"{b['import_mib']:5.0f} MiB", flush=True)
    for (framework, model), b in results.items():
        if framework != "pytorch" and "blocks" in b and "blocks" in torch_run:
            won = sum(m < t for m, t in zip(b["blocks"], torch_run["blocks"]))
            print(f"  {labels[(framework, model)]} was faster than pytorch in {won} of {len(b['blocks'])} blocks; "
                  f"fastest block {min(b['blocks']) * 1e3:.1f} ms against {min(torch_run['blocks']) * 1e3:.1f}")
    for (framework, model), with_torch in results.items():
        if framework == "minidl-torch":
            print_coexistence(model, results[("minidl", model)], with_torch, torch_s)


def run_label(run, arch):
    framework, model = run
    return {"minidl": f"minidl {model}", "minidl-torch": f"minidl+torch {model}"}.get(framework, f"pytorch {arch}")


def print_coexistence(model, alone, with_torch, torch_s):
    """--with-torch: minidl's step with torch imported first over its step without, block by block."""
    ratio = with_torch["seconds"] / alone["seconds"]
    won = sum(w < a for w, a in zip(with_torch["blocks"], alone["blocks"]))
    n = len(alone["blocks"])
    against_torch = (f"; against pytorch {torch_s / alone['seconds']:.2f} without torch, "
                     f"{torch_s / with_torch['seconds']:.2f} with" if torch_s else "")
    print(f"  coexistence, minidl {model} with torch imported first / without: {ratio:.2f} step time "
          f"({with_torch['seconds'] * 1e3:.1f} / {alone['seconds'] * 1e3:.1f} ms; issue 30's limit 1.10: "
          f"{'holds' if ratio <= 1.10 else 'EXCEEDED'}); faster with torch in {won} of {n} blocks, "
          f"without in {n - won}{against_torch}")


def load_note():
    """The 1-minute load average, and a warning when other processes compete for the cores."""
    load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    busy = "" if load < cores + 0.5 else f" (WARNING: above {cores} cores: the figures measure the neighbours too)"
    return f"load average {load:.2f}{busy}"


def schedule():
    if args.interleave:
        return (f"{args.repeats} x {args.interleave} interleaved blocks of {args.steps} steps per framework "
                f"(fresh workers {args.repeats} times), median of the blocks' medians")
    return f"{args.steps} steps per round, best of {args.repeats} rounds"


def main():
    torch_ok = installed("torch")
    if args.with_torch and not torch_ok:
        sys.exit('bench_train: --with-torch needs PyTorch in this environment: pip install -e ".[bench]" '
                 '(torch==2.13.0)')
    print(f"machine: {machine()}; threads={args.threads}; numpy {version('numpy')}; torch {version('torch')}; "
          f"minidl mode {args.mode}; {schedule()}; {load_note()}")
    models = ["resnet20", "resnet20_user", "mlp"] if args.model == "all" else [args.model]
    for arch in dict.fromkeys(MODELS[m]["arch"] for m in models):
        bench(arch, [m for m in models if MODELS[m]["arch"] == arch], torch_ok)
    print("\n" + run_worker("overhead")["line"])
    print(f"at the end: {load_note()}")


if __name__ == "__main__" and args.worker:
    print(json.dumps(worker(args.worker)), flush=True)
elif __name__ == "__main__":
    main()
