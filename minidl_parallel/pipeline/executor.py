"""One pipeline step on one rank: its stage's actions, in the schedule's order, and the messages
between neighbouring stages.

Forward of micro-batch i (``F i``): the network's construct runs under :class:`StageForward`; the
stage's input (stage > 0) arrives from the stage before, its output (stage < p - 1) leaves for the
stage after, and the last stage keeps the loss. Backward (``B i``): the gradient of the output
arrives from the stage after (the last stage starts from the loss, with gradient 1), the stage's
graph of that micro-batch is differentiated for its parameters and its input, and the input's
gradient leaves for the stage before. Parameter gradients add up over the micro-batches in the
order 0 .. m-1, as a single device accumulating them does, so the sums are the same, bit for bit.

Messages: an activation's shape is known to its sender only, so each is preceded by a small header
(dtype and shape, int64); a gradient has the shape of the activation it belongs to. Sends start no
later than the next receive, in one batch with it (``batch_isend_irecv``: on NCCL one group, so two
neighbours sending to each other at once do not wait for each other), and receives wait: with the
schedule's orders this never deadlocks (``Schedule.timeline`` is the proof). Every message is
logged in the step's :class:`StepLog` (what tests and benchmarks count).
"""
import numpy

from minidl import backend
from minidl.autograd import run_backward
from minidl.runtime import mode_layer
from minidl.tensor import Tensor, is_grad_enabled

from ..comm.p2p import P2POp
from ..comm.threads import _add_note
from .schedules import FORWARD
from .stage_cut import NO_CUT
from .stage_forward import PipelineError, StageForward, check_one_activation

__all__ = ["run_step", "split_micro_batches", "MessageRecord", "StepLog"]

ACTIVATION_TAG, HEADER_TAG, GRADIENT_TAG = 1, 2, 3
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8", "int16", "bool")
_MAX_NDIM = 8


class MessageRecord:
    """One message this rank sent or received in a step: the action, "send" or "recv", the peer
    stage, what it carried ("activation", "gradient" or "header") and its bytes."""

    __slots__ = ("action", "direction", "peer", "payload", "nbytes")

    def __init__(self, action, direction, peer, payload, nbytes):
        self.action, self.direction, self.peer, self.payload, self.nbytes = action, direction, peer, payload, nbytes

    def __repr__(self):
        return f"MessageRecord({self.action}, {self.direction}, stage {self.peer}, {self.payload}, {self.nbytes} B)"


class StepLog:
    """What one step did on this rank: ``messages`` (MessageRecord list, in order) and ``peak_held``,
    the most micro-batches whose forward graph (activations) the stage held at once."""

    __slots__ = ("messages", "peak_held")

    def __init__(self):
        self.messages, self.peak_held = [], 0

    def count(self, direction, payload):
        """(messages, bytes) this rank sent or received ("send" / "recv") carrying ``payload``."""
        chosen = [m for m in self.messages if m.direction == direction and m.payload == payload]
        return len(chosen), sum(m.nbytes for m in chosen)


def split_micro_batches(inputs, micro_batches):
    """The inputs cut along axis 0 into ``micro_batches`` equal parts (Tensors only; other
    arguments go to every micro-batch as they are): a list of argument tuples."""
    parts = []
    for i, x in enumerate(inputs):
        if isinstance(x, Tensor):
            n = x.shape[0] if x.ndim else None
            if n is None or n % micro_batches:
                raise ValueError(f"PipelineCell: input {i} of shape {tuple(x.shape)} cannot be cut into micro_size="
                                 f"{micro_batches} micro-batches along axis 0 (its length must be a multiple of "
                                 f"{micro_batches})")
            size = n // micro_batches
            parts.append([Tensor(x.data[k * size:(k + 1) * size]) for k in range(micro_batches)])
        else:
            parts.append([x] * micro_batches)
    return [tuple(p[k] for p in parts) for k in range(micro_batches)]


