"""One stage's forward of one micro-batch: the whole construct runs on every rank, and the cells of
other stages are stood in for.

Every rank of a pipeline runs the network's Python code for each forward action, in the same order,
so every rank meets the same cells. This layer (a :class:`minidl.runtime.Layered` runtime installed
on the thread for the action) decides at each cell with a ``pipeline_stage`` (a *staged* cell):

- its stage is this rank's: its inputs that are :class:`Remote` (outputs of the previous stage) are
  received from that stage, as leaves that require a gradient, and the cell runs;
- another stage's: this rank's tensors it takes are sent to that stage (the next one), and it gives
  back a :class:`Remote` standing for its output, without running.

Code between staged cells (the construct's own ops, a loss cell without parameters) runs where its
inputs live: on this rank when they are its own tensors or local constants, and as a Remote of the
same stage when one of them is a Remote. A tensor built from the data alone (positions, masks) is a
constant every rank makes. So activations cross exactly at stage boundaries, once per micro-batch
each, and in the order every rank computes.

Weights read outside their staged cell: an op of the construct that reads a parameter with inputs of a
later stage runs there (a tied head); an op or glue cell of weights alone (a cast of the table) runs on
every rank, as a constant. Either way, the stage that takes a weight, or a function of weights alone, in shares it
(StagePlan.share): its copy's gradient there is summed with the owner's.

Limits, each raised naming the cell: a staged cell of stage j takes another stage's output only from
stage j - 1 (stages follow the order of the forward); one tensor crosses each boundary per
micro-batch; an op reads parameters of one stage only, each of some staged cell. Reading a Remote's shape or value in the
construct raises naming the cell that made it: such code belongs inside a cell of a stage.
"""
from minidl import Parameter, Tensor
from minidl.runtime import Layered

__all__ = ["Remote", "StageForward", "PipelineError"]


class PipelineError(RuntimeError):
    """A network whose stages cannot run as a pipeline (what and where, in the message)."""


class RemoteAttributeError(PipelineError, AttributeError):
    """An attribute (shape, dtype, ...) of a value that lives on another stage's rank: an
    AttributeError too, so that ``getattr(x, "shape", None)`` says "no shape here"."""


class Remote:
    """The output of a cell of another stage (or code on it): it lives on that stage's ranks."""

    __slots__ = ("stage", "made_by")

    def __init__(self, stage, made_by):
        self.stage, self.made_by = stage, made_by

    def __getattr__(self, name):
        raise RemoteAttributeError(f"the construct reads {name!r} of the output of {self.made_by}, which lives on pipeline "
                            f"stage {self.stage} (another rank): move this code into a cell of that stage")

    def __getitem__(self, key):  # (an attention's (output, weights)[0]: still the other stage's)
        return self

    def __bool__(self):
        raise PipelineError(f"the construct tests the output of {self.made_by}, which lives on pipeline stage "
                            f"{self.stage} (another rank): move this code into a cell of that stage")

    def __repr__(self):
        return f"Remote(stage={self.stage}, made_by={self.made_by})"


