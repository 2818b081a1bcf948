"""Hypothesis strategies for layouts, shared by the planner's and the executor's tests."""
from math import lcm

from hypothesis import strategies as st

from minidl_parallel.tensor_parallel.layout import Layout

WORLDS = (1, 2, 4, 8, 12)


def factorisations(n):
    """Every ordered factorisation of n into factors > 1 ([] for 1)."""
    if n == 1:
        return [()]
    return [(f,) + rest for f in range(2, n + 1) if n % f == 0 for rest in factorisations(n // f)]


@st.composite
def layouts(draw, n, ndim, op):
    """A random layout of n devices: each axis cuts a dim, is partial (when op), or replicates."""
    dm = list(draw(st.sampled_from(factorisations(n))))
    if not dm or draw(st.integers(0, 4)) == 0:
        dm.insert(draw(st.integers(0, len(dm))), 1)  # size-1 axes, as repeat axes of 1 produce
    tmap, partial = [[] for _ in range(ndim)], []
    for a in draw(st.permutations(range(len(dm)))):
        where = draw(st.integers(-2 if op else -1, ndim - 1))
        if where >= 0:
            tmap[where].append(a)
        elif where == -2:
            partial.append((a, op))
    return Layout(tuple(dm), tuple(tuple(d) for d in tmap), tuple(partial))


@st.composite
def layout_pairs(draw, n=None, partial=True):
    """(src, dst, shape): two layouts of the same n devices and a shape both can cut.

    One partial op per example: a layout mixing sum and max axes has no defined reduction order.
    """
    n = draw(st.sampled_from(WORLDS)) if n is None else n
    ndim = draw(st.integers(0, 3))
    op = draw(st.sampled_from(("sum", "sum", "max"))) if partial else None
    src = draw(layouts(n, ndim, op))
    dst = draw(layouts(n, ndim, op))
    shape = tuple(lcm(a, b) * draw(st.integers(1, 2)) for a, b in zip(src.cuts(), dst.cuts()))
    return src, dst, shape
