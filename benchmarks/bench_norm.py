"""BatchNorm and BatchNorm(+Add)+ReLU in training: minidl's CPU kernels vs PyTorch, per call, per shape.

    python benchmarks/bench_norm.py                      # ResNet-20's three activation shapes, batch 64
    python benchmarks/bench_norm.py --threads 1 --repeats 5
    MINIDL_KERNELS=reference python benchmarks/bench_norm.py     # minidl's reference bodies

Per shape (float32, NCHW, training: batch statistics and the moving-statistic update) and
per case, the forward and the backward time of one call:

- ``bn``: minidl ``ops.BatchNorm`` (its kernel: BatchNormBlocked) / ``F.batch_norm``;
- ``bn+relu``: minidl ``ops.BatchNormReLU`` (BatchNormReLUBlocked) / ``F.relu(F.batch_norm())``;
- ``bn+add+relu``: the same with the residual input / ``F.relu(F.batch_norm() + r)``;
- ``ops: bn,relu`` and ``ops: bn,add,relu`` (minidl only): the separate BatchNorm, Add and ReLU
  ops a user-written model runs eagerly (its time is their sum);

and the memory bound: the bytes the case's passes must move at least (forward: read x for the
statistics, read x (and the residual) and write y; backward: read gy and x (and y for the
ReLU's mask) for the sums, read them again and write gx (and the residual's gradient)),
over the copy bandwidth measured in the same run on an array of that size (a copy split over
the threads; the best of minidl's and PyTorch's, each in its own process). ``x bound`` is
the time over that bound: 1.0 would be a kernel as fast as the memory allows.

Each framework runs in its own worker process that imports only itself (see
benchmarks/bench_train.py: spinning BLAS and OpenMP threads would take the cores from each
other). Each worker times ``--reps`` calls per case and reports the median; the workers
alternate for ``--repeats`` rounds and the best round is kept (another process on the same
cores slows a round, never speeds it up).
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # minidl from this checkout

SHAPES = [(64, 16, 32, 32), (64, 32, 16, 16), (64, 64, 8, 8)]  # ResNet-20's activations at batch 64
FUSED = ["bn", "bn+relu", "bn+add+relu"]  # both frameworks
SEPARATE = ["ops: bn,relu", "ops: bn,add,relu"]  # minidl's separate ops, as a user-written model runs them
# Multiples of the array's bytes each case must move at least: (forward, backward); see the docstring.
BYTES = {"bn": (3, 5), "bn+relu": (3, 7), "bn+add+relu": (4, 8), "ops: bn,relu": (3, 7), "ops: bn,add,relu": (4, 8)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="BLAS / intra-op / PyTorch threads for both frameworks")
    p.add_argument("--reps", type=int, default=30, help="timed calls per case and round (the median is kept)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds of the workers; the best is kept")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args()


args = parse_args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)


# ---- workers: each runs in its own process and prints one JSON line ----

def median_ms(fn, reps):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e3


def time_case(forward, backward, reps):
    """(forward ms, backward ms), medians over ``reps`` forward-then-backward calls, as a training
    step makes them (a backward frees the graph; forwards alone would keep minidl's kernel nodes
    until the garbage collector breaks their reference cycle, and allocate fresh memory)."""
    backward(forward())  # warm: pools, first allocations
    fwd, bwd = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        backward(out)
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    return sorted(fwd)[reps // 2] * 1e3, sorted(bwd)[reps // 2] * 1e3


def minidl_worker():
    import numpy as np
    from minidl import kernels, ops, Tensor
    from minidl.kernels.cpu import threads as intra_op
    from minidl.autograd import run_backward
    results, copies = {}, {}
    for shape in SHAPES:
        rng = np.random.default_rng(0)
        c = shape[1]
        x, gy, r = (rng.normal(1.0, 2.0, shape).astype(np.float32) for _ in range(3))
        tx, tr = Tensor(x, requires_grad=True), Tensor(r, requires_grad=True)
        ts, tb = Tensor(np.ones(c, np.float32), requires_grad=True), Tensor(np.zeros(c, np.float32), requires_grad=True)
        mean, var = Tensor(np.zeros(c, np.float32)), Tensor(np.ones(c, np.float32))

        def fused(residual):
            extra = (tr,) if residual else ()
            return lambda: ops.BatchNormReLU(True, 1e-5, 0.1)(tx, ts, tb, mean, var, *extra)

        def separate(relu, residual):
            def forward():
                y = ops.BatchNorm(True, 1e-5, 0.1)(tx, ts, tb, mean, var)
                y = ops.add(y, tr) if residual else y
                return ops.relu(y) if relu else y
            return forward

        def backward(residual):  # autograd, as torch.autograd.grad: it frees each node once run
            targets = [tx, ts, tb] + ([tr] if residual else [])
            return lambda y: run_backward(y, gy, targets=targets)

        cases = {"bn": (separate(False, False), backward(False)),
                 "bn+relu": (fused(False), backward(False)),
                 "bn+add+relu": (fused(True), backward(True)),
                 "ops: bn,relu": (separate(True, False), backward(False)),
                 "ops: bn,add,relu": (separate(True, True), backward(True))}
        with kernels.tracking() as used:
            results[str(shape)] = {name: time_case(f, b, args.reps) for name, (f, b) in cases.items()}
        out = np.empty_like(x)
        threads = min(intra_op.get_num_threads(), shape[0])
        spans = intra_op.split(shape[0], -(-shape[0] // threads), threads)
        copies[str(shape)] = median_ms(lambda: intra_op.parallel_map(
            lambda t: np.copyto(out[slice(*spans[t])], x[slice(*spans[t])]), len(spans)), args.reps)
    return {"times": results, "copy_ms": copies, "kernels": sorted(k.name for k in used),
            "reference_only": kernels.is_reference_only()}


def pytorch_worker():
    import numpy as np
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    results, copies = {}, {}
    for shape in SHAPES:
        rng = np.random.default_rng(0)
        c = shape[1]
        x, gy, r = (torch.from_numpy(rng.normal(1.0, 2.0, shape).astype(np.float32)) for _ in range(3))
        x.requires_grad_(True), r.requires_grad_(True)
        w, b = torch.ones(c, requires_grad=True), torch.zeros(c, requires_grad=True)
        mean, var = torch.zeros(c), torch.ones(c)
        bn = lambda: F.batch_norm(x, mean, var, w, b, training=True, momentum=0.1, eps=1e-5)  # noqa: E731
        cases = {"bn": (bn, [x, w, b]),
                 "bn+relu": (lambda: F.relu(bn()), [x, w, b]),
                 "bn+add+relu": (lambda: F.relu(bn() + r), [x, w, b, r])}
        results[str(shape)] = {name: time_case(f, lambda y, inputs=inputs: torch.autograd.grad(y, inputs, gy),
                                               args.reps)
                               for name, (f, inputs) in cases.items()}
        src, out = x.detach(), torch.empty(shape)
        copies[str(shape)] = median_ms(lambda: out.copy_(src), args.reps)
    return {"times": results, "copy_ms": copies, "version": torch.__version__}


# ---- driver: imports no framework ----

def run_worker(kind):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", kind, "--threads", str(args.threads),
           "--reps", str(args.reps)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"bench_norm: worker {kind} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def machine():
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


def load_note():
    load, cores = os.getloadavg()[0], len(os.sched_getaffinity(0))
    busy = "" if load < cores + 0.5 else f" (WARNING: above {cores} cores: the figures measure the neighbours too)"
    return f"load average {load:.2f}{busy}"


def best_of(rounds):
    """Per shape and case, the best (forward, backward) over the rounds; the copy times likewise."""
    best = json.loads(json.dumps(rounds[0]))
    for r in rounds[1:]:
        for shape, cases in r["times"].items():
            for name, (f, b) in cases.items():
                bf, bb = best["times"][shape][name]
                best["times"][shape][name] = [min(f, bf), min(b, bb)]
        for shape, ms in r["copy_ms"].items():
            best["copy_ms"][shape] = min(ms, best["copy_ms"][shape])
    return best


def main():
    import importlib.util
    torch_ok = importlib.util.find_spec("torch") is not None
    print(f"machine: {machine()}; threads={args.threads}; median of {args.reps} calls, best of {args.repeats} "
          f"rounds; {load_note()}")
    rounds = {"minidl": [], "pytorch": []}
    for _ in range(args.repeats):
        for kind in rounds if torch_ok else ["minidl"]:
            rounds[kind].append(run_worker(kind))
    ours = best_of(rounds["minidl"])
    theirs = best_of(rounds["pytorch"]) if torch_ok else None
    print(f"minidl kernels: {'reference bodies only' if ours['reference_only'] else ', '.join(ours['kernels'])}; "
          f"PyTorch {theirs['version'] if theirs else 'not installed'}")
    for dims in SHAPES:
        shape, nbytes = str(dims), 4 * dims[0] * dims[1] * dims[2] * dims[3]
        copy_ms = min([ours["copy_ms"][shape]] + ([theirs["copy_ms"][shape]] if theirs else []))
        gbps = 2 * nbytes / copy_ms / 1e6
        print(f"\n{shape} float32, {nbytes / 2 ** 20:.1f} MiB; copy {gbps:.1f} GB/s "
              f"(minidl {2 * nbytes / ours['copy_ms'][shape] / 1e6:.1f}"
              + (f", PyTorch {2 * nbytes / theirs['copy_ms'][shape] / 1e6:.1f}" if theirs else "") + ")")
        print(f"  {'case':18s} {'minidl fwd':>10s} {'bwd':>7s} {'torch fwd':>10s} {'bwd':>7s} {'vs torch':>8s} "
              f"{'bound fwd':>9s} {'bwd':>6s} {'x bound':>8s}")
        for name in FUSED + SEPARATE:
            f, b = ours["times"][shape][name]
            tf, tb = theirs["times"][shape][name] if theirs and name in theirs["times"][shape] else (None, None)
            bf, bb = (k * nbytes / gbps / 1e6 for k in BYTES[name])
            torch_cols = f"{tf:10.3f} {tb:7.3f} {(tf + tb) / (f + b):8.2f}" if tf is not None else f"{'':27s}"
            print(f"  {name:18s} {f:10.3f} {b:7.3f} {torch_cols} {bf:9.3f} {bb:6.3f} {(f + b) / (bf + bb):8.1f}")
    print(f"\n(ms per call; 'vs torch': PyTorch's forward + backward time over minidl's, > 1: minidl faster)\n"
          f"at the end: {load_note()}")


if __name__ == "__main__" and args.worker:
    print(json.dumps(minidl_worker() if args.worker == "minidl" else pytorch_worker()), flush=True)
elif __name__ == "__main__":
    main()
