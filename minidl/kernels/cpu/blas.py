"""GEMM straight into a BLAS library, for kernels that need what ``numpy.matmul`` cannot say.

``numpy.matmul`` always overwrites its output and takes whole arrays. The tap convolution
(taps.py here) sums one GEMM per kernel offset into the same output, ``C = A @ B + C``, with
operands that start anywhere in a flat buffer: that is BLAS's ``beta = 1`` and a base pointer
with a leading dimension, one ``cblas_?gemm`` call, made through ctypes (which releases the
GIL, so the intra-op threads run their GEMMs at once).

Only libraries minidl declares as dependencies are bound, each through its documented interface
(never a copy another package vendors for itself, such as NumPy's in ``numpy.libs``). Which one
(the ``blas`` option):
- ``"openblas"``: the ``scipy-openblas64`` wheel (a dependency of minidl), found by its
  documented ``get_lib_dir()`` / ``get_library()``; its ``scipy_``-prefixed, 64-bit-integer
  symbols are its documented API. A library of its own, so its thread count is minidl's and
  NumPy's own OpenBLAS (``numpy.matmul``) keeps its pool.
- ``"mkl"``: Intel's MKL (``pip install 'minidl[mkl]'``, PyPI's ``mkl``): its ``mkl_rt`` as the
  wheel's file list (``importlib.metadata``) names it. On the conv kernels' GEMM shapes (16-64
  output channels, a few thousand columns) it measured 1.2-1.5x OpenBLAS's speed on one core
  (benchmarks/bench_gemm.py --direct).
- None: MKL when it is installed, else the OpenBLAS wheel. The default is ``$MINIDL_BLAS`` when set.
Without either :func:`available` is false and kernels take their NumPy routes (threads.py then
runs an op's chunks on one thread). :func:`library` says which is in use.

Threads (threads.py owns the count, ``minidl.set_num_threads``). OpenBLAS: its process-wide count
is the thread count, and 1 while intra-op threads run chunks (:func:`one_thread`). MKL is loaded
with its Intel OpenMP threading layer and its global count 1 (so a call from an intra-op thread
never starts a team of its own); a MatMul's call (kernels/cpu/matmul.py) sets its ``threads``
thread-locally for that call. Intel OpenMP's threads spin after a parallel region for the
blocktime of the thread that started it, 200 ms by default (``KMP_BLOCKTIME``), on cores the
intra-op threads then need (the user-written ResNet-20's step took 1.29x the CPU time with them:
docs/performance.md). So a
threaded call also sets the calling thread's blocktime (``kmp_set_blocktime``, Intel OpenMP's
runtime API) to ``MINIDL_OMP_BLOCKTIME_MS`` (default 1 ms: 300 us made the MLP's step slower,
its threads then sleeping before the next GEMM) and gives the thread its own value back after
it: only the teams of minidl's GEMMs wait so briefly, and nothing is written to the environment.
"""
import contextlib
import ctypes
import importlib.metadata
import importlib.util
import os
import threading
import warnings

import numpy

from .. import declare_option, get_option
from . import thread_count

__all__ = ["available", "library", "installed", "load", "gemm", "gemm_for", "matmul", "address", "status",
           "set_num_threads", "num_threads", "one_thread", "chunks_may_run_in_parallel"]

declare_option("blas", os.environ.get("MINIDL_BLAS") or None,
               "the BLAS the CPU kernels call directly: 'mkl', 'openblas' (the scipy-openblas64 wheel), or "
               "None: MKL when installed (pip install 'minidl[mkl]'), else that OpenBLAS (a dependency, "
               "scipy-openblas64); default: $MINIDL_BLAS")

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_INTEL_THREADS = 0  # MKL_Set_Threading_Layer's MKL_THREADING_INTEL (Intel OpenMP)
_OPENBLAS_WHEEL = "scipy_openblas64"
_BLOCKTIME_VARIABLE = "MINIDL_OMP_BLOCKTIME_MS"
_BLOCKTIME_DEFAULT_MS = 1
_found = {}  # library name -> {dtype char: ctypes gemm} ({} when that library is absent)
_refused = {}  # library name -> why it was found but not used
_set_local = {}  # library name -> its thread-local "n threads" setter (returns the previous setting)
_blocktime = {}  # library name -> (get, set) of its OpenMP's blocktime of the calling thread, and the ms wanted
_counts = {}  # library name -> (set process-wide count, get count) as ctypes functions
_lock = threading.Lock()
_one_thread = {"depth": 0}  # how many one_thread blocks are open (intra-op maps, maybe from several threads)


