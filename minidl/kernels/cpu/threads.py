"""Intra-op parallelism on the CPU, and the one owner of minidl's thread counts.

Why: a convolution on the CPU is, per chunk of images, a padding copy, an im2col copy, a
GEMM and a transposing copy. NumPy runs the copies on one core, and OpenBLAS splits the
skinny GEMMs of small networks (16-64 output channels) badly over two. Running whole
chunks on separate threads, each calling a single-threaded BLAS, uses every core for all
four steps: the ResNet-20 convolutions measured 1.5x faster on 2 cores
(benchmarks/bench_train.py). NumPy releases the GIL in copies and in matmul, so Python
threads are enough.

One owner: :func:`set_num_threads` (``minidl.set_num_threads``) sets every pool minidl uses:
these intra-op threads, the BLAS the kernels call (blas.py: the OpenBLAS wheel's count, MKL's
per-call count) and oneDNN's convolutions (conv_onednn.py runs them on these threads, one chunk
of the batch each, on one OpenMP thread apiece). The count (thread_count.py) defaults to
``MINIDL_NUM_THREADS``, else the cores this process may run on (``os.sched_getaffinity``).
NumPy's own OpenBLAS (``numpy.matmul``) is NumPy's: minidl leaves its pool alone.

A chunk's GEMM must run on one thread while the others run theirs: so chunks run in parallel
only where the kernels' GEMMs go to a library whose count minidl sets (blas.py's
:func:`~minidl.kernels.cpu.blas.one_thread`, with the ``openblas`` or ``mkl`` extra); without
one they would be ``numpy.matmul`` on NumPy's pool, and the chunks run in turn on the calling
thread (:func:`blas_status` says which case holds). Work is split statically (chunk i to thread
i % T), so a result never depends on which thread was faster.

Sizes that depend on the caches come from this machine's sysfs (:func:`cache_sizes`,
:func:`l2_bytes`, :func:`min_parallel_bytes`), not from constants measured elsewhere.
"""
import glob
import os
import queue
import threading

import numpy

from .. import declare_option, get_option
from . import blas, thread_count

_lock = threading.Lock()
_state = {"pool": None}


class _WorkerFlag(threading.local):
    active = False  # True in a pool worker; a class-level default is fast to read (no AttributeError)


_worker = _WorkerFlag()


def blas_status():
    """In words: the BLAS whose threads minidl sets for the intra-op threads, or why ops run their
    chunks on one thread."""
    return blas.status()


# ---- how many threads ----

cores = thread_count.cores


def get_num_threads():
    """The threads minidl's CPU work may use (like ``torch.get_num_threads``): an op's chunks, the
    BLAS the kernels call, oneDNN."""
    return thread_count.get()


def set_num_threads(n):
    """Sets the threads of every pool minidl uses (like ``torch.set_num_threads``): the intra-op
    threads, the OpenBLAS wheel's count and MKL's per-call count (blas.py), and so oneDNN's
    convolutions, which run on the intra-op threads (conv_onednn.py). NumPy's own OpenBLAS, which ``numpy.matmul`` runs on, is not changed.

    Args:
        n: a positive int.
    """
    thread_count.put(n)
    blas.set_num_threads(n)
    with _lock:
        pool, _state["pool"] = _state["pool"], None
    if pool is not None:
        pool.close()


# ---- the pool ----

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
        while True:
            task = self.tasks.get()
            if task is None:
                return
            fn, i, done = task
            del task
            try:
                outcome = [(i, fn(i), None)]
            except BaseException as e:  # handed to the caller, which re-raises it
                outcome = [(i, None, e)]
            # The task's closure holds its op's arrays (activations, gradients): they go before the
            # caller hears back, as the caller's next op may ask the buffer pool for their blocks
            # (buffers.py: a block is free when nothing refers to it); this thread may be paused
            # after the put for long enough. The outcome travels in a list the caller empties, so
            # nothing this frame holds refers to the result either.
            del fn
            done.put(outcome)
            del outcome, done

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


def in_worker():
    """Whether this thread is one of the pool's (running another op's chunk)."""
    return _worker.active


def parallel_map(fn, n, calls_blas=True):
    """[fn(0), ..., fn(n-1)]: the caller runs fn(0), the pool's threads the rest; n <= get_num_threads().
    In turn on the calling thread where the kernels' BLAS is not one minidl sets (module docstring),
    unless ``calls_blas`` is False: the calls run no BLAS (oneDNN's convolutions), so they may run
    in parallel whichever BLAS there is.

    Every call finishes before this returns, also when one raises (the first error is then
    re-raised): callers share buffers between the calls' results.
    """
    if n == 1 or _worker.active:
        return [fn(i) for i in range(n)]
    if n > get_num_threads():
        raise ValueError(f"parallel_map: {n} calls for {get_num_threads()} threads")
    if calls_blas and not blas.chunks_may_run_in_parallel():
        return [fn(i) for i in range(n)]
    done = queue.SimpleQueue()
    pool = _pool()
    results, error = [None] * n, None
    # The OpenBLAS wheel's count is process-wide: it is 1 from before the first task is queued
    # until the last one is back, or a worker's GEMM could run on the full count, oversubscribing
    # the cores (MKL's global count is 1 always).
    with blas.one_thread():
        for i in range(1, n):
            pool.tasks.put((fn, i, done))
        try:
            results[0] = fn(0)
        except BaseException as e:
            error = e
        finally:
            for _ in range(n - 1):
                i, result, e = done.get().pop()
                results[i] = result
                error = error or e
    if error is not None:
        raise error
    return results


