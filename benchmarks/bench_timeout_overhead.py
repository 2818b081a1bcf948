"""What the collective timeout and MINIDL_DIST_DEBUG cost a data-parallel training step (mpi backend).

    python benchmarks/bench_timeout_overhead.py                      # MLP, 2 ranks, Model's overlapped path
    python benchmarks/bench_timeout_overhead.py --path blocking      # reducer(grads): blocking all-reduces
    python benchmarks/bench_timeout_overhead.py --model conv --batch 32 --rounds 10 --steps 30

The driver starts ``mpirun --oversubscribe -n RANKS`` of this file (as root it sets
OMPI_ALLOW_RUN_AS_ROOT(_CONFIRM)). Each rank trains one small network with a
``DistributedGradReducer`` and times single steps in rounds, switching the communicator's
settings between rounds (both ranks switch together; the settings are plain attributes read
on every collective, so one process and one network serve every variant):

    on     the defaults: timeout 600 s, stall warning 60 s (the bounded waits)
    off    timeout 0 and stall warning 0: the plain blocking MPI calls (the watchdog thread is
           stopped, so its idle cost is measured too)
    dbg1   "on" plus MINIDL_DIST_DEBUG=1 (a fingerprint allgather_object before every collective)
    dbg2   "on" plus MINIDL_DIST_DEBUG=2 (the same with the call site in the fingerprint)

Rounds are PAIRED: a round runs ``--steps`` steps of every variant, interleaved step by step
(on, off, dbg1, dbg2, then reversed, rotating), so a neighbour that slows the machine for a
while slows every variant of the round alike: on this 2-vCPU VM whole rounds of steps ran 2x
slower at times, which made the ratio of two rounds run one after the other range over
0.3-3.4 for A against A. Each step starts after an untimed barrier, so no step's time holds
the tail of its neighbour (of another variant). A step's time is the slowest rank's (a
data-parallel step is as slow as its slowest rank; the per-step maxima are taken after the
round, outside the timing).
Printed: each variant's median step time over all rounds; for each variant against "off"
(or "on" for the debug levels) the median of the per-round ratios of median step times, with
its min, max and interquartile range; and the debug levels' cost per collective (their extra
time per step divided by the collectives per step). An "on" against "on" pair (--aa) shows
the harness's own spread.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import time

VARIANTS = ("on", "off", "dbg1", "dbg2")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["mlp", "conv"], default="mlp",
                   help="mlp: 784-512-512-10 (2.6 MB of gradients); conv: a small CNN on 3x32x32")
    p.add_argument("--batch", type=int, default=None, help="samples per rank (default 128 for mlp, 32 for conv)")
    p.add_argument("--path", choices=["overlap", "blocking"], default="overlap",
                   help="overlap: Model.train's step (reducer.ready during backward, then finish: iallreduce_); "
                        "blocking: reducer(grads) after backward (allreduce_)")
    p.add_argument("--fusion-kb", type=int, default=None,
                   help="the reducer's bucket size in KiB (default the reducer's 25 MiB: one bucket)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=30, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per variant before the rounds")
    p.add_argument("--variants", default="on,off,dbg1,dbg2", help=f"comma-separated, from {','.join(VARIANTS)}")
    p.add_argument("--aa", action="store_true", help="also an on/on pair (two copies of 'on'): the harness's spread")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank")
    p.add_argument("--mpirun", default="mpirun")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.batch is None:
        args.batch = 128 if args.model == "mlp" else 32
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad or not args.variants:
        p.error(f"--variants: expected names from {VARIANTS}, got {args.variants}")
    if args.aa:
        args.variants.append("on2")
    for name in ("batch", "rounds", "steps", "ranks", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be positive, got {getattr(args, name)}")
    return args


args = parse_args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def conv_net(nn):
    return nn.SequentialCell([
        nn.Conv2d(3, 16, 3, pad_mode="same"), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Conv2d(16, 32, 3, pad_mode="same"), nn.ReLU(), nn.MaxPool2d(2, 2),
        nn.Flatten(), nn.Dense(32 * 8 * 8, 128), nn.ReLU(), nn.Dense(128, 10)])


def worker():
    """One rank: trains, times the variants in paired rounds; rank 0 prints the results as JSON."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import minidl
    from minidl import nn, Tensor
    from minidl.models import MLP
    import minidl_parallel as mp
    from minidl_parallel.comm.base import DEFAULT_STALL_WARNING_S, DEFAULT_TIMEOUT_S
    try:
        from minidl_parallel.comm.mpi import _get_watchdog as watchdog_of_this_process, stop_watchdog
    except ImportError:  # a version without the watchdog (polled non-blocking collectives)
        watchdog_of_this_process = stop_watchdog = lambda: None

    os.environ.pop("MINIDL_DIST_DEBUG", None)
    comm = mp.init("mpi", timeout=DEFAULT_TIMEOUT_S, stall_warning=DEFAULT_STALL_WARNING_S)
    minidl.set_seed(0)  # the same initial parameters on every rank
    net = MLP((784, 512, 512, 10)) if args.model == "mlp" else conv_net(nn)
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    kwargs = {} if args.fusion_kb is None else {"fusion_bytes": args.fusion_kb * 1024}
    reducer = mp.DistributedGradReducer(opt.parameters, mean=True, **kwargs)
    shape = (784,) if args.model == "mlp" else (3, 32, 32)
    rng = np.random.default_rng(comm.rank)  # each rank its own shard
    x = Tensor(rng.standard_normal((args.batch,) + shape).astype(np.float32))
    y = Tensor(rng.integers(0, 10, args.batch).astype(np.int32))
    forward = lambda x, y: loss_fn(net(x), y)  # noqa: E731
    if args.path == "overlap":  # what Model.train runs: buckets start during backward
        grad_fn = minidl.value_and_grad(forward, None, opt.parameters, on_grad_ready=reducer.ready)

        def step():
            grad_fn(x, y)
            opt(reducer.finish())
    else:
        grad_fn = minidl.value_and_grad(forward, None, opt.parameters)

        def step():
            _, grads = grad_fn(x, y)
            opt(reducer(grads))

    settings = {"on": (DEFAULT_TIMEOUT_S, DEFAULT_STALL_WARNING_S, 0), "on2": (DEFAULT_TIMEOUT_S,
                DEFAULT_STALL_WARNING_S, 0), "off": (0.0, 0.0, 0),
                "dbg1": (DEFAULT_TIMEOUT_S, DEFAULT_STALL_WARNING_S, 1),
                "dbg2": (DEFAULT_TIMEOUT_S, DEFAULT_STALL_WARNING_S, 2)}

    def use(variant):
        comm.timeout, comm.stall_warning, comm.debug = settings[variant]
        # "off" runs without the watchdog thread (it would otherwise idle on, answering
        # questions 20 times a second); the others get it here, not inside a timed step.
        if comm.timeout or comm.stall_warning:
            watchdog_of_this_process()
        else:
            stop_watchdog()

    for variant in args.variants:
        use(variant)
        for _ in range(args.warmup):
            step()
    use("on")
    before = comm.collective_count
    step()
    per_step = comm.collective_count - before
    times = {v: [] for v in args.variants}  # [round][step]
    for r in range(args.rounds):
        steps = {v: np.empty(args.steps) for v in args.variants}
        use("on")
        comm.barrier()
        for i in range(args.steps):
            # The variants alternate step by step, in an order that rotates and reverses, so
            # each step of one has neighbours of the others on both sides.
            k = (i + r) % len(args.variants)
            order = args.variants[k:] + args.variants[:k]
            for variant in (order[::-1] if i % 2 else order):
                # An untimed barrier first: without it a step's time would include waiting for
                # the other rank to finish the previous step, so one variant's cost would leak
                # into its neighbours' times (it hid a 1.2x slowdown as 1.04x).
                use("off")
                comm.barrier()
                use(variant)
                t = time.perf_counter()
                step()
                steps[variant][i] = time.perf_counter() - t
        use("off")  # the gathering below is not timed and needs no bound
        for variant in args.variants:
            times[variant].append(comm.allreduce(steps[variant], "max").tolist())
    use("on")
    # A single collective alone, to cost the machinery per collective: a 4-byte all-reduce,
    # the variants alternating in 10 rounds of 1000 calls, the median round of each kept.
    small = np.ones(1, dtype=np.float32)
    alone_rounds = {v: [] for v in ("on", "off", "dbg1", "dbg2")}
    for r in range(10):
        for variant in (("on", "off", "dbg1", "dbg2") if r % 2 else ("dbg2", "dbg1", "off", "on")):
            use(variant)
            comm.barrier()
            t = time.perf_counter()
            for _ in range(1000):
                comm.allreduce_(small)
            elapsed = (time.perf_counter() - t) / 1000
            use("off")
            alone_rounds[variant].append(float(comm.allreduce(np.array([elapsed]), "max")[0]))
    alone = {v: float(np.median(t)) for v, t in alone_rounds.items()}
    if comm.rank == 0:
        params = sum(int(np.prod(p.shape)) for p in opt.parameters)
        print(json.dumps({"times": times, "collectives_per_step": per_step, "params": params,
                          "buckets": len(reducer.buckets), "alone": alone}), flush=True)
    mp.release()


