"""The Dense and ApplyMomentum kernels' loops, compiled by Numba, and their jobs for team.py.

Imported at a kernel's first compiled pass, never with minidl (Numba's import is slow). Each
loop is written as plain Python and works on the arrays or range it is given, so that the
serial call (the whole range) and a team job (one slice per chunk) run the same code:

- :func:`_momentum`: ApplyMomentum's update, element by element in the reference's order of
  operations (kernels/cpu/updates.py);
- :func:`_add_bias_relu`: y += b per row, then the ReLU as ``numpy.maximum(y, 0)`` (dense.py);
- :func:`_masked_sums`: g = gy * (y > 0) and the column sums of g, columns j0..j1 (dense.py).

A job splits its range into ``chunks`` (the header's slot 1) and each team thread claims the
next chunk with an atomic add on slot 0 until none is left: which thread runs a chunk does not
change its result. The splits never cut a sum: momentum and the bias and ReLU are elementwise,
and the masked sums are split by columns, each column's rows still added in order. So a team
pass is bit for bit the serial one.
"""
import numba
import numpy
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

_F32, _F64 = 4, 8  # a header's itemsize slot: which dtype its arrays hold
_plain = numba.njit(nogil=True, cache=True)  # no fastmath: no FMA contraction, no reordering


@intrinsic
def _pointer(typingctx, address, dtype):
    """``address`` (an int64) as a pointer to ``dtype`` (numba.float32 or numba.float64)."""
    sig = types.CPointer(dtype.dtype)(address, dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))
    return sig, codegen