def _flatten(value):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _flatten(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flatten(v)
    else:
        yield value


def _replace(value, mapping):
    if isinstance(value, (tuple, list)):
        return type(value)(_replace(v, mapping) for v in value)
    if isinstance(value, dict):
        return {k: _replace(v, mapping) for k, v in value.items()}
    return mapping.get(id(value), value)


class StageForward(Layered):
    """The layer for one forward action ``F(stage, micro)``; see the module docstring.

    Args:
        inner: the runtime the stage's own cells and ops run on.
        plan: the network's :class:`~minidl_parallel.pipeline.stages.StagePlan`.
        stage: this rank's stage.
        receive: ``receive(from_stage, made_by) -> Tensor``: the activation of the previous stage.
        send: ``send(tensor, to_stage, made_by) -> Tensor``: hands this stage's output to the next stage;
            returns the tensor sent (the output, or it moved to the layout the stages exchange).
    """

    layers_pass_through = True  # GRAPH_MODE's layer runs inside the stage's cells (``inner``), not over this

    def __init__(self, inner, plan, stage, receive, send):
        super().__init__(inner)
        self.plan, self.stage = plan, stage
        self._receive, self._send = receive, send
        self._depth = 0  # > 0 inside a staged cell of this rank's stage
        self._tagged = {}  # id(tensor) -> (tensor, stage): what this rank computed outside staged cells
        self._from_weights = {}  # id(tensor) -> (tensor, [parameters]): computed from weights alone
        self._received = {}  # id(Remote) -> the Tensor received for it
        self._sent = set()  # ids of the tensors already sent on (one message per tensor)
        self.inputs = []  # the leaves received this action
        self.outputs = []  # the tensors sent this action

    # ---- cells and ops ----------------------------------------------------------------------

    def call_cell(self, cell, args, kwargs):
        if self._depth:
            return self.inner.call_cell(cell, args, kwargs)
        stage = self.plan.stage_of_cell(cell)
        if stage is None and self.plan.holds_stages(cell):  # a container: its construct routes the cells inside
            return cell.construct(*args, **kwargs)
        if stage is not None:
            return self._run_on(stage, self.plan.describe(cell), args, kwargs, self.inner.call_cell, cell)
        # Glue without parameters (a loss, an activation cell): it runs where its inputs live, as an op.
        return self._run_on(self._stage_of_inputs(args, kwargs), f"{type(cell).__name__} cell", args, kwargs,
                            lambda c, a, k: c.construct(*a, **k), cell)

    def call_op(self, prim, args):
        if self._depth:
            return self.inner.call_op(prim, args)
        # An op that reads a parameter (a method of a staged cell, BatchNorm's with_relu) runs on the
        # parameter's stage; other ops of the construct run where their inputs live.
        stages = {self.plan.stage_of_parameter.get(id(a)) for a in args if isinstance(a, Parameter)}
        if None in stages:
            name = next(a.name for a in args if isinstance(a, Parameter)
                        and self.plan.stage_of_parameter.get(id(a)) is None)
            raise PipelineError(f"{prim.name} reads parameter {name!r}, which belongs to no cell with a pipeline_stage")
        if len(stages) > 1:
            raise PipelineError(f"{prim.name} reads parameters of stages {sorted(stages)}: an op runs on one stage")
        later = self._stage_of_inputs(args, {})
        weights = self._weights_of(args)
        if weights and later is None:
            # A function of weights alone (mixed precision's cast of a tied head's table): every rank
            # computes it, as a constant; the stage that takes it in shares the weights (_run_on).
            out = self.inner.call_op(prim, args)
            self._from_weights[id(out)] = (out, weights)
            return out
        stage = stages.pop() if stages else None
        if stage is None:
            stage = later
        elif later is not None and later > stage:
            # Its other inputs come from a later stage (a head tied to the embedding table): the op
            # runs there, and the parameters become shared with that stage (their gradients summed).
            for a in args:
                if isinstance(a, Parameter):
                    self.plan.share(a, stage, later)
            stage = later
        return self._run_on(stage, f"op {prim.name}", args, {}, lambda p, a, k: self.inner.call_op(p, a), prim)

    def _stage_of_inputs(self, args, kwargs):
        stages = [self.stage_of(v) for v in _flatten((args, kwargs))]
        stages = [s for s in stages if s is not None]
        return max(stages) if stages else None

    def _weights_of(self, args):
        """The parameters the tensors among ``args`` are (or were computed from, alone), in order."""
        weights = []
        for a in _flatten(args):
            found = [a] if isinstance(a, Parameter) else self._from_weights.get(id(a), (None, []))[1]
            weights += [w for w in found if all(w is not seen for seen in weights)]
        return weights

    def _run_on(self, stage, name, args, kwargs, run, target):
        """``run(target, args, kwargs)`` on ``stage``: here, with the inputs of the stage before received;
        elsewhere, with this rank's inputs sent there and a Remote for the output."""
        # A weight (or a function of weights alone) taken in on another stage than its own: that stage
        # shares the weight, so its gradient there is summed with the owner's (a tied head).
        weights = self._weights_of((args, kwargs))
        for w in weights if stage is not None else ():
            owner = self.plan.stage_of_parameter.get(id(w))
            if owner is not None and owner != stage:
                self.plan.share(w, owner, stage)
        if stage is not None and stage != self.stage:
            self._send_inputs(args, kwargs, stage, name)
            return Remote(stage, name)
        mapping = self._receive_inputs(args, kwargs, name)
        args, kwargs = _replace(args, mapping), _replace(kwargs, mapping)
        self._depth += 1
        try:
            out = run(target, args, kwargs)
        finally:
            self._depth -= 1
        if stage is not None or mapping or self._stage_of_inputs(args, kwargs) is not None:
            for t in _flatten(out):
                if isinstance(t, Tensor):
                    self._tagged[id(t)] = (t, self.stage)
        elif weights:
            # A cell of weights alone ran on every rank, as call_op's function of weights alone does: the
            # stage that takes its output in shares the weights (their gradients summed).
            for t in _flatten(out):
                if isinstance(t, Tensor):
                    self._from_weights[id(t)] = (t, weights)
        return out

    def _send_inputs(self, args, kwargs, stage, name):
        for value in _flatten((args, kwargs)):
            if not isinstance(value, Tensor) or id(value) not in self._tagged:
                continue  # data and constants: every rank has them
            if stage != self.stage + 1:
                raise _out_of_order(name, stage, self.stage)
            if id(value) not in self._sent:
                self._sent.add(id(value))
                self.outputs.append(self._send(value, stage, name))  # (the tensor sent: its layout may change)

    def _receive_inputs(self, args, kwargs, name):
        mapping = {}
        for value in _flatten((args, kwargs)):
            if not isinstance(value, Remote):
                continue
            if value.stage != self.stage - 1:
                raise _out_of_order(name, self.stage, value.stage)
            if id(value) not in self._received:
                self._received[id(value)] = self._receive(value.stage, value.made_by)
                self.inputs.append(self._received[id(value)])
            mapping[id(value)] = self._received[id(value)]
        return mapping

    def keep(self, tensor):
        """Records ``tensor`` (made from this stage's outputs after the construct returned) as this stage's."""
        self._tagged[id(tensor)] = (tensor, self.stage)

    def stage_of(self, value):
        """The stage a value of this action lives on: its own for tensors this rank computed from
        staged cells, a Remote's, or None for data and constants."""
        if isinstance(value, Remote):
            return value.stage
        if isinstance(value, Tensor) and id(value) in self._tagged:
            return self._tagged[id(value)][1]
        return None


def _out_of_order(name, stage, source):
    """The error both ranks of a message against the stage order raise: the same words on each."""
    takes = "only the data" if stage == 0 else f"the data and the outputs of stage {stage - 1} only"
    return PipelineError(f"{name} (pipeline stage {stage}) takes an output of stage {source}, but stage {stage} takes "
                         f"{takes}: set pipeline_stage so that the stages follow the order of the forward")


def check_one_activation(layer, micro, what):
    """Raises unless the action moved at most one tensor each way (the limit the backward relies on)."""
    for kind, tensors in (("received", layer.inputs), ("sent", layer.outputs)):
        if len(tensors) > 1:
            shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
            raise PipelineError(f"{what} of micro-batch {micro} {kind} {len(tensors)} tensors ({shapes}) across its "
                                f"stage boundary; minidl's pipeline moves one tensor per boundary: return one tensor "
                                f"from the last cell of each stage")
