"""The Dense kernels' sweeps (dense.py) as single loops compiled by Numba (optional: ``minidl[numba]``).

Imported at a kernel's first compiled sweep, never with minidl (Numba's import is slow). No
fastmath (no FMA contraction, no reordering), so each sweep is NumPy's passes bit for bit:

- :func:`add_bias_relu`: y += b per row, then the ReLU as ``numpy.maximum(y, 0)``;
- :func:`masked_sums`: g = gy * (y > 0) and the column sums of g, each column's rows added in
  order, as ``g.sum(axis=0)`` adds them.
"""
import numba

_plain = numba.njit(nogil=True, cache=True)


@_plain
def add_bias_relu(y, b, relu):
    """y + b, then max(., 0) where ``relu``, in y's memory (y C-contiguous 2-D, b 1-D)."""
    zero = y.dtype.type(0)
    for i in range(y.shape[0]):
        for j in range(y.shape[1]):
            v = y[i, j] + b[j]
            if relu:
                v = v if (v > zero or v != v) else zero  # numpy.maximum(v, 0): NaN stays, -0.0 -> 0.0
            y[i, j] = v


@_plain
def masked_sums(gy, y, g, gb):
    """g = gy * (y > 0) and gb = g's column sums (gy, y, g C-contiguous 2-D, gb 1-D)."""
    # Row by row, in two loops per row: each one Numba vectorises. (One loop that both writes g
    # and adds into the sums was slower than these two, whose second reads the row back from L1:
    # the compiler cannot prove that g and the sums do not overlap.)
    zero, one = g.dtype.type(0), g.dtype.type(1)
    for j in range(gb.size):
        gb[j] = zero
    for i in range(g.shape[0]):
        gy_i, y_i, g_i = gy[i], y[i], g[i]
        for j in range(g_i.size):
            g_i[j] = gy_i[j] * (one if y_i[j] > zero else zero)  # as gy * (y > 0): NaN or inf * 0 is NaN
        for j in range(g_i.size):
            gb[j] += g_i[j]
