"""A redistribution plan as plain data: :class:`Step` values in a :class:`Plan`, and their bytes.

The planner (redistribution.py) makes plans, the executor (executor.py) runs them; a plan
itself only says what moves: printable, hashable, comparable, testable without
communicating. The planner makes each plan together with its adjoint (the way a gradient
goes back), so this module needs nothing from it. The seven kinds of steps and the bytes
one rank sends for each (``in`` = its block's bytes, ``g`` = the group size, nccl-tests
conventions):

    slice           local      0                  R    -> S(d)
    allgather       ring       (g-1) * in         S(d) -> R
    allreduce       ring       2 (g-1)/g * in     P    -> R
    reduce_scatter  ring       (g-1)/g * in       P    -> S(d)
    alltoall        pairwise   (g-1)/g * in       S(d) -> S(e)
    zero_partial    local      0                  R    -> P
    relabel         none       0                  same blocks, another device matrix
"""
from dataclasses import dataclass, field
from math import prod

from .layout import Layout, axis_name

__all__ = ["Step", "Plan", "comm_bytes", "KINDS", "COLLECTIVES"]

COLLECTIVES = ("allgather", "allreduce", "reduce_scatter", "alltoall")
KINDS = ("slice",) + COLLECTIVES + ("zero_partial", "relabel")


def comm_bytes(kind, local_bytes_in, group_size):
    """The bytes one rank sends in a step (ring / pairwise algorithms, nccl-tests conventions).

    Args:
        kind: a step kind (see :data:`KINDS`); local kinds send nothing.
        local_bytes_in: the size in bytes of this rank's block before the step.
        group_size: ranks in the step's group.

    Example:
        >>> comm_bytes("allreduce", 4096, 4)
        6144
    """
    n, g = int(local_bytes_in), int(group_size)
    if kind not in KINDS:
        raise ValueError(f"comm_bytes: kind must be one of {KINDS}, got {kind!r}")
    if kind not in COLLECTIVES or g <= 1:
        return 0
    if kind == "allgather":
        return (g - 1) * n
    if kind == "allreduce":
        return 2 * (g - 1) * n // g
    return (g - 1) * n // g  # reduce_scatter, alltoall


def _names(axes):
    return "".join(axis_name(a) for a in axes)


@dataclass(frozen=True)
class Step:
    """One step of a plan: plain data, printable, hashable.

    Attributes:
        kind: one of :data:`KINDS`.
        before, after: the layouts before and after the step (a relabel changes the device
            matrix; every other step keeps ``before``'s).
        local_shape_in, local_shape_out: a rank's block before and after.
        axes: the device axes of ``before`` whose ranks form the step's group, major first
            (for slices: the axes whose coordinates pick the block).
        dim: the tensor dimension gathered, sliced or scattered (alltoall: gathered).
        split_dim: alltoall only: the dimension newly cut.
        op: the reduction (allreduce, reduce_scatter) or the new partial op (zero_partial).
        bytes_per_rank: what one rank sends (:func:`comm_bytes`).
    """

    kind: str
    before: Layout
    after: Layout
    local_shape_in: tuple
    local_shape_out: tuple
    axes: tuple = ()
    dim: object = None
    split_dim: object = None
    op: object = None
    bytes_per_rank: int = 0

    @property
    def group_size(self):
        return prod(self.before.device_matrix[a] for a in self.axes)

    @property
    def is_collective(self):
        return self.kind in COLLECTIVES

    def short(self):
        """A few characters: ``allreduce(b)``, ``slice(1:b)``, ``alltoall(b:0->1)``."""
        ax = _names(self.axes)
        if self.kind == "relabel":
            return "relabel"
        if self.kind == "alltoall":
            return f"alltoall({ax}:{self.dim}->{self.split_dim})"
        if self.dim is not None:
            return f"{self.kind}({self.dim}:{ax})"
        return f"{self.kind}({ax})"

    def __str__(self):
        if self.kind == "relabel":
            return f"relabel: {self.before} -> {self.after}"
        g = self.group_size
        ax = _names(self.axes)
        if self.kind == "slice":
            head = f"slice dim {self.dim} over {ax} ({g} blocks)"
        elif self.kind == "zero_partial":
            head = f"zero_partial {self.op} over {ax}"
        else:
            op = f" {self.op}" if self.op is not None else ""
            dims = "" if self.dim is None else f" dim {self.dim}"
            if self.kind == "alltoall":
                dims = f" dim {self.dim} -> dim {self.split_dim}"
            head = f"{self.kind}{op}{dims} over {ax} (groups of {g})"
        return (f"{head}: {self.before} -> {self.after}  block {tuple(self.local_shape_out)}  "
                f"{self.bytes_per_rank} B/rank")


@dataclass(frozen=True)
class Plan:
    """How a tensor of global ``shape`` moves from layout ``src`` to ``dst``: ``steps`` in order.

    ``back`` is the adjoint plan (see :meth:`adjoint`), made by the planner with this one; an
    adjoint has none itself. It takes no part in comparisons.
    """

    src: Layout
    dst: Layout
    shape: tuple
    steps: tuple = ()
    itemsize: int = 4
    back: object = field(default=None, compare=False, repr=False)

    @property
    def bytes_per_rank(self):
        """What one rank sends over the whole plan."""
        return sum(s.bytes_per_rank for s in self.steps)

    @property
    def num_collectives(self):
        return sum(1 for s in self.steps if s.is_collective)

    @property
    def moves_data(self):
        """False when the plan only relabels (the rank keeps its block as it is)."""
        return any(s.kind != "relabel" for s in self.steps)

    def adjoint(self):
        """The plan a gradient takes back: ``dst`` to ``src``, both without partial axes.

        A gradient of a tensor of layout L has layout ``L.without_partial()``, so the gradient of
        the moved tensor goes from ``dst.without_partial()`` to ``src.without_partial()``.
        """
        if self.back is None:
            raise ValueError(f"Plan.adjoint: the plan {self.src} -> {self.dst} has no adjoint: it is an adjoint "
                             f"itself (redistributions are differentiated once) or was not made by "
                             f"plan_redistribution")
        return self.back

    def short(self):
        """The steps on one line: ``allreduce(b), slice(1:b)`` (``no-op`` when empty)."""
        return ", ".join(s.short() for s in self.steps) or "no-op"

    def __str__(self):
        if not self.steps:
            return f"no change: {self.src}"
        return "\n".join(str(s) for s in self.steps)
