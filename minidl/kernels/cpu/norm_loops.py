"""The BatchNorm kernels' passes as single loops compiled by Numba (optional: ``minidl[numba]``).

Each pass of minidl/kernels/cpu/norm.py is, per block of samples, several NumPy calls (multiply,
add, maximum; a product then a sum), each a sweep over the block with a temporary. Compiled, a
pass is one sweep over its arrays with no temporary: the same arithmetic in the same order per
element, so the elementwise results are those of the NumPy passes, bit for bit; the sums add the
same terms in another order (SIMD lanes: each sample's sums in x's dtype, then the samples' in
float64, as the NumPy passes do). ``nogil`` lets the intra-op threads run them at once.

All take 3-D views (samples, C, values per channel), channels first; per-channel operands are
1-D of x's dtype. Where Numba is not installed, :data:`available` is False and the NumPy passes run.
"""
import importlib.util

# Numba is imported at the first compiled pass, not with minidl: its import alone took 0.12 s
# (half of ``import minidl``) and 60 MiB of resident memory.
available = importlib.util.find_spec("numba") is not None
__all__ = ["available", "moments", "affine", "grad_sums", "grad_apply"]
_compiled = {}


def _loops():
    """{name: compiled function}, compiled (or loaded from Numba's cache) on first use."""
    if not _compiled:
        import numba
        # Only the sums may be reassociated (vectorised); no contraction into FMAs anywhere, so
        # each element is computed as the NumPy passes compute it.
        plain = numba.njit(nogil=True, cache=True)
        sums = numba.njit(nogil=True, cache=True, fastmath={"reassoc"})
        _compiled.update(moments=sums(_moments), affine=plain(_affine), grad_sums=sums(_grad_sums),
                         grad_apply=plain(_grad_apply))
    return _compiled


def moments(x3, shift, s, q):
    """s[c] += sum(x - shift[c]), q[c] += sum((x - shift[c])^2), per channel (s, q float64)."""
    _loops()["moments"](x3, shift, s, q)


def affine(x3, k, shift, r3, relu, zero, y3):
    """y = x * k + shift [+ r] [max 0]; r3 of shape (0, 0, 0) for no residual. ``zero`` (and
    grad_sums' ``one``) are scalars of x's dtype: a float literal would widen float32 sums."""
    _loops()["affine"](x3, k, shift, r3, relu, zero, y3)


def grad_sums(gy3, y3, x3, mu, relu, one, zero, g3, s, d):
    """g = gy [* (y > 0)] (written to g3 when relu); s[c] += sum(g), d[c] += sum(g * (x - mu[c]))."""
    _loops()["grad_sums"](gy3, y3, x3, mu, relu, one, zero, g3, s, d)


def grad_apply(g3, x3, k, a, c, gx3):
    """gx = g * k - x * a + c, per channel."""
    _loops()["grad_apply"](g3, x3, k, a, c, gx3)


# The loops Numba compiles (plain Python: readable, and testable without Numba).


def _moments(x3, shift, s, q):
    """s[c] += sum(x - shift[c]), q[c] += sum((x - shift[c])^2), per channel (s, q float64)."""
    n, channels, m = x3.shape
    for i in range(n):
        for c in range(channels):
            sh = shift[c]
            a = sh - sh
            b = sh - sh
            for j in range(m):
                v = x3[i, c, j] - sh
                a += v
                b += v * v
            s[c] += a
            q[c] += b



def _affine(x3, k, shift, r3, relu, zero, y3):
    """y = x * k + shift [+ r] [max 0]; r3 of shape (0, 0, 0) for no residual. ``zero`` (and
    grad_sums' ``one``) are scalars of x's dtype: a float literal would widen float32 sums."""
    n, channels, m = x3.shape
    residual = r3.shape[0] > 0
    for i in range(n):
        for c in range(channels):
            kc, sc = k[c], shift[c]
            for j in range(m):
                v = x3[i, c, j] * kc
                v += sc
                if residual:
                    v += r3[i, c, j]
                if relu and v < zero:  # NaN stays NaN, as numpy.maximum(v, 0) keeps it
                    v = zero
                y3[i, c, j] = v



def _grad_sums(gy3, y3, x3, mu, relu, one, zero, g3, s, d):
    """g = gy [* (y > 0)] (written to g3 when relu); s[c] += sum(g), d[c] += sum(g * (x - mu[c]))."""
    n, channels, m = x3.shape
    for i in range(n):
        for c in range(channels):
            mc = mu[c]
            a = mc - mc
            b = mc - mc
            for j in range(m):
                g = gy3[i, c, j]
                if relu:
                    g = g * (one if y3[i, c, j] > zero else zero)  # as gy * (y > 0): inf * 0 is NaN
                    g3[i, c, j] = g
                a += g
                b += g * (x3[i, c, j] - mc)
            s[c] += a
            d[c] += b



def _grad_apply(g3, x3, k, a, c, gx3):
    """gx = g * k - x * a + c, per channel."""
    n, channels, m = x3.shape
    for i in range(n):
        for ch in range(channels):
            kc, ac, cc = k[ch], a[ch], c[ch]
            for j in range(m):
                v = g3[i, ch, j] * kc
                v -= x3[i, ch, j] * ac
                v += cc
                gx3[i, ch, j] = v
