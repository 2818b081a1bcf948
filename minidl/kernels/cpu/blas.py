"""GEMM straight into a BLAS library, for kernels that need what ``numpy.matmul`` cannot say.

``numpy.matmul`` always overwrites its output and takes whole arrays. The tap convolution
(taps.py here) sums one GEMM per kernel offset into the same output, ``C = A @ B + C``, with
operands that start anywhere in a flat buffer: that is BLAS's ``beta = 1`` and a base pointer
with a leading dimension, one ``cblas_?gemm`` call, made through ctypes (which releases the
GIL, so the intra-op threads run their GEMMs at once).

Which library (the ``blas`` option):
- ``"openblas"``: the one NumPy itself links (found by minidl/_intra_op.py: the wheel's copy);
  the intra-op threads make it single-threaded for theirs.
- ``"mkl"``: Intel's MKL (``pip install 'minidl[mkl]'``, PyPI's ``mkl``). On the conv kernels'
  GEMM shapes (16-64 output channels, a few thousand columns) it measured 1.2-1.5x OpenBLAS's
  speed on one core (benchmarks/bench_gemm.py --direct). NumPy's own matmul stays on OpenBLAS.

Threads. The conv kernels call :func:`gemm` from the intra-op threads, one single-threaded GEMM
per thread; a MatMul (kernels/cpu/matmul.py) calls :func:`matmul` with ``threads=n`` from the
op's own thread, one GEMM on n threads. OpenBLAS: its thread-local count (the intra-op threads
set theirs to 1). MKL is loaded with its Intel OpenMP threading layer, its global count set to
1 (so a call from an intra-op thread never starts a team of its own) and a call's ``threads``
set thread-locally for that call. OpenMP's threads spin for ``KMP_BLOCKTIME`` after a parallel
GEMM, 200 ms by default: on cores the intra-op threads then need. minidl sets it to 1 ms unless
it is already set (the MLP's GEMMs come less than 1 ms apart: the spin is what makes MKL's
threaded GEMMs faster than OpenBLAS's there).
- None: MKL when it is installed, else OpenBLAS. The default is ``$MINIDL_BLAS`` when set.
Without either (a NumPy on another BLAS) :func:`available` is false and kernels take their
other routes. :func:`library` says which is in use.
"""
import ctypes
import glob
import importlib.util
import os
import sys
import warnings

import numpy

from ... import _intra_op as intra_op
from .. import declare_option, get_option

__all__ = ["available", "library", "installed", "load", "gemm", "gemm_for", "matmul", "address"]

declare_option("blas", os.environ.get("MINIDL_BLAS") or None,
               "the BLAS the CPU kernels call directly: 'mkl', 'openblas' (NumPy's), or None: MKL when "
               "installed (pip install 'minidl[mkl]'), else NumPy's OpenBLAS; default: $MINIDL_BLAS")

declare_option("blas_compiled", True,
               "make matmul's BLAS call from Numba-compiled code (blas_compiled.py: the same call, without "
               "ctypes' per-call Python) where Numba is installed; False: through ctypes")

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112
_MKL_INTEL_THREADS = 0  # MKL_Set_Threading_Layer's MKL_THREADING_INTEL (Intel OpenMP)
_BLOCKTIME_MS = "1"  # KMP_BLOCKTIME's default here (see the module docstring)
# (prefix, suffix, BLAS integer): NumPy's wheels ship OpenBLAS built with 64-bit integers under
# scipy_ names; a system OpenBLAS has the plain CBLAS names (LP64) or the 64_ suffix (ILP64).
_OPENBLAS_NAMES = (("scipy_cblas_", "64_", ctypes.c_int64), ("cblas_", "64_", ctypes.c_int64),
                   ("cblas_", "", ctypes.c_int))
_found = {}  # library name -> {dtype char: ctypes gemm} ({} when that library is absent)
_refused = {}  # library name -> why it was found but not used
_set_local = {}  # library name -> its thread-local "n threads" setter (returns the previous setting)
_blas_int = {}  # library name -> its BLAS integer type (ctypes)
_numba = importlib.util.find_spec("numba") is not None
_compiled = {}  # "module": blas_compiled.py; library name -> ({dtype char: gemm address}, setter address, int sample)


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
    """MKL's single dynamic library, as the mkl wheel installs it under sys.prefix/lib."""
    return sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))


def installed(name):
    """Whether library ``name`` can be loaded, without loading it (MKL: its file is there)."""
    return bool(_mkl_paths()) if name == "mkl" else bool(load(name))


