"""Weak scaling of data-parallel training over MPI: N ranks vs 1 process, same batch per rank.

    python benchmarks/bench_scaling.py                          # ResNet-20, batch 64 per rank, 1 vs 2 ranks
    python benchmarks/bench_scaling.py --model mlp --batch 256 --steps 20
    python benchmarks/bench_scaling.py --ranks 2,4 --threads 1  # needs as many cores as ranks to mean much

The driver launches every run itself: the 1-rank baseline as a plain process (no
minidl_parallel, no reducer: what a user runs without parallelism) and each N-rank run as
``mpirun --oversubscribe -n N`` of this file, which trains with ``minidl_parallel.init()``,
``ParallelMode.DATA_PARALLEL`` (gradients_mean=True) and a ``DistributedGradReducer``. Each
rank uses ``--threads`` BLAS threads (default: cores // max ranks, so ranks do not share a core).

It prints the time per step of each run, the part of it spent in the gradient reducer
(pack + all-reduce + mean), and the weak-scaling efficiency t1 / tN: 1.00 means N ranks
process N times the samples in the time one process takes for its own batch. It also runs N
independent 1-process trainings at once (no communication at all): their efficiency is the
most this machine allows (shared caches, memory bandwidth, turbo), so the gap between that
row and the mpirun row is what data parallelism itself costs.

Runs alternate for ``--repeats`` rounds and the best of each is kept: on a small shared
machine the neighbours' load, not the framework, decides the worst rounds. An N-rank step
time is the slowest rank's. As root, OpenMPI's OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM) are set for
the mpirun children.
"""
import argparse
import json
import os
import subprocess
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet20", "mlp"], default="resnet20")
    p.add_argument("--batch", type=int, default=None, help="samples per rank (default 64 for resnet20, 256 for mlp)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ranks", default="2", help="comma-separated rank counts to compare with 1 process")
    p.add_argument("--threads", type=int, default=None, help="BLAS threads per rank (default cores // max ranks)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best is kept")
    p.add_argument("--mpirun", default="mpirun", help="the MPI launcher")
    p.add_argument("--no-independent", dest="independent", action="store_false",
                   help="skip the N independent processes (no communication) that show the machine's own ceiling")
    p.add_argument("--worker", choices=["single", "mpi"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.batch is None:
        args.batch = 64 if args.model == "resnet20" else 256
    args.ranks = [int(r) for r in args.ranks.split(",") if r]
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // max(args.ranks + [1]))
    for name in ("batch", "steps", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    if any(r < 2 for r in args.ranks):
        p.error(f"--ranks must be >= 2 (1 is always the baseline), got {args.ranks}")
    return args


args = parse_args()
# Thread counts must be fixed before NumPy's BLAS is loaded (and OMP_NUM_THREADS being set
# keeps minidl_parallel.init from re-limiting them).
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
INPUTS = {"resnet20": ((3, 32, 32), 10), "mlp": ((784,), 10)}


def worker(mode):
    """Runs one training job (one rank of it under mpirun); rank 0 prints the timings as JSON."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import minidl
    from minidl import nn, Tensor
    from minidl.models import resnet20, MLP

    comm, reducer = None, None
    if mode == "mpi":
        import minidl_parallel as mp
        comm = mp.init("mpi")
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    rank = 0 if comm is None else comm.rank

    minidl.set_seed(0)  # the same initial parameters on every rank, as parameter_broadcast would give
    net = resnet20() if args.model == "resnet20" else MLP((784, 512, 512, 10))
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    if comm is not None:
        reducer = mp.DistributedGradReducer(opt.parameters, mean=True)

    shape, classes = INPUTS[args.model]
    rng = np.random.default_rng(rank)  # each rank its own shard of the global batch
    x = Tensor(rng.standard_normal((args.batch,) + shape).astype(np.float32))
    y = Tensor(rng.integers(0, classes, args.batch).astype(np.int32))
    reduce_time = [0.0]

    def step():
        _, grads = grad_fn(x, y)
        if reducer is not None:
            t = time.perf_counter()
            grads = reducer(grads)
            reduce_time[0] += time.perf_counter() - t
        opt(grads)

    for _ in range(args.warmup):
        step()
    reduce_time[0] = 0.0
    if comm is not None:
        comm.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - t0) / args.steps
    reducing = reduce_time[0] / args.steps
    if comm is not None:
        # A data-parallel step is as slow as its slowest rank.
        seconds = float(comm.allreduce(np.array([seconds]), "max")[0])
        reducing = float(comm.allreduce(np.array([reducing]), "max")[0])
    alone = 0.0
    if comm is not None:
        # The reducer by itself, ranks in step: its share of the in-step time beyond this is
        # waiting for the slower rank (the all-reduce is where ranks meet).
        _, grads = grad_fn(x, y)
        comm.barrier()
        t = time.perf_counter()
        for _ in range(20):
            reducer(grads)
        alone = float(comm.allreduce(np.array([(time.perf_counter() - t) / 20]), "max")[0])
    if rank == 0:
        params = sum(int(np.prod(p.shape)) for p in opt.parameters)
        print(json.dumps({"seconds": seconds, "reduce_seconds": reducing, "reduce_alone": alone, "params": params,
                          "buckets": 0 if reducer is None else len(reducer.buckets)}), flush=True)
    if comm is not None:
        mp.release()


def run_concurrent(n):
    """n independent 1-process runs at once (no communication): the ceiling this machine allows."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "single"] + _worker_opts()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"bench_scaling: {' '.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return max(results, key=lambda r: r["seconds"])


def _worker_opts():
    return ["--model", args.model, "--batch", str(args.batch), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--threads", str(args.threads), "--ranks", ",".join(map(str, args.ranks))]


def run(ranks):
    """One job: 1 plain process, or ``ranks`` ranks under mpirun; returns rank 0's JSON."""
    opts = _worker_opts()
    me = [sys.executable, os.path.abspath(__file__)]
    env = dict(os.environ)
    if ranks == 1:
        cmd = me + ["--worker", "single"] + opts
    else:
        cmd = [args.mpirun, "--oversubscribe", "-n", str(ranks)] + me + ["--worker", "mpi"] + opts
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        raise SystemExit(f"bench_scaling: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    import platform
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; model {args.model}, batch {args.batch} per rank; "
          f"{args.threads} BLAS thread(s) per rank; {args.steps} steps, best of {args.repeats} alternating rounds",
          flush=True)
    counts = [1] + args.ranks
    runs = [(n, "mpi") for n in counts] + ([(n, "independent") for n in args.ranks] if args.independent else [])
    best = {}
    for _ in range(args.repeats):
        for key in runs:
            r = run(key[0]) if key[1] == "mpi" else run_concurrent(key[0])
            if key not in best or r["seconds"] < best[key]["seconds"]:
                best[key] = r
    t1 = best[(1, "mpi")]["seconds"]
    print(f"{'run':>22s} {'global batch':>12s} {'ms/step':>9s} {'reducer ms':>10s} {'alone ms':>8s} {'img/s':>9s} "
          f"{'efficiency':>10s}")
    for n, kind in runs:
        r = best[(n, kind)]
        t = r["seconds"]
        name = "1 process" if n == 1 else (f"{n} ranks (mpirun)" if kind == "mpi" else f"{n} x 1 process, no comm")
        red = (f"{r['reduce_seconds'] * 1e3:10.1f} {r['reduce_alone'] * 1e3:8.2f}" if n > 1 and kind == "mpi"
               else f"{'-':>10s} {'-':>8s}")
        print(f"{name:>22s} {n * args.batch:12d} {t * 1e3:9.1f} {red} {n * args.batch / t:9.1f} {t1 / t:10.2f}")
    r = best[(counts[-1], "mpi")]
    print(f"{r['params']} parameters ({r['params'] * 4 / 2**20:.2f} MB of float32 gradients) in {r['buckets']} "
          f"bucket(s); efficiency = t1 / tN (weak scaling, same batch per rank); reducer ms = time in the reducer "
          f"per step inside training (includes waiting for the slower rank), alone ms = the reducer by itself",
          flush=True)


if __name__ == "__main__" and args.worker:
    worker(args.worker)
elif __name__ == "__main__":
    main()
