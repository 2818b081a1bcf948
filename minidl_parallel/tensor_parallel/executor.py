"""Running redistribution plans: each step on this rank's block, over cached sub-communicators.

:func:`execute` walks a :class:`~.redistribution.Plan` (plain data) and turns every step into
one call on the communicator of its group (``world_comm.split(ranks)``, cached by
:class:`GroupCache`); slices and zero_partial are local. It is exact: nothing but the
reductions of allreduce and reduce_scatter touches the values.

:class:`Redistribute` is the autograd op. Its backward moves the gradient back with the plan
``dst.without_partial() -> src.without_partial()``: the gradient of a tensor whose layout is
L always has layout ``L.without_partial()`` (the gradient of a partial sum is the whole
gradient, on every partial rank), so each step meets its adjoint (all-gather <-> slice,
reduce-scatter <-> all-gather, all-reduce <-> nothing, all-to-all <-> the reverse all-to-all).

Example (inside each rank):
    >>> plan = plan_redistribution(src, dst, shape, x.dtype.itemsize)
    >>> y = Redistribute(plan, world_comm)(x)       # differentiable; y holds dst's block
"""
import threading
import weakref

from minidl.backend import get_array_module
from minidl.ops.primitive import Primitive

from . import counter
from .layout import Layout
from .redistribution import Plan, comm_bytes, plan_redistribution

__all__ = ["GroupCache", "execute", "Redistribute", "gather_full", "local_block"]


class GroupCache:
    """Sub-communicators by (world communicator, ranks), made once.

    ``split`` is collective over the group's members, so every member must ask for a group
    the first time at the same point of the program: plans are the same on every rank and
    each member of a group computes the same ``ranks`` tuple, so they do.
    """

    def __init__(self):
        self._lock = threading.Lock()
        # Weak keys: a world that ends (threads tests make many) takes its groups with it, and a
        # new communicator reusing its id() can never see them.
        self._groups = weakref.WeakKeyDictionary()

    def get(self, world_comm, ranks):
        """The communicator over ``ranks`` (world ranks, in group order).

        Returns ``world_comm`` itself for the whole world in rank order, None for one rank
        (a group of one needs no communication).
        """
        ranks = tuple(int(r) for r in ranks)
        if len(ranks) == 1:
            return None
        if ranks == tuple(range(world_comm.size)):
            return world_comm
        with self._lock:
            groups = self._groups.setdefault(world_comm, {})
            sub = groups.get(ranks)
        if sub is None:
            sub = world_comm.split(ranks)  # outside the lock: split may wait for the other members
            with self._lock:
                groups[ranks] = sub
        return sub

    def clear(self):
        with self._lock:
            self._groups.clear()


_default_groups = GroupCache()


def _block_index(layout, coords, axes):
    i = 0
    for a in axes:
        i = i * layout.device_matrix[a] + coords[a]
    return i


def _run_step(step, x, world_comm, rank, groups, phase):
    kind = step.kind
    if kind == "relabel":
        return x
    if kind == "slice":
        g = step.group_size
        i = _block_index(step.before, step.before.coords(rank), step.axes)
        n = x.shape[step.dim] // g
        index = [slice(None)] * x.ndim
        index[step.dim] = slice(i * n, (i + 1) * n)
        return x[tuple(index)].copy()  # a block of its own: the source may be written later
    if kind == "zero_partial":
        coords = step.before.coords(rank)
        if step.op == "sum" and any(coords[a] for a in step.axes):
            return get_array_module(x).zeros_like(x)
        return x  # max: every rank holding the value keeps the maximum the value
    ranks = step.before.group(rank, step.axes)
    comm = groups.get(world_comm, ranks)
    if comm is None:
        return x
    if phase is not None:
        counter.record(kind, len(ranks), comm_bytes(kind, x.nbytes, len(ranks)), phase)
    if kind == "allgather":
        return comm.allgather(x, step.dim)
    if kind == "allreduce":
        return comm.allreduce(x, step.op)
    if kind == "reduce_scatter":
        return comm.reduce_scatter(x, step.op, step.dim)
    if kind == "alltoall":
        return comm.alltoall(x, split_axis=step.split_dim, concat_axis=step.dim)
    raise ValueError(f"execute: unknown step kind {kind!r}")


