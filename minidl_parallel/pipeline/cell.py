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
from minidl.runtime import get_runtime

from .. import context
from ..comm.p2p import P2POp
from .executor import DTYPES, dtype_named, run_step, split_micro_batches
from ..tensor_parallel import dispatch, parameters
from .. import pipeline_groups as groups
from .schedules import pipeline_schedule
from .stage_cut import NO_CUT, StageCut
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
        last_plan: the latest step's ``StagePlan`` (with the parameters found shared as it ran: a tied
            head's table), or None before the first; checkpoints read it.
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
        self.last_plan = None
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
        stage, comm = groups.pipeline_group(world, stages)
        plan = StagePlan(self.network, stages)
        for _, param in self.network.parameters_and_names():
            owner = plan.stage_of_parameter[id(param)]
            if stage == owner and param.placement is not None:  # a block of a stage cut by shard(): whole first
                value = comm.broadcast(parameters.whole(param, groups.stage_group(world, stages)[1],
                                                        dispatch.groups()), root=owner)
            else:
                value = comm.broadcast(param.data, root=owner)
            if stage != owner:
                param.set_data(value)

    def _settings(self):
        return context.pipeline_settings()  # (raises naming the mode when it cannot run a pipeline)

    def construct(self, *inputs):
        stages, scheduler = self._settings()
        if stages == 1:
            return self._accumulate(inputs)
        settings = context.current_world().settings
        _refuse_unbuilt(settings)
        world = context.get_communicator()
        stage, comm = groups.pipeline_group(world, stages)
        _, stage_comm = groups.stage_group(world, stages)
        plan = StagePlan(self.network, stages)
        # With shard() strategies the stage's cells are cut over its ranks (their gradients reduced by the
        # dispatcher's layouts); without, its ranks are replicas, each with its own batch.
        cut = NO_CUT
        if plan.sharded:
            cut = StageCut(self.network, stage_comm, settings["dataset_strategy"], get_runtime().placing)
        schedule = pipeline_schedule(stages, self.micro_size, scheduler)
        loss, sums, self.last_step = run_step(self.network, plan, schedule, comm, stage, inputs, cut)
        self.last_plan = plan
        loss = _from_last_stage(comm, loss, stages - 1)
        params = plan.parameters[stage]
        # (the blocks of a shared parameter are compared only where strategies cut it: else all are whole)
        _sum_shared(comm, plan, stage, sums, not self._synced.get(id(comm)), stage_comm.rank if plan.sharded else None)
        self._synced[id(comm)] = True
        if stage_comm.size > 1 and cut is NO_CUT:  # the stage's replicas: their gradients are reduced over them
            _reduce_over_replicas(stage_comm, params, sums, settings["gradients_mean"])
        # (the loss that came from the last stage, on this stage's device)
        loss = backend.to_device(loss, backend.get_array_module(params[0].data) if params else backend.default_xp())
        return _StepGradients(loss, [sums.get(id(p)) for p in params]).apply(*params)

    def _accumulate(self, inputs):
        total = None
        for micro in split_micro_batches(inputs, self.micro_size):
            loss = self.network(*micro)
            total = loss if total is None else total + loss
        return total


SHARED_TAG = 4  # (the executor's tags are 1-3)


def _refuse_unbuilt(settings):
    """Raises for settings a pipeline would otherwise ignore (the same on every rank, before any message)."""
    if settings["enable_parallel_optimizer"]:
        raise NotImplementedError("PipelineCell: enable_parallel_optimizer=True (optimizer parallelism inside a "
                                  "pipeline) is not built in minidl; set it to False with pipeline_stages > 1")
    config = settings["strategy_ckpt_config"]
    for entry in ("load_file", "save_file"):
        if config[entry]:
            raise NotImplementedError(f"PipelineCell: strategy_ckpt_config {entry}={config[entry]!r} (a strategy file "
                                      f"of a pipeline) is not built in minidl; set it to \"\" with pipeline_stages > 1")


def _sum_shared(comm, plan, stage, sums, check, block_rank):
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
            if block_rank is not None:
                _check_cut_alike(comm, param, stage, stages, peers, block_rank)
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


_CUT_BYTES = 512  # room for a layout's description


def _block_of(param, rank):
    """Which part of ``param`` this rank holds, e.g. "[0:6, 0:8] of (12, 8)" (rank: in its stage's group)."""
    placement = param.placement
    shape = tuple(param.shape) if placement is None else tuple(placement.shape)
    cover = [slice(0, n) for n in shape] if placement is None else placement.layout.local_slices(rank, shape)
    return f"[{', '.join(f'{s.start}:{s.stop}' for s in cover)}] of {shape}"


def _check_cut_alike(comm, param, stage, stages, peers, rank):
    """Raises unless this rank's copies of a shared parameter on its stages hold the same block (shard()
    strategies inside the stages): their gradients are summed block by block. Two strategies may describe
    one cut differently (a vocabulary-parallel lookup and head): the blocks are compared, not the layouts."""
    mine = _block_of(param, rank).encode()[:_CUT_BYTES]
    carrier = numpy.zeros(_CUT_BYTES, numpy.uint8)
    carrier[:len(mine)] = numpy.frombuffer(mine, numpy.uint8)
    blocks = {s: bytes(a).rstrip(b"\0").decode(errors="replace")
              for s, a in _exchange(comm, carrier, peers).items()}
    blocks[stage] = mine.decode(errors="replace")
    if len(set(blocks.values())) > 1:  # (the same words on every rank: in stage order)
        raise PipelineError(f"parameter {param.name!r} is used by stages {stages} but cut differently by their shard() "
                            f"strategies: rank {rank} of each stage holds "
                            + ", ".join(f"{blocks[s]} on stage {s}" for s in sorted(blocks))
                            + "; give the operators that use it strategies that cut it alike")


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
