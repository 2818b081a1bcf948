"""The GEMMs of ResNet-20's convolutions on one core: GFLOP/s, and what the row pitch does.

    python benchmarks/bench_gemm.py
    python benchmarks/bench_gemm.py --direct     # also through kernels/cpu/blas.py: OpenBLAS and MKL

For each 3x3 stage (K = 9*C rows of columns, O output channels, m columns per chunk of
images) times ``w (O, K) @ col (K, m)`` with one BLAS thread, once with col's rows packed
at pitch m and once at the pitch the conv kernels use (``im2col._row_pitch``: an odd multiple of
64 bytes). A pitch that is a multiple of a large power of two maps the rows BLAS packs
together onto the same cache sets. With ``--direct``, the padded-pitch GEMM again through the
direct BLAS calls of the conv kernels (minidl/kernels/cpu/blas.py), in NumPy's OpenBLAS and, where
the mkl extra is installed, in MKL (one thread per call). Prints the best-of-30 quarter-percentile GFLOP/s.
"""
import os
import sys
import time

os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from minidl import kernels  # noqa: E402
from minidl.kernels.cpu import blas  # noqa: E402
from minidl.kernels.cpu.im2col import _row_pitch  # noqa: E402

# (stage, K, O, m): m = images per chunk * OH * row pitch of the flat rows
SHAPES = [("16ch 32x32", 144, 16, 6144), ("16ch 32x32", 144, 16, 6336), ("32ch 16x16", 288, 32, 3072),
          ("32ch 16x16", 288, 32, 3264), ("64ch 8x8", 576, 64, 1024), ("64ch 8x8", 576, 64, 1800)]


def gflops(w, col, out, reps=30, library=None):
    if library is not None:
        kernels.set_option("blas", library)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        if library is None:
            np.matmul(w, col, out=out)
        else:
            blas.matmul(w, col, out)
        times.append(time.perf_counter() - t)
    return 2 * w.shape[0] * w.shape[1] * col.shape[1] / sorted(times)[reps // 4] / 1e9


def main():
    direct = "--direct" in sys.argv[1:]
    libraries = [name for name in ("openblas", "mkl") if direct and blas.load(name)]
    if direct and "mkl" not in libraries:
        print("(MKL not installed: pip install 'minidl[mkl]')")
    rng = np.random.default_rng(0)
    print(f"one BLAS thread, float32, numpy {np.__version__}")
    print(f"{'stage':12s} {'K':>4s} {'O':>3s} {'m':>5s} | pitch m: GFLOP/s | pitch {'(_row_pitch)':12s}: GFLOP/s"
          + "".join(f" | direct {name:8s}" for name in libraries))
    for stage, k, o, m in SHAPES:
        w = rng.random((o, k), dtype=np.float32)
        out = np.empty((o, m), np.float32)
        packed = rng.random((k, m), dtype=np.float32)
        pitch = _row_pitch(np, m, 4)
        padded = rng.random((k, pitch), dtype=np.float32)[:, :m]
        print(f"{stage:12s} {k:4d} {o:3d} {m:5d} | {gflops(w, packed, out):16.0f} | {pitch:6d}       : "
              f"{gflops(w, padded, out):7.0f}"
              + "".join(f" | {gflops(w, padded, out, library=name):15.0f}" for name in libraries))


if __name__ == "__main__":
    main()
