"""Memory bandwidth of this machine, for one thread and for several: what bounds BatchNorm, ReLU and
the copies around the convolutions' GEMMs on the CPU.

    python benchmarks/bench_memory.py                # threads = cpu count
    python benchmarks/bench_memory.py --mb 64 --threads 4

Times ``numpy.copyto`` of a --mb MiB float32 array (read + write), whole on one thread and
split into equal parts over --threads threads (NumPy releases the GIL in copies), and of a
1 MiB array that stays in cache. Prints GB/s as bytes read plus bytes written, the best
of --repeats. When the threaded figure is not much above the single-thread one, an
elementwise pass over a large array does not get faster with more threads, however it is
split: only fewer passes (or passes over cache-sized blocks) help.
"""
import argparse
import os
import threading
import time

import numpy as np


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=int, default=32, help="MiB per array for the out-of-cache copies")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=10)
    return p.parse_args()


def best_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def threaded_copy(dst, src, threads):
    """Copies src into dst in ``threads`` equal parts, one per thread."""
    bounds = np.linspace(0, src.size, threads + 1).astype(int)
    workers = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b])) for a, b in zip(bounds[1:-1], bounds[2:])]
    for w in workers:
        w.start()
    np.copyto(dst[:bounds[1]], src[:bounds[1]])
    for w in workers:
        w.join()


def main():
    args = parse_args()
    n = (args.mb << 20) // 4
    src, dst = np.ones(n, np.float32), np.empty(n, np.float32)
    np.copyto(dst, src)  # fault the pages in before timing
    moved = 2 * src.nbytes / 1e9
    one = moved / best_seconds(lambda: np.copyto(dst, src), args.repeats)
    many = moved / best_seconds(lambda: threaded_copy(dst, src, args.threads), args.repeats)
    small_src, small_dst = np.ones((1 << 20) // 4, np.float32), np.empty((1 << 20) // 4, np.float32)
    inner = 50

    def small():
        for _ in range(inner):
            np.copyto(small_dst, small_src)
    cached = inner * 2 * small_src.nbytes / 1e9 / best_seconds(small, args.repeats)
    print(f"numpy {np.__version__}, {os.cpu_count()} cores")
    print(f"copy {args.mb} MiB, 1 thread: {one:6.1f} GB/s")
    print(f"copy {args.mb} MiB, {args.threads} thread(s): {many:6.1f} GB/s ({many / one:.2f}x)")
    print(f"copy 1 MiB (in cache), 1 thread: {cached:6.1f} GB/s")


if __name__ == "__main__":
    main()
