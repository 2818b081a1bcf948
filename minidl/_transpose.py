"""Fast 2-D transposing copies on the CPU, through OpenBLAS's blocked ``?omatcopy``.

Why: NumPy copies ``a.T`` element by element along the destination, which reads the
source with a large stride; on this project's 2-core machine a (64, 16384) float32
transpose took 5.7 ms that way and 1.7 ms with OpenBLAS's cache-blocked omatcopy
(benchmarks/bench_conv.py, Winograd layout changes). Where that routine is missing (another
BLAS, a non-float dtype, CuPy arrays) the plain NumPy copy runs instead: same result.
"""
import ctypes

import numpy

from . import _intra_op as intra_op

_ROW_MAJOR, _TRANS = 101, 112
# (symbol, index type): NumPy's wheels export the ILP64 build with a scipy_ prefix and a 64_ suffix.
_NAMES = {
    numpy.dtype(numpy.float32): (("scipy_cblas_somatcopy64_", ctypes.c_int64), ("cblas_somatcopy64_", ctypes.c_int64),
                                 ("cblas_somatcopy", ctypes.c_int)),
    numpy.dtype(numpy.float64): (("scipy_cblas_domatcopy64_", ctypes.c_int64), ("cblas_domatcopy64_", ctypes.c_int64),
                                 ("cblas_domatcopy", ctypes.c_int)),
}
_found = {}


def _routine(dtype):
    """The ctypes omatcopy for dtype, or None."""
    if dtype not in _found:
        _found[dtype] = None
        lib = intra_op._openblas()
        for name, index in _NAMES.get(dtype, ()):
            fn = getattr(lib, name, None) if lib else None
            if fn is not None:
                scalar = ctypes.c_float if dtype == numpy.float32 else ctypes.c_double
                fn.restype = None
                fn.argtypes = [ctypes.c_int, ctypes.c_int, index, index, scalar, ctypes.c_void_p, index,
                               ctypes.c_void_p, index]
                _found[dtype] = fn
                break
    return _found[dtype]


def transpose_into(xp, a, out):
    """out[...] = a.T for 2-D a and out; a's rows and out's rows may be strided (not their elements)."""
    rows, cols = a.shape
    if out.shape != (cols, rows):
        raise ValueError(f"transpose_into: out of shape {out.shape} cannot hold the transpose of {a.shape}")
    fn = _routine(a.dtype) if xp is numpy and out.dtype == a.dtype else None
    it = a.itemsize
    if (fn is None or a.strides[1] != it or out.strides[1] != it or a.strides[0] % it or out.strides[0] % it
            or rows == 0 or cols == 0):
        xp.copyto(out, a.T)
        return out
    fn(_ROW_MAJOR, _TRANS, rows, cols, 1.0, a.ctypes.data, a.strides[0] // it, out.ctypes.data, out.strides[0] // it)
    return out
