"""GRAPH_MODE: a user's separate BatchNorm, residual Add and ReLU run as one fused op; so do a
Dense layer (one Dense op, or a user's MatMul and BiasAdd) and its ReLU.

Under ``minidl.set_context(mode=minidl.GRAPH_MODE)``, a call of ``ops.BatchNorm`` (its exact
class, on the local runtime) does not run: it checks its arguments as eager would, then returns
a *deferred* tensor that holds the call (the primitive and its arguments). The model's Python
runs on every step as in PYNATIVE_MODE; only this one output waits, for the few lines until its
first use:

- ``ReLU(d)`` runs ``BatchNormReLU`` on the recorded arguments (the kernels table picks its
  fast body) and returns its output;
- ``Add(d, r)`` or ``Add(r, d)``, r a tensor of exactly d's shape and dtype, returns another
  deferred tensor, "d + r", whose ReLU runs BatchNormReLU with the residual r;
- any other use (another op, any attribute but ``shape``, ``dtype``, ``ndim``, ``size``)
  *materialises* d: the recorded BatchNorm runs now, as eager ran it, with the same arguments.

A ``Dense`` (nn.Dense's one op, ops/dense.py) is a head like BatchNorm: a ReLU then runs
``DenseReLU`` on its arguments, any other use runs the Dense. A user's own Dense, a ``MatMul``
with nn.Dense's transposes (x @ w.T, both 2-D, one dtype), is a head too:
``BiasAdd(d, b)`` of a 1-D b defers again, a ReLU then runs ``DenseReLU(x, w, b)`` (ops/dense.py;
``DenseReLU(x, w)`` straight after the MatMul), and any other use of the BiasAdd's output runs
``Dense(x, w, b)``: the product and the bias in one op, which is what every Dense layer with a
bias and no ReLU gets. A MatMul output used otherwise runs as eager's MatMul. In a
SequentialCell an nn.Dense cell followed by an nn.ReLU cell runs as that same DenseReLU at once
(:func:`_sequence`): the Dense's output goes to the ReLU only, so there is nothing to defer. A Cell's end
runs its pending ops as it runs BatchNorms (below), the op after a head first: a pending
BiasAdd then runs as Dense.

So the values, the graph and the side effects are eager's. Two things keep them so:

- Side effects happen even for an output nobody uses: a training BatchNorm updates its moving
  statistics. Each ``Cell.__call__`` materialises, when it returns, the deferred outputs made
  during it that are still pending and not in its return value (the BatchNorm cell returns its
  output, so the window spans the enclosing block's construct); the outermost cell's return,
  the end of a function under ``value_and_grad`` / ``grad``, and a mode change force the rest.
- Order: while a BatchNorm is pending, its inputs (x, gamma, beta, the moving statistics) are
  *watched*: their class is swapped for a subclass (made once per class) whose attribute
  access first materialises the pending op, then puts the class back. Reading
  ``bn.moving_mean`` or writing into x before the ReLU therefore sees exactly what eager
  would. (Python cannot tell a read from a write, so any access resolves; the ResNet pattern
  touches none of them in the window.)

After fusion the BatchNorm's own output d may still be used (two consumers: ``a = relu(y);
b = y * 2``). It then materialises as BatchNorm without a second update of the moving
statistics (``mean=None, variance=None``), on the values x, gamma and beta had at fusion: they
stay watched until d is materialised or garbage-collected (held weakly: a dead d costs
nothing). Its node and the fused one send gradients that sum to eager's.

Anything not handled here (NHWC, a residual that broadcasts, a grad mode that changed in the
window, a subclass such as SyncBatchNorm's op, a parallel runtime) runs eagerly: never a
replayed guess. Why deferral rather than record and replay: docs/graph_mode.md.

The machinery reaches the core through four seams it installs while the mode is GRAPH_MODE
(None otherwise, so PYNATIVE_MODE pays one ``is None`` check per op and per cell):
``ops.primitive._graph_call``, ``nn.cell._graph_call``, ``autograd._graph_flush`` and
``backend``'s mode listeners (the arrows point from here to them, never back).
"""
import copy
import functools
import threading
import weakref

