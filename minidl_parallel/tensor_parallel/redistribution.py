"""The redistribution planner: how a tensor moves from one layout to another, as plain data.

A :class:`Plan` (plan.py) is a tuple of :class:`Step` values, each one of seven kinds;
nothing here communicates (executor.py runs plans). The transitions, per device axis of a layout
(P = partial, S(d) = cuts dimension d, R = replica; bytes one rank sends, ``in`` its block):

    R    -> S(d)   slice           local              0
    S(d) -> R      allgather       ring               (g-1) * in
    P    -> R      allreduce       ring               2 (g-1)/g * in
    P    -> S(d)   reduce_scatter  ring               (g-1)/g * in
    S(d) -> S(e)   alltoall        pairwise           (g-1)/g * in
    R    -> P      zero_partial    local              0      (sum: ranks off coordinate 0 hold 0)
    same data, another device matrix: relabel         0

The planner puts both layouts on one device matrix of "atoms": device axis i of size s and
stride t covers the rank digits [t, t*s); cutting every axis at every boundary of either
matrix gives atoms, so that each axis of either layout is a run of atoms (``[8]`` and
``[2, 4]`` share the atoms ``[2, 4]``). On atoms a greedy loop moves the tensor: free slices
first (they shrink every later message), then reduce-scatters, all-to-alls, all-reduces, and
all-gathers last, each over the combined group of all the atoms it moves. On matrices of up
to 4 atoms a bounded search (Dijkstra over layouts, by bytes, then collectives, then steps)
then looks for a cheaper route than the greedy one; it finds the fewest bytes over these
seven kinds of steps. When the two matrices have no common atoms (``[3, 4]`` and ``[4, 3]``)
or the route would send more, the plan is the naive route: all-reduce, all-gather to
replicated, slice.

Example:
    >>> src = Layout((2, 4, 1), ((0,), (2,)), ((1, "sum"),))   # MatMul's partial output
    >>> dst = Layout((2, 4), ((0,), (1,)))
    >>> plan = plan_redistribution(src, dst, (16, 16))
    >>> plan.short(), plan.num_collectives, plan.bytes_per_rank
    ('reduce_scatter(1:b), relabel', 1, 384)
    >>> print(plan.steps[1])
    relabel: (a, b) on [2, 4, 1] -> (a, b) on [2, 4]
"""
from functools import lru_cache
from heapq import heappop, heappush
from itertools import combinations, count, permutations
from math import prod

from .layout import PARTIAL_OPS, Layout
from .plan import COLLECTIVES, KINDS, Plan, Step, comm_bytes  # noqa: F401  (re-exported)

__all__ = ["Step", "Plan", "plan_redistribution", "comm_bytes", "naive_bytes", "KINDS", "COLLECTIVES"]

# ---- building steps -------------------------------------------------------------------------

def _moved(tmap, partial, kind, axes, dim=None, split_dim=None, op=None):
    """What a step does to (tensor_map, partial) as tuples: the one place that says it."""
    tmap = [list(d) for d in tmap]
    part = dict(partial)
    if kind in ("allgather", "alltoall"):
        assert tuple(tmap[dim][-len(axes):]) == tuple(axes), (tmap, kind, axes, dim)
        del tmap[dim][-len(axes):]
    if kind in ("allreduce", "reduce_scatter"):
        for a in axes:
            del part[a]
    if kind == "zero_partial":
        part.update((a, op) for a in axes)
    if kind in ("slice", "reduce_scatter"):
        tmap[dim] += axes
    if kind == "alltoall":
        tmap[split_dim] += axes
    return tuple(tuple(d) for d in tmap), tuple(sorted(part.items()))


def _after(layout, kind, axes, dim=None, split_dim=None, op=None):
    """The layout a step leaves."""
    return Layout(layout.device_matrix, *_moved(layout.tensor_map, layout.partial, kind, axes, dim, split_dim, op))


