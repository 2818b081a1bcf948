"""``nn.PipelineCell``: MindSpore's wrapper that cuts each batch into micro-batches and runs them
through the stages of a pipeline.

The network (usually ``nn.WithLossCell(backbone, loss_fn)``) has ``pipeline_stage`` set on its
cells; ``set_auto_parallel_context(pipeline_stages=p, pipeline_config=...)`` says how many stages
and which schedule. A call runs one whole step of the schedule on this rank's stage (forwards and
backwards of every micro-batch, and the messages between stages) and returns the sum of the
micro-batch losses, as MindSpore's PipelineCell does, on every rank of the pipeline (the last stage
computes it and sends it to the others). The gradients of the stage's parameters are computed
then; differentiating the returned loss (``value_and_grad``, ``TrainOneStepCell``, ``Model``)
hands them over, times the loss's incoming gradient (a loss scale). Parameters of other stages
get no gradient on this rank.

With ``pipeline_stages`` 1 the micro-batches run one after the other on this rank: the same sum,
by plain gradient accumulation.
"""
import numpy

from minidl import backend
from minidl.nn import Cell
from minidl.ops.primitive import Primitive

from .. import context
from ..comm.p2p import P2POp
from .executor import DTYPES, dtype_named, run_step, split_micro_batches
from .schedules import pipeline_schedule
from .stage_forward import PipelineError
from .stages import StagePlan

__all__ = ["PipelineCell"]


class _StepGradients(Primitive):
    """The loss of a pipeline step, as a node whose backward hands each of the stage's parameters the
    gradient the step already computed (times the loss's incoming gradient)."""

    n_inputs = None  # one per parameter of the stage

    def __init__(self, loss, gradients):
        super().__init__()
        self.loss, self.gradients = loss, gradients

    def forward(self, *weights):
        return self.loss

    def backward(self, gy):
        if bool((gy == 1).all()):  # the usual case: the sums as they are, bit for bit
            return tuple(self.gradients)
        return tuple(None if g is None else g * gy.astype(g.dtype) for g in self.gradients)


class PipelineCell(Cell):
    """Cuts each batch into ``micro_size`` micro-batches and runs them through the pipeline's stages.

    Args:
        network: the Cell to run, its cells' ``pipeline_stage`` set; it returns the loss.
        micro_size: micro-batches per step (an int >= pipeline_stages; the batch's first axis is cut
            into that many equal parts).
        stage_config: optional ``{cell path: stage}`` that sets ``pipeline_stage`` on those cells
            (MindSpore's argument); a path the network lacks raises KeyError naming it.

    Attributes:
        last_step: what the latest step did on this rank (a ``StepLog``: its messages, and the most
            micro-batches it held at once), or None before the first.
    """

    def __init__(self, network, micro_size, stage_config=None):
        super().__init__(auto_prefix=False)
        if not isinstance(network, Cell):
            raise TypeError(f"PipelineCell: network must be a Cell, got {type(network).__name__}")
        if isinstance(micro_size, bool) or not isinstance(micro_size, int):
            raise TypeError(f"PipelineCell: micro_size must be an int, got {type(micro_size).__name__}: {micro_size!r}")
        if micro_size < 1:
            raise ValueError(f"PipelineCell: micro_size must be an int >= 1, got {micro_size}")
        self.network = network
        self.micro_size = micro_size
        self.last_step = None
        self._groups = {}  # (world communicator, its pipeline ranks) -> the pipeline group, split once
        self._synced = {}  # id(pipeline group) -> whether its shared parameters' copies were compared
        if stage_config is not None:
            self._set_stages(stage_config)

    def _set_stages(self, stage_config):
        cells = dict(self.network.cells_and_names())
        missing = [name for name in stage_config if name not in cells]
        if missing:
            raise KeyError(f"PipelineCell: stage_config names {missing}, which the network does not have; its cells "
                           f"are {[name for name in cells if name]}")
        for name, stage in stage_config.items():
            cells[name].pipeline_stage = stage

    def schedule(self):
        """The schedule one step runs (``print`` it to see the bubble), from the current settings."""
        stages, scheduler = self._settings()
        return pipeline_schedule(stages, self.micro_size, scheduler)

    def gather_parameters(self):
        """Makes this rank's copy of every stage's parameters (BatchNorm statistics included) current:
        each stage's values go to the other stages of its pipeline (a collective of the pipeline group:
        every rank calls it). Between steps a rank's copies of other stages' parameters are stale; after
        this call the network on every rank is the trained one, to sample from or save whole."""
        stages, _ = self._settings()
        if stages == 1:
            return
        world = context.get_communicator()
        stage, _, pipeline_ranks = context.stage_layout(world.size, world.rank, stages)
        comm = self._group(world, pipeline_ranks)
        plan = StagePlan(self.network, stages)
        for _, param in self.network.parameters_and_names():
            owner = plan.stage_of_parameter[id(param)]
            value = comm.broadcast(param.data, root=owner)
            if stage != owner:
                param.set_data(value)

    def _settings(self):
        return context.pipeline_settings()  # (raises naming the mode when it cannot run a pipeline)

    def construct(self, *inputs):
        stages, scheduler = self._settings()
        if stages == 1:
            return self._accumulate(inputs)
        world = context.get_communicator()
        stage, stage_ranks, pipeline_ranks = context.stage_layout(world.size, world.rank, stages)
        comm = self._group(world, pipeline_ranks)
        plan = StagePlan(self.network, stages)
        schedule = pipeline_schedule(stages, self.micro_size, scheduler)
        loss, sums, self.last_step = run_step(self.network, plan, schedule, comm, stage, inputs)
        loss = _from_last_stage(comm, loss, stages - 1)
        params = plan.parameters[stage]
        _sum_shared(comm, plan, stage, sums, check=not self._synced.get(id(comm)))
        self._synced[id(comm)] = True
        if len(stage_ranks) > 1:  # data parallel replicas of the stage: their gradients are reduced over them
            _reduce_over_replicas(self._group(world, stage_ranks), params, sums,
                                  context.current_world().settings["gradients_mean"])
        # (the loss that came from the last stage, on this stage's device)
        loss = backend.to_device(loss, backend.get_array_module(params[0].data) if params else backend.default_xp())
        return _StepGradients(loss, [sums.get(id(p)) for p in params]).apply(*params)

    def _accumulate(self, inputs):
        total = None
        for micro in split_micro_batches(inputs, self.micro_size):
            loss = self.network(*micro)
            total = loss if total is None else total + loss
        return total

    def _group(self, world, pipeline_ranks):
        if list(pipeline_ranks) == list(range(world.size)):
            return world
        key = (id(world), tuple(pipeline_ranks))
        if key not in self._groups:
            self._groups[key] = world.split(list(pipeline_ranks))
        return self._groups[key]


