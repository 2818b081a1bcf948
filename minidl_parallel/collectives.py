"""Differentiable collectives: AllReduce, AllGather, ReduceScatter and Broadcast as Primitives.

Each is an ``ops``-style primitive usable inside a Cell; forward calls the communicator and
backward calls its adjoint collective. The adjoints are those of the GLOBAL loss, the sum
over ranks of each rank's loss, which is what data-parallel training differentiates (every
rank runs backward on its own loss and the gradient sums of all ranks meet in the adjoint):

    forward                          backward (gy: this rank's output gradient)
    y = allreduce(x, sum)            gx = allreduce(gy, sum)
    y = allreduce(x, mean)           gx = allreduce(gy, mean)
    y = allreduce(x, max | min)      gx = allreduce(gy, sum) where x is the extremum, split
                                     evenly among the ranks that tie, 0 elsewhere
    y = allgather(x)  (axis 0)       gx = reduce_scatter(gy, sum)
    y = reduce_scatter(x, sum)       gx = allgather(gy)
    y = broadcast(x, root)           gx = allreduce(gy, sum) on root, zeros elsewhere

``op="prod"`` runs forward but has no gradient (backward raises): its adjoint divides by x,
which is undefined where any rank holds a zero.

Every rank must call the same collectives in the same order, in forward and in backward;
the graphs of a data-parallel net are the same on every rank, so this holds there.

Example:
    >>> from minidl_parallel.collectives import AllReduce
    >>> total = AllReduce("sum")(x)      # same Tensor on every rank, differentiable
"""
from minidl.backend import get_array_module
from minidl.ops.primitive import Primitive

_REDUCE_OPS = ("sum", "mean", "max", "min", "prod")


def resolve_communicator(who, group=None):
    """The communicator a collective uses: ``group`` when given, else the context's world.

    The world is read at call time, so a net built before ``init()`` (or, under the threads
    backend, in another thread) still talks to the calling rank's world; before ``init()``
    it is a world of one.
    """
    if group is not None:
        if not hasattr(group, "allreduce"):
            raise TypeError(f"{who}: group must be a Communicator (or None for the world), "
                            f"got {type(group).__name__}")
        return group
    from . import context
    if context.is_initialized():
        return context.get_communicator()
    # Not initialised: a world of one, so single-process scripts run unchanged.
    from .comm.local import LocalCommunicator
    return LocalCommunicator()


def _check_op(who, op, allowed):
    if op not in allowed:
        raise ValueError(f"{who}: op must be one of {allowed}, got {op!r}")
    return op


class AllReduce(Primitive):
    """Reduces x over the ranks of a group; every rank gets the result.

    Args:
        op: "sum", "mean", "max", "min" or "prod" (prod has no gradient).
        group: a Communicator, or None for the world.
    """

    n_inputs = 1

    def __init__(self, op="sum", group=None):
        super().__init__()
        self.op = _check_op("AllReduce", op, _REDUCE_OPS)
        self.group = group

    def forward(self, x):
        comm = resolve_communicator(self.name, self.group)
        y = comm.allreduce(x, self.op)
        if self.op in ("max", "min"):
            self.x, self.y = x, y
        return y

    def backward(self, gy):
        comm = resolve_communicator(self.name, self.group)
        if self.op == "prod":
            raise RuntimeError("AllReduce: op='prod' has no gradient (its adjoint divides by x, undefined "
                               "where a rank holds 0); use 'sum', 'mean', 'max' or 'min'")
        if self.op == "mean":
            return (comm.allreduce(gy, "mean"),)
        g = comm.allreduce(gy, "sum")
        if self.op == "sum":
            return (g,)
        # max/min: the ranks holding the extremum share the gradient evenly (ties split).
        hit = (self.x == self.y).astype(gy.dtype)
        ties = comm.allreduce(hit, "sum")
        xp = get_array_module(gy)
        return (xp.divide(g * hit, xp.maximum(ties, 1)),)


class AllGather(Primitive):
    """Concatenates every rank's x (same shape on all) along axis 0.

    Args:
        group: a Communicator, or None for the world.
    """

    n_inputs = 1

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, x):
        if getattr(x, "ndim", 0) < 1:
            raise ValueError(f"AllGather: x must have at least 1 dimension, got shape {tuple(getattr(x, 'shape', ()))}")
        return resolve_communicator(self.name, self.group).allgather(x, 0)

    def backward(self, gy):
        return (resolve_communicator(self.name, self.group).reduce_scatter(gy, "sum", 0),)


class ReduceScatter(Primitive):
    """Sums x over the ranks and gives rank r the r-th of ``size`` equal slices along axis 0.

    Args:
        op: "sum" or "mean".
        group: a Communicator, or None for the world.
    """

    n_inputs = 1

    def __init__(self, op="sum", group=None):
        super().__init__()
        self.op = _check_op("ReduceScatter", op, ("sum", "mean"))
        self.group = group

    def forward(self, x):
        comm = resolve_communicator(self.name, self.group)
        shape = tuple(getattr(x, "shape", ()))
        if len(shape) < 1 or shape[0] % comm.size:
            raise ValueError(f"ReduceScatter: x of shape {shape}: axis 0 must be divisible by the group "
                             f"size {comm.size}")
        return comm.reduce_scatter(x, self.op, 0)

    def backward(self, gy):
        comm = resolve_communicator(self.name, self.group)
        gx = comm.allgather(gy, 0)
        if self.op == "mean":
            gx = gx / comm.size
        return (gx,)


class Broadcast(Primitive):
    """Gives every rank root's x (all ranks pass an x of the same shape and dtype).

    Args:
        root: the rank whose x is sent, in the group's numbering.
        group: a Communicator, or None for the world.
    """

    n_inputs = 1

    def __init__(self, root=0, group=None):
        super().__init__()
        if isinstance(root, bool) or not isinstance(root, int) or root < 0:
            raise ValueError(f"Broadcast: root must be a non-negative int, got {root!r}")
        self.root = root
        self.group = group

    def forward(self, x):
        comm = resolve_communicator(self.name, self.group)
        if self.root >= comm.size:
            raise ValueError(f"Broadcast: root {self.root} is not a rank of a group of size {comm.size}")
        return comm.broadcast(x, self.root)

    def backward(self, gy):
        comm = resolve_communicator(self.name, self.group)
        g = comm.allreduce(gy, "sum")  # every rank must take part, even those that get zeros
        if comm.rank != self.root:
            g = get_array_module(g).zeros_like(g)
        return (g,)


__all__ = ["AllReduce", "AllGather", "ReduceScatter", "Broadcast", "resolve_communicator"]