def _bind(lib, prefix, suffix, blas_int):
    """{dtype char: gemm} from lib's ``{prefix}?gemm{suffix}``, or {} when it lacks them."""
    names = {"f": f"{prefix}sgemm{suffix}", "d": f"{prefix}dgemm{suffix}"}
    if not all(hasattr(lib, n) for n in names.values()):
        return {}
    fns = {}
    for char, name in names.items():
        scalar = ctypes.c_float if char == "f" else ctypes.c_double
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = ([ctypes.c_int] * 3 + [blas_int] * 3 + [scalar, ctypes.c_void_p, blas_int,
                       ctypes.c_void_p, blas_int, scalar, ctypes.c_void_p, blas_int])
        fns[char] = fn
    return fns


def _mkl_paths():
    """MKL's single dynamic library, ``libmkl_rt.so*``, as the ``mkl`` wheel's file list names it."""
    try:
        files = importlib.metadata.files("mkl") or []
    except importlib.metadata.PackageNotFoundError:
        return []
    return sorted(str(f.locate()) for f in files if f.name.startswith("libmkl_rt.so"))


def _openblas_path():
    """The ``scipy-openblas64`` wheel's library, through its documented ``get_lib_dir`` and
    ``get_library``; None where the wheel is not installed. Importing the wheel loads it."""
    if importlib.util.find_spec(_OPENBLAS_WHEEL) is None:
        return None
    wheel = importlib.import_module(_OPENBLAS_WHEEL)
    return os.path.join(wheel.get_lib_dir(), wheel.get_library(fullname=True))


def installed(name):
    """Whether library ``name`` ('mkl' or 'openblas') is installed, without loading it."""
    if name == "mkl":
        return bool(_mkl_paths())
    return importlib.util.find_spec(_OPENBLAS_WHEEL) is not None


def status():
    """In words: the library the kernels' GEMMs call and who sets its threads, or why there is none."""
    try:
        name = library()
    except RuntimeError as e:
        return f"{e}: CPU ops run their chunks on one thread"
    if name is None:
        refused = "".join(f" ({why})" for why in _refused.values())
        return ("no BLAS minidl binds is installed (pip install scipy-openblas64, a dependency, or 'minidl[mkl]')"
                f"{refused}: kernels take their NumPy routes and CPU ops run their chunks on one thread")
    return f"{name}: its GEMMs on minidl's thread count, one thread each in the intra-op threads"


def blocktime_ms(environ=None):
    """How long (ms) MKL's OpenMP threads wait for more work after a GEMM minidl ran on them:
    ``MINIDL_OMP_BLOCKTIME_MS`` (a whole number, 0 or more), default 1; ValueError naming it."""
    text = (os.environ if environ is None else environ).get(_BLOCKTIME_VARIABLE)
    if not text:
        return _BLOCKTIME_DEFAULT_MS
    if not text.strip().isdigit():
        raise ValueError(f"{_BLOCKTIME_VARIABLE} must be a whole number of milliseconds (0 or more), got {text!r}")
    return int(text)


def _load_openblas():
    path = _openblas_path()
    if path is None:
        return {}
    lib = ctypes.CDLL(path)
    fns = _bind(lib, "scipy_cblas_", "64_", ctypes.c_int64)  # the wheel's ILP64 names
    if fns:
        set_count, get_count = lib.scipy_openblas_set_num_threads64_, lib.scipy_openblas_get_num_threads64_
        set_count.argtypes, set_count.restype = [ctypes.c_int], None
        get_count.argtypes, get_count.restype = [], ctypes.c_int
        _counts["openblas"] = (set_count, get_count)
        with _lock:
            if _one_thread["depth"] == 0:
                set_count(thread_count.get())
            else:
                set_count(1)
    return fns


def _load_mkl():
    fns = {}
    for path in _mkl_paths():
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        lib.MKL_Set_Threading_Layer(_MKL_INTEL_THREADS)
        lib.MKL_Set_Num_Threads(1)  # threads come per call (matmul's threads), thread-locally
        lib.MKL_Get_Max_Threads()  # starts its OpenMP runtime, loading libiomp5
        fns = _bind(lib, "cblas_", "", ctypes.c_int)  # mkl_rt's default interface is LP64
        if fns and not _products_agree(fns, lib.MKL_Set_Num_Threads_Local):
            # Seen with PyTorch imported first: its MKL's symbols, already in the process, take
            # the place of some of this one's, and GEMMs come out wrong. Never silently wrong.
            _refused["mkl"] = (f"MKL ({path}) was loaded after another copy of MKL in this process "
                               f"(e.g. PyTorch's, when torch is imported before minidl's kernels "
                               f"first run) and its GEMMs disagree with NumPy's")
            warnings.warn(f"minidl: {_refused['mkl']}; the CPU kernels use the OpenBLAS wheel (or NumPy) instead "
                          f"(to keep MKL, call minidl.kernels.cpu.blas.load('mkl') before importing torch; "
                          f"MINIDL_BLAS=openblas chooses OpenBLAS without this warning)", RuntimeWarning,
                          stacklevel=3)
            fns = {}
        if fns:
            set_local = lib.MKL_Set_Num_Threads_Local
            set_local.argtypes, set_local.restype = [ctypes.c_int], ctypes.c_int
            _set_local["mkl"] = set_local
            _blocktime["mkl"] = _openmp_blocktime()
            get_count = lib.MKL_Get_Max_Threads
            get_count.restype = ctypes.c_int
            _counts["mkl"] = (None, get_count)  # its global count stays 1 (see the module docstring)
            break
    return fns


