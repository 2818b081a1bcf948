"""Where a minidl training step's time goes: per op class and per kernel, forward and backward.

    python benchmarks/profile_step.py                       # the user-written ResNet-20, batch 64
    python benchmarks/profile_step.py --model resnet20 --by-shape --threads 1 --steps 10
    python benchmarks/profile_step.py --mode graph          # under set_context(mode=GRAPH_MODE)

For the profiled steps only, and from the outside (nothing in minidl changes):
``Primitive.apply`` is wrapped to time each op call's forward, to note which kernel ran
(``minidl.kernels.tracking()``; "reference" when none did) and to wrap the recorded node's
``backward``, which the autograd loop calls, so its backward is timed under the same label.
Times are exclusive: an op called inside another op's forward or backward counts for itself,
not twice. What no op accounts for is "other": autograd's bookkeeping and the Python between
ops (loss, value_and_grad), and the optimizer's own work outside ops.

Per row, the median over the steps of its summed time per step, and its share of the median
step (so the rows need not add up to exactly 100%). The wrappers cost a few microseconds per
call: the unprofiled step time is printed beside the profiled one. Steps run in ``--mode``
(default pynative); in both modes every op that runs goes through ``Primitive.apply`` (under
graph, the fused BatchNormReLU and DenseReLU show where BatchNorm, Add and ReLU, or MatMul,
BiasAdd and ReLU ran). Conv2D, MatMul and Dense calls also count their forward FLOPs, checked
against benchmarks/flops.py's count from the layers.
"""
import argparse
import collections
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet20_user", "resnet20", "resnet18", "mlp"], default="resnet20_user")
    p.add_argument("--batch", type=int, help="default: 64, 256 for the MLP")
    p.add_argument("--steps", type=int, default=8, help="timed steps (profiled, and as many unprofiled)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="BLAS / intra-op threads")
    p.add_argument("--by-shape", action="store_true", help="split Conv2D and MatMul rows by layer shape")
    p.add_argument("--mode", choices=["pynative", "graph"], default="pynative",
                   help="minidl's execution mode: set_context(mode=PYNATIVE_MODE or GRAPH_MODE)")
    return p.parse_args()


args = parse_args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import minidl  # noqa: E402
from minidl import kernels, ops  # noqa: E402
from minidl.ops.primitive import Primitive  # noqa: E402
from minidl.tensor import Tensor  # noqa: E402
import flops  # noqa: E402
import models_minidl  # noqa: E402


class StepProfile:
    """``with StepProfile() as prof:`` times every op call's forward and backward in the block.

    ``prof.fwd`` / ``prof.bwd``: {(op, kernel): exclusive seconds}; ``prof.calls``: {(op, kernel):
    forward calls}; ``prof.flop``: forward FLOPs of Conv2D and MatMul calls; ``prof.total()``:
    the seconds of all of them. Clear them with ``prof.clear()``.
    """

    def __init__(self, by_shape=False):
        self.by_shape = by_shape
        self._stack = []  # per open timed call: seconds spent in calls nested inside it
        self.clear()

    def clear(self):
        self.fwd, self.bwd = collections.defaultdict(float), collections.defaultdict(float)
        self.calls, self.flop = collections.Counter(), 0

    def total(self):
        return sum(self.fwd.values()) + sum(self.bwd.values())

    def _timed(self, fn, table, label, *a):
        self._stack.append(0.0)
        t = time.perf_counter()
        try:
            return fn(*a)
        finally:
            spent = time.perf_counter() - t
            nested = self._stack.pop()
            if self._stack:
                self._stack[-1] += spent
            table[label] += spent - nested

    def _label(self, prim, args, used):
        kernel = next((k.name for k in used if k.op is type(prim)), "reference")
        op = prim.name
        if self.by_shape and isinstance(prim, ops.Conv2D):
            x, w = (getattr(a, "shape", None) for a in args[:2])
            op = f"Conv2D {w[2]}x{w[3]}/{prim.stride[0]} {x[1]}->{w[0]} {x[2]}x{x[3]}"
        elif self.by_shape and isinstance(prim, ops.MatMul):
            x, w = (getattr(a, "shape", None) for a in args[:2])
            op = f"MatMul {x[0]}x{x[1]}{'T' if prim.transpose_a else ''} @ {w[0]}x{w[1]}{'T' if prim.transpose_b else ''}"
        elif self.by_shape and isinstance(prim, ops.Dense):
            x, w = (getattr(a, "shape", None) for a in args[:2])
            op = f"{prim.name} {x[0]}x{x[1]} @ {w[0]}x{w[1]}T"
        return op, kernel

    def _count_flop(self, prim, args, out):
        if isinstance(prim, ops.Conv2D):  # 2 x N x out pixels x O x C/g x kh x kw
            w = args[1].shape
            self.flop += 2 * out.data.size * w[1] * w[2] * w[3]
        elif isinstance(prim, ops.MatMul):  # 2 x out elements x the contracted length
            self.flop += 2 * out.data.size * args[0].shape[-2 if prim.transpose_a else -1]
        elif isinstance(prim, ops.Dense):  # Dense and DenseReLU (graph mode's Dense layers): x @ w.T
            self.flop += 2 * out.data.size * args[0].shape[-1]

    def __enter__(self):
        original, profile = Primitive.apply, self

        def apply(prim, *a):
            # Timed here rather than through _timed: the label is known only after the call,
            # once it is known which kernel ran.
            profile._stack.append(0.0)
            t = time.perf_counter()
            try:
                with kernels.tracking() as used:
                    out = original(prim, *a)
            finally:
                spent = time.perf_counter() - t
                nested = profile._stack.pop()
                if profile._stack:
                    profile._stack[-1] += spent
            label = profile._label(prim, a, used)
            profile.fwd[label] += spent - nested
            profile.calls[label] += 1
            if isinstance(out, Tensor):
                profile._count_flop(prim, a, out)
                node = out._node
                if node is not None:
                    backward = node.backward  # the op's own, or its kernel's (an instance attribute)
                    node.backward = lambda gy: profile._timed(backward, profile.bwd, label, gy)
            return out
        self._original = original
        Primitive.apply = apply
        return self

    def __exit__(self, *exc):
        Primitive.apply = self._original


def run_steps(grad_fn, opt, x, y, steps, prof=None):
    """Per step: (step seconds, value_and_grad seconds outside ops, optimizer seconds outside ops,
    {(op, kernel): (forward seconds, backward seconds, calls)}, forward FLOPs counted)."""
    out = []
    for _ in range(steps):
        if prof is not None:
            prof.clear()
        t0 = time.perf_counter()
        _, grads = grad_fn(x, y)
        t1, in_grad = time.perf_counter(), prof.total() if prof is not None else 0.0
        opt(grads)
        t2 = time.perf_counter()
        if prof is None:
            out.append((t2 - t0, None, None, {}, 0))
            continue
        in_opt = prof.total() - in_grad
        rows = {k: (prof.fwd.get(k, 0.0), prof.bwd.get(k, 0.0), prof.calls[k]) for k in set(prof.fwd) | set(prof.bwd)}
        out.append((t2 - t0, t1 - t0 - in_grad, t2 - t1 - in_opt, rows, prof.flop))
    return out


def main():
    batch = args.batch or (256 if args.model == "mlp" else 64)
    minidl.set_context(mode=minidl.GRAPH_MODE if args.mode == "graph" else minidl.PYNATIVE_MODE)
    _, grad_fn, opt = models_minidl.training_parts(args.model)
    rng = np.random.default_rng(0)
    shape = (batch, 784) if args.model == "mlp" else (batch, 3, 32, 32)
    x = minidl.Tensor(rng.standard_normal(shape).astype(np.float32))
    y = minidl.Tensor(rng.integers(0, 10, batch).astype(np.int64))

    run_steps(grad_fn, opt, x, y, args.warmup)
    plain = run_steps(grad_fn, opt, x, y, args.steps)
    with StepProfile(args.by_shape) as prof:
        run_steps(grad_fn, opt, x, y, 1, prof)  # a first profiled step: the wrappers' own first calls
        steps = run_steps(grad_fn, opt, x, y, args.steps, prof)

    ms = lambda values: float(np.median(values)) * 1e3  # noqa: E731
    step = ms([s[0] for s in steps])
    rows = []
    for op, kernel in set().union(*(s[3] for s in steps)):
        per_step = [s[3].get((op, kernel), (0.0, 0.0, 0)) for s in steps]
        rows.append((f"{op} [{kernel}]", ms([p[0] for p in per_step]), ms([p[1] for p in per_step]), per_step[-1][2]))
    rows.append(("other: autograd, loss, Python between ops", ms([s[1] for s in steps]), 0.0, None))
    rows.append(("other: optimizer outside ops", ms([s[2] for s in steps]), 0.0, None))
    rows.sort(key=lambda r: -(r[1] + r[2]))

    arch = "mlp" if args.model == "mlp" else args.model.split("_")[0]
    layers = flops.ARCHITECTURES.get(arch)
    counted = f"{steps[-1][4] / 1e9:.3f} GFLOP forward in Conv2D, MatMul and Dense calls"
    if layers is not None:
        counted += f" (flops.py from the layers: {flops.step_flops(layers(), batch)[0] / 1e9:.3f})"
    print(f"{args.model}, batch {batch}, {args.threads} thread(s), {args.mode} mode, kernels "
          f"{'off (MINIDL_KERNELS=reference)' if kernels.is_reference_only() else 'on'}: median step "
          f"{step:.1f} ms profiled, {ms([s[0] for s in plain]):.1f} ms unprofiled, over {args.steps} steps; {counted}")
    print(f"{'op [kernel]':48s} {'calls':>5s} {'fwd ms':>8s} {'bwd ms':>8s} {'share':>6s}")
    digits = 2 if step < 20 else 1  # a few-ms step (the MLP) needs the hundredths
    for label, f, b, calls in rows:
        print(f"{label:48s} {'' if calls is None else calls:>5} {f:8.{digits}f} {b:8.{digits}f} {100 * (f + b) / step:5.1f}%")
    by_op = collections.defaultdict(float)
    for label, f, b, _ in rows:
        by_op[label.split()[0].rstrip(":")] += f + b  # the op class, whatever shape or kernel
    print("per op class: " + ", ".join(f"{op} {100 * t / step:.0f}%" for op, t in
                                       sorted(by_op.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