class _Messages:
    """This rank's sends and receives in one step, over the pipeline group (group rank = stage)."""

    def __init__(self, comm, record):
        self.comm, self.record = comm, record
        self._pending = []  # sends not started yet: they start with the next receive
        self._started = []  # requests of started sends, completed at the end of the step

    def send(self, array, peer, tag, action, payload):
        self._pending.append((P2POp("send", array, peer, tag), _label(action, f"its {payload} for stage {peer}")))
        self.record.append(MessageRecord(action, "send", peer, payload, int(array.nbytes)))

    def _start(self, ops):
        """Starts the (op, label) pairs in one batch (one NCCL group), labelled with the last one's: the
        receive a stall waits for (the sends before it belong to the actions just done)."""
        with self.comm.labelled(ops[-1][1]):
            return self.comm.batch_isend_irecv([op for op, _ in ops])

    def recv(self, buf, peer, tag, action, payload):
        requests = self._start(self._pending + [(P2POp("recv", buf, peer, tag),
                                                 _label(action, f"the {payload} from stage {peer}"))])
        self._pending = []
        # Sends that have completed let go of their arrays now, not at the step's end: a stage of 1F1B
        # would otherwise hold every activation it sent (m of them) after their backwards freed them.
        self._started = [r for r in self._started if not r.test()] + requests[:-1]
        requests[-1].wait()
        self.record.append(MessageRecord(action, "recv", peer, payload, int(buf.nbytes)))
        return buf

    def finish(self):
        if self._pending:
            self._started += self._start(self._pending)
            self._pending = []
        for request in self._started:
            request.wait()
        self._started = []


def _label(action, what):
    return f"pipeline stage {action.stage}, {action}: {what}"


def _header(array):
    if array.ndim > _MAX_NDIM or str(array.dtype) not in DTYPES:
        raise PipelineError(f"an activation of shape {tuple(array.shape)} and dtype {array.dtype} cannot cross a stage "
                            f"boundary: at most {_MAX_NDIM} dimensions, dtypes {DTYPES}")
    header = numpy.zeros(2 + _MAX_NDIM, dtype=numpy.int64)
    header[0], header[1] = DTYPES.index(str(array.dtype)), array.ndim
    header[2:2 + array.ndim] = array.shape
    return header


def dtype_named(name):
    if name == "bfloat16":
        import ml_dtypes
        return numpy.dtype(ml_dtypes.bfloat16)
    return numpy.dtype(name)