def _openmp_blocktime():
    """(kmp_get_blocktime, kmp_set_blocktime, ms wanted) of the Intel OpenMP runtime MKL loaded,
    None where it has none (another threading layer, or no such symbols)."""
    try:
        iomp = ctypes.CDLL("libiomp5.so", mode=os.RTLD_NOLOAD)  # the one loaded: never a new copy
        get, put = iomp.kmp_get_blocktime, iomp.kmp_set_blocktime
    except (OSError, AttributeError):
        return None
    get.argtypes, get.restype = [], ctypes.c_int
    put.argtypes, put.restype = [ctypes.c_int], None
    return get, put, blocktime_ms()


@contextlib.contextmanager
def _short_blocktime(name):
    """The calling thread's OpenMP blocktime is the wanted one (:func:`blocktime_ms`) for a threaded
    GEMM of library ``name``, then its own again (module docstring)."""
    entry = _blocktime.get(name)
    if entry is None:
        yield
        return
    get, put, wanted = entry
    own = get()
    put(wanted)
    try:
        yield
    finally:
        put(own)


def load(name):
    """{dtype char: gemm} of library ``name`` ('mkl' or 'openblas'), loading it once; {} when absent."""
    if name not in _found:
        _found[name] = _load_openblas() if name == "openblas" else _load_mkl()
    return _found[name]


def set_num_threads(n):
    """Gives the loaded OpenBLAS ``n`` threads (a library loaded later reads thread_count at its load;
    inside :func:`one_thread` blocks it stays at 1 until the last one ends). MKL's count is set per
    call from the same number (matmul.py), its global count staying 1. threads.py calls this."""
    with _lock:
        counts = _counts.get("openblas")
        if counts is not None and _one_thread["depth"] == 0:
            counts[0](thread_count.check(n))


def num_threads(name):
    """The threads library ``name``'s next GEMM from this thread runs on, by the library's own getter
    (MKL: its thread-local count, else its global 1); None where it is not loaded."""
    counts = _counts.get(name)
    return None if counts is None else int(counts[1]())


@contextlib.contextmanager
def one_thread():
    """Inside the block, every GEMM of the loaded OpenBLAS runs on one thread (MKL's global count is
    1 already): the intra-op threads run theirs at once, one core each. OpenBLAS's count is
    process-wide, so it is 1 from the first open block to the end of the last one, also when
    several threads' blocks overlap, then the thread count again."""
    with _lock:
        _one_thread["depth"] += 1
        counts = _counts.get("openblas")
        if counts is not None and _one_thread["depth"] == 1:
            counts[0](1)
    try:
        yield
    finally:
        with _lock:
            _one_thread["depth"] -= 1
            counts = _counts.get("openblas")
            if counts is not None and _one_thread["depth"] == 0:
                counts[0](thread_count.get())


def chunks_may_run_in_parallel():
    """Whether the kernels' GEMMs go to a library whose threads minidl sets (:func:`library` is one),
    so that intra-op threads can each run theirs on one thread. Without one, a chunk's GEMM is
    ``numpy.matmul`` on NumPy's own pool, which minidl leaves alone: the chunks then run in turn."""
    try:
        return library() is not None
    except RuntimeError:  # the blas option names a library that is absent: the kernels say so
        return False


def _products_agree(fns, set_local_threads):
    """Whether each bound GEMM computes ``C = A @ B + C`` and ``A @ B.T + C`` as NumPy does, on one
    thread and on two (the library's own), on small products (checked once, when it is loaded)."""
    rng = numpy.random.default_rng(0)
    for threads in (1, 2):
        previous = set_local_threads(threads)
        try:
            for char, fn in fns.items():
                for m, n, k in ((5, 7, 6), (8, 32, 20), (32, 32, 32)):
                    for trans_b in (False, True):
                        a = rng.standard_normal((m, k)).astype(char)
                        b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(char)
                        c = rng.standard_normal((m, n)).astype(char)
                        want = a.astype("d") @ (b.T if trans_b else b).astype("d") + c
                        fn(_ROW_MAJOR, _NO_TRANS, _TRANS if trans_b else _NO_TRANS, m, n, k, 1.0, a.ctypes.data, k,
                           b.ctypes.data, b.shape[1], 1.0, c.ctypes.data, n)
                        if not numpy.allclose(c, want, rtol=1e-4, atol=1e-4):
                            return False
        finally:
            set_local_threads(previous)
    return True


