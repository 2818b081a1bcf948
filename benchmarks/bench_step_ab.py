"""A paired A/B of whole ResNet-20 training steps: minidl as it is against one of its speed-ups undone.

    python benchmarks/bench_step_ab.py --change bn-relu      # fused BatchNormReLU vs BN, Add, ReLU
    python benchmarks/bench_step_ab.py --change none --threads 1 --steps 30   # A against A
    python benchmarks/bench_step_ab.py --set minidl.ops.im2col._CACHE_BYTES=1048576   # any module setting

One ResNet-20 trains, its steps alternating between A (minidl as it is) and B (the change
undone for that step), in the order A, B, B, A, ... Alternating single steps pairs the
variants in time, so a neighbour that slows the machine for a while slows both: on a
shared host that is the only comparison of whole steps that is stable from run to run (a
microbenchmark on data already in cache overstates gains; separate runs measure the
neighbours). One net, not two: two identical nets alternating measured 1.12x apart with
nothing changed, from where their arrays lie in memory. Prints the median step of each and
their ratio; ``--change none`` (A against A) shows the harness's own spread. The tests
check that each change leaves the results unchanged.

``--set module.NAME=value`` (repeatable) instead runs B with module settings changed, to try
a setting before making it the default. Changes (what "undone" runs instead):
    none        nothing: an A/A run, whose ratio shows the harness's own spread
    bn-relu     BatchNorm2d.with_relu as BatchNorm, Add and ReLU, three ops (ops/norm_relu.py)
"""
import argparse
import ast
import contextlib
import importlib
import os
import sys
import time

CHANGES = ("none", "bn-relu")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--change", choices=CHANGES, default="bn-relu", help="the speed-up to undo in B")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="run B with this module setting instead (a Python literal); repeatable")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS / intra-op threads")
    return p.parse_args()


args = parse_args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import minidl  # noqa: E402
from minidl import nn, ops, Tensor  # noqa: E402
from minidl.models import resnet20  # noqa: E402


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
            raise SystemExit(f"--set {item!r}: expected MODULE.NAME=VALUE, e.g. minidl.ops.im2col._CACHE_BYTES=1048576")
        obj = importlib.import_module(module)
        if not hasattr(obj, name):
            raise SystemExit(f"--set {item!r}: module {module} has no attribute {name!r}")
        out.append((obj, name, ast.literal_eval(literal)))
    if out:
        return out
    if args.change == "bn-relu":
        out.append((nn.BatchNorm2d, "with_relu", separate_ops))
    return out


@contextlib.contextmanager
def settings(changes):
    """The attributes set to the given values for the duration."""
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)


def main():
    minidl.set_seed(0)
    net = resnet20()
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((args.batch, 3, 32, 32)).astype(np.float32))
    y = Tensor(rng.integers(0, 10, args.batch).astype(np.int32))
    times = {"A": [], "B": []}
    b_settings = settings_of_b()
    what = ", ".join(args.set) if args.set else f"{args.change} undone"
    for i in range(args.warmup + args.steps):
        for name in ("A", "B") if i % 2 else ("B", "A"):  # neither always runs first
            t = time.perf_counter()
            with settings(b_settings if name == "B" else []):
                _, grads = grad_fn(x, y)
                opt(grads)
            if i >= args.warmup:
                times[name].append(time.perf_counter() - t)
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    print(f"ResNet-20, batch {args.batch}, {args.threads} thread(s), {args.steps} alternating steps each")
    print(f"A  minidl: {med['A']:.1f} ms/step (median)")
    print(f"B  with {what}: {med['B']:.1f} ms/step (median)")
    print(f"A is {med['B'] / med['A']:.3f}x as fast as B")


if __name__ == "__main__":
    main()
