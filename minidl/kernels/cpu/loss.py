"""SparseSoftmaxCrossEntropyWithLogits in one compiled loop per direction (optional: ``minidl[numba]``).

The reference (minidl/ops/loss.py) is NumPy's log-softmax over each row, a gather, and in
backward ``exp(log_p)``, a scatter of -1 and a multiply. With few classes (the MLP's 10) NumPy
spends its time per call and per row, not per element: a row max over 10 values took longer
than the exp of the whole batch. Here the row reductions, the gather and the scatter are
compiled loops; the exponentials stay NumPy's (SIMD; Numba's exp is a scalar call per element).
Numba is imported at the first call, not with minidl.

Bound: the row sums add in order where NumPy sums pairwise, and the log is Numba's (a last-bit
difference in the log-probabilities).
"""
import importlib.util

import numpy

from ...ops.loss import SparseSoftmaxCrossEntropyWithLogits, _check_index_labels, _check_logits
from .. import Kernel, declare_option, get_option, register

__all__ = ["SparseSoftmaxCrossEntropyLoop"]

declare_option("loss_numba", True, "SparseSoftmaxCrossEntropyWithLogits' compiled row loops (with Numba); "
               "False: the reference's NumPy passes")

_compiled = {}


def _loops():
    if not _compiled:
        import numba
        plain = numba.njit(nogil=True, cache=True)
        _compiled.update(shift=plain(_shift), normalise=plain(_normalise), onehot_scale=plain(_onehot_scale))
    return _compiled


def _shift(logits, out):
    """out = logits - max over each row."""
    for i in range(logits.shape[0]):
        row = logits[i]
        top = row[0]
        for j in range(1, row.size):
            top = max(top, row[j])  # a NaN anywhere makes the row NaN below, as in the reference
        for j in range(row.size):
            out[i, j] = row[j] - top


def _normalise(log_p, e, labels, loss):
    """log_p -= log(sum of the row's e) per row (e = exp(log_p)); loss[i] = -log_p[i, labels[i]]."""
    for i in range(log_p.shape[0]):
        total = e.dtype.type(0)
        for j in range(e.shape[1]):
            total += e[i, j]
        lse = numpy.log(total)
        for j in range(log_p.shape[1]):
            log_p[i, j] -= lse
        loss[i] = -log_p[i, labels[i]]


def _onehot_scale(gx, labels, gy):
    """gx[i, labels[i]] -= 1, then gx[i] *= gy[i] (gx = exp(log_p) on entry)."""
    one = gx.dtype.type(1)
    for i in range(gx.shape[0]):
        gx[i, labels[i]] -= one
        for j in range(gx.shape[1]):
            gx[i, j] *= gy[i]


@register
class SparseSoftmaxCrossEntropyLoop(Kernel):
    op, backend = SparseSoftmaxCrossEntropyWithLogits, "numpy"
    bound = {"float32": (1e-5, 1e-6), "float64": (1e-12, 1e-14)}
    available = importlib.util.find_spec("numba") is not None  # else the reference runs
    extra = "numba"

    def applies(self, node, logits, labels):
        return (self.available and get_option("loss_numba") and isinstance(logits, numpy.ndarray) and isinstance(labels, numpy.ndarray)
                and logits.ndim == 2 and logits.dtype.char in "fd" and logits.shape[1] > 0
                and labels.dtype.kind in "iu" and labels.ndim == 1)

    def forward(self, node, logits, labels):
        _check_logits(node.name, logits)
        labels = _check_index_labels(node.name, labels, (logits.shape[0],), logits.shape[1], logits.shape)
        loops = _loops()
        log_p = node.log_p = numpy.empty(logits.shape, dtype=logits.dtype)
        node.labels = labels
        loops["shift"](logits, log_p)
        loss = numpy.empty(logits.shape[0], dtype=logits.dtype)
        loops["normalise"](log_p, numpy.exp(log_p), labels, loss)  # NumPy's exp: SIMD, Numba's is not
        return loss

    def backward(self, node, gy):
        gx = numpy.exp(node.log_p)
        _loops()["onehot_scale"](gx, node.labels, gy)
        return gx, None

    def cases(self):
        rng = numpy.random.default_rng(7)
        out = []
        for dtype in (numpy.float32, numpy.float64):
            for n, c in ((256, 10), (3, 1), (5, 40)):
                logits = (rng.standard_normal((n, c)) * 4).astype(dtype)
                labels = rng.integers(0, c, n).astype(numpy.int32)
                out.append((SparseSoftmaxCrossEntropyWithLogits, [logits, labels]))
        return out
