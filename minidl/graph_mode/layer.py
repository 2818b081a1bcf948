"""GRAPH_MODE's runtime layer: it defers the heads of the fusion rules and fuses at their tails.

:class:`GraphLayer` is a :class:`minidl.runtime.Layered` runtime over the runtime that places
the work (the local one, or a parallel one): every op and Cell call comes through it, and
whatever it runs goes to that inner runtime, so data- and tensor-parallel runs fuse too (the
tensor-parallel rules shard BatchNormReLU and DenseReLU as the ops they replace).

- ``call_op``: a head (rules.HEADS) whose guards hold returns a pending output (pending.py);
  an op that continues a pending pattern (rules.RULES) is deferred too (a middle) or runs the
  replacement (a tail); any other op runs now, through the inner runtime, after the pending
  values it uses.
- ``call_cell``: each Cell call is a window. When it returns, the pending ops made during it
  that its return value does not hold run, as eager ran them (a training BatchNorm updates its
  moving statistics even when nobody uses its output); the outermost Cell runs them all.
- ``settle``: the end of a function under ``value_and_grad`` runs what is left.
"""
import threading
import weakref

from .. import nn
from ..ops.dense import DenseReLU
from ..runtime import Layered
from ..tensor import Tensor, _grad_mode
from . import pending as _pending
from .pending import FUSED, PENDING, RUNNING, Pending, lock, pending_head, pending_record
from . import rules as _rules  # (its HEADS read at each call: a benchmark may leave rows out)

__all__ = ["GraphLayer", "flush", "is_deferred"]


class _Thread(threading.local):
    frames = None  # [(cell or None, {id: pending output}), ...]: the open Cell calls, outermost first
    journal = None  # explain's journal while it runs, else None


_thread = _Thread()


def _frames():
    frames = _thread.frames
    if frames is None:
        frames = _thread.frames = [(None, {})]  # the outermost: ops called outside any Cell
    return frames


def is_deferred(t):
    """Whether ``t`` is an op output GRAPH_MODE has not computed yet."""
    return pending_record(t) is not None


