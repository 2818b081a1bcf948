"""A paired A/B of whole training steps (ResNet-20 by default): minidl as it is against one of its speed-ups undone.

    python benchmarks/bench_step_ab.py --change bn-relu      # fused BatchNormReLU vs BN, Add, ReLU
    python benchmarks/bench_step_ab.py --change none --threads 1 --steps 30   # A against A
    python benchmarks/bench_step_ab.py --option conv_cache_bytes=1048576   # any kernels option (minidl.kernels)
    python benchmarks/bench_step_ab.py --env MINIDL_MALLOC_TUNING=1 --model mlp --rounds 8   # a process-wide setting

One ``--model`` (default: the project's ResNet-20) trains in ``--mode``, its steps alternating
between A (minidl as it is) and B (the change undone for that step), in the order A, B, B,
A, ... Alternating single steps pairs the
variants in time, so a neighbour that slows the machine for a while slows both: on a
shared host that is the only comparison of whole steps that is stable from run to run (a
microbenchmark on data already in cache overstates gains; separate runs measure the
neighbours). One net, not two: two identical nets alternating measured 1.12x apart with
nothing changed, from where their arrays lie in memory. Prints the median step of each and
their ratio; ``--change none`` (A against A) shows the harness's own spread. Each change
swaps two routes the tests hold to the same results (the kernels' differential tests,
tests/minidl/test_graph_mode_dense.py, tests/minidl/optim/test_optim.py); tests/test_benchmarks.py
runs this script itself, tiny, to see that it runs.

``--option NAME=value`` (repeatable) instead runs B with a kernels option set
(``minidl.kernels.options()`` lists them), and ``--set module.NAME=value`` with a module
attribute set, to try a setting before making it the default. Changes (what "undone" runs instead):
    none        nothing: an A/A run, whose ratio shows the harness's own spread
    bn-relu     BatchNorm2d.with_relu as BatchNorm, Add and ReLU, three ops (ops/norm_relu.py)
    taps        stride-1 convolutions by im2col and one GEMM per chunk, not by tap GEMMs (kernels/cpu/taps.py)
    dense       nn.Dense as MatMul then BiasAdd, two ops, as MindSpore's layer (not one ops.Dense:
                minidl/nn/layers/basic.py), and under --mode graph no ReLU fused after either
                (minidl/graph_mode/): every Dense layer's MatMul, BiasAdd and ReLU as three ops
                (use --model mlp)
    dense-relu  under --mode graph, nn.Dense's one op and its ReLU as two ops, not one DenseReLU
    sequence    under --mode graph, a SequentialCell's Dense and ReLU cells called one by one (the
                Dense deferred, then fused at the ReLU), not run as one DenseReLU at once
    multi-momentum  nn.Momentum's update one ApplyMomentum per parameter, not one
                MultiApplyMomentum for all (minidl/optim/momentum.py)

``--env NAME=VALUE`` (repeatable) is for settings that hold for a whole process (the malloc
tuning of minidl/kernels/cpu/malloc.py, opt-in): they cannot alternate step by step, so A and B run in
processes of their own instead, alternating A, B, B, A, ... for ``--rounds`` pairs, each
training ``--model`` (benchmarks/models_minidl.py, as bench_train.py does) for ``--steps``
after ``--warmup``. A runs with the named variables removed from the environment, B with
them set. Per step each process measures the wall time, its CPU time (all its threads, user
and system) and its minor page faults; printed are the medians over processes of each
process's median, and their ratios. On a host shared with other jobs the wall time moves
with the neighbours; the CPU time of a one-thread run (``--threads 1``) much less.
"""
import argparse
import ast
import contextlib
import importlib
import json
import os
import resource
import subprocess
import sys
import time