class _StageRun:
    """The state of one step on one stage: the graphs of the micro-batches in flight, the sums."""

    def __init__(self, network, plan, schedule, comm, stage, log, cut):
        self.network, self.plan, self.schedule, self.stage = network, plan, schedule, stage
        self.cut = cut  # how the stage's cells run: cut over the stage's ranks (stage_cut.py) or locally
        self.last = schedule.stages - 1
        self.log = log
        self.messages = _Messages(comm, log.messages)
        self.params = plan.parameters[stage]
        # (a stage without parameters, a ReLU cell, receives onto the context's device)
        self.xp = backend.get_array_module(self.params[0].data) if self.params else backend.default_xp()
        self.in_flight = {}  # micro-batch -> (its root: output sent or loss, its input leaf or None)
        self.sums = {}  # id(parameter) -> its gradient summed over the micro-batches so far
        self.loss = None  # the last stage's sum of the micro-batch losses

    def forward(self, action, inputs):
        i = action.micro

        def receive(from_stage, made_by):
            header = self.messages.recv(numpy.empty(2 + _MAX_NDIM, numpy.int64), from_stage, HEADER_TAG, action,
                                        "header")
            shape = tuple(int(d) for d in header[2:2 + int(header[1])])
            buf = self.xp.empty(shape, dtype=dtype_named(DTYPES[int(header[0])]))
            self.messages.recv(buf, from_stage, ACTIVATION_TAG, action, "activation")
            return self.cut.tag(Tensor(buf, requires_grad=True))

        def send(tensor, to_stage, made_by):
            tensor = self.cut.to_edge(tensor)
            array = self.xp.asarray(tensor.data, order="C")  # (ascontiguousarray makes a 0-d array 1-d)
            self.messages.send(_header(array), to_stage, HEADER_TAG, action, "header")
            self.messages.send(array, to_stage, ACTIVATION_TAG, action, "activation")
            return tensor

        # The stage's own cells run on the local runtime, or through the tensor-parallel dispatcher over
        # the stage's ranks (stage_cut.py), under the mode's layer when one is installed (GRAPH_MODE fuses
        # inside the stage's cells).
        mode = mode_layer()
        inner = self.cut.runtime
        layer = StageForward(inner if mode is None else mode(inner), self.plan, self.stage, receive, send)
        with layer:
            out = self.network(*(self.cut.tag(x) if isinstance(x, Tensor) else x for x in inputs))
            if self.stage == self.last and isinstance(out, Tensor) and layer.stage_of(out) == self.stage:
                out = self.cut.whole(out)
                layer.keep(out)
        what = f"stage {self.stage}"
        check_one_activation(layer, i, what)
        if self.stage > 0 and not layer.inputs:
            raise PipelineError(f"{what} received nothing from stage {self.stage - 1} in micro-batch {i}: none of its "
                                f"cells takes an output of the stage before it")
        if self.stage == self.last:
            root = self.keep_last(i, out, layer)
        else:
            if not layer.outputs:
                raise PipelineError(f"{what} sent nothing to stage {self.stage + 1} in micro-batch {i}: no cell of a "
                                    f"later stage takes an output of stage {self.stage}")
            root = layer.outputs[0]
        if is_grad_enabled():  # (no backward follows under no_grad: nothing to hold)
            self.in_flight[i] = (root, layer.inputs[0] if layer.inputs else None)
            self.log.peak_held = max(self.log.peak_held, len(self.in_flight))

    def keep_last(self, micro, out, layer):
        """The last stage's output of micro-batch ``micro``: the loss, added to the step's sum; returns the
        root of its backward. (Evaluation keeps any outputs instead: evaluation.py overrides this.)"""
        if not isinstance(out, Tensor) or layer.stage_of(out) != self.stage or out.size != 1:
            raise PipelineError(f"the network's output on the last stage ({self.stage}) must be the loss, a "
                                f"one-element Tensor computed on it; got {_describe(out, layer)}: wrap the network "
                                f"and its loss in nn.WithLossCell, with the loss after the last stage's cells")
        value = out.data.reshape(())
        self.loss = value.copy() if self.loss is None else self.loss + value
        return out

    def backward(self, action):
        root, leaf = self.in_flight.pop(action.micro)
        if self.stage == self.last:
            gy = self.xp.ones(root.data.shape, dtype=root.dtype)
        else:
            gy = self.messages.recv(self.xp.empty(root.data.shape, dtype=root.dtype), self.stage + 1, GRADIENT_TAG,
                                    action, "gradient")
        targets = list(self.params) + ([leaf] if leaf is not None else [])
        grads, _ = run_backward(root, gy, targets=targets) if root.requires_grad else ({}, None)
        for p in self.params:
            g = grads.get(id(p))
            if g is not None:
                total = self.sums.get(id(p))
                self.sums[id(p)] = g if total is None else total + g
        if leaf is not None:
            g = grads.get(id(leaf))
            if g is None:  # the stage's output does not depend on its input
                g = self.xp.zeros(leaf.data.shape, dtype=leaf.dtype)
            self.messages.send(self.xp.asarray(g, order="C"), self.stage - 1, GRADIENT_TAG, action, "gradient")


def _describe(out, layer):
    if isinstance(out, Tensor):
        where = layer.stage_of(out)
        return f"a Tensor of shape {tuple(out.shape)}" + (" made from the data only" if where is None else "")
    return repr(out) if not isinstance(out, (tuple, list)) else f"a {type(out).__name__} of {len(out)} values"


def run_step(network, plan, schedule, comm, stage, inputs, cut=NO_CUT):
    """Runs ``schedule``'s actions of ``stage`` for one step of ``network`` on ``inputs`` (the whole
    batch: cut into micro-batches here); ``cut`` says how the stage's cells run (stage_cut.py).

    Returns:
        (the last stage's sum of the micro-batch losses as a 0-d array, else None;
         {id(parameter): gradient summed over the micro-batches} for the stage's parameters;
         the step's StepLog: its messages and the most micro-batches held at once)
    """
    micro = split_micro_batches(inputs, schedule.micro_batches)
    log = StepLog()
    run = _StageRun(network, plan, schedule, comm, stage, log, cut)
    actions = schedule.actions(stage)
    if not is_grad_enabled():  # (evaluation under no_grad: the forwards alone, in the schedule's order)
        actions = [a for a in actions if a.kind == FORWARD]
    for action in actions:
        try:
            if action.kind == FORWARD:
                run.forward(action, micro[action.micro])
            else:
                run.backward(action)
        except Exception as exc:  # noqa: B902 - re-raised, with where it happened
            _add_note(exc, f"(in pipeline stage {stage}, {action}: the {action.kind} of micro-batch {action.micro})")
            raise
    run.messages.finish()  # (not after a failure: the job ends, and a send's wait would only delay it)
    return run.loss, run.sums, log
