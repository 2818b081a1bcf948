"""Adasum (Horovod's operator, Maleki et al. 2021): combining gradients so that orthogonal
ones add and identical ones average.

For two gradients a and b::

    adasum(a, b) = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

and over 2^k ranks recursively: ranks (0, 1), (2, 3), ... pair first, then the pairs' results
pair, and so on (the tree Horovod's recursive halving computes). Horovod applies it per
tensor, and so does minidl. A gradient with |g|^2 < 1e-8 keeps coefficient 1 for its partner's
term, as in Horovod (the formula would divide by almost zero).

minidl computes the tree on every rank after one all-gather of the (compressed) bucket, in
float64, in the same order everywhere, so all ranks hold bit-identical results. That moves
n times a bucket where Horovod's recursive halving moves about 2 buckets: simple and exact
rather than bandwidth-optimal (docs/parallel.md says so).
"""

__all__ = ["adasum_pair", "adasum_tree", "adasum_per_tensor", "check_world"]

_TINY_NORM = 1e-8  # Horovod's threshold on |g|^2 below which a coefficient stays 1


def adasum_pair(xp, a, b):
    """adasum(a, b) for two float64 vectors of one tensor."""
    dot, na, nb = xp.vdot(a, b), xp.vdot(a, a), xp.vdot(b, b)  # on the device: no host sync
    ca = xp.where(na >= _TINY_NORM, 1.0 - dot / xp.maximum(na, _TINY_NORM) * 0.5, 1.0)
    cb = xp.where(nb >= _TINY_NORM, 1.0 - dot / xp.maximum(nb, _TINY_NORM) * 0.5, 1.0)
    return ca * a + cb * b


def adasum_tree(xp, vectors):
    """Adasum over a power-of-two list of vectors, pairing neighbours level by level."""
    level = list(vectors)
    while len(level) > 1:
        level = [adasum_pair(xp, level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


def adasum_per_tensor(xp, gathered, slots, out):
    """Each tensor's Adasum over the ranks' rows of one fused bucket, written into ``out``.

    Args:
        xp: the array module.
        gathered: (ranks, bucket size) float64, one row per rank (rank order).
        slots: (offset, element count) of each tensor in the bucket.
        out: the bucket's buffer; each tensor's result is cast to its dtype.
    """
    for off, n in slots:
        rows = [gathered[r, off:off + n] for r in range(gathered.shape[0])]
        out[off:off + n] = adasum_tree(xp, rows).astype(out.dtype)


def check_world(size, who):
    """Raises unless size is a power of two (the tree pairs every rank at every level)."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"{who}: Adasum needs a power-of-two number of ranks (its tree pairs them level by "
                         f"level), got a world of {size}; use 1, 2, 4, 8... ranks, or op=Average")