def sum_in_order(parts):
    """The threads' partial sums (arrays from parallel_map) added into the first, in thread order,
    so that a result never depends on which thread finished first."""
    for part in parts[1:]:
        parts[0] += part
    return parts[0]


def split(n_items, max_per_chunk, threads):
    """Chunks (start, stop) of at most max_per_chunk items, a multiple of ``threads`` of them
    where there are enough items, their sizes differing by at most one."""
    n_chunks = min(n_items, threads * -(-n_items // (threads * max(1, max_per_chunk))))
    base, extra = divmod(n_items, n_chunks)
    bounds = [0]
    for i in range(n_chunks):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds[:-1], bounds[1:]))


# ---- sizes from this machine's caches ----

SYSFS_CPUS = "/sys/devices/system/cpu"
# Where sysfs says nothing (not Linux, a container that hides it): the L2 of the 2-core Xeon
# (Sapphire Rapids class) the thresholds below were measured on, so they keep those values.
FALLBACK_L2_BYTES = 2 << 20
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _first_cpu():
    return min(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0


def cache_sizes(root=SYSFS_CPUS, cpu=None):
    """{level: bytes} of the data and unified caches of one CPU (the first this process may run
    on), read from ``root``/cpuN/cache/index*/{level,type,size}; {} where there is no such tree.

    ``root`` is a parameter so a test can hand it a fake tree.
    """
    cpu = _first_cpu() if cpu is None else cpu
    sizes = {}
    for index in sorted(glob.glob(os.path.join(root, f"cpu{cpu}", "cache", "index*"))):
        try:
            fields = {}
            for name in ("level", "type", "size"):
                with open(os.path.join(index, name)) as f:
                    fields[name] = f.read().strip()
            if fields["type"] == "Instruction":
                continue
            size = fields["size"].upper().removesuffix("B")
            number, unit = (size[:-1], size[-1]) if size[-1:] in _UNITS else (size, "")
            sizes[int(fields["level"])] = int(number) * _UNITS[unit]
        except (OSError, ValueError):
            continue  # an unreadable or odd entry: skip it, the caller has a fallback
    return sizes


def l2_bytes(root=SYSFS_CPUS, cpu=None):
    """The L2 cache of the first CPU this process may run on (or ``cpu``), in bytes, from
    sysfs, else ``FALLBACK_L2_BYTES``: the cache one thread's working block should fit.
    The machine's own answer is read once and kept."""
    own = root == SYSFS_CPUS and cpu is None
    if own and "l2" in _state:
        return _state["l2"]
    size = cache_sizes(root, cpu).get(2) or FALLBACK_L2_BYTES
    if own:
        _state["l2"] = size
    return size


def _min_parallel_bytes(l2):
    # An elementwise pass over an array that fits one core's L2 runs from that cache on the
    # thread that wrote it; split over threads, the other cores fetch their part from L3 first.
    # BatchNorm on 4 MB measured 1.5x faster on 2 threads, on 2 MB no faster (2 MB L2 Xeon,
    # benchmarks/bench_train.py): so split from 1.5x the L2 on.
    return 3 * l2 // 2


# The value as a constant, for code written before the option; call min_parallel_bytes().
MIN_PARALLEL_BYTES = _min_parallel_bytes(l2_bytes())
declare_option("parallel_min_bytes", MIN_PARALLEL_BYTES,
               "map_rows splits a NumPy array over the intra-op threads from this many bytes on "
               "(default: 1.5x this machine's L2, from sysfs)")


def min_parallel_bytes():
    """Bytes from which an elementwise pass is split over the intra-op threads: the
    ``parallel_min_bytes`` kernels option, by default 1.5x :func:`l2_bytes`."""
    return get_option("parallel_min_bytes")


def map_rows(xp, a, fn):
    """[fn(start, stop) for blocks of a's first axis], one block per thread when a is a NumPy
    array of at least :func:`min_parallel_bytes`, else one block: for passes whose per-block
    results (partial sums) the caller combines in block order."""
    threads = 1
    if xp is numpy and a.nbytes >= min_parallel_bytes():
        threads = min(get_num_threads(), a.shape[0])
    if threads <= 1:
        return [fn(0, a.shape[0])]
    blocks = split(a.shape[0], -(-a.shape[0] // threads), threads)
    return parallel_map(lambda t: fn(*blocks[t]), len(blocks))