from . import autograd, backend
from .nn import cell as _cell
from .nn.layers.activation import ReLU as _ReLUCell
from .nn.layers.basic import Dense as _DenseCell
from .ops import primitive as _primitive
from .ops.dense import Dense, DenseReLU
from .ops.linalg import BiasAdd, MatMul, check_matmul
from .ops.math import Add, ReLU
from .ops.norm import BatchNorm
from .ops.norm_relu import BatchNormReLU
from .tensor import Tensor, _grad_mode

__all__ = ["flush", "is_deferred"]

PENDING, FUSED, DONE = "pending", "fused", "done"
_KNOWN = frozenset(("shape", "dtype", "ndim", "size"))  # known without running the op
_lock = threading.RLock()  # watches and materialisation are shared between threads
_local = threading.local()  # .frames: this thread's pending BatchNorms, one dict per open Cell call
_watched = {}  # id(tensor) -> (tensor, its own class, the _Record watching it)
_watching_classes = {}  # class -> its watching subclass
_watching_bases = {}  # watching subclass -> the class it watches for


class _Record:
    """What a deferred tensor holds in its ``data`` slot until it is computed.

    ``op`` and ``args``: the call: a *head* (a BatchNorm or a MatMul), or the op after one (the
    Add of a BatchNorm's deferred output and a residual, the BiasAdd of a MatMul's): then
    ``head`` is the position of that output in args. ``grad``: whether the call was recorded
    for backward. ``frame``: the dict of pending heads that holds it.
    """

    __slots__ = ("op", "args", "grad", "shape", "dtype", "state", "head", "frame", "watching", "ref")

    def __init__(self, op, args, grad, shape, dtype, head=None):
        self.op, self.args, self.grad, self.shape, self.dtype, self.head = op, args, grad, shape, dtype, head
        self.state, self.frame, self.watching, self.ref = PENDING, None, (), None

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: _prod(self.shape))


def _prod(shape):
    n = 1
    for s in shape:
        n *= s
    return n


class _Deferred(Tensor):
    """An op's output not computed yet; the first attribute access computes it (see module doc).

    Tensor's slots hold it: ``data`` the _Record until then. Materialised, it becomes a plain
    Tensor (``__class__`` swapped back), so it costs nothing afterwards.
    """

    __slots__ = ()

    def __getattribute__(self, name):
        if name in _KNOWN:
            return getattr(object.__getattribute__(self, "data"), name)
        _materialise(self)
        return object.__getattribute__(self, name)

    def __setattr__(self, name, value):
        _materialise(self)
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        _materialise(self)
        object.__delattr__(self, name)

    # copy and pickle look these up on the class, before any instance attribute
    def __reduce_ex__(self, protocol):
        _materialise(self)
        return self.__reduce_ex__(protocol)

    def __copy__(self):
        _materialise(self)
        return copy.copy(self)

    def __deepcopy__(self, memo):
        _materialise(self)
        return copy.deepcopy(self, memo)


def is_deferred(t):
    """Whether ``t`` is an op output GRAPH_MODE has not computed yet (no attribute is read)."""
    return type(t) is _Deferred


def _record(d):
    return object.__getattribute__(d, "data")


def _new_deferred(record):
    d = Tensor.__new__(_Deferred)
    put = object.__setattr__
    put(d, "data", record)
    put(d, "grad", None)
    put(d, "requires_grad", False)
    put(d, "_node", None)
    put(d, "placement", None)
    record.ref = weakref.ref(d, functools.partial(_dead, record))
    return d


def _dead(record, _ref):
    """A deferred tensor was garbage-collected: stop watching its inputs (a fused one's)."""
    with _lock:
        _unwatch(record)
        record.args = record.ref = None


