"""Where a training step's time goes: forward and backward time per op type (and per conv shape).

    python benchmarks/profile_step.py                   # ResNet-20, batch 64, all cores
    python benchmarks/profile_step.py --threads 1 --steps 10

Every Primitive's forward and backward is wrapped with a timer for the run, so the table
adds up to the step minus the Python glue between ops (autograd bookkeeping, the optimizer),
which is printed as "other". Per op: the median over the steps of its summed time per step.
The wrappers cost a few microseconds per call, small against ResNet's ops.
"""
import argparse
import collections
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["resnet20", "resnet18"], default="resnet20")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=8, help="timed steps")
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
from minidl.models import resnet18, resnet20  # noqa: E402
from minidl.ops.primitive import Primitive  # noqa: E402

_times = collections.defaultdict(float)  # (label, "fwd"/"bwd") -> seconds this step


def _label(op, arrays):
    if isinstance(op, ops.Conv2D):
        x = arrays[0] if arrays else op.x
        return f"Conv2D {op.kernel_size[0]}x{op.kernel_size[1]}/{op.stride[0]} {x.shape[1]}->{op.out_channel} " \
               f"{x.shape[2]}x{x.shape[3]}"
    return op.name


def _wrap(cls):
    fwd, bwd = cls.forward, cls.backward

    def forward(self, *a):
        t = time.perf_counter()
        out = fwd(self, *a)
        self._profile_label = _label(self, a)
        _times[(self._profile_label, "fwd")] += time.perf_counter() - t
        return out

    def backward(self, gy):
        t = time.perf_counter()
        out = bwd(self, gy)
        _times[(self._profile_label, "bwd")] += time.perf_counter() - t
        return out
    cls.forward, cls.backward = forward, backward


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def main():
    for cls in set(_subclasses(Primitive)):
        if "forward" in cls.__dict__ or "backward" in cls.__dict__:
            _wrap(cls)
    minidl.set_seed(0)
    net = resnet20() if args.model == "resnet20" else resnet18()
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((args.batch, 3, 32, 32)).astype(np.float32))
    y = Tensor(rng.integers(0, 10, args.batch).astype(np.int32))

    per_step, totals = collections.defaultdict(list), []
    for i in range(args.warmup + args.steps):
        _times.clear()
        t = time.perf_counter()
        _, grads = grad_fn(x, y)
        opt(grads)
        total = time.perf_counter() - t
        if i >= args.warmup:
            totals.append(total)
            for k, v in _times.items():
                per_step[k].append(v)
            per_step[("other", "")].append(total - sum(_times.values()))

    median = lambda v: float(np.median(v)) * 1e3  # noqa: E731
    step = median(totals)
    labels = sorted({k[0] for k in per_step}, key=lambda l: -sum(median(per_step[(l, d)]) for d in ("fwd", "bwd", "")
                                                               if (l, d) in per_step))
    print(f"{args.model}, batch {args.batch}, {args.threads} thread(s): median step {step:.1f} ms "
          f"over {args.steps} steps")
    print(f"{'op':34s} {'fwd ms':>8s} {'bwd ms':>8s} {'share':>6s}")
    for label in labels:
        f = median(per_step[(label, "fwd")]) if (label, "fwd") in per_step else 0.0
        b = median(per_step[(label, "bwd")]) if (label, "bwd") in per_step else 0.0
        if label == "other":
            f = median(per_step[("other", "")])
        print(f"{label:34s} {f:8.1f} {b:8.1f} {100 * (f + b) / step:5.1f}%")


if __name__ == "__main__":
    main()
