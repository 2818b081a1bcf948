"""MatMul on MKL's threads, where the ``mkl`` extra is installed.

The reference (minidl/ops/linalg.py) is ``numpy.matmul``: NumPy's OpenBLAS on its own threads.
On the MLP's GEMMs (batch 256, 784-512-512-10) MKL's threaded GEMM made the training step
1.07-1.08x faster than OpenBLAS's on 2 cores (``python benchmarks/bench_step_ab.py --model mlp
--env MINIDL_BLAS=openblas``: processes of their own, since two libraries' spinning thread pools
in one process take the cores from each other). The same products as the reference, each
gradient in its input's layout, through blas.py's direct call on the intra-op thread count (1
inside an intra-op thread: an op run by another op's chunk stays on its thread).

Bound: another library, so another blocking of the sums: float32 products of a few hundred
terms of values ~1 differ in the last bits of the sum (relative to the terms' magnitudes).
"""
import numpy

from . import buffers, threads as intra_op
from ...ops.linalg import MatMul, check_matmul
from .. import Kernel, register
from . import blas

__all__ = ["MatMulThreaded"]


def _threads():
    """The threads one GEMM of an op may use: the intra-op count, 1 inside an intra-op thread."""
    return 1 if intra_op.in_worker() else intra_op.get_num_threads()


def _product(a, b):
    """a @ b through blas.py's library on :func:`_threads`; NumPy's where BLAS cannot take the views."""
    out = buffers.empty((a.shape[0], b.shape[1]), a.dtype)
    if not blas.matmul(a, b, out, threads=_threads()):
        numpy.matmul(a, b, out=out)
    return out


@register
class MatMulThreaded(Kernel):
    op, backend = MatMul, "numpy"
    # MKL and NumPy's OpenBLAS add the k products in different orders: an element near zero of a
    # 300-term float32 product (entries ~20) differs by ulps of its terms, not its own (1.6e-5 seen on an
    # AMD EPYC, where the two libraries block differently), so the absolute part is 1e-4.
    bound = {"float32": (1e-5, 1e-4), "float64": (1e-13, 1e-13)}
    available, extra = blas.installed("mkl"), "mkl"

    def applies(self, node, x, w):
        return (x.ndim == 2 == w.ndim and x.dtype == w.dtype and x.dtype.kind == "f"
                and blas.library() == "mkl" and blas.available(x.dtype))

    def forward(self, node, x, w):
        check_matmul(node.name, x, w, node.transpose_a, node.transpose_b, batched=False)
        node.x, node.w = x, w
        return _product(x.T if node.transpose_a else x, w.T if node.transpose_b else w)

    def backward(self, node, gy):
        # As MatMul.backward: dA = gy B^T, dB = A^T gy, each formed in its input's layout.
        x, w, ta, tb = node.x, node.w, node.transpose_a, node.transpose_b
        a = x.T if ta else x
        b = w.T if tb else w
        gx = gw = None
        if node.needs_grad[0]:
            gx = _product(b, gy.T) if ta else _product(gy, b.T)
        if node.needs_grad[1]:
            gw = _product(gy.T, a) if tb else _product(a.T, gy)
        return gx, gw

    def cases(self):
        rng = numpy.random.default_rng(12)
        out = []
        for dtype in (numpy.float32, numpy.float64):
            for (m, k, n), ta, tb in (((256, 300, 200), False, True), ((64, 64, 10), False, False),
                                      ((33, 17, 65), True, False), ((40, 50, 30), True, True)):
                x = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
                w = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
                out.append(((lambda ta, tb: lambda: MatMul(ta, tb))(ta, tb), [x, w]))
        return out