CHANGES = ("none", "bn-relu", "taps", "dense", "dense-relu", "sequence", "multi-momentum")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--change", choices=CHANGES, default="bn-relu", help="the speed-up to undo in B")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="run B with this module setting instead (a Python literal); repeatable")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="run B with this kernels option (a Python literal); repeatable")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="run B in its own processes with this environment variable; repeatable")
    p.add_argument("--model", default="resnet20", choices=["resnet20", "resnet20_user", "mlp"],
                   help="the model trained (benchmarks/models_minidl.py, as in bench_train.py)")
    p.add_argument("--mode", choices=["pynative", "graph"], default="pynative",
                   help="minidl's execution mode in the paired run: set_context(mode=PYNATIVE_MODE or GRAPH_MODE)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=6, help="with --env: pairs of A and B processes")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS / intra-op threads")
    return p.parse_args()


args = parse_args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)


def env_worker():
    """One process of an --env run: times --steps training steps; prints one JSON line of medians."""
    import numpy as np
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import minidl
    import models_minidl
    shape, classes = ((784,), 10) if args.model == "mlp" else ((3, 32, 32), 10)
    batch = 256 if args.model == "mlp" else args.batch
    step = models_minidl.step_fn(args.model)
    rng = np.random.default_rng(0)
    x = minidl.Tensor(rng.standard_normal((batch,) + shape).astype(np.float32))
    y = minidl.Tensor(rng.integers(0, classes, batch).astype(np.int64))
    wall, cpu, faults = [], [], []
    for i in range(args.warmup + args.steps):
        w, c, f = time.perf_counter(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(x, y)
        if i >= args.warmup:
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"wall": float(np.median(wall)), "cpu": float(np.median(cpu)),
                      "faults": float(np.median(faults)), "peak_mib": peak_mib}))


