"""Evaluation through a pipeline: each batch's forwards run through the stages, and the last stage
returns the network's outputs (loss, logits, label, ...) for ``Model.eval``'s metrics.

A training step's network ends in the loss (executor.py refuses anything else on the last stage);
an evaluation network returns whatever the metrics read, and only the last stage holds it. So:

- :class:`PipelineEvalCell` runs the forwards of every micro-batch in the schedule's order, under
  no_grad (the same messages as a training step's forwards, no backward), and returns on the last
  stage the outputs of the whole batch: each micro-batch's tensors joined along axis 0, and a 0-d
  tensor (a mean loss) as the batch's mean, the micro-batches' values weighted by their rows. The
  other stages return None: nothing is sent back to them per batch.
- Its ``evaluation_layout()`` tells ``Model.eval`` which ranks hold the outputs and how the world
  splits into data-parallel replicas. Model then updates the metrics on the last stage's ranks only
  (one per replica for a dataset sharded over the replicas; replica 0's alone for a dataset every
  replica reads whole), the other ranks keep their cleared (zero) statistics, and its one sum over
  the world at the end (``sum_over_ranks``) counts every row once and gives every rank the totals:
  the values one device computes from the same rows.

A batch need not be a multiple of ``micro_size`` here (a last, smaller batch; the rows sharding pads
are dropped): it is cut into min(micro_size, rows) micro-batches whose sizes differ by at most one.
"""
import numpy

from minidl import backend
from minidl.nn import Cell
from minidl.runtime import get_runtime
from minidl.tensor import Tensor, no_grad

from .. import context
from .. import pipeline_groups as groups
from ..comm.threads import _add_note
from .executor import StepLog, _StageRun
from .schedules import FORWARD, pipeline_schedule
from .stage_cut import NO_CUT, StageCut
from .stage_forward import PipelineError, Remote
from .stages import StagePlan

__all__ = ["PipelineEvalCell"]


class PipelineEvalCell(Cell):
    """Runs an evaluation network through the pipeline's stages; its outputs come back on the last stage.

    Args:
        network: the Cell to run, its cells' ``pipeline_stage`` set (the same cells as the training
            PipelineCell's network); it returns a Tensor or a tuple of Tensors computed on the last
            stage or taken from the data, e.g. ``(loss, logits, label)``.
        micro_size: micro-batches per batch (an int >= 1; fewer when the batch has fewer rows).

    Returns, per call: on the last stage, the network's outputs for the whole batch (tensors joined
    along axis 0; a 0-d tensor as the batch's mean, weighted by the micro-batches' rows); on the other
    stages None. With ``pipeline_stages`` 1: ``network(*inputs)``, on every rank.

    Example:
        >>> pipe = nn.PipelineCell(nn.WithLossCell(net, loss_fn), 4)
        >>> model = Model(pipe, optimizer=opt, metrics={"acc", "loss"},
        ...               eval_network=PipelineEvalCell(EvalNet(net, loss_fn), 4), eval_indexes=[0, 1, 2])
        >>> model.eval(dataset)  # on every rank: the values one device gives
    """

    def __init__(self, network, micro_size):
        super().__init__(auto_prefix=False)
        if not isinstance(network, Cell):
            raise TypeError(f"PipelineEvalCell: network must be a Cell, got {type(network).__name__}")
        if isinstance(micro_size, bool) or not isinstance(micro_size, int) or micro_size < 1:
            raise ValueError(f"PipelineEvalCell: micro_size must be an int >= 1, got {micro_size!r}")
        self.network = network
        self.micro_size = micro_size
        self.last_step = None  # the latest call's StepLog on this rank (its messages), None before the first

    def evaluation_layout(self):
        """How ``Model.eval`` counts this network's outputs (see minidl/train/model.py): None with one
        stage (every rank holds its outputs), else (whether this rank holds them: the last stage's
        ranks; the number of data-parallel replicas; this rank's replica)."""
        stages, _ = context.pipeline_settings()
        if stages == 1:
            return None
        world = context.get_communicator()
        stage, stage_ranks, _ = context.stage_layout(world.size, world.rank, stages)
        return stage == stages - 1, len(stage_ranks), list(stage_ranks).index(world.rank)

    def construct(self, *inputs):
        stages, scheduler = context.pipeline_settings()
        if stages == 1:  # nothing to cut: the whole batch at once, as one device evaluates it
            with no_grad():
                return self.network(*inputs)
        world = context.get_communicator()
        stage, comm = groups.pipeline_group(world, stages)
        plan = StagePlan(self.network, stages)
        cut = NO_CUT
        if plan.sharded:  # each rank of the last stage returns its rows of the outputs (see _EvalRun)
            settings = context.current_world().settings
            cut = StageCut(self.network, groups.stage_group(world, stages)[1], settings["dataset_strategy"],
                           get_runtime().placing)
        micro, rows = _micro_batches(inputs, self.micro_size)
        # (a schedule needs micro-batches >= stages; with fewer, its first forwards are this batch's)
        schedule = pipeline_schedule(stages, max(len(micro), stages), scheduler)
        with no_grad():
            outputs, self.last_step = _run_forwards(self.network, plan, schedule, comm, stage, micro, cut)
        return None if outputs is None else _join_outputs(outputs, rows)