def load(name):
    """{dtype char: gemm} of library ``name`` ('mkl' or 'openblas'), loading it once; {} when absent."""
    if name not in _found:
        fns = {}
        if name == "openblas":
            lib = intra_op._openblas()
            for prefix, suffix, blas_int in _OPENBLAS_NAMES if lib else ():
                fns = _bind(lib, prefix, suffix, blas_int)
                if fns:
                    _set_local[name] = lib.openblas_set_num_threads_local
                    _blas_int[name] = blas_int
                    break
        else:
            for path in _mkl_paths():
                try:
                    lib = ctypes.CDLL(path)
                except OSError:
                    continue
                # Before OpenMP starts (it reads its environment once) and MKL's first computation.
                os.environ.setdefault("KMP_BLOCKTIME", _BLOCKTIME_MS)
                lib.MKL_Set_Threading_Layer(_MKL_INTEL_THREADS)
                lib.MKL_Set_Num_Threads(1)  # threads come per call (matmul's threads), thread-locally
                fns = _bind(lib, "cblas_", "", ctypes.c_int)  # mkl_rt's default interface is LP64
                if fns and not _products_agree(fns, lib.MKL_Set_Num_Threads_Local):
                    # Seen with PyTorch imported first: its MKL's symbols, already in the process, take
                    # the place of some of this one's, and GEMMs come out wrong. Never silently wrong.
                    _refused[name] = (f"MKL ({path}) was loaded after another copy of MKL in this process "
                                      f"(e.g. PyTorch's, when torch is imported before minidl's kernels "
                                      f"first run) and its GEMMs disagree with NumPy's")
                    warnings.warn(f"minidl: {_refused[name]}; the CPU kernels use NumPy's OpenBLAS instead "
                                  f"(to keep MKL, call minidl.kernels.cpu.blas.load('mkl') before importing torch; "
                                  f"MINIDL_BLAS=openblas chooses OpenBLAS without this warning)", RuntimeWarning,
                                  stacklevel=2)
                    fns = {}
                if fns:
                    _set_local[name] = lib.MKL_Set_Num_Threads_Local
                    _blas_int[name] = ctypes.c_int
                    break
        _found[name] = fns
    return _found[name]


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
            raise RuntimeError(f"kernels option blas={choice!r}, but it was not found"
                               + (": pip install 'minidl[mkl]'" if choice == "mkl" else f" ({intra_op.blas_status()})"))
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
    one float dtype through :func:`gemm`, on ``threads`` threads of the library's own; False
    (nothing done) where BLAS cannot take them as they lie. Whether it can depends only on dtypes
    and strides, not on the values. Where Numba is installed the same call is made from compiled
    code (the ``blas_compiled`` option, blas_compiled.py)."""
    # Called once per GEMM of every MatMul and Dense: the library is looked up once, here.
    name = library()
    fn = _found[name].get(out.dtype.char) if name else None
    if fn is None or not a.dtype == b.dtype == out.dtype:
        return False
    if _numba and get_option("blas_compiled"):
        module, (gemms, set_threads, blas_int) = _compiled_call(name)
        return module.matmul(gemms[out.dtype.char], set_threads if threads != 1 else 0, blas_int, a, b, out, beta,
                             threads)
    if not (a.size and b.size):
        return False
    ra, rb, rc = _rows(a), _rows(b), _rows(out)
    if ra is None or rb is None or rc is None or rc[2]:
        return False
    (pa, lda, ta), (pb, ldb, tb) = ra, rb
    m, k = a.shape
    set_local = _set_local[name] if threads != 1 else None
    previous = set_local(threads) if set_local else None
    try:
        fn(_ROW_MAJOR, _TRANS if ta else _NO_TRANS, _TRANS if tb else _NO_TRANS,
           m, b.shape[1], k, 1.0, pa, lda, pb, ldb, beta, rc[0], rc[1])
    finally:
        if set_local:
            set_local(previous)
    return True


def _compiled_call(name):
    """(blas_compiled.py, (library ``name``'s {dtype char: gemm address}, its thread-count setter's
    address, a sample of its BLAS integer type)), made once per library."""
    entry = _compiled.get(name)
    if entry is None:
        module = _compiled.get("module")
        if module is None:
            from . import blas_compiled as module
            _compiled["module"] = module
        address_of = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
        sample = numpy.int64(0) if _blas_int[name] is ctypes.c_int64 else numpy.int32(0)
        entry = _compiled[name] = (module, ({c: address_of(f) for c, f in _found[name].items()},
                                            address_of(_set_local[name]), sample))
    return entry