class GraphLayer(Layered):
    """GRAPH_MODE over ``inner`` (see the module doc); :meth:`over` gives one per inner runtime."""

    _layers = weakref.WeakKeyDictionary()

    @classmethod
    def over(cls, inner):
        layer = cls._layers.get(inner)
        if layer is None:
            layer = cls._layers[inner] = cls(inner)
        return layer

    # ---- ops ------------------------------------------------------------------------------------

    def call_op(self, prim, args):
        cls = type(prim)
        head = _rules.HEADS.get(cls)
        if head is not None and (prim.in_strategy is None or not self.inner.intercepts_ops):
            return self._head(prim, head, args)
        for i, a in enumerate(args):  # (a residual Add may hold two pending outputs: either may go on)
            record = pending_record(a)
            if record is not None and record.state is PENDING:
                out = self._continue(prim, args, i, record)
                if out is not None:
                    return out
        self._resolve(prim, args)
        return self.inner.call_op(prim, args)

    def _resolve(self, user, args):
        """The pending values ``user`` (an op or a Cell) takes are computed first (eager's order)."""
        for a in args:
            if isinstance(a, Tensor) and a._pending is not None:
                a._pending.resolve(f"{type(user).__name__} used it")

    def _head(self, prim, head, args):
        known = head(prim, args, self.inner)
        if isinstance(known, str):
            self._note("not deferred", prim.name, known)
            self._resolve(prim, args)  # (a parallel runtime reads placements before values)
            return self.inner.call_op(prim, args)
        shape, dtype = known
        grad = _grad_mode.enabled
        # The primitive itself, as eager passes it on: a parallel runtime knows an op by its
        # identity (its path in the network, the strategies it agreed once); apply clones it.
        record = Pending(prim, tuple(args), grad, shape, dtype, self.inner, journal=self._journal())
        out = _pending.new_output(record, _records_grad(prim, args, grad, dtype))
        _pending.watch(record, args)
        cell, frame = _frames()[-1]
        frame[id(out)] = out
        record.frame = frame
        if record.journal is not None:
            record.journal.deferred(record, cell)
        return out

    def _continue(self, prim, args, i, record):
        """``prim`` takes the pending ``args[i]``: the replacement's output, a pending middle, or
        None (no row continues the pattern, or a guard failed: the caller runs it as eager)."""
        head_record = record if record.head is None else pending_head(record.args[record.head])
        if head_record is None or head_record.state is not PENDING:
            return None
        chain = (type(head_record.op),) + (() if record is head_record else (type(record.op),))
        rows = _rules.following(chain, type(prim))
        journal = record.journal
        if not rows:
            if journal is not None:
                journal.broke(record, f"{prim.name} used its output (no rule continues "
                                      f"{' + '.join(c.__name__ for c in chain)} with {prim.name})")
            return None
        reason = self._guard(prim, head_record)
        tails = [r for r in rows if len(r.pattern) == len(chain) + 1 and not r.at_end]
        if reason is None and tails:
            return self._tail(args, record, head_record, tails[0])
        if reason is None:  # a middle: it waits too
            return self._middle(prim, args, i, record, rows[0])
        if journal is not None:
            journal.broke(record, reason)
        return None

    def _guard(self, prim, record):
        """What every continuation needs: no strategy of the user's for a runtime that reads it,
        the head's grad mode."""
        if prim.in_strategy is not None and self.inner.intercepts_ops:
            return f"{prim.name} has a user strategy (the replacement would need its own)"
        if record.grad != _grad_mode.enabled:
            return "the grad mode changed since the head was called"
        return None

    def _middle(self, prim, args, i, record, rule):
        if record.head is not None or len(args) != 2 or i not in rule.head_at:
            return None
        operand = args[1 - i]
        if not isinstance(operand, Tensor) or operand is args[i]:
            return None
        if operand._pending is not None:  # a pending operand is computed now (then it can be watched)
            operand._pending.resolve(f"{prim.name} used it")
        record = pending_head(args[i])  # still pending? (reading the operand may have run it)
        if record is None:
            return None
        if operand.placement is not None and not self.inner.intercepts_ops:
            return None
        reason = rule.middle(operand, record)
        if reason is not None:
            if record.journal is not None:
                record.journal.broke(record, reason)
            return None
        after = Pending(prim, tuple(args), record.grad, record.shape, record.dtype, self.inner, head=i,
                        journal=record.journal)
        if after.journal is not None:
            after.journal.continued(after, record)
        out = _pending.new_output(after, _records_grad(prim, args, record.grad, record.dtype))
        _pending.watch(after, (operand,))
        if record.frame is not None:  # runs when its head would (a Cell's end), before it
            record.frame[id(out)] = out
            after.frame = record.frame
        return out

    def _tail(self, args, record, head_record, rule):
        if len(args) != 1:
            return None
        d = args[0]
        operand = None if record is head_record else record.args[1 - record.head]
        fused_op, fused_args, kept = rule.fuse(head_record, operand)
        head = d if record is head_record else record.args[record.head]
        with lock:
            if head_record.state is not PENDING or record.state is not PENDING:
                return None  # another thread ran it meanwhile: the caller runs the tail as eager
            _pending.unwatch(head_record)
            _pending.unwatch(record)
            head_record.state = record.state = RUNNING
        try:
            out = self.inner.call_op(fused_op, fused_args)  # never under the lock (see pending.py)
        except BaseException:
            with lock:  # as eager: the error at the tail; the pattern's ops stay pending
                head_record.state = record.state = PENDING
                _pending._ran.notify_all()
            raise
        if record is not head_record:
            with lock:
                record.state = FUSED
                _pending.leave_frame(d, record)
            _pending.watch(record, (operand,))
        _pending.fused(head, head_record, kept)
        if head_record.journal is not None:
            head_record.journal.fused(head_record, rule)
        return out

    # ---- cells ------------------------------------------------------------------------------------

    def call_cell(self, cell, args, kwargs):
        """construct, then run the pending ops it left, but for those its return value holds
        (when an enclosing Cell is still running)."""
        frames = _frames()
        if self.inner.intercepts_ops and len(frames) == 1:  # a parallel runtime tags the network's inputs
            self._resolve(cell, tuple(args) + tuple(kwargs.values()))  # by their placements
        frame = {}
        frames.append((cell, frame))
        try:
            # (a cell whose construct was replaced on the instance, as Cell.recompute does, runs that)
            if (type(cell) is nn.SequentialCell and "construct" not in cell.__dict__ and len(args) == 1
                    and not kwargs and not self.inner.intercepts_ops):
                out = self._sequence(cell, args[0])
            else:
                out = self.inner.call_cell(cell, args, kwargs)
        except BaseException:
            frames.pop()
            _run(frame, "an error left its Cell")  # eager ran them before the error
            raise
        frames.pop()
        if frame:
            returned = _returned(out, {}) if len(frames) > 1 else {}  # the outermost cell runs all
            kept = set(returned) | {id(_head_of(d)) for d in returned.values()}
            parent = frames[-1][1]
            for key, d in _in_running_order(frame):
                if key not in frame:  # run already, with or inside the op after it
                    continue
                if key in kept:
                    parent[key] = d
                    d._pending.frame = parent
                else:
                    _pending.materialise(d, "its Cell returned without using it" if len(frames) > 1
                                         else "the network returned")
        return out

    def _sequence(self, seq, x):
        """SequentialCell.construct, but an nn.Dense cell followed by an nn.ReLU cell runs as one
        DenseReLU at once: in a SequentialCell the Dense's output goes to the ReLU and nowhere
        else, so there is nothing to defer (row "Dense + ReLU", without the two cells' calls)."""
        cells = [c for c in seq._cells.values() if c is not None]
        i, n = 0, len(cells)
        while i < n:
            cell = cells[i]
            if i + 1 < n and type(cells[i + 1]) is nn.ReLU and type(cell) is nn.Dense and "construct" not in cell.__dict__:
                out = self._dense_relu(cell, x)
                if out is not None:
                    x, i = out, i + 2
                    continue
            x = cell(x)
            i += 1
        return x

    def _dense_relu(self, dense, x):
        if (dense.activation is not None or not dense.one_op() or not isinstance(x, Tensor) or x.ndim != 2
                or x.shape[1] != dense.in_channels):
            return None
        args = (x, dense.weight, dense.bias) if dense.has_bias else (x, dense.weight)
        head = _rules.HEADS.get(type(dense.dense))
        if head is None or isinstance(head(dense.dense, args, self.inner), str):
            return None
        out = self.inner.call_op(DenseReLU(), args)
        journal = _thread.journal
        if journal is not None:
            journal.sequence(dense)
        return out

    # ---- the end of a function under value_and_grad ----------------------------------------------

    def settle(self):
        flush()
        self.inner.settle()

    def _journal(self):
        return _thread.journal

    def _note(self, what, name, reason):
        journal = _thread.journal
        if journal is not None:
            journal.note(what, name, _frames()[-1][0], reason)


