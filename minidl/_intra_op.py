"""Intra-op parallelism on the CPU: the chunks of one op on a few threads, one BLAS thread each.

Why: a convolution on the CPU is, per chunk of images, a padding copy, an im2col copy, a
GEMM and a transposing copy. NumPy runs the copies on one core, and OpenBLAS splits the
skinny GEMMs of small networks (16-64 output channels) badly over two. Running whole
chunks on separate threads, each calling a single-threaded BLAS, uses every core for all
four steps: the ResNet-20 convolutions measured 1.5x faster on 2 cores
(benchmarks/bench_train.py). NumPy releases the GIL in copies and in matmul, so Python
threads are enough.

A single-threaded BLAS for one thread only needs OpenBLAS's thread-local setting
(``openblas_set_num_threads_local``, OpenBLAS >= 0.3.27, which NumPy's wheels ship). NumPy's
build configuration (``numpy.show_config``) says which BLAS it uses; the OpenBLAS library is
the one the wheel vendors in ``numpy.libs``, or one threadpoolctl (optional) sees loaded.
Where there is none with that setting (another BLAS, an older OpenBLAS, a build whose
library neither finds), ops run their chunks serially on one thread: :func:`blas_status`
says which case holds and why.

The thread count follows the BLAS's (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, else its
default), at most the cores this process may run on (``os.sched_getaffinity``), so a
framework comparison at N threads means N here too; ``MINIDL_NUM_THREADS`` overrides it and
1 turns this off. Work is split statically (chunk i to thread i % T), so a result never
depends on which thread was faster.

Sizes that depend on the caches come from this machine's sysfs (:func:`cache_sizes`,
:func:`l2_bytes`, :func:`min_parallel_bytes`), not from constants measured elsewhere.
"""
import ctypes
import glob
import os
import queue
import threading

import numpy

from .kernels import declare_option, get_option

_SET_LOCAL = "openblas_set_num_threads_local"
_GET_THREADS = ("openblas_get_num_threads", "scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_")
_DETECT = object()  # "find NumPy's OpenBLAS" where a test passes a library (or None) instead

_lock = threading.Lock()
_state = {"blas": None, "blas_status": None, "threads": None, "pool": None}


class _WorkerFlag(threading.local):
    active = False  # True in a pool worker; a class-level default is fast to read (no AttributeError)


_worker = _WorkerFlag()


# ---- which BLAS: NumPy's build configuration, then the library itself ----

def numpy_blas_name(config=None):
    """The BLAS NumPy was built with, lower case ('scipy-openblas', 'accelerate', 'mkl', ...),
    from ``numpy.show_config(mode="dicts")`` or the given ``config`` dict; '' when it does not say."""
    if config is None:
        config = numpy.show_config(mode="dicts")
    return str(config.get("Build Dependencies", {}).get("blas", {}).get("name", "")).lower()


def openblas_paths():
    """Files that may hold NumPy's OpenBLAS: the wheel's vendored copy (``numpy.libs``) first,
    then every OpenBLAS that threadpoolctl (optional) sees loaded in this process."""
    libs = os.path.join(os.path.dirname(numpy.__file__), os.pardir, "numpy.libs")
    paths = sorted(glob.glob(os.path.join(libs, "*openblas*")))
    try:
        import threadpoolctl
    except ImportError:
        pass
    else:
        paths += [info["filepath"] for info in threadpoolctl.threadpool_info() if info.get("internal_api") == "openblas"]
    return list(dict.fromkeys(os.path.realpath(p) for p in paths))


def find_openblas(blas_name, paths):
    """(library, why): the first of ``paths`` that loads and has OpenBLAS's thread-local thread
    count, as a ctypes library, else None; ``why`` says what was found, in words.

    ``blas_name`` is NumPy's BLAS (:func:`numpy_blas_name`); one that is not OpenBLAS means
    there is nothing to look for (its own threads would fight with ours: ops stay serial).
    """
    if blas_name and "openblas" not in blas_name:
        return None, f"NumPy's BLAS is {blas_name!r}, not OpenBLAS: CPU ops run their chunks on one thread"
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, _SET_LOCAL):
            getattr(lib, _SET_LOCAL).restype = ctypes.c_int
            return lib, f"OpenBLAS with a thread-local thread count: {path}"
    if not paths:
        return None, ("NumPy's OpenBLAS was not found (no numpy.libs copy; threadpoolctl, optional, absent or "
                      "seeing none): CPU ops run their chunks on one thread")
    return None, (f"no {_SET_LOCAL} (OpenBLAS >= 0.3.27) in {', '.join(paths)}: "
                  "CPU ops run their chunks on one thread")


def _openblas():
    """NumPy's OpenBLAS as a ctypes library with the thread-local setter, or False (found once)."""
    if _state["blas"] is None:
        lib, _state["blas_status"] = find_openblas(numpy_blas_name(), openblas_paths())
        _state["blas"] = lib or False
    return _state["blas"]


def blas_status():
    """In words: the BLAS the intra-op threads control, or why ops run their chunks on one thread."""
    _openblas()
    return _state["blas_status"]


# ---- how many threads ----

def cores():
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _default_threads(environ=None, lib=_DETECT):
    """MINIDL_NUM_THREADS when set, else the BLAS's thread count capped at :func:`cores`; 1 where
    ``lib`` (NumPy's OpenBLAS unless given) has no thread-local setting."""
    environ = os.environ if environ is None else environ
    env = environ.get("MINIDL_NUM_THREADS")
    n = None
    if env:
        try:
            n = int(env)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"MINIDL_NUM_THREADS must be a positive int, got {env!r}")
    lib = _openblas() if lib is _DETECT else lib
    if not lib:
        return 1  # no per-thread BLAS control: the threads would fight over the BLAS's own
    if n is not None:
        return n
    for name in _GET_THREADS:
        if hasattr(lib, name):
            return max(1, min(int(getattr(lib, name)()), cores()))
    return cores()


def get_num_threads():
    """Threads one CPU op may use for its chunks (1: serial), like ``torch.get_num_threads``."""
    if _state["threads"] is None:
        _state["threads"] = _default_threads()
    return _state["threads"]


def set_num_threads(n):
    """Sets the threads a CPU op may use for its chunks (like ``torch.set_num_threads``).

    n > 1 needs NumPy's OpenBLAS with a thread-local thread count; without it ops stay
    serial (:func:`blas_status` says why). The BLAS's own thread count (for GEMMs outside
    these ops) is not changed.
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"set_num_threads: n must be a positive int, got {n!r}")
    with _lock:
        _state["threads"] = n if n == 1 or _openblas() else 1
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
            # This frame waits for the next task, maybe for long: the finished one's closure holds
            # its op's arrays (activations, gradients), which must not outlive the step.
            del task, fn, done

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
    results, error = [None] * n, None
    lib = _openblas()
    # NumPy's OpenBLAS (0.3.31) keeps this count per process, not per thread as its name says: so it
    # is 1 from before the first task is queued until the last one is back, or a worker's GEMM could
    # run on the caller's full count of BLAS threads, oversubscribing the cores.
    previous = lib.openblas_set_num_threads_local(1)
    try:
        for i in range(1, n):
            pool.tasks.put((fn, i, done))
        try:
            results[0] = fn(0)
        except BaseException as e:
            error = e
        finally:
            for _ in range(n - 1):
                i, result, e = done.get()
                results[i] = result
                error = error or e
    finally:
        lib.openblas_set_num_threads_local(previous)
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