def library():
    """'mkl' or 'openblas': the library gemm calls; None when neither is found."""
    choice = get_option("blas")
    if choice is not None:
        if choice not in ("mkl", "openblas"):
            raise ValueError(f"kernels option blas must be 'mkl', 'openblas' or None, got {choice!r}")
        if not load(choice):
            if choice in _refused:
                raise RuntimeError(f"kernels option blas={choice!r}, but {_refused[choice]}: set blas='openblas' "
                                   f"or None, or call minidl.kernels.cpu.blas.load('mkl') before importing torch")
            raise RuntimeError(f"kernels option blas={choice!r}, but it was not found: pip install 'minidl[{choice}]'")
        return choice
    for name in ("mkl", "openblas"):
        if load(name):
            return name
    return None


def _functions():
    name = library()
    return _found[name] if name else {}


def available(dtype):
    """Whether :func:`gemm` can run for ``dtype`` (float32 or float64, with a library found)."""
    return numpy.dtype(dtype).char in _functions()


def address(a):
    """The address of a's first element (for :func:`gemm`)."""
    return a.__array_interface__["data"][0]


def gemm(dtype, m, n, k, a, lda, b, ldb, c, ldc, beta=0.0, trans_b=False):
    """``C = A @ B + beta * C`` (``A @ B.T`` with trans_b) on row-major operands given by address:
    A (m, k) with row stride lda, B (k, n) or, with trans_b, (n, k), stride ldb, C (m, n), stride ldc,
    all in elements of ``dtype``. The caller keeps the arrays alive and in bounds."""
    gemm_for(dtype)(m, n, k, a, lda, b, ldb, c, ldc, beta, trans_b)


def gemm_for(dtype):
    """:func:`gemm` for one dtype, without its first argument, the library looked up once: a
    kernel's loop of many small GEMMs calls it."""
    fn = _functions()[numpy.dtype(dtype).char]

    def gemm_dtype(m, n, k, a, lda, b, ldb, c, ldc, beta=0.0, trans_b=False):
        fn(_ROW_MAJOR, _NO_TRANS, _TRANS if trans_b else _NO_TRANS, m, n, k, 1.0, a, lda, b, ldb, beta, c, ldc)
    return gemm_dtype


def _rows(a):
    """(address, row stride in elements, transposed) of a 2-D view BLAS can take as it lies."""
    it = a.itemsize
    s0, s1 = a.strides
    if s1 == it and s0 % it == 0 and s0 >= max(1, a.shape[1]) * it:
        return a.__array_interface__["data"][0], s0 // it, False
    if s0 == it and s1 % it == 0 and s1 >= max(1, a.shape[0]) * it:
        return a.__array_interface__["data"][0], s1 // it, True
    return None


def matmul(a, b, out, beta=0.0, threads=1):
    """``out[...] = a @ b + beta * out`` for 2-D NumPy views (any row pitch, either orientation) of
    one float dtype through :func:`gemm`, on ``threads`` threads of MKL's own (OpenBLAS: on its
    count, which is minidl's thread count, 1 inside :func:`one_thread`); False
    (nothing done) where BLAS cannot take them as they lie. Whether it can depends only on dtypes
    and strides, not on the values."""
    # Called once per GEMM of every MatMul and Dense: the library is looked up once, here.
    name = library()
    fn = _found[name].get(out.dtype.char) if name else None
    if fn is None or not a.dtype == b.dtype == out.dtype:
        return False
    if not (a.size and b.size):
        return False
    ra, rb, rc = _rows(a), _rows(b), _rows(out)
    if ra is None or rb is None or rc is None or rc[2]:
        return False
    (pa, lda, ta), (pb, ldb, tb) = ra, rb
    m, k = a.shape
    set_local = _set_local.get(name) if threads != 1 else None  # OpenBLAS: its count is already ours
    previous = set_local(threads) if set_local else None
    try:
        with _short_blocktime(name) if set_local else contextlib.nullcontext():
            fn(_ROW_MAJOR, _TRANS if ta else _NO_TRANS, _TRANS if tb else _NO_TRANS,
               m, b.shape[1], k, 1.0, pa, lda, pb, ldb, beta, rc[0], rc[1])
    finally:
        if set_local:
            set_local(previous)
    return True