class _Builder:
    """A plan under construction: the steps so far and the working layout they reach."""

    def __init__(self, layout, shape, itemsize):
        self.shape, self.itemsize = shape, itemsize
        self.steps = []
        self._load(layout)

    def _load(self, layout):
        # The greedy route reads the working layout as lists (cuts per dim, partial axis -> op).
        self.layout = layout
        self.dm = layout.device_matrix
        self.tmap = [list(d) for d in layout.tensor_map]
        self.part = dict(layout.partial)

    def relabel(self, layout):
        before = self.layout
        local = before.local_shape(self.shape)
        assert layout.local_shape(self.shape) == local
        self._load(layout)
        self.steps.append(Step("relabel", before, layout, local, local))

    def emit(self, kind, axes, dim=None, split_dim=None, op=None):
        before, axes = self.layout, tuple(axes)
        self._load(_after(before, kind, axes, dim, split_dim, op))
        local_in = before.local_shape(self.shape)
        sent = comm_bytes(kind, prod(local_in) * self.itemsize, prod(self.dm[a] for a in axes))
        self.steps.append(Step(kind, before, self.layout, local_in, self.layout.local_shape(self.shape), axes, dim,
                               split_dim, op, sent))

    @property
    def bytes(self):
        return sum(s.bytes_per_rank for s in self.steps)

    @property
    def cost(self):
        """What plans are compared by: bytes sent, then collectives, then steps."""
        moving = [s for s in self.steps if s.kind != "relabel"]
        return self.bytes, sum(s.is_collective for s in moving), len(moving)


def _naive_steps(src, dst, shape, itemsize):
    """All-reduce every partial axis, all-gather every cut, relabel, slice, zero: always correct."""
    b = _Builder(src, shape, itemsize)
    for op in PARTIAL_OPS:
        axes = [a for a, o in src.partial if o == op]
        if axes:
            b.emit("allreduce", axes, op=op)
    for d, axes in enumerate(src.tensor_map):
        if axes:
            b.emit("allgather", axes, dim=d)
    whole = Layout(dst.device_matrix, ((),) * len(shape))
    if b.layout != whole:
        b.relabel(whole)
    for d, axes in enumerate(dst.tensor_map):
        if axes:
            b.emit("slice", axes, dim=d)
    for op in PARTIAL_OPS:
        axes = [a for a, o in dst.partial if o == op]
        if axes:
            b.emit("zero_partial", axes, op=op)
    return b


# ---- atoms: a device matrix both layouts can be written on ----------------------------------

def _spans(dm):
    """{axis: (stride, stride * size)} for the axes of size > 1: the rank digits each covers."""
    out, stride = {}, 1
    for a in reversed(range(len(dm))):
        if dm[a] > 1:
            out[a] = (stride, stride * dm[a])
        stride *= dm[a]
    return out


def _atom_bounds(dm1, dm2):
    """Sorted digit boundaries of both matrices, or None when they form no divisibility chain."""
    cuts = {1, prod(dm1)}
    for dm in (dm1, dm2):
        for lo, hi in _spans(dm).values():
            cuts |= {lo, hi}
    bounds = sorted(cuts)
    if any(hi % lo for lo, hi in zip(bounds, bounds[1:])):
        return None
    return bounds


def _on_atoms(layout, bounds, dm, atom_axis):
    """``layout`` rewritten on matrix ``dm`` whose axis ``atom_axis[j]`` is atom j (major first)."""
    k = len(bounds) - 1
    spans = _spans(layout.device_matrix)

    def atoms(a):
        lo, hi = spans[a]
        return [atom_axis[j] for j in range(k) if lo <= bounds[k - 1 - j] and bounds[k - j] <= hi]

    tmap = tuple(tuple(x for a in dim for x in atoms(a)) for dim in layout.tensor_map)
    part = tuple((x, op) for a, op in layout.partial for x in atoms(a))
    return Layout(dm, tmap, part)