# ---- watching a pending op's inputs -----------------------------------------------------------

def _watching_class(cls):
    """The subclass of ``cls`` whose every attribute access first resolves the watch (same slots,
    so ``__class__`` can be swapped both ways; same name, so messages read the same)."""
    watching = _watching_classes.get(cls)
    if watching is None:
        def resolved(self, name):
            _release(self)
            return object.__getattribute__(self, name)

        def setattr_(self, name, value):
            _release(self)
            object.__setattr__(self, name, value)

        def delattr_(self, name):
            _release(self)
            object.__delattr__(self, name)
        body = {"__slots__": (), "__getattribute__": resolved, "__setattr__": setattr_, "__delattr__": delattr_,
                "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        watching = _watching_classes[cls] = type(cls.__name__, (cls,), body)
        _watching_bases[watching] = cls
    return watching



def _watch(record, tensors):
    """Watches ``tensors`` (Tensors, or None) for ``record``; resolves any other watch first."""
    watching = []
    for t in tensors:
        if t is None or any(t is w for w in watching):
            continue
        if type(t) in _watching_bases:
            _release(t)
        cls = type(t)
        object.__setattr__(t, "__class__", _watching_class(cls))
        _watched[id(t)] = (t, cls, record)
        watching.append(t)
    record.watching = tuple(watching)


def _unwatch(record):
    for t in record.watching:
        entry = _watched.pop(id(t), None)
        object.__setattr__(t, "__class__", entry[1] if entry is not None else _watching_bases[type(t)])
    record.watching = ()


def _release(t):
    """A watched tensor is being used: compute the op that watches it, then stop watching."""
    with _lock:
        entry = _watched.get(id(t))
        if entry is None or entry[0] is not t:  # released meanwhile (another thread)
            base = _watching_bases.get(type(t))
            if base is not None:
                object.__setattr__(t, "__class__", base)
            return
        record = entry[2]
        d = None if record.ref is None else record.ref()
        if d is not None and type(d) is _Deferred:
            _materialise(d)
        else:
            _unwatch(record)


# ---- computing a deferred output --------------------------------------------------------------

def _materialise(d):
    """Runs the op d holds, as eager ran it, and turns d into a plain Tensor with its result."""
    with _lock:
        if type(d) is not _Deferred:
            return
        record = _record(d)
        _unwatch(record)
        op, args = record.op, record.args
        if record.head is None and record.state is FUSED and type(op) is BatchNorm and op.is_training:
            args = args[:3] + (None, None)  # the fused op updated the moving statistics already
        head = None if record.head is None else args[record.head]
        head_record = _pending_head(head, MatMul)
        if head_record is not None:  # the BiasAdd of a pending MatMul: Dense
            _unwatch(head_record)
            op, args = Dense(), head_record.args + args[1:]
        before = _grad_mode.enabled
        _grad_mode.enabled = record.grad
        try:
            out = op.apply(*args)
        finally:
            _grad_mode.enabled = before
        if head_record is not None:
            _fused(head, head_record, head_record.args)
        record.state = DONE
        _leave_frame(d, record)
        record.args = record.ref = None
        put = object.__setattr__
        put(d, "data", out.data)
        put(d, "requires_grad", out.requires_grad)
        put(d, "_node", out._node)
        put(d, "__class__", Tensor)


def _leave_frame(d, record):
    if record.frame is not None:
        record.frame.pop(id(d), None)
        record.frame = None


# ---- the rules: Primitive.__call__ under GRAPH_MODE on the local runtime -------------------------

def _call(prim, args):
    cls = type(prim)
    if cls is BatchNorm:
        return _batch_norm(prim, args)
    if cls is MatMul:
        return _matmul(prim, args)
    if cls is Dense:
        return _dense(prim, args)
    if cls is ReLU:
        if len(args) == 1 and type(args[0]) is _Deferred:
            return _relu(prim, args[0])
    elif cls is Add:
        if len(args) == 2 and (type(args[0]) is _Deferred or type(args[1]) is _Deferred):
            return _add(prim, args)
    elif cls is BiasAdd:
        if len(args) == 2 and type(args[0]) is _Deferred:
            return _bias_add(prim, args)
    return prim.apply(*args)


def _batch_norm(prim, args):
    """Defers a BatchNorm call, once its arguments pass eager's checks (so errors come at the call)."""
    if len(args) != 5 or prim.data_format != "NCHW":
        return prim.apply(*args)
    x, scale, bias, mean, variance = args
    if not (isinstance(x, Tensor) and isinstance(scale, Tensor) and isinstance(bias, Tensor)
            and all(a is None or isinstance(a, Tensor) for a in (mean, variance))):
        return prim.apply(*args)  # a raw array could change under us unwatched
    # Reading .data resolves what watches these tensors and computes a deferred x, as eager's order.
    arrays = [None if a is None else a.data for a in args]
    if any(a is not None and a.placement is not None for a in args):
        return prim.apply(*args)
    prim._check(*arrays)
    x_data = arrays[0]
    if prim.is_training and x_data.size // max(x_data.shape[1], 1) < 2:
        return prim.apply(*args)  # raises eager's "more than 1 value per channel"
    return _defer_head(prim, BatchNorm, args, tuple(x_data.shape), x_data.dtype)


def _matmul(prim, args):
    """Defers nn.Dense's MatMul (x @ w.T of 2-D local tensors of one dtype), once eager's checks pass."""
    if (prim.transpose_a or not prim.transpose_b or len(args) != 2
            or not all(isinstance(a, Tensor) for a in args)):
        return prim.apply(*args)
    x, w = (a.data for a in args)  # resolves watches and deferred inputs, as eager's order
    if any(a.placement is not None for a in args) or x.dtype != w.dtype or type(x) is not type(w):
        return prim.apply(*args)  # eager's call (and its errors: a device mix names MatMul)
    check_matmul(prim.name, x, w, False, True, batched=False)
    return _defer_head(prim, MatMul, args, (x.shape[0], w.shape[0]), x.dtype)


def _dense(prim, args):
    """Defers a Dense call (nn.Dense's one op: x @ w.T + b of local tensors), once eager's checks pass."""
    arrays = _checked_dense_arrays(prim, args)
    if arrays is None:
        return prim.apply(*args)  # eager's call (and its errors: a device mix names Dense)
    x, w = arrays[:2]
    return _defer_head(prim, Dense, args, (x.shape[0], w.shape[0]), x.dtype)


def _checked_dense_arrays(prim, args):
    """The arrays of Dense ``prim``'s 2 or 3 args when all are local Tensors on one device, after
    the op's own checks (which raise eager's errors); None where the call must run as eager's.
    Reading ``.data`` resolves watches and computes a deferred input first, as eager's order."""
    if len(args) not in (2, 3) or not all(isinstance(a, Tensor) for a in args):
        return None
    arrays = [a.data for a in args]
    if any(a.placement is not None for a in args) or len({type(a) for a in arrays}) != 1:
        return None
    prim._check(*arrays) if len(arrays) == 3 else prim._check(*arrays, None)
    return arrays


def _defer_head(prim, cls, args, shape, dtype):
    """A deferred output for a head op's call (BatchNorm or MatMul), its arguments watched."""
    node = object.__new__(cls)
    node.__dict__.update(prim.__dict__)
    record = _Record(node, args, _grad_mode.enabled, shape, dtype)
    d = _new_deferred(record)
    with _lock:
        _watch(record, args)
    frame = _frames()[-1]
    frame[id(d)] = d
    record.frame = frame
    return d


def _pending_head(t, cls=None):
    """t's record when t is a head's output (of class ``cls``, when given) still pending, else None."""
    if type(t) is not _Deferred:
        return None
    record = _record(t)
    if record.head is not None or record.state is not PENDING or (cls is not None and type(record.op) is not cls):
        return None
    return record


def _defer_after(prim, args, i, operand, shape, cls):
    """``prim(*args)`` with args[i] a pending head's output of class ``cls`` and ``operand`` the other
    argument (a plain local tensor after this), when ``shape(operand, head record)``: deferred
    too; else eager's call."""
    d = args[i]
    if _pending_head(d, cls) is None or not isinstance(operand, Tensor) or operand is d:
        return prim.apply(*args)
    operand.data  # noqa: B018 - a deferred operand is computed now (a plain tensor can be watched)
    record = _pending_head(d, cls)  # still pending? (reading the operand may have resolved d)
    if (record is None or operand.placement is not None or operand.dtype != record.dtype
            or not shape(tuple(operand.shape), record) or record.grad != _grad_mode.enabled):
        return prim.apply(*args)
    node = object.__new__(type(prim))
    node.__dict__.update(prim.__dict__)
    after = _Record(node, tuple(args), record.grad, record.shape, record.dtype, head=i)
    s = _new_deferred(after)
    with _lock:
        _watch(after, (operand,))
    if record.frame is not None:  # runs when its head would (a Cell's end, a mode change), before it
        record.frame[id(s)] = s
        after.frame = record.frame
    return s


def _add(prim, args):
    """``d + r`` for a pending BatchNorm output d and r of d's exact shape and dtype: deferred too."""
    i = 0 if _pending_head(args[0], BatchNorm) is not None else 1
    return _defer_after(prim, args, i, args[1 - i], lambda shape, record: shape == record.shape, BatchNorm)


def _bias_add(prim, args):
    """``d + b`` for a pending MatMul output d and a bias b of its columns: deferred too."""
    return _defer_after(prim, args, 0, args[1], lambda shape, record: shape == record.shape[1:], MatMul)


def _relu(prim, d):
    """ReLU of a pending head's output, or of the op after it: BatchNormReLU or DenseReLU."""
    record = _record(d)
    if record.state is not PENDING or record.grad != _grad_mode.enabled:
        return prim.apply(d)
    if record.head is None:
        head, head_record, extra = d, record, ()
    else:
        head, extra = record.args[record.head], (record.args[1 - record.head],)
        head_record = _pending_head(head)
        if head_record is None or head_record.grad != record.grad:
            return prim.apply(d)
    op = head_record.op
    if type(op) is BatchNorm:
        fused = BatchNormReLU(op.is_training, op.epsilon, op.momentum)
        kept = head_record.args[:3] if op.is_training else head_record.args
    else:
        fused, kept = DenseReLU(), head_record.args
    with _lock:
        _unwatch(head_record)
        _unwatch(record)
        out = fused.apply(*(head_record.args + extra))
        record.state = FUSED
        _fused(head, head_record, kept)
        if record is not head_record:
            _leave_frame(d, record)
            _watch(record, extra)
    return out


def _fused(head, head_record, kept):
    """The head (its deferred output, its record) ran inside a fused op. Its own output may still
    be used: it is computed then from the values ``kept`` had (its arguments, or those that
    matter), so they stay watched."""
    head_record.state = FUSED
    _leave_frame(head, head_record)
    _watch(head_record, kept)


# ---- when pending BatchNorms must run: Cell.__call__, value_and_grad, a mode change ----------------

def _frames():
    frames = getattr(_local, "frames", None)
    if frames is None:
        frames = _local.frames = [{}]  # the outermost: ops called outside any cell
    return frames


def _call_cell(cell, args, kwargs):
    """Cell.__call__ under GRAPH_MODE: construct, then run the BatchNorms it left pending, but for
    those its return value holds (when an enclosing cell is still running)."""
    frames = _frames()
    frame = {}
    frames.append(frame)
    try:
        if type(cell) is _cell.SequentialCell and len(args) == 1 and not kwargs:
            out = _sequence(cell, args[0])
        else:
            out = cell.construct(*args, **kwargs)
    except BaseException:
        frames.pop()
        _run_pending(frame)  # eager ran them before the error
        raise
    frames.pop()
    if frame:
        returned = _returned(out, {}) if len(frames) > 1 else {}  # the outermost cell runs all
        kept = set(returned) | {id(_head_of(d)) for d in returned.values()}
        parent = frames[-1]
        for key, d in _in_running_order(frame):
            if key not in frame:  # run already, with or inside the op after it
                continue
            if key in kept:
                parent[key] = d
                _record(d).frame = parent
            else:
                _materialise(d)
    return out


def _sequence(seq, x):
    """SequentialCell.construct, but an nn.Dense cell followed by an nn.ReLU cell runs as the one
    DenseReLU their deferred Dense and ReLU fuse into, without the deferral: in a SequentialCell the
    Dense's output goes to the ReLU and nowhere else, so there is nothing to watch or defer (and
    the two cells' calls, whose windows would hold only that output, are not needed)."""
    cells = [c for c in seq._cells.values() if c is not None]
    i, n = 0, len(cells)
    while i < n:
        cell = cells[i]
        if i + 1 < n and type(cells[i + 1]) is _ReLUCell and type(cell) is _DenseCell:
            out = _dense_relu(cell, x)
            if out is not None:
                x, i = out, i + 2
                continue
        x = cell(x)
        i += 1
    return x


def _dense_relu(dense, x):
    """``relu(dense(x))`` as one DenseReLU for an nn.Dense cell whose call would defer its one Dense
    op (no activation, ``one_op()``, 2-D x of its in_channels: see _dense) and whose output a ReLU
    fuses; the Dense op's checks first, so errors are eager's. None where the cells must run."""
    if (dense.activation is not None or not dense.one_op() or not isinstance(x, Tensor) or x.ndim != 2
            or x.shape[1] != dense.in_channels):
        return None
    args = (x, dense.weight, dense.bias) if dense.has_bias else (x, dense.weight)
    if _checked_dense_arrays(dense.dense, args) is None:
        return None
    return DenseReLU().apply(*args)


def _returned(out, found):
    """{id: d} of the deferred outputs ``out`` holds (in tuples, lists and dict values)."""
    if type(out) is _Deferred:
        found[id(out)] = out
    elif isinstance(out, (tuple, list)):
        for o in out:
            _returned(o, found)
    elif isinstance(out, dict):
        for o in out.values():
            _returned(o, found)
    return found


def _head_of(d):
    """The head's deferred output that d is, or follows (the BatchNorm before an Add, the MatMul before a BiasAdd)."""
    record = _record(d)
    return d if record.head is None else record.args[record.head]


def _in_running_order(frame):
    """(id, d) of a frame's pending outputs, the ops after a head first: a BiasAdd materialised
    with its MatMul pending runs as one Dense."""
    items = list(frame.items())
    return [kv for kv in items if _record(kv[1]).head is not None] + [kv for kv in items if _record(kv[1]).head is None]


def _run_pending(frame):
    for key, d in _in_running_order(frame):
        if key in frame:  # (not run already, with or inside the op after it)
            _materialise(d)


def flush():
    """Runs every BatchNorm this thread left pending (value_and_grad's function ended, the mode changed)."""
    for frame in _frames():
        _run_pending(frame)


def _on_mode(mode):
    flush()
    on = mode == backend.GRAPH_MODE
    _primitive._graph_call = _call if on else None
    _cell._graph_call = _call_cell if on else None
    autograd._graph_flush = flush if on else None


backend.add_mode_listener(_on_mode)
_on_mode(backend.get_context("mode"))  # MINIDL_MODE=graph: the default mode is GRAPH_MODE
