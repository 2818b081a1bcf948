"""ApplyMomentum's update (updates.py) as one loop compiled by Numba (optional: ``minidl[numba]``).

Imported at the kernel's first call, never with minidl (Numba's import is slow). Element by
element in the reference's order of operations (minidl/ops/updates.py), with no fastmath (no FMA
contraction), so the update is the reference's bit for bit.
"""
import numba


@numba.njit(nogil=True, cache=True)
def momentum(w, v, g, lr, m, nesterov):
    """v = v * m + g; w -= (v * m + g) * lr with ``nesterov``, else v * lr (w, v, g 1-D, one dtype;
    lr and m scalars of that dtype)."""
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