def lscpu_model():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or platform.machine()
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def quartiles(values):
    import numpy as np
    q1, q2, q3 = np.percentile(values, [25, 50, 75])
    return float(q1), float(q2), float(q3)


def main():
    import numpy as np
    mpi_version = subprocess.run([sys.executable, "-c", "from mpi4py import MPI; "
                                  "print(MPI.Get_library_version().splitlines()[0])"],
                                 capture_output=True, text=True, timeout=60).stdout.replace("\x00", "").strip()
    print(f"machine: {lscpu_model()}, {os.cpu_count()} cores, {platform.python_implementation()} "
          f"{platform.python_version()}; {mpi_version}", flush=True)
    print(f"model {args.model}, batch {args.batch} per rank, {args.ranks} ranks, {args.threads} BLAS thread(s) per "
          f"rank, path {args.path}; {args.rounds} paired rounds x {args.steps} steps per variant", flush=True)
    me = [sys.executable, os.path.abspath(__file__), "--worker"] + sys.argv[1:]
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    cmd = [args.mpirun, "--oversubscribe", "-n", str(args.ranks)] + me
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    if proc.returncode != 0:
        raise SystemExit(f"bench_timeout_overhead: {' '.join(cmd)} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    times = {v: np.array(t) for v, t in result["times"].items()}  # [round, step]
    per_step = result["collectives_per_step"]
    print(f"{result['params']} parameters in {result['buckets']} bucket(s); {per_step} collectives per step")
    # Other work on the machine shows here: a loaded machine makes rounds several times slower.
    print(f"1-minute load average before {load_before:.2f}, after {load_after:.2f} (this job adds ~{args.ranks})")
    print(f"{'variant':>8s} {'median ms/step':>15s}  per-round medians (ms)")
    for v in args.variants:
        rounds = " ".join(f"{m * 1e3:.1f}" for m in np.median(times[v], axis=1))
        print(f"{v:>8s} {np.median(times[v]) * 1e3:15.3f}  {rounds}")
    pairs = [("on", "off"), ("on2", "on"), ("dbg1", "on"), ("dbg2", "on")]
    print(f"{'pair':>12s} {'median ratio':>12s} {'min':>7s} {'q1':>7s} {'q3':>7s} {'max':>7s}  "
          f"(per-round ratio of median step times)")
    for a, b in pairs:
        if a in times and b in times:
            ratios = np.median(times[a], axis=1) / np.median(times[b], axis=1)
            q1, q2, q3 = quartiles(ratios)
            print(f"{a + '/' + b:>12s} {q2:12.4f} {ratios.min():7.4f} {q1:7.4f} {q3:7.4f} {ratios.max():7.4f}")
    alone = result["alone"]
    print("one 4-byte allreduce_ alone (median of 10 alternating rounds x 1000): " +
          ", ".join(f"{v} {alone[v] * 1e6:.1f} us" for v in ("on", "off", "dbg1", "dbg2")))
    for level in ("dbg1", "dbg2"):
        if level in times and "on" in times:
            extra = float(np.median(np.median(times[level], axis=1) - np.median(times["on"], axis=1)))
            print(f"{level}: +{extra * 1e3:.3f} ms per step (median of per-round differences), "
                  f"{extra / per_step * 1e6:.1f} us per collective ({per_step} per step); alone: "
                  f"+{(alone[level] - alone['on']) * 1e6:.1f} us per collective")


if __name__ == "__main__" and args.worker:
    worker()
elif __name__ == "__main__":
    main()
