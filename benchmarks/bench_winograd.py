"""Winograd F(2x2, 3x3) against im2col in minidl: ResNet-20's 3x3 stride-1 convs and a whole step.

    python benchmarks/bench_winograd.py                # threads = cpu count
    python benchmarks/bench_winograd.py --threads 1

For each 3x3 stride-1 ResNet-20 shape (batch 64, float32) times Conv2D forward + backward
with the Winograd path on and off (``minidl.ops.winograd.ENABLED``, channel floor lifted so
the 16-channel shape runs too), then a whole ResNet-20 training step with the path as
``MINIDL_WINOGRAD=1`` would set it (32+ channels) and off. The two alternate call by call in
one process, and the best of ``--repeats`` is printed, so a noisy neighbour hits both alike.
"""
import argparse
import os
import sys
import time

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS / intra-op threads")
p.add_argument("--repeats", type=int, default=7, help="alternating calls per variant; the best is kept")
p.add_argument("--step-repeats", type=int, default=4, help="alternating rounds of 2 training steps")
args = p.parse_args()
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MINIDL_NUM_THREADS"):
    os.environ[var] = str(args.threads)  # before NumPy's BLAS loads

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import minidl  # noqa: E402
from minidl import nn, ops, Tensor  # noqa: E402
from minidl.models import resnet20  # noqa: E402
from minidl.ops import winograd  # noqa: E402


def best_of(variants, repeats):
    """{name: best seconds}, calling the variants in turn ``repeats`` times."""
    times = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(repeats):
        for k, fn in variants.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: min(v) for k, v in times.items()}


def conv_variant(x, w, gy, on):
    def run():
        winograd.ENABLED = on
        op = ops.Conv2D(w.shape[0], 3, pad_mode="pad", pad=1)
        op.needs_grad = (True, True)
        op.forward(x, w)
        op.backward(gy)
    return run


def step_variant(on):
    minidl.set_seed(0)
    net = resnet20()
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    rng = np.random.default_rng(0)
    x, y = Tensor(rng.random((64, 3, 32, 32), dtype=np.float32)), Tensor(rng.integers(0, 10, 64).astype(np.int32))

    def run():
        winograd.ENABLED = on
        for _ in range(2):
            loss, grads = grad_fn(x, y)
            opt(grads)
    return run


def main():
    print(f"machine: {os.uname().machine}, {os.cpu_count()} cores; threads={args.threads}; numpy {np.__version__}; "
          f"batch 64, float32, ms: best of {args.repeats} alternating calls")
    rng = np.random.default_rng(0)
    winograd.MIN_CHANNELS = 1
    for c, size in ((16, 32), (32, 16), (64, 8)):
        x = rng.standard_normal((64, c, size, size)).astype(np.float32)
        w = (rng.standard_normal((c, c, 3, 3)) * 0.1).astype(np.float32)
        gy = rng.standard_normal((64, c, size, size)).astype(np.float32)
        t = best_of({"im2col": conv_variant(x, w, gy, False), "winograd": conv_variant(x, w, gy, True)}, args.repeats)
        print(f"conv {c}->{c} {size}x{size} fwd+bwd | im2col {t['im2col'] * 1e3:7.1f} | winograd "
              f"{t['winograd'] * 1e3:7.1f} | speed-up {t['im2col'] / t['winograd']:.2f}x")
    winograd.MIN_CHANNELS = 32  # as MINIDL_WINOGRAD=1 runs it
    t = best_of({"im2col": step_variant(False), "winograd": step_variant(True)}, args.step_repeats)
    print(f"ResNet-20 step (Winograd on 32+ channels) | im2col {t['im2col'] / 2 * 1e3:7.1f} | winograd "
          f"{t['winograd'] / 2 * 1e3:7.1f} | speed-up {t['im2col'] / t['winograd']:.2f}x")


main()
