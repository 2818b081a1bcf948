"""The GEMMs of ResNet-20's convolutions on one core: GFLOP/s, the row pitch, and the orientation.

    python benchmarks/bench_gemm.py

For each 3x3 stage (K = 9*C rows of columns, O output channels, m columns per chunk of
images) times, with one BLAS thread:
- ``w (O, K) @ col (K, m)`` with col's rows packed at pitch m, and at the pitch Conv2D uses
  (``im2col._row_pitch``: an odd multiple of 64 bytes). A pitch that is a multiple of a
  large power of two maps the rows BLAS packs together onto the same cache sets.
- the transposed orientation Conv2D uses on NumPy, ``col^T (m, K) @ w^T (K, O)`` with w^T
  contiguous, plus the blocked transpose of its (m, O) result back to (O, m).
Prints the best-of-30 quarter-percentile GFLOP/s (the transposed column counts the
transpose's time too).
"""
import os
import sys
import time

os.environ["OPENBLAS_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"] = "1"
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from minidl.ops.im2col import _row_pitch  # noqa: E402
from minidl._transpose import transpose_into  # noqa: E402

# (stage, K, O, m): m = images per chunk * OH * row pitch of the flat rows
SHAPES = [("16ch 32x32", 144, 16, 6144), ("16ch 32x32", 144, 16, 6336), ("32ch 16x16", 288, 32, 3072),
          ("32ch 16x16", 288, 32, 3264), ("64ch 8x8", 576, 64, 1024), ("64ch 8x8", 576, 64, 1800)]


def gflops(run, flops, reps=30):
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return flops / sorted(times)[reps // 4] / 1e9


def main():
    rng = np.random.default_rng(0)
    print(f"one BLAS thread, float32, numpy {np.__version__}")
    print(f"{'stage':12s} {'K':>4s} {'O':>3s} {'m':>5s} | w @ col, pitch m | pitch {'(_row_pitch)':12s}: GFLOP/s"
          f" | col^T @ w^T + transpose")
    for stage, k, o, m in SHAPES:
        w = rng.random((o, k), dtype=np.float32)
        w_t = np.ascontiguousarray(w.T)
        out = np.empty((o, m), np.float32)
        out_t = np.empty((m, o), np.float32)
        packed = rng.random((k, m), dtype=np.float32)
        pitch = _row_pitch(m, 4)
        padded = rng.random((k, pitch), dtype=np.float32)[:, :m]
        flops = 2 * o * k * m

        def transposed():
            np.matmul(padded.T, w_t, out=out_t)
            transpose_into(np, out_t, out)
        print(f"{stage:12s} {k:4d} {o:3d} {m:5d} | {gflops(lambda: np.matmul(w, packed, out=out), flops):16.0f} | "
              f"{pitch:6d}       : {gflops(lambda: np.matmul(w, padded, out=out), flops):7.0f} | "
              f"{gflops(transposed, flops):23.0f}")


if __name__ == "__main__":
    main()
