"""Pending values: an op's output GRAPH_MODE has not computed yet, and the inputs it watches.

A pending output is a plain :class:`~minidl.tensor.Tensor` whose ``_data`` is None and whose
``_pending`` slot holds a :class:`Pending` record (the op, its arguments, the grad mode it was
called under, the shape and dtype it will have). The record also *watches* the op's tensor
arguments: their ``_pending`` slot points at it. Tensor's ``data`` property (minidl/tensor.py)
calls :meth:`Pending.resolve` whenever a tensor with a record is read or written, so:

- using the output (another op, ``asnumpy``, printing, backward) computes it first;
- reading or replacing an argument (``bn.moving_mean`` read before the ReLU, ``x.data`` written
  into) first runs the op that waits on it, as eager ran it before that line.

No object changes class, and nothing here is installed into the core: Tensor asks its
record, and the record is this module's.

After fusion (rules.py) the head's own output may still be used (two consumers): it stays
pending in the FUSED state, watching the arguments whose values it needs, and computes then
without updating the moving statistics a second time. Records hold their output weakly: a
dead output stops watching and costs nothing.
"""
import threading
import time
import weakref

from ..ops.norm import BatchNorm
from ..tensor import Tensor, _grad_mode
from .rules import ending

PENDING, FUSED, RUNNING, DONE = "pending", "fused", "running", "done"

# Watches and records are shared between threads (an argument may be one rank-thread's parameter
# read by another's checkpoint). The lock guards only that bookkeeping: no op ever runs while it
# is held, because under a parallel runtime an op may wait for the other ranks, which are threads
# that need the lock for their own records. A record being run is RUNNING; another thread that
# needs its value waits (bounded) on ``_ran``.
lock = threading.RLock()
_ran = threading.Condition(lock)
WAIT_S = 600.0  # for another thread's run of a pending op (it may include a collective)


class Pending:
    """What a pending output waits for (see the module doc).

    ``op``, ``args``: the call (``op`` a configured copy of the called primitive); a *head*
    (BatchNorm, MatMul, Dense), or the op after one, whose argument ``head`` is the head's
    pending output. ``inner``: the runtime the call would have gone to (it runs the op).
    ``frame``: the Cell call's window that holds it. ``journal``: where :func:`explain` notes
    what ran and why (None outside explain).
    """

    __slots__ = ("op", "args", "grad", "shape", "dtype", "state", "head", "frame", "watching", "ref", "inner",
                 "journal", "__weakref__")

    def __init__(self, op, args, grad, shape, dtype, inner, head=None, journal=None):
        self.op, self.args, self.grad, self.shape, self.dtype = op, args, grad, shape, dtype
        self.inner, self.head, self.journal = inner, head, journal
        self.state, self.frame, self.watching, self.ref = PENDING, None, (), None

    ndim = property(lambda self: len(self.shape))

    def output(self):
        """The pending output tensor, while it is alive and still waits for this record."""
        out = None if self.ref is None else self.ref()
        return out if out is not None and out._pending is self else None

    def resolve(self, why="its value was read"):
        """Its output or one of its arguments is being used: run the op now (as eager's order)."""
        out = self.output()
        if out is not None:
            materialise(out, why)
        else:
            with lock:
                unwatch(self)


def new_output(record, requires_grad):
    """A pending Tensor for ``record`` (its ``requires_grad`` as eager's op would set it)."""
    t = Tensor.__new__(Tensor)
    t._data = None
    t.grad = None
    t.requires_grad = requires_grad
    t._node = None
    t.placement = None
    t._pending = record
    record.ref = weakref.ref(t, _output_dead(record))
    return t


def _output_dead(record):
    record_ref = weakref.ref(record)

    def dead(_):
        record = record_ref()
        if record is not None:
            with lock:
                unwatch(record)
                record.args = None
    return dead


def pending_record(t):
    """t's record when ``t`` is a pending output (not computed yet), else None."""
    if not isinstance(t, Tensor):
        return None
    record = t._pending
    return record if record is not None and t._data is None else None


def pending_head(t):
    """t's record when t is a head's output still PENDING, else None."""
    record = pending_record(t)
    if record is None or record.head is not None or record.state is not PENDING:
        return None
    return record


# ---- watching ------------------------------------------------------------------------------------

def watch(record, tensors):
    """Watches ``tensors`` (Tensors, or None) for ``record``: another op's watch on one runs first.
    Call it without holding ``lock`` (that other op runs here)."""
    watching = []
    for t in tensors:
        if t is None or any(t is w for w in watching):
            continue
        other = t._pending
        if other is not None and other is not record:
            other.resolve("another pending op took its input")
        watching.append(t)
    with lock:
        for t in watching:
            t._pending = record
        record.watching = tuple(watching)


def unwatch(record):
    """Stops watching ``record``'s arguments (with ``lock`` held)."""
    for t in record.watching:
        if t._pending is record:
            t._pending = None
    record.watching = ()


# ---- computing a pending output ---------------------------------------------------------------------

def materialise(out, why):
    """Runs the op ``out`` waits for, as eager ran it, and puts the result into ``out``."""
    with lock:
        record = _claim(out)
        if record is None:
            return
        unwatch(record)
        op, args, state = record.op, record.args, record.state
        if record.head is None and state is FUSED and type(op) is BatchNorm and op.is_training:
            args = args[:3] + (None, None)  # the fused op updated the moving statistics already
        head = None if record.head is None else args[record.head]
        head_record = pending_head(head)
        rule = None if head_record is None else ending((type(head_record.op), type(op)))
        if rule is not None:  # e.g. the BiasAdd of a pending MatMul: one Dense
            unwatch(head_record)
            head_record.state = RUNNING
            op, args, _ = rule.fuse(head_record, args[1 - record.head])
        record.state = RUNNING
    before = _grad_mode.enabled
    _grad_mode.enabled = record.grad
    try:
        result = record.inner.call_op(op, args)
    except BaseException:
        with lock:  # not run: it stays pending (a later use raises again, as eager's call did)
            record.state = state
            if rule is not None:
                head_record.state = PENDING
            _ran.notify_all()
        raise
    finally:
        _grad_mode.enabled = before
    if rule is not None:
        fused(head, head_record, head_record.args)
    with lock:
        leave_frame(out, record)
        record.args = record.ref = None
        out._pending = None
        out._data = result._data
        out.requires_grad = result.requires_grad
        out._node = result._node
        out.placement = result.placement
        record.state = DONE
        _ran.notify_all()
    if record.journal is not None:
        record.journal.ran(record, rule, why)


def _claim(out):
    """``out``'s record, once no other thread runs it (with ``lock`` held); None: computed already."""
    record = pending_record(out)
    deadline = time.monotonic() + WAIT_S  # (a wake-up is any record's run ending: count seconds, not wake-ups)
    while record is not None and record.state is RUNNING:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"GRAPH_MODE: waited {WAIT_S:.0f} s for another thread to compute a pending "
                               f"{record.op.name}; is that thread stopped?")
        _ran.wait(timeout=min(left, 1.0))
        record = pending_record(out)
    return record


def fused(head, head_record, kept):
    """The head (its pending output, its record) ran inside a fused op. Its own output may still
    be used: it is computed then from the values ``kept`` have now, so they stay watched."""
    with lock:
        head_record.state = FUSED
        leave_frame(head, head_record)
        _ran.notify_all()
    watch(head_record, kept)


def leave_frame(out, record):
    if record.frame is not None:
        record.frame.pop(id(out), None)
        record.frame = None
