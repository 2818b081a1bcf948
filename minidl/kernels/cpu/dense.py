"""Dense and DenseReLU on NumPy: the bias added by the GEMM, the ReLU in place, one backward sweep.

The reference (minidl/ops/dense.py) is MatMul's product, then ``+= b``, then ``maximum``: three
passes over the output. Here the output is first filled with b and the GEMM adds the product
onto it (BLAS's beta = 1, blas.py's direct call on the intra-op thread count, as matmul.py's
MatMul), then the ReLU runs in place: one write pass instead of two read-write ones.

Backward of DenseReLU: the masked gradient ``gy * (y > 0)`` and the bias gradient (its column
sums) in one compiled sweep where Numba is installed (``minidl[numba]``: one read of gy and y
instead of NumPy's mixed-type mask multiply and a second pass for the sums), else those two
passes. Both add the rows in order, as ``sum(axis=0)`` does, so the sweep is the reference's bit
for bit.

Bound: BLAS sums ``b + x w^T`` where the reference rounds ``x w^T`` first, then adds b (one more
rounding), and another library (MKL) may block the products' sums otherwise: float32 products of
a few hundred terms of values ~1 differ in the last bits, relative to the terms' magnitudes.
"""
import importlib.util

import numpy

from ...ops.dense import Dense, DenseReLU
from .. import Kernel, register
from . import blas
from .matmul import _product, _threads

__all__ = ["DenseBLAS", "DenseReLUBLAS", "relu_grad"]

_numba = importlib.util.find_spec("numba") is not None
_compiled = {}


def _masked_sums(gy, y, g, gb):
    """g = gy where y > 0 else 0, and gb = its column sums, rows added in order (Numba compiles this)."""
    zero, one = g.dtype.type(0), g.dtype.type(1)
    for j in range(g.shape[1]):
        gb[j] = zero
    for i in range(g.shape[0]):
        for j in range(g.shape[1]):
            v = gy[i, j] * (one if y[i, j] > zero else zero)  # as gy * (y > 0): NaN or inf * 0 is NaN
            g[i, j] = v
            gb[j] += v


def relu_grad(gy, y, compiled=None):
    """(gy * (y > 0), its sums over axis 0) for 2-D arrays; ``compiled`` (default: whether Numba is
    installed) picks the one sweep over the NumPy passes."""
    if compiled is None:
        compiled = _numba
    if not compiled or not (gy.flags.c_contiguous and y.flags.c_contiguous):
        g = gy * (y > 0)
        return g, g.sum(axis=0)
    if not _compiled:
        import numba
        _compiled["masked_sums"] = numba.njit(nogil=True, cache=True)(_masked_sums)
    g, gb = numpy.empty_like(y), numpy.empty(y.shape[1], dtype=y.dtype)
    _compiled["masked_sums"](gy, y, g, gb)
    return g, gb


class _DenseBLAS(Kernel):
    backend = "numpy"
    bound = {"float32": (1e-5, 1e-5), "float64": (1e-13, 1e-13)}
    relu = False

    def applies(self, node, x, w, b=None):
        return (x.ndim == 2 == w.ndim and x.dtype == w.dtype and blas.available(x.dtype)
                and (b is None or b.dtype == x.dtype))

    def forward(self, node, x, w, b=None):
        node._check(x, w, b)
        node.x, node.w = x, w
        y = numpy.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
        if b is not None:
            y[...] = b
        if not blas.matmul(x, w.T, y, beta=0.0 if b is None else 1.0, threads=_threads()):
            y = x @ w.T if b is None else numpy.add(x @ w.T, b, out=y)
        if self.relu:
            node.y = numpy.maximum(y, 0, out=y)
        return y

    def backward(self, node, gy):
        needs = node.needs_grad
        gb = None
        if self.relu:
            g, gb = relu_grad(gy, node.y)
        else:
            g = gy
        gx = _product(g, node.w) if needs[0] else None
        gw = _product(g.T, node.x) if needs[1] else None
        if len(needs) < 3:
            return gx, gw
        return gx, gw, ((g.sum(axis=0) if gb is None else gb) if needs[2] else None)

    def cases(self):
        rng = numpy.random.default_rng(13)
        out = []
        for dtype in (numpy.float32, numpy.float64):
            for n, k, o, bias in ((256, 300, 200, True), (7, 5, 3, True), (33, 17, 10, False)):
                arrays = [rng.standard_normal((n, k)).astype(dtype), rng.standard_normal((o, k)).astype(dtype)]
                if bias:
                    arrays.append(rng.standard_normal(o).astype(dtype))
                out.append((self.op, arrays))
        return out


@register
class DenseBLAS(_DenseBLAS):
    op = Dense


@register
class DenseReLUBLAS(_DenseBLAS):
    op = DenseReLU
    relu = True