SHARED_TAG = 4  # (the executor's tags are 1-3)


def _sum_shared(comm, plan, stage, sums, check):
    """The gradient of each parameter several stages use, summed over its stages in stage order (the
    same sum, bit for bit, on each); with ``check``, the copies' values are compared first, since a
    copy made with another seed would train a different model (MindSpore's sync_pipeline_shared_parameters
    copies the first stage's; here every rank builds the same network, and a difference is a bug)."""
    for param, stages in plan.shared.values():  # (in the order found: the same on every rank)
        if stage not in stages:
            continue
        peers = [s for s in stages if s != stage]
        xp = backend.get_array_module(param.data)
        mine = sums.get(id(param))
        mine = xp.zeros(param.data.shape, param.data.dtype) if mine is None else mine
        if check:
            values = _exchange(comm, param.data, peers)
            differ = [s for s, v in values.items() if not bool((v == param.data).all())]
            if differ:
                raise PipelineError(f"parameter {param.name!r} is used by stages {stages}, but its copy on stage "
                                    f"{stage} differs from the copy on stage(s) {differ}: build the network with the "
                                    f"same seed and weights on every rank")
        grads = _exchange(comm, mine, peers)
        grads[stage] = mine
        total = grads[stages[0]].copy()
        for s in stages[1:]:
            total += grads[s]
        sums[id(param)] = total


def _exchange(comm, array, peers):
    """{stage: its array} from every peer stage, this rank's sent to each."""
    array = array if array.flags.c_contiguous else array.copy()
    ops = [P2POp("send", array, peer, SHARED_TAG) for peer in peers]
    received = {peer: backend.get_array_module(array).empty_like(array) for peer in peers}
    ops += [P2POp("recv", received[peer], peer, SHARED_TAG) for peer in peers]
    for request in comm.batch_isend_irecv(ops):
        request.wait()
    return received


def _reduce_over_replicas(comm, params, sums, mean):
    """Sums (or averages, with gradients_mean) the stage's gradients over its data-parallel replicas,
    one all-reduce per dtype of one flat buffer; a parameter this replica's loss did not reach counts
    as zeros, so every replica passes the same buffer."""
    by_dtype = {}
    for p in params:
        by_dtype.setdefault(str(p.dtype), []).append(p)
    for group in by_dtype.values():
        xp = backend.get_array_module(group[0].data)
        flat = xp.concatenate([(sums[id(p)] if id(p) in sums else xp.zeros(p.data.shape, p.data.dtype)).ravel()
                               for p in group])
        comm.allreduce_(flat, "mean" if mean else "sum")
        offset = 0
        for p in group:
            size = p.data.size
            sums[id(p)] = flat[offset:offset + size].reshape(p.data.shape)
            offset += size


def _from_last_stage(comm, loss, last):
    """The last stage's loss on every stage of the pipeline (one broadcast of its value and dtype:
    every dtype an activation may have, bfloat16 included, holds exactly in float64)."""
    carrier = numpy.zeros(2)
    if loss is not None:
        carrier[0], carrier[1] = float(loss), DTYPES.index(str(loss.dtype))
    carrier = comm.broadcast(carrier, root=last)
    if loss is not None:
        return loss
    return numpy.asarray(carrier[0], dtype=dtype_named(DTYPES[int(carrier[1])]))