@intrinsic
def _claim(typingctx, head):
    """Atomically adds 1 to the header's slot 0; returns the value before: the next chunk."""
    sig = types.int64(types.voidptr)

    def codegen(context, builder, signature, args):
        slot = builder.bitcast(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", slot, ir.Constant(ir.IntType(64), 1), "seq_cst")
    return sig, codegen


def _job(fn):
    return numba.cfunc(types.void(types.voidptr), nopython=True, cache=True)(fn)


@_plain
def address(x):
    """The address of x's first element, as ``x.ctypes.data``: compiled, it costs a fraction of that
    attribute's Python (a ctypes object per call), and headers need several per step."""
    return x.ctypes.data


# ---- the loops ----------------------------------------------------------------------------


@_plain
def _momentum(w, v, g, lr, m, nesterov):
    for i in range(w.size):
        a = v[i] * m
        a += g[i]
        v[i] = a
        if nesterov:
            s = a * m
            s += g[i]
            s *= lr
        else:
            s = a * lr
        w[i] -= s


@_plain
def _add_bias_relu(y, b, relu):
    zero = y.dtype.type(0)
    for i in range(y.shape[0]):
        for j in range(y.shape[1]):
            v = y[i, j] + b[j]
            if relu:
                v = v if (v > zero or v != v) else zero  # numpy.maximum(v, 0): NaN stays, -0.0 -> 0.0
            y[i, j] = v


@_plain
def _masked_sums(gy, y, g, gb, j0, j1):
    # Row by row over contiguous slices of columns j0..j1, in two loops per row: each one Numba
    # vectorises. (Indexing the 2-D arrays with a variable column range ran several times slower;
    # one loop that both writes g and adds into the sums was slower than these two, whose second
    # reads the row back from L1: the compiler cannot prove that g and the sums do not overlap.)
    zero, one = g.dtype.type(0), g.dtype.type(1)
    sums = gb[j0:j1]
    for j in range(sums.size):
        sums[j] = zero
    for i in range(g.shape[0]):
        gy_i, y_i, g_i = gy[i, j0:j1], y[i, j0:j1], g[i, j0:j1]
        for j in range(g_i.size):
            g_i[j] = gy_i[j] * (one if y_i[j] > zero else zero)  # as gy * (y > 0): NaN or inf * 0 is NaN
        for j in range(g_i.size):
            sums[j] += g_i[j]


# ---- serial calls (the caller's thread) -----------------------------------------------------

def momentum(w, v, g, lr, m, nesterov):
    _momentum(w, v, g, lr, m, nesterov)


def add_bias_relu(y, b, relu):
    _add_bias_relu(y, b, relu)


def masked_sums(gy, y, g, gb):
    _masked_sums(gy, y, g, gb, 0, g.shape[1])


# ---- team jobs: header slots 0 (claimed chunks) and 1 (chunks: team.run sets both), then the
# job's own: addresses and sizes as int64, scalars as float64 bits -----------------------------

def momentum_multi_header(ws, vs, gs, lr, m, nesterov):
    """The header of :data:`momentum_multi_job` over parameters k = 0.. with C-contiguous arrays
    ws[k], vs[k], gs[k] of one dtype and shape per k: the range is their elements end to end."""
    slots = [0, 0, len(ws), ws[0].itemsize if ws else _F32, int(nesterov), 0, 0, 0]
    for w, v, g in zip(ws, vs, gs):
        slots += (address(w), address(v), address(g), w.size)  # (a list, then one array: an optimizer step's cost)
    slots[7] = sum(w.size for w in ws)
    head = numpy.array(slots, dtype=numpy.int64)
    head.view(numpy.float64)[5:7] = (lr, m)
    return head


@_job
def momentum_multi_job(data):
    count = carray(data, 8, numpy.int64)[2]
    h = carray(data, 8 + 4 * count, numpy.int64)
    f = carray(data, 8, numpy.float64)
    size, total, chunks, nesterov = h[3], h[7], h[1], h[4] != 0
    c = _claim(data)
    while c < chunks:
        lo, hi = c * total // chunks, (c + 1) * total // chunks  # of all the elements, end to end
        start = 0
        for k in range(count):
            n = h[11 + 4 * k]
            a, b = max(lo - start, 0), min(hi - start, n)  # this parameter's part of the chunk
            if a < b:
                w, v, g = h[8 + 4 * k] + a * size, h[9 + 4 * k] + a * size, h[10 + 4 * k] + a * size
                if size == _F32:
                    _momentum(carray(_pointer(w, numba.float32), b - a), carray(_pointer(v, numba.float32), b - a),
                              carray(_pointer(g, numba.float32), b - a), numpy.float32(f[5]), numpy.float32(f[6]),
                              nesterov)
                else:
                    _momentum(carray(_pointer(w, numba.float64), b - a), carray(_pointer(v, numba.float64), b - a),
                              carray(_pointer(g, numba.float64), b - a), f[5], f[6], nesterov)
            start += n
        c = _claim(data)


def add_bias_relu_header(y, b, relu):
    """The header of :data:`add_bias_relu_job` (y C-contiguous 2-D, b 1-D contiguous)."""
    head = numpy.zeros(8, dtype=numpy.int64)
    head[2:8] = (address(y), address(b), y.shape[0], y.shape[1], y.itemsize, relu)
    return head


@_job
def add_bias_relu_job(data):
    h = carray(data, 8, numpy.int64)
    rows, cols, size, chunks = h[4], h[5], h[6], h[1]
    c = _claim(data)
    while c < chunks:
        lo, hi = c * rows // chunks, (c + 1) * rows // chunks
        y = h[2] + lo * cols * size  # the chunk's rows as an array of their own
        if size == _F32:
            _add_bias_relu(carray(_pointer(y, numba.float32), (hi - lo, cols)), carray(_pointer(h[3], numba.float32), cols),
                           h[7] != 0)
        else:
            _add_bias_relu(carray(_pointer(y, numba.float64), (hi - lo, cols)), carray(_pointer(h[3], numba.float64), cols),
                           h[7] != 0)
        c = _claim(data)


def masked_sums_header(gy, y, g, gb):
    """The header of :data:`masked_sums_job` (gy, y, g C-contiguous 2-D, gb 1-D)."""
    head = numpy.zeros(9, dtype=numpy.int64)
    head[2:9] = (address(gy), address(y), address(g), address(gb), g.shape[0], g.shape[1], g.itemsize)
    return head


@_job
def masked_sums_job(data):
    h = carray(data, 9, numpy.int64)
    rows, cols, chunks = h[6], h[7], h[1]
    c = _claim(data)
    while c < chunks:
        j0, j1 = c * cols // chunks, (c + 1) * cols // chunks
        if h[8] == _F32:
            _masked_sums(carray(_pointer(h[2], numba.float32), (rows, cols)), carray(_pointer(h[3], numba.float32), (rows, cols)),
                         carray(_pointer(h[4], numba.float32), (rows, cols)), carray(_pointer(h[5], numba.float32), cols), j0, j1)
        else:
            _masked_sums(carray(_pointer(h[2], numba.float64), (rows, cols)), carray(_pointer(h[3], numba.float64), (rows, cols)),
                         carray(_pointer(h[4], numba.float64), (rows, cols)), carray(_pointer(h[5], numba.float64), cols), j0, j1)
        c = _claim(data)