def env_ab():
    """A and B in alternating processes, B with --env set; prints the medians and their ratios."""
    names = dict(item.partition("=")[::2] for item in args.env)
    if not all(names) or not all("=" in item for item in args.env):
        raise SystemExit(f"--env {args.env!r}: expected NAME=VALUE, e.g. MINIDL_MALLOC_TUNING=1")
    env_a = {k: v for k, v in os.environ.items() if k not in names}
    envs = {"A": env_a, "B": dict(env_a, **names)}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--model", args.model, "--batch", str(args.batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads)]
    runs = {"A": [], "B": []}
    for i in range(args.rounds):
        for name in ("A", "B") if i % 2 == 0 else ("B", "A"):  # neither always runs first
            out = subprocess.run(cmd, env=envs[name], capture_output=True, text=True)
            if out.returncode:
                raise SystemExit(f"bench_step_ab: the {name} worker failed:\n{out.stderr}")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def median(name, key):
        values = sorted(r[key] for r in runs[name])
        return values[len(values) // 2]
    print(f"{args.model}, {args.threads} thread(s), {args.rounds} processes each, {args.steps} steps after {args.warmup}")
    for name, what in (("A", "minidl"), ("B", "with " + " ".join(args.env))):
        print(f"{name}  {what}: {median(name, 'wall') * 1e3:.1f} ms/step wall, {median(name, 'cpu') * 1e3:.1f} ms CPU, "
              f"{median(name, 'faults'):.0f} minor faults; peak RSS {max(r['peak_mib'] for r in runs[name]):.0f} MiB")
        print("   wall / CPU ms of each process: "
              + " ".join(f"{r['wall'] * 1e3:.0f}/{r['cpu'] * 1e3:.0f}" for r in runs[name]))
    print(f"A is {median('B', 'wall') / median('A', 'wall'):.3f}x as fast as B in wall time, "
          f"{median('B', 'cpu') / median('A', 'cpu'):.3f}x in CPU time")


if __name__ == "__main__" and args.worker:
    env_worker()
    sys.exit(0)
if __name__ == "__main__" and args.env:
    env_ab()
    sys.exit(0)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import minidl  # noqa: E402
from minidl import nn, ops, Tensor  # noqa: E402
from minidl import graph_mode  # noqa: E402
from minidl.graph_mode import rules as graph_rules  # noqa: E402
from minidl.kernels.cpu.taps import Taps  # noqa: E402
from minidl.optim.optimizer import Optimizer  # noqa: E402


def separate_ops(bn, x, residual=None):
    """What with_relu computes, as three ops."""
    y = bn(x)
    return ops.relu(y if residual is None else y + residual)


def settings_of_b():
    """[(object, attribute, value)] that B runs with: from --set, else what undoes --change."""
    out = []
    for item in args.set:
        target, _, literal = item.partition("=")
        module, _, name = target.rpartition(".")
        if not module or not literal:
            raise SystemExit(f"--set {item!r}: expected MODULE.NAME=VALUE, e.g. minidl.nn.BatchNorm2d.with_relu=...")
        obj = importlib.import_module(module)
        if not hasattr(obj, name):
            raise SystemExit(f"--set {item!r}: module {module} has no attribute {name!r}")
        out.append((obj, name, ast.literal_eval(literal)))
    for item in args.option:
        name, _, literal = item.partition("=")
        if name not in minidl.kernels.options() or not literal:
            raise SystemExit(f"--option {item!r}: expected NAME=VALUE with NAME one of {sorted(minidl.kernels.options())}")
        out.append((None, name, ast.literal_eval(literal)))  # None: a kernels option
    if out:
        return out
    if args.change == "bn-relu":
        out.append((nn.BatchNorm2d, "with_relu", separate_ops))
    if args.change == "taps":
        out.append((Taps, "fits", staticmethod(lambda *arrays: False)))
    if args.change == "dense":
        out.append((nn.Dense, "one_op", lambda dense: False))  # MatMul, BiasAdd: MindSpore's layer
    if args.change in ("dense", "dense-relu"):  # GRAPH_MODE's rule table without the rows these heads start
        dropped = (ops.MatMul, ops.Dense) if args.change == "dense" else (ops.Dense,)
        out.append((graph_rules, "HEADS", {k: v for k, v in graph_rules.HEADS.items() if k not in dropped}))
    if args.change in ("dense", "dense-relu", "sequence"):
        out.append((graph_mode.GraphLayer, "_sequence", lambda layer, seq, x: seq.construct(x)))
    if args.change == "multi-momentum":
        out.append((nn.Momentum, "_update_many", Optimizer._update_many))
    return out


@contextlib.contextmanager
def settings(changes):
    """The attributes set to the given values for the duration."""
    def get(obj, name):
        return minidl.kernels.get_option(name) if obj is None else getattr(obj, name)

    def put(obj, name, value):
        minidl.kernels.set_option(name, value) if obj is None else setattr(obj, name, value)

    saved = [(obj, name, get(obj, name)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            put(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            put(obj, name, value)


def main():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import models_minidl
    minidl.set_context(mode=minidl.GRAPH_MODE if args.mode == "graph" else minidl.PYNATIVE_MODE)
    step = models_minidl.step_fn(args.model)
    shape, batch = ((784,), 256) if args.model == "mlp" else ((3, 32, 32), args.batch)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((batch,) + shape).astype(np.float32))
    y = Tensor(rng.integers(0, 10, batch).astype(np.int32))
    times, faults = {"A": [], "B": []}, {"A": [], "B": []}
    b_settings = settings_of_b()
    what = ", ".join(args.set + args.option) if args.set or args.option else f"{args.change} undone"
    for i in range(args.warmup + args.steps):
        for name in ("A", "B") if i % 2 else ("B", "A"):  # neither always runs first
            t, f = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            with settings(b_settings if name == "B" else []):
                step(x, y)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f)
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    flt = {k: int(np.median(v)) for k, v in faults.items()}
    print(f"{args.model}, batch {batch}, {args.threads} thread(s), {args.mode} mode, {args.steps} alternating steps each")
    print(f"A  minidl: {med['A']:.2f} ms/step (median), {flt['A']} minor page faults per step")
    print(f"B  with {what}: {med['B']:.2f} ms/step (median), {flt['B']} minor page faults per step")
    print(f"A is {med['B'] / med['A']:.3f}x as fast as B")


if __name__ == "__main__":
    main()
