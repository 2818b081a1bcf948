"""Dense and DenseReLU on NumPy: the bias added by the GEMM, the ReLU in place, one backward sweep.

The reference (minidl/ops/dense.py) is MatMul's product, then ``+= b``, then ``maximum``: three
passes over the output. Here the GEMM writes the product (blas.py's direct call on the intra-op
thread count, as matmul.py's MatMul), then one compiled sweep where Numba is installed
(``minidl[numba]``) adds b and applies the ReLU in place: one read-write pass after the GEMM. (The
GEMM adding the product onto a copy of b, BLAS's beta = 1, was slower: the copy is a pass too.)

Backward of DenseReLU: the masked gradient ``gy * (y > 0)`` and the bias gradient (its column
sums) in one compiled sweep (one read of gy and y instead of NumPy's mixed-type mask multiply and
a second pass for the sums), else those two passes. Both add the rows in order, as
``sum(axis=0)`` does, so the sweep is the reference's bit for bit.

Both sweeps run on the calling thread (dense_loops.py). (Running them on MKL's OpenMP team
between the GEMMs made the MLP's GRAPH_MODE step 1.04x as fast on 2 cores of an AMD EPYC, below
the 5% issue 30 asks of a thread pool of its own: docs/performance.md.)

Bound: another library (MKL) may block the products' sums otherwise than NumPy's matmul: float32
products of a few hundred terms of values ~1 differ in the last bits, relative to the terms'
magnitudes. The bias and ReLU are then the reference's, element by element.
"""
import importlib.util

import numpy

from ...ops.dense import Dense, DenseReLU
from .. import Kernel, register
from . import blas, buffers
from .matmul import _product, _threads

__all__ = ["DenseBLAS", "DenseReLUBLAS", "add_bias_relu", "relu_grad"]

_numba = importlib.util.find_spec("numba") is not None


def add_bias_relu(y, b, relu, compiled=None):
    """y + b (b None: y), then the ReLU where ``relu``, in y's memory; one compiled sweep where
    Numba is installed (``compiled``, as relu_grad's), else NumPy's passes."""
    if compiled is None:
        compiled = _numba
    if b is not None and compiled and y.flags.c_contiguous and b.flags.c_contiguous:
        from . import dense_loops  # imports Numba: at the first sweep, not with minidl
        dense_loops.add_bias_relu(y, b, relu)
        return y
    if b is not None:
        numpy.add(y, b, out=y)
    return numpy.maximum(y, 0, out=y) if relu else y


def relu_grad(gy, y, compiled=None):
    """(gy * (y > 0), its sums over axis 0) for 2-D arrays; ``compiled`` (default: whether Numba is
    installed) picks the one sweep over the NumPy passes."""
    if compiled is None:
        compiled = _numba
    if not compiled or not (gy.flags.c_contiguous and y.flags.c_contiguous):
        g = gy * (y > 0)
        return g, g.sum(axis=0)
    from . import dense_loops  # imports Numba: at the first sweep, not with minidl
    g, gb = buffers.empty(y.shape, y.dtype), numpy.empty(y.shape[1], dtype=y.dtype)
    dense_loops.masked_sums(gy, y, g, gb)
    return g, gb


class _DenseBLAS(Kernel):
    backend = "numpy"
    # MKL and NumPy's OpenBLAS add the k products in different orders: an element near zero of a
    # 300-term float32 product (entries ~20) differs by ulps of its terms, not its own (1.6e-5 seen on an
    # AMD EPYC, where the two libraries block differently), so the absolute part is 1e-4.
    bound = {"float32": (1e-5, 1e-4), "float64": (1e-13, 1e-13)}
    relu = False

    def applies(self, node, x, w, b=None):
        return (x.ndim == 2 == w.ndim and x.dtype == w.dtype and blas.available(x.dtype)
                and (b is None or b.dtype == x.dtype))

    def forward(self, node, x, w, b=None):
        node._check(x, w, b)
        node.x, node.w = x, w
        y = buffers.empty((x.shape[0], w.shape[0]), x.dtype)
        if not blas.matmul(x, w.T, y, threads=_threads()):
            numpy.matmul(x, w.T, out=y)
        if b is not None or self.relu:
            add_bias_relu(y, b, self.relu)
        if self.relu:
            node.y = y
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