def _records_grad(prim, args, grad, dtype):
    """Whether eager's call would record a node: grad mode on, a float output, a Tensor argument
    that requires grad (a pending output's ``requires_grad`` is known before it is computed)."""
    return bool(grad and prim.differentiable and dtype.kind in "fc"
                and any(isinstance(a, Tensor) and a.requires_grad for a in args))


def _returned(out, found):
    """{id: d} of the pending outputs ``out`` holds (in tuples, lists and dict values)."""
    if pending_record(out) is not None:
        found[id(out)] = out
    elif isinstance(out, (tuple, list)):
        for o in out:
            _returned(o, found)
    elif isinstance(out, dict):
        for o in out.values():
            _returned(o, found)
    return found


def _head_of(d):
    record = d._pending
    return d if record.head is None else record.args[record.head]


def _in_running_order(frame):
    """(id, d) of a window's pending outputs, the ops after a head first: a BiasAdd run with its
    MatMul pending runs as one Dense (rules.ending)."""
    items = list(frame.items())
    return [kv for kv in items if kv[1]._pending.head is not None] + [kv for kv in items if kv[1]._pending.head is None]


def _run(frame, why):
    for key, d in _in_running_order(frame):
        if key in frame:  # (not run already, with or inside the op after it)
            _pending.materialise(d, why)


def flush():
    """Runs every op this thread left pending (value_and_grad's function ended, the mode changed)."""
    for _, frame in _frames():
        _run(frame, "the step ended")
