"""Intra-op parallelism on the CPU: the chunks of one op on a few threads, one BLAS thread each.

Why: a convolution on the CPU is, per chunk of images, a padding copy, an im2col copy, a
GEMM and a transposing copy. NumPy runs the copies on one core, and OpenBLAS splits the
skinny GEMMs of small networks (16-64 output channels) badly over two. Running whole
chunks on separate threads, each calling a single-threaded BLAS, uses every core for all
four steps: the ResNet-20 convolutions measured 1.5x faster on 2 cores
(benchmarks/bench_train.py). NumPy releases the GIL in copies and in matmul, so Python
threads are enough.

A single-threaded BLAS for one thread only needs OpenBLAS's thread-local setting
(``openblas_set_num_threads_local``, OpenBLAS >= 0.3.27, which NumPy's wheels ship); where
it is missing (another BLAS, an older OpenBLAS) ops run their chunks serially as before.

The thread count follows the BLAS's (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, else the
cores), so a framework comparison at N threads means N here too; ``MINIDL_NUM_THREADS``
overrides it and 1 turns this off. Work is split statically (chunk i to thread i % T), so
a result never depends on which thread was faster.
"""
import ctypes
import glob
import os
import queue
import threading

import numpy

_SET_LOCAL = "openblas_set_num_threads_local"
_GET_THREADS = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_")

_lock = threading.Lock()
_state = {"blas": None, "threads": None, "pool": None}
class _WorkerFlag(threading.local):
    active = False  # True in a pool worker; a class-level default is fast to read (no AttributeError)


_worker = _WorkerFlag()


def _openblas():
    """NumPy's OpenBLAS as a ctypes library with the thread-local setter, or False."""
    if _state["blas"] is None:
        _state["blas"] = False
        candidates = []
        try:
            with open("/proc/self/maps") as maps:
                candidates = sorted({line.split()[-1] for line in maps if "openblas" in line.lower()})
        except OSError:
            pass
        libs_dir = os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs")
        candidates += glob.glob(os.path.join(libs_dir, "*openblas*"))
        for path in candidates:
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if hasattr(lib, _SET_LOCAL):
                lib.openblas_set_num_threads_local.restype = ctypes.c_int
                _state["blas"] = lib
                break
    return _state["blas"]


def _default_threads():
    env = os.environ.get("MINIDL_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"MINIDL_NUM_THREADS must be a positive int, got {env!r}") from None
        if n < 1:
            raise ValueError(f"MINIDL_NUM_THREADS must be a positive int, got {env!r}")
    else:
        n = None
    lib = _openblas()
    if not lib:
        return 1  # no per-thread BLAS control: the threads would fight over the BLAS's own
    if n is not None:
        return n
    for name in _GET_THREADS:
        if hasattr(lib, name):
            return max(1, int(getattr(lib, name)()))
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def get_num_threads():
    """Threads one CPU op may use for its chunks (1: serial), like ``torch.get_num_threads``."""
    if _state["threads"] is None:
        _state["threads"] = _default_threads()
    return _state["threads"]


def set_num_threads(n):
    """Sets the threads a CPU op may use for its chunks (like ``torch.set_num_threads``).

    n > 1 needs NumPy's OpenBLAS with a thread-local thread count; without it ops stay
    serial. The BLAS's own thread count (for GEMMs outside these ops) is not changed.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"set_num_threads: n must be a positive int, got {n!r}")
    with _lock:
        _state["threads"] = n if n == 1 or _openblas() else 1
        pool, _state["pool"] = _state["pool"], None
    if pool is not None:
        pool.close()


class _Pool:
    """Worker threads that run (fn, i) tasks with a single-threaded BLAS."""

    def __init__(self, size):
        self.pid = os.getpid()
        self.tasks = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, name=f"minidl-intra-op-{i}", daemon=True)
                        for i in range(size)]
        for t in self.threads:
            t.start()

    def _work(self):
        _worker.active = True
        _openblas().openblas_set_num_threads_local(1)
        while True:
            task = self.tasks.get()
            if task is None:
                return
            fn, i, done = task
            try:
                done.put((i, fn(i), None))
            except BaseException as e:  # handed to the caller, which re-raises it
                done.put((i, None, e))

    def close(self):
        for _ in self.threads:
            self.tasks.put(None)


def _pool():
    with _lock:
        pool = _state["pool"]
        if pool is None or pool.pid != os.getpid():
            # A forked child inherits the pool object but not its threads: make a new one.
            pool = _state["pool"] = _Pool(get_num_threads() - 1)
        return pool


def parallel_map(fn, n):
    """[fn(0), ..., fn(n-1)]: the caller runs fn(0), the pool's threads the rest; n <= get_num_threads().

    Every call finishes before this returns, also when one raises (the first error is then
    re-raised): callers share buffers between the calls' results.
    """
    if n == 1 or _worker.active:
        return [fn(i) for i in range(n)]
    if n > get_num_threads():
        raise ValueError(f"parallel_map: {n} calls for {get_num_threads()} threads")
    done = queue.SimpleQueue()
    pool = _pool()
    for i in range(1, n):
        pool.tasks.put((fn, i, done))
    results, error = [None] * n, None
    lib = _openblas()
    previous = lib.openblas_set_num_threads_local(1)
    try:
        results[0] = fn(0)
    except BaseException as e:
        error = e
    finally:
        lib.openblas_set_num_threads_local(previous)
        for _ in range(n - 1):
            i, result, e = done.get()
            results[i] = result
            error = error or e
    if error is not None:
        raise error
    return results


def split(n_items, max_per_chunk, threads):
    """Chunks (start, stop) of at most max_per_chunk items, a multiple of ``threads`` of them
    where there are enough items, their sizes differing by at most one."""
    n_chunks = min(n_items, threads * -(-n_items // (threads * max(1, max_per_chunk))))
    base, extra = divmod(n_items, n_chunks)
    bounds = [0]
    for i in range(n_chunks):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds[:-1], bounds[1:]))


# Below this many bytes an elementwise pass is not worth a thread handoff (~40 us): BatchNorm
# on 4 MB measured 1.5x faster on 2 threads, on 2 MB no faster (benchmarks/bench_train.py).
MIN_PARALLEL_BYTES = 3 << 20


def map_rows(xp, a, fn):
    """[fn(start, stop) for blocks of a's first axis], one block per thread when a is a NumPy
    array of at least MIN_PARALLEL_BYTES, else one block: for passes whose per-block
    results (partial sums) the caller combines in block order."""
    threads = 1
    if xp is numpy and a.nbytes >= MIN_PARALLEL_BYTES:
        threads = min(get_num_threads(), a.shape[0])
    if threads <= 1:
        return [fn(0, a.shape[0])]
    blocks = split(a.shape[0], -(-a.shape[0] // threads), threads)
    return parallel_map(lambda t: fn(*blocks[t]), len(blocks))