class _EvalRun(_StageRun):
    """A step's forwards whose last stage keeps the network's outputs, whatever they are."""

    def __init__(self, *args):
        super().__init__(*args)
        self.outputs = {}  # micro-batch -> the network's outputs (last stage)

    def keep_last(self, micro, out, layer):
        values = list(out) if isinstance(out, (tuple, list)) else [out]
        for k, value in enumerate(values):
            if isinstance(value, Remote):
                raise PipelineError(f"output {k} of the evaluation network is the output of {value.made_by}, which "
                                    f"lives on pipeline stage {value.stage}: return only what the last stage "
                                    f"({self.stage}) computes, and the data")
            if not isinstance(value, Tensor):
                raise PipelineError(f"output {k} of the evaluation network is a {type(value).__name__}; it must "
                                    f"return Tensors (a Tensor, or a tuple of them) for the metrics")
        if self.cut is not NO_CUT:
            # Cut by shard() over the stage's ranks: each rank keeps the rows it was fed (the edge's layout:
            # its block of the batch, or all of it with "full_batch"), as a data-parallel replica would, and a
            # 0-d output (the micro-batch's loss) whole. Model then counts each rank's rows as a replica's.
            values = [self.cut.whole(v) if v.ndim == 0 else self.cut.to_edge(v) for v in values]
            out = type(out)(values) if isinstance(out, (tuple, list)) else values[0]
        self.outputs[micro] = out
        return None  # (no backward follows)


def _run_forwards(network, plan, schedule, comm, stage, micro, cut):
    """The forwards of ``schedule`` on ``stage``; returns (the outputs per micro-batch on the last stage,
    else None; the StepLog)."""
    log = StepLog()
    run = _EvalRun(network, plan, schedule, comm, stage, log, cut)
    for action in schedule.actions(stage):
        if action.kind != FORWARD or action.micro >= len(micro):
            continue
        try:
            run.forward(action, micro[action.micro])
        except Exception as exc:  # noqa: B902 - re-raised, with where it happened
            _add_note(exc, f"(in pipeline stage {stage}, {action}: the evaluation forward of micro-batch "
                           f"{action.micro})")
            raise
    run.messages.finish()
    if stage != schedule.stages - 1:
        return None, log
    return [run.outputs[k] for k in range(len(micro))], log


def _micro_batches(inputs, micro_size):
    """(the inputs cut along axis 0 into min(micro_size, rows) parts of sizes differing by at most one,
    the parts' rows); arguments other than Tensors go to every part as they are."""
    lengths = {int(x.shape[0]) for x in inputs if isinstance(x, Tensor) and x.ndim}
    if any(isinstance(x, Tensor) and not x.ndim for x in inputs) or len(lengths) != 1:
        shapes = [tuple(x.shape) for x in inputs if isinstance(x, Tensor)]
        raise ValueError(f"PipelineEvalCell: the inputs' Tensors must share their first axis (the batch), which is "
                         f"cut into micro-batches; got shapes {shapes}")
    n = lengths.pop()
    parts = max(1, min(micro_size, n))
    bounds = [k * n // parts for k in range(parts + 1)]
    micro = [tuple(Tensor(x.data[lo:hi]) if isinstance(x, Tensor) else x for x in inputs)
             for lo, hi in zip(bounds, bounds[1:])]
    return micro, [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def _join_outputs(outputs, rows):
    """The micro-batches' outputs as one batch's (see PipelineEvalCell)."""
    first = outputs[0]
    if isinstance(first, (tuple, list)):
        return type(first)(_join([out[k] for out in outputs], rows) for k in range(len(first)))
    return _join(outputs, rows)


def _join(values, rows):
    xp = backend.get_array_module(values[0].data)
    if values[0].ndim == 0:
        # A 0-d output is a reduction over its micro-batch (a mean loss): the batch's mean weighs each
        # micro-batch by its rows (float64, so the equal-sized case is the plain mean of the means).
        total = sum(v.data.astype(numpy.float64) * n for v, n in zip(values, rows)) / sum(rows)
        return Tensor(xp.asarray(total).astype(values[0].data.dtype))
    return Tensor(xp.concatenate([v.data for v in values]))
