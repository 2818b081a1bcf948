"""Conv2D forward + backward on the ResNet-20 shapes (batch 64): minidl vs PyTorch (CPU).

    python benchmarks/bench_conv.py                  # all shapes, threads = cpu count
    python benchmarks/bench_conv.py --threads 1 --iters 5 --dtype float64
    python benchmarks/bench_conv.py --reference      # minidl's reference bodies, no kernels

For each convolution shape of ResNet-20 prints the forward and forward+backward time of
minidl and, when PyTorch is installed, of torch.nn.functional.conv2d with as many intra-op
threads as NumPy's BLAS has, and the ratio torch / minidl (above 1: minidl is faster). The
last line weights each shape by how often it occurs in one ResNet-20 training step. The
stem (3 input channels) runs without an input gradient, as in training.

Each framework runs in its own worker process, and the workers alternate for ``--repeats``
rounds. Both in one process measured minidl up to 5x slower: after each parallel region the
OpenMP threads of PyTorch and the OpenBLAS threads of NumPy spin-wait, and on a 2-core
machine they take the cores from each other. Each round reports medians over its calls,
which a few calls disturbed by other processes do not move, and the best round is kept,
so that a neighbour busy for a whole round does not count either.
"""
import argparse
import json
import os
import subprocess
import sys
import time

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


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iters", type=int, default=10, help="timed calls per shape and round")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds of the two workers")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="BLAS / intra-op threads for both")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--reference", action="store_true",
                   help="minidl's reference conv bodies only, no kernels (MINIDL_KERNELS=reference)")
    p.add_argument("--worker", choices=["minidl", "torch"], help=argparse.SUPPRESS)
    return p.parse_args()


def time_calls(fn, iters):
    """Seconds per call, one sample per call (after one warm-up call)."""
    fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def minidl_fns(np, x, w, stride, pad, need_gx):
    from minidl import ops, Tensor
    conv = ops.Conv2D(w.shape[0], w.shape[2:], pad_mode="pad", pad=pad, stride=stride)
    tx, tw = Tensor(x, requires_grad=need_gx), Tensor(w, requires_grad=True)
    y = conv(tx, tw)
    gy = Tensor(np.random.default_rng(1).standard_normal(y.shape).astype(x.dtype))

    def fwd():
        conv(Tensor(x), Tensor(w))

    def fwd_bwd():
        tx.grad = tw.grad = None
        conv(tx, tw).backward(gy)

    return fwd, fwd_bwd


def torch_fns(np, x, w, stride, pad, need_gx):
    import torch
    f = torch.nn.functional.conv2d
    tx = torch.from_numpy(x).requires_grad_(need_gx)
    tw = torch.from_numpy(w).requires_grad_(True)
    y = f(tx, tw, stride=stride, padding=pad)
    gy = torch.from_numpy(np.random.default_rng(1).standard_normal(tuple(y.shape)).astype(x.dtype))

    def fwd():
        with torch.no_grad():
            f(tx, tw, stride=stride, padding=pad)

    def fwd_bwd():
        tx.grad = tw.grad = None
        f(tx, tw, stride=stride, padding=pad).backward(gy)

    return fwd, fwd_bwd


def worker(args):
    """Times every shape in this process and prints {name: [fwd samples, fwd+bwd samples]} as JSON."""
    # Thread counts must be fixed before NumPy's BLAS is loaded.
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    import numpy as np
    if args.worker == "torch":
        import torch
        torch.set_num_threads(args.threads)
        make, version = torch_fns, torch.__version__
    else:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        make, version = minidl_fns, np.__version__
    rng = np.random.default_rng(0)
    result = {"version": version}
    for name, cin, cout, size, k, stride, pad, _ in SHAPES:
        x = rng.standard_normal((args.batch, cin, size, size)).astype(args.dtype)
        w = (rng.standard_normal((cout, cin, k, k)) * 0.1).astype(args.dtype)
        result[name] = [time_calls(fn, args.iters) for fn in make(np, x, w, stride, pad, need_gx=cin != 3)]
    print(json.dumps(result))


def run_worker(args, which):
    if args.reference:
        os.environ["MINIDL_KERNELS"] = "reference"  # read when the worker imports minidl
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", which, "--batch", str(args.batch),
           "--iters", str(args.iters), "--threads", str(args.threads), "--dtype", args.dtype]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
    try:
        import importlib.util
        have_torch = importlib.util.find_spec("torch") is not None
    except ValueError:
        have_torch = False
    frameworks = ["minidl"] + (["torch"] if have_torch else [])
    inf = float("inf")
    times = {fw: {name: [inf, inf] for name, *_ in SHAPES} for fw in frameworks}
    versions = {}
    for _ in range(args.repeats):  # alternate the workers so drifts of the machine hit both alike
        for fw in frameworks:
            res = run_worker(args, fw)
            versions[fw] = res.pop("version")
            for name, pair in res.items():
                best = times[fw][name]
                for i, samples in enumerate(pair):
                    best[i] = min(best[i], median(samples))
    print(f"batch {args.batch}, {args.dtype}, {args.threads} thread(s), numpy {versions['minidl']}, "
          f"torch {versions.get('torch', 'not installed')}; ms: the best of {args.repeats} rounds' medians")
    head = f"{'shape':<22}{'n':>3}{'fwd':>9}{'fwd+bwd':>9}"
    if have_torch:
        head += f"{'torch fwd':>11}{'torch f+b':>11}{'ratio fwd':>11}{'ratio f+b':>11}"
    print(head)
    total = {fw: 0.0 for fw in frameworks}
    for name, *_, count in SHAPES:
        m = times["minidl"][name]
        line = f"{name:<22}{count:>3}{m[0] * 1e3:>9.2f}{m[1] * 1e3:>9.2f}"
        for fw in frameworks:
            total[fw] += count * times[fw][name][1]
        if have_torch:
            t = times["torch"][name]
            line += f"{t[0] * 1e3:>11.2f}{t[1] * 1e3:>11.2f}{t[0] / m[0]:>11.2f}{t[1] / m[1]:>11.2f}"
        print(line)
    line = f"ResNet-20 convs per training step (fwd+bwd, weighted): minidl {total['minidl'] * 1e3:.1f} ms"
    if have_torch:
        line += f", torch {total['torch'] * 1e3:.1f} ms, ratio torch/minidl {total['torch'] / total['minidl']:.2f}"
    print(line)


if __name__ == "__main__":
    main()