def execute(plan, array, world_comm, rank=None, groups=None, phase="forward"):
    """Runs ``plan`` on this rank's block ``array``; returns the block of ``plan.dst``.

    Every rank of ``world_comm`` must call it with the same plan. The result may be
    ``array`` itself when the plan moves nothing.

    Args:
        plan: a Plan (:func:`~.redistribution.plan_redistribution`).
        array: this rank's block of ``plan.src`` (numpy or cupy).
        world_comm: the communicator of all ``plan.src.device_num`` ranks.
        rank: this rank in ``world_comm`` (default ``world_comm.rank``).
        groups: a GroupCache (default: one shared by the process).
        phase: "forward" or "backward" for :mod:`.counter`; None records nothing.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"execute: plan must be a Plan, got {type(plan).__name__}")
    rank = world_comm.rank if rank is None else int(rank)
    groups = _default_groups if groups is None else groups
    if world_comm.size != plan.src.device_num:
        raise ValueError(f"execute: the plan {plan.src} -> {plan.dst} is for {plan.src.device_num} ranks, but the "
                         f"communicator has {world_comm.size}")
    expected = plan.src.local_shape(plan.shape)
    if tuple(array.shape) != expected:
        raise ValueError(f"execute: the block of a {plan.shape} tensor laid out as {plan.src} has shape {expected}, "
                         f"got {tuple(array.shape)}")
    x = array
    for step in plan.steps:
        x = _run_step(step, x, world_comm, rank, groups, phase)
    return x


class Redistribute(Primitive):
    """Moves a tensor's block from ``plan.src`` to ``plan.dst``; backward runs the adjoint plan.

    Args:
        plan: the Plan to run.
        world_comm: the communicator of every rank of the layouts.
        groups: a GroupCache (default: one shared by the process).
    """

    n_inputs = 1

    def __init__(self, plan, world_comm, groups=None):
        super().__init__()
        if not isinstance(plan, Plan):
            raise TypeError(f"Redistribute: plan must be a Plan, got {type(plan).__name__}")
        self.plan = plan
        self.world_comm = world_comm
        self.groups = _default_groups if groups is None else groups

    @property
    def name(self):
        return f"Redistribute[{self.plan.short()}]"

    def forward(self, x):
        return execute(self.plan, x, self.world_comm, self.world_comm.rank, self.groups, "forward")

    def backward(self, gy):
        if not self.needs_grad[0]:
            return (None,)
        return (execute(self.plan.adjoint(), gy, self.world_comm, self.world_comm.rank, self.groups, "backward"),)

    def __repr__(self):
        return f"Redistribute({self.plan.src} -> {self.plan.dst}: {self.plan.short()})"


def gather_full(array, layout, shape, world_comm, groups=None):
    """The whole logical tensor on every rank, from this rank's block (every rank must call it).

    Used for checkpoints and tests, so it is not reported to :mod:`.counter`.
    """
    shape = tuple(int(n) for n in shape)
    whole = Layout(layout.device_matrix, ((),) * len(shape))
    if layout == whole:
        return array
    plan = plan_redistribution(layout, whole, shape, array.dtype.itemsize)
    return execute(plan, array, world_comm, world_comm.rank, groups, phase=None)


def local_block(full_array, layout, rank):
    """The block of a whole array that ``rank`` holds under ``layout`` (a view where possible).

    Partial layouts: a sum-partial value lives on the ranks at coordinate 0 of every sum
    axis, the others hold 0 (the sum's identity); along max axes every rank holds the value.
    """
    block = full_array[layout.local_slices(rank, tuple(full_array.shape))]
    coords = layout.coords(rank)
    if any(op == "sum" and coords[a] for a, op in layout.partial):
        return get_array_module(block).zeros_like(block)
    return block
