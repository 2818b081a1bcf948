"""Conv2D forward + backward on the ResNet-20 shapes (batch 64): minidl vs PyTorch (CPU).

    python benchmarks/bench_conv.py                  # all shapes, threads = cpu count
    python benchmarks/bench_conv.py --threads 1 --iters 5 --dtype float32

For each convolution shape of ResNet-20 prints the forward and forward+backward time of
minidl and, when PyTorch is installed, of torch.nn.functional.conv2d with the same number
of intra-op threads as NumPy's BLAS, and the ratio torch / minidl (above 1: minidl faster).
The last line weights each shape by how often it occurs in one ResNet-20 training step.
The first layer (3 input channels) runs without an input gradient, as in training.
"""
import argparse
import os
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=10, help="timed iterations per round")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds; the best is kept")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS / intra-op threads for both")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    return p.parse_args()


args = parse_args()
# Thread counts must be fixed before NumPy's BLAS is loaded.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from minidl import ops, Tensor  # noqa: E402

try:
    import torch
    torch.set_num_threads(args.threads)
except ImportError:
    torch = None

# (name, in channels, out channels, input size, kernel, stride, padding, count in ResNet-20)
SHAPES = [
    ("stem 3->16 32x32", 3, 16, 32, 3, 1, 1, 1),
    ("3x3 16->16 32x32", 16, 16, 32, 3, 1, 1, 6),
    ("3x3 16->32 s2 32x32", 16, 32, 32, 3, 2, 1, 1),
    ("1x1 16->32 s2 32x32", 16, 32, 32, 1, 2, 0, 1),
    ("3x3 32->32 16x16", 32, 32, 16, 3, 1, 1, 5),
    ("3x3 32->64 s2 16x16", 32, 64, 16, 3, 2, 1, 1),
    ("1x1 32->64 s2 16x16", 32, 64, 16, 1, 2, 0, 1),
    ("3x3 64->64 8x8", 64, 64, 8, 3, 1, 1, 5),
]


def best_time(fn, iters, repeats_state):
    fn()  # warm-up: allocator, BLAS buffers
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def minidl_fns(x, w, stride, pad, need_gx):
    conv = ops.Conv2D(w.shape[0], w.shape[2:], pad_mode="pad", pad=pad, stride=stride)
    tx = Tensor(x, requires_grad=need_gx)
    tw = Tensor(w, requires_grad=True)
    y = conv(tx, tw)
    gy = Tensor(np.random.default_rng(1).standard_normal(y.shape).astype(x.dtype))

    def fwd():
        conv(Tensor(x), Tensor(w))

    def fwd_bwd():
        tx.grad = tw.grad = None
        conv(tx, tw).backward(gy)

    return fwd, fwd_bwd


def torch_fns(x, w, stride, pad, need_gx):
    tx = torch.from_numpy(x).requires_grad_(need_gx)
    tw = torch.from_numpy(w).requires_grad_(True)
    f = torch.nn.functional.conv2d
    y = f(tx, tw, stride=stride, padding=pad)
    gy = torch.from_numpy(np.random.default_rng(1).standard_normal(tuple(y.shape)).astype(x.dtype))

    def fwd():
        with torch.no_grad():
            f(tx, tw, stride=stride, padding=pad)

    def fwd_bwd():
        tx.grad = tw.grad = None
        f(tx, tw, stride=stride, padding=pad).backward(gy)

    return fwd, fwd_bwd


def main():
    rng = np.random.default_rng(0)
    print(f"batch {args.batch}, {args.dtype}, {args.threads} thread(s), numpy {np.__version__}, "
          f"torch {torch.__version__ if torch else 'not installed'}; times in ms (best of {args.repeats})")
    head = f"{'shape':<22}{'n':>3}{'fwd':>9}{'fwd+bwd':>9}"
    if torch:
        head += f"{'torch fwd':>11}{'torch f+b':>11}{'ratio fwd':>11}{'ratio f+b':>11}"
    print(head)
    total_m = total_t = 0.0
    for name, cin, cout, size, k, stride, pad, count in SHAPES:
        x = rng.standard_normal((args.batch, cin, size, size)).astype(args.dtype)
        w = (rng.standard_normal((cout, cin, k, k)) * 0.1).astype(args.dtype)
        need_gx = cin != 3
        runs = {"minidl": minidl_fns(x, w, stride, pad, need_gx)}
        if torch:
            runs["torch"] = torch_fns(x, w, stride, pad, need_gx)
        best = {key: [float("inf"), float("inf")] for key in runs}
        for _ in range(args.repeats):  # alternate frameworks so drifts hit both alike
            for key, fns in runs.items():
                for i, fn in enumerate(fns):
                    best[key][i] = min(best[key][i], best_time(fn, args.iters, None))
        m = best["minidl"]
        line = f"{name:<22}{count:>3}{m[0] * 1e3:>9.2f}{m[1] * 1e3:>9.2f}"
        total_m += count * m[1]
        if torch:
            t = best["torch"]
            total_t += count * t[1]
            line += f"{t[0] * 1e3:>11.2f}{t[1] * 1e3:>11.2f}{t[0] / m[0]:>11.2f}{t[1] / m[1]:>11.2f}"
        print(line, flush=True)
    line = f"ResNet-20 convs per step (fwd+bwd, weighted): minidl {total_m * 1e3:.1f} ms"
    if torch:
        line += f", torch {total_t * 1e3:.1f} ms, ratio torch/minidl {total_t / total_m:.2f}"
    print(line)


if __name__ == "__main__":
    main()
