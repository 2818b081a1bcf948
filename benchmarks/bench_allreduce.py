"""All-reduce bandwidth: minidl_parallel's mpi communicator vs raw mpi4py, on the same buffers.

    mpirun --oversubscribe -n 2 python benchmarks/bench_allreduce.py
    mpirun --oversubscribe -n 4 python benchmarks/bench_allreduce.py --max-bytes 16M --repeats 3

(As root add ``--allow-run-as-root`` or set OMPI_ALLOW_RUN_AS_ROOT=1 and
OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.)

For float32 buffers of 4 KB to 64 MB (powers of 4) it times, per size:

    raw        comm.Allreduce(MPI.IN_PLACE, buf)              (mpi4py, the reference)
    raw_oop    comm.Allreduce(buf, np.empty_like(buf))        (mpi4py, into a new array; optional)
    iallreduce_  communicator.iallreduce_(buf).wait()         (ours, non-blocking, as the reducer; optional)
    raw_i      comm.Iallreduce(MPI.IN_PLACE, buf).Wait()      (mpi4py, non-blocking; optional)
    allreduce_ communicator.allreduce_(buf)                   (ours, in place)
    allreduce  communicator.allreduce(buf)                    (ours, returns a new array)
    mean_      communicator.allreduce_(buf, "mean")           (ours, in place, sum then / size)
    raw_f16    comm.Allreduce(MPI.IN_PLACE, half)             (mpi4py, MPI's float16 SUM; optional)
    allreduce_f16  communicator.allreduce_(half)              (ours: a NumPy-vectorised float16 sum; optional)

(the f16 variants reduce a float16 buffer of as many elements: half the bytes.)

and prints time, algbw = bytes / time and busbw = algbw * 2 (n - 1) / n, the bus bandwidth
of nccl-tests for all-reduce (what each rank's link carries; comparable across n), and the
ratio ours / raw (raw time / our time; 1.00 = as fast as raw mpi4py).

The variants alternate within each round, and the best round of each is kept: this measures
the code around the collective, not whatever else was running on the machine at that moment.
A round's time is the slowest rank's (a collective is as slow as its slowest rank).
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def parse_bytes(text):
    text = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * mult)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-bytes", type=parse_bytes, default="4K")
    p.add_argument("--max-bytes", type=parse_bytes, default="64M")
    p.add_argument("--factor", type=int, default=4, help="size step (2 or 4)")
    p.add_argument("--repeats", type=int, default=5, help="alternating rounds; the best is kept")
    p.add_argument("--round-bytes", type=parse_bytes, default="256M",
                   help="bytes all-reduced per variant per round (sets the iterations per size)")
    p.add_argument("--variants", default="raw,allreduce_,allreduce,mean_",
                   help="comma-separated, from raw, allreduce_, allreduce, mean_, raw_oop, iallreduce_, raw_i, "
                        "raw_f16, allreduce_f16")
    return p.parse_args()


def fmt_bytes(n):
    for unit, div in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= div:
            return f"{n / div:g} {unit}"
    return f"{n} B"


def main():
    args = parse_args()
    import minidl_parallel as mp
    from mpi4py import MPI

    comm = mp.init("mpi")
    raw = MPI.COMM_WORLD
    n, rank = comm.size, comm.rank

    halves = {}

    def half(b):  # a float16 buffer of b's element count (zeros: sums stay finite)
        return halves.setdefault(b.size, np.zeros(b.size, dtype=np.float16))

    variants = {
        "raw": lambda b: raw.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM),
        "raw_f16": lambda b: raw.Allreduce(MPI.IN_PLACE, half(b), op=MPI.SUM),
        "allreduce_f16": lambda b: comm.allreduce_(half(b)),
        "allreduce_": lambda b: comm.allreduce_(b),
        "allreduce": lambda b: comm.allreduce(b),
        "raw_oop": lambda b: raw.Allreduce(b, np.empty_like(b), op=MPI.SUM),
        "iallreduce_": lambda b: comm.iallreduce_(b).wait(),
        "raw_i": lambda b: raw.Iallreduce(MPI.IN_PLACE, b, op=MPI.SUM).Wait(),
        "mean_": lambda b: comm.allreduce_(b, "mean"),
    }
    names = [v for v in args.variants.split(",") if v]
    for v in names:
        if v not in variants:
            raise SystemExit(f"bench_allreduce: unknown variant {v!r}; choose from {sorted(variants)}")
    if "raw" not in names:
        names.insert(0, "raw")

    if rank == 0:
        import platform
        import mpi4py
        print(f"machine: {platform.machine()}, {os.cpu_count()} cores; ranks={n}; mpi4py {mpi4py.__version__}; "
              f"{MPI.Get_library_version().splitlines()[0].strip()}; float32, op=sum unless noted; "
              f"best of {args.repeats} alternating rounds", flush=True)
        print(f"algbw = bytes / time, busbw = algbw * 2(n-1)/n = algbw * {2 * (n - 1) / n:.2f}, both in GB/s "
              f"(1e9 B/s); /raw = raw time / our time", flush=True)
        head = f"{'size':>8s} {'iters':>5s}"
        for v in names:
            head += f" | {v + ' us':>14s} {'algbw':>6s} {'busbw':>6s}"
            if v != "raw":
                head += f" {'/raw':>5s}"
        print(head, flush=True)

    size = args.min_bytes
    while size <= args.max_bytes:
        count = max(1, size // 4)
        # Zeros stay zeros under repeated in-place sums: no overflow to inf over many iterations.
        buf = np.zeros(count, dtype=np.float32)
        iters = int(min(1000, max(3, args.round_bytes // max(size, 1))))
        best = {v: float("inf") for v in names}
        for v in names:  # warm up: first-touch pages, MPI's shared-memory segments
            variants[v](buf)
        for _ in range(args.repeats):
            for v in names:
                fn = variants[v]
                raw.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(buf)
                dt = (time.perf_counter() - t0) / iters
                dt = raw.allreduce(dt, op=MPI.MAX)
                best[v] = min(best[v], dt)
        if rank == 0:
            nbytes = count * 4
            line = f"{fmt_bytes(nbytes):>8s} {iters:5d}"
            for v in names:
                t = best[v]
                algbw = nbytes / t / 1e9
                line += f" | {t * 1e6:14.1f} {algbw:6.2f} {algbw * 2 * (n - 1) / n:6.2f}"
                if v != "raw":
                    line += f" {best['raw'] / t:5.2f}"
            print(line, flush=True)
        size *= args.factor
    mp.release()


if __name__ == "__main__":
    main()
