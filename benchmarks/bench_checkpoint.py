"""What a checkpoint's integrity checks cost: save and load of a ~52 MB checkpoint, and the
CRC32 pass alone over the same bytes (the part the checksums add to each).

    python benchmarks/bench_checkpoint.py [--mb 52] [--repeats 7]

Save includes the fsyncs of the atomic write; load reads from the page cache (the file was
just written), where the checksum pass weighs most. Prints medians and the machine.
"""
import argparse
import os
import platform
import statistics
import tempfile
import time
import zlib

import numpy as np

import minidl


def median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=52.0, help="checkpoint size in MB (default 52)")
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    n = int(args.mb * 1e6 / 4 / 10)
    rng = np.random.default_rng(0)
    tensors = {f"layer{i}.weight": rng.standard_normal(n).astype(np.float32) for i in range(10)}
    nbytes = sum(a.nbytes for a in tensors.values())
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "net.ckpt")
        save = median_seconds(lambda: minidl.save_checkpoint(tensors, path), args.repeats)
        load = median_seconds(lambda: minidl.load_checkpoint(path), args.repeats)
    crc = median_seconds(lambda: [zlib.crc32(a) for a in tensors.values()], args.repeats)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"CPython {platform.python_version()}, NumPy {np.__version__}")
    print(f"checkpoint {nbytes / 1e6:.1f} MB in 10 float32 tensors, medians of {args.repeats}:")
    print(f"  save (with fsync)      {save * 1e3:8.1f} ms")
    print(f"  load (page cache)      {load * 1e3:8.1f} ms")
    print(f"  CRC32 pass alone       {crc * 1e3:8.1f} ms  ({nbytes / crc / 1e9:.1f} GB/s; paid once by save, once by load)")


if __name__ == "__main__":
    main()