def _working_matrix(src, dst, bounds):
    """The matrix to plan on: src's or dst's when its axes are the atoms (no relabel), else the atoms."""
    k = len(bounds) - 1
    sizes = tuple(bounds[k - j] // bounds[k - 1 - j] for j in range(k))
    for lay in (src, dst):
        big = [a for a, s in enumerate(lay.device_matrix) if s > 1]
        if tuple(lay.device_matrix[a] for a in big) == sizes:
            return lay.device_matrix, big
    return sizes, list(range(k))


# ---- the greedy route on atoms (an upper bound; the route itself on large matrices) --------

def _route(b, target):
    """Appends steps to ``b`` until its layout is ``target`` (same device matrix)."""
    want = [list(d) for d in target.tensor_map]
    want_part = dict(target.partial)
    actions = (_slice, _reduce_scatter, _alltoall, _allreduce, _gather, _zero)
    for _ in range(1000):  # each action makes progress; the bound only turns a bug into an error
        if not any(act(b, want, want_part) for act in actions):
            break
    assert b.layout == target, f"planner bug: reached {b.layout}, wanted {target}"


def _is_prefix(b, want, d):
    cur = b.tmap[d]
    return cur == want[d][:len(cur)]


def _next_wanted(b, want, d):
    """The atoms dst wants next on dim d, when d's cuts so far are what dst wants; else []."""
    return want[d][len(b.tmap[d]):] if _is_prefix(b, want, d) else []


def _extras(b, want, d):
    """Position where dim d's cuts stop agreeing with dst's: the atoms after it must go."""
    cur, w = b.tmap[d], want[d]
    p = 0
    while p < len(cur) and p < len(w) and cur[p] == w[p]:
        p += 1
    return p


def _free(b, a):
    return a not in b.part and all(a not in dim for dim in b.tmap)


def _slice(b, want, want_part):
    for d in range(len(want)):
        run = []
        for a in _next_wanted(b, want, d):
            if not _free(b, a):
                break
            run.append(a)
        if run:
            b.emit("slice", run, dim=d)
            return True
    return False


def _reduce_scatter(b, want, want_part):
    for d in range(len(want)):
        run, op = [], None
        for a in _next_wanted(b, want, d):
            if a not in b.part or (op is not None and b.part[a] != op):
                break
            run.append(a)
            op = b.part[a]
        if run:
            b.emit("reduce_scatter", run, dim=d, op=op)
            return True
    return False


def _alltoall(b, want, want_part):
    best = None
    for d in range(len(want)):
        extras = b.tmap[d][_extras(b, want, d):]
        for e in range(len(want)):
            nxt = _next_wanted(b, want, e) if e != d else []
            r = min(len(extras), len(nxt))
            while r and extras[-r:] != nxt[:r]:
                r -= 1
            if r and (best is None or r > best[0]):
                best = (r, d, e)
    if best is None:
        return False
    r, d, e = best
    b.emit("alltoall", b.tmap[d][-r:], dim=d, split_dim=e)
    return True


def _allreduce(b, want, want_part):
    for op in PARTIAL_OPS:
        axes = [a for a, o in sorted(b.part.items()) if o == op and want_part.get(a) != op]
        if axes:
            b.emit("allreduce", axes, op=op)
            return True
    return False


def _ends_a_wanted_run(cur, p, q, nxt):
    """Whether cur[q - r + 1 : q + 1] == nxt[:r] for some r >= 1 inside the extras (from p)."""
    return any(cur[q + 1 - r:q + 1] == nxt[:r] for r in range(1, min(q + 1 - p, len(nxt)) + 1))


def _gather(b, want, want_part):
    for d in range(len(want)):
        cur = b.tmap[d]
        p = _extras(b, want, d)
        if p == len(cur):
            continue
        # Gather only the atoms minor to a run another dim wants next: an all-to-all then moves the run.
        others = [_next_wanted(b, want, e) for e in range(len(want)) if e != d]
        start = next((q + 1 for q in range(len(cur) - 2, p - 1, -1)
                      if any(_ends_a_wanted_run(cur, p, q, nxt) for nxt in others if nxt)), p)
        b.emit("allgather", cur[start:], dim=d)
        return True
    return False


def _zero(b, want, want_part):
    for op in PARTIAL_OPS:
        axes = [a for a, o in sorted(want_part.items()) if o == op and b.part.get(a) != op]
        if axes:
            assert all(_free(b, a) for a in axes)
            b.emit("zero_partial", axes, op=op)
            return True
    return False


# ---- the exact search, on small matrices -----------------------------------------------------

_SEARCH_ATOMS = 4      # the search runs on matrices of up to 4 atoms (16 devices of size-2 atoms) ...
_SEARCH_STATES = 1000  # ... and gives up after this many layouts (about 0.1 s): the greedy route stays


def _moves(dm, tmap, partial, want_part):
    """Every step the search tries from a layout: (kind, axes, dim, split_dim, op)."""
    part = dict(partial)
    used = {a for d in tmap for a in d} | set(part)
    free = [a for a, size in enumerate(dm) if size > 1 and a not in used]
    for d, cut in enumerate(tmap):
        for k in range(1, len(free) + 1):
            for run in permutations(free, k):
                yield "slice", run, d, None, None
        for k in range(1, len(cut) + 1):
            yield "allgather", cut[-k:], d, None, None
            for e in range(len(tmap)):
                if e != d:
                    yield "alltoall", cut[-k:], d, e, None
    for op in PARTIAL_OPS:
        axes = [a for a, o in partial if o == op]
        for k in range(1, len(axes) + 1):
            for group in combinations(axes, k):
                yield "allreduce", group, None, None, op
            for run in permutations(axes, k):
                for d in range(len(tmap)):
                    yield "reduce_scatter", run, d, None, op
        zero = [a for a in free if want_part.get(a) == op]
        for k in range(1, len(zero) + 1):
            for group in combinations(zero, k):
                yield "zero_partial", group, None, None, op


def _search(src, dst, shape, itemsize, bound):
    """The cheapest route from src to dst (one matrix), Dijkstra over layouts; None past the budget.

    Finds what the greedy route misses, such as parking a cut on another dimension with an
    all-to-all instead of gathering it: ``(b, a) -> (-, ba)`` is two all-to-alls, not two
    all-gathers. ``bound`` (the greedy route's cost) prunes everything dearer. States are
    (tensor_map, partial) tuples: building Layouts here would cost more than the search.
    """
    dm, want_part = src.device_matrix, dict(dst.partial)
    start, goal = (src.tensor_map, src.partial), (dst.tensor_map, dst.partial)
    best, came = {start: (0, 0, 0)}, {}
    heap, tie = [((0, 0, 0), 0, start)], count(1)
    expanded = 0
    while heap:
        cost, _, state = heappop(heap)
        if state == goal:
            path = []
            while state in came:
                state, move = came[state]
                path.append(move)
            return path[::-1]
        if cost > best[state]:
            continue
        expanded += 1
        if expanded > _SEARCH_STATES:
            return None
        tmap, partial = state
        local_bytes = itemsize * prod(n // prod(dm[a] for a in cut) for n, cut in zip(shape, tmap))
        for move in _moves(dm, tmap, partial, want_part):
            nxt = _moved(tmap, partial, *move)
            if any(n % prod(dm[a] for a in cut) for n, cut in zip(shape, nxt[0])):
                continue
            kind, axes = move[0], move[1]
            sent = comm_bytes(kind, local_bytes, prod(dm[a] for a in axes))
            c = (cost[0] + sent, cost[1] + (kind in COLLECTIVES), cost[2] + 1)
            if c <= bound and c < best.get(nxt, (float("inf"),)):
                best[nxt], came[nxt] = c, (state, move)
                heappush(heap, (c, next(tie), nxt))
    return None


def _smart_steps(src, dst, shape, itemsize, bounds):
    dm, atom_axis = _working_matrix(src, dst, bounds)
    src_w, dst_w = _on_atoms(src, bounds, dm, atom_axis), _on_atoms(dst, bounds, dm, atom_axis)

    def start():
        b = _Builder(src, shape, itemsize)
        if src_w != src:
            b.relabel(src_w)
        return b

    b = start()
    _route(b, dst_w)
    # Mixed sum and max partial axes have no defined order: keep the greedy route's (sum first).
    if len(bounds) - 1 <= _SEARCH_ATOMS and len({op for _, op in src.partial}) <= 1:
        path = _search(src_w, dst_w, shape, itemsize, b.cost)
        if path is not None:
            found = start()
            for move in path:
                found.emit(*move)
            if found.cost < b.cost:
                b = found
    if dst_w != dst:
        b.relabel(dst)
    return b


# ---- public entry points ---------------------------------------------------------------------

def _check(src, dst, shape, who):
    for name, lay in (("src", src), ("dst", dst)):
        if not isinstance(lay, Layout):
            raise TypeError(f"{who}: {name} must be a Layout, got {type(lay).__name__}")
    head = f"{who}: a tensor of shape {shape} cannot move from {src} to {dst}"
    if src.device_num != dst.device_num:
        raise ValueError(f"{head}: the layouts have {src.device_num} and {dst.device_num} devices")
    try:
        src.check_shape(shape, "src")
        dst.check_shape(shape, "dst")
    except ValueError as e:
        raise ValueError(f"{head}: {e}") from None


def _norm_shape(shape):
    try:
        return tuple(int(n) for n in shape)
    except TypeError:
        raise TypeError(f"plan_redistribution: shape must be a tuple of ints, got {shape!r}") from None


def plan_redistribution(src, dst, shape, itemsize=4):
    """The plan that moves a tensor of global ``shape`` from layout ``src`` to ``dst`` (cached).

    Args:
        src, dst: Layouts with the same number of devices, both valid for ``shape``.
        shape: the tensor's global shape.
        itemsize: bytes per element (for the byte counts only).

    Raises:
        ValueError naming both layouts and the shape when they cannot describe the same tensor.

    Example:
        >>> plan = plan_redistribution(Layout((8,), ((0,), ())), Layout((2, 4), ((0,), (1,))), (16, 32))
        >>> plan.num_collectives, plan.steps[-1].kind
        (1, 'alltoall')
    """
    return _plan(src, dst, _norm_shape(shape), int(itemsize))


@lru_cache(maxsize=4096)
def _plan(src, dst, shape, itemsize):
    """The plan, with its adjoint: the gradient's way back, ``dst`` to ``src`` without partial axes."""
    steps = _steps(src, dst, shape, itemsize)
    back_src, back_dst = dst.without_partial(), src.without_partial()
    back = Plan(back_src, back_dst, shape, _steps(back_src, back_dst, shape, itemsize), itemsize)
    return Plan(src, dst, shape, steps, itemsize, back)


@lru_cache(maxsize=4096)
def _steps(src, dst, shape, itemsize):
    _check(src, dst, shape, "plan_redistribution")
    if src == dst:
        return ()
    naive = _naive_steps(src, dst, shape, itemsize)
    bounds = _atom_bounds(src.device_matrix, dst.device_matrix)
    best = naive
    if bounds is not None:
        smart = _smart_steps(src, dst, shape, itemsize, bounds)
        if smart.cost <= naive.cost:
            best = smart
    return tuple(best.steps)


def naive_bytes(src, dst, shape, itemsize=4):
    """Bytes per rank of the naive route (all-reduce, all-gather to replicated, slice): an upper bound."""
    shape = _norm_shape(shape)
    _check(src, dst, shape, "naive_bytes")
    return _naive_steps(src, dst, shape, int(itemsize)).bytes
