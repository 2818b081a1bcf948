"""The parallel runtime: minidl's one seam, answered for one rank of a parallel world.

``init()`` (minidl_parallel/world.py) installs a :class:`ParallelRuntime` around this rank's
:class:`~minidl_parallel.context.World` and ``release()`` removes it. minidl asks it at the
moment of use, and every answer reads the world's settings then, so a mode set after a Model
was built is the mode its next ``train`` runs in:

- operators and Cells run through the tensor-parallel dispatcher under SEMI_AUTO_PARALLEL /
  AUTO_PARALLEL, and locally otherwise;
- ``Model.train`` gets a DistributedGradReducer under DATA_PARALLEL (an OptimizerParallelReducer
  with ``enable_parallel_optimizer``, whose sliced weights the outermost Cell call gathers);
- the rank and world size come from the world's communicator;
- sharded tensors become whole (checkpoints) and whole values become blocks (loading,
  optimizer state) through tensor_parallel/parameters.py;
- metric sums, shared decisions and gathered small values are small collectives over the world;
- training steps are collective (``trains_in_lockstep``) in every mode but STAND_ALONE.
"""
import threading
import weakref

import numpy

from minidl.backend import get_array_module
from minidl.runtime import Runtime
from minidl.tensor import Parameter, Tensor

from . import context
from .grad_reducer import DistributedGradReducer
from .optimizer_parallel import level3, slices
from .optimizer_parallel.reducer import OptimizerParallelReducer
from .pipeline_groups import stage_group
from .tensor_parallel import dispatch, parameters

__all__ = ["ParallelRuntime"]


def _apply(prim, args):
    return prim.apply(*args)


def _construct(cell, args, kwargs):
    return cell.construct(*args, **kwargs)


def _holding(array, placement):
    """A Tensor holding ``array`` as the block ``placement`` describes (for the tensor-parallel helpers)."""
    t = Tensor(array)
    t.placement = placement
    return t


class ParallelRuntime(Runtime):
    """The runtime of one rank.

    Args:
        world: this rank's :class:`~minidl_parallel.context.World` (communicator and settings).
        scope: where it is installed: "process" or "thread" (see ``minidl.runtime.set_runtime``).
    """

    name = "parallel"

    def __init__(self, world, scope="process"):
        self.world = world
        self.scope = scope
        self._slicing = weakref.WeakSet()  # optimizer-parallel reducers whose weights Cell calls gather
        self._cell_depth = threading.local()

    @property
    def intercepts_ops(self):
        return self._tensor_parallel()

    def _tensor_parallel(self):
        settings = self.world.settings
        # A pipeline places its own work, stage by stage (minidl_parallel/pipeline), and runs the
        # dispatcher itself inside each stage, over the stage's ranks (pipeline/stage_cut.py).
        return (settings["parallel_mode"] in (context.ParallelMode.SEMI_AUTO_PARALLEL, context.ParallelMode.AUTO_PARALLEL)
                and settings["pipeline_stages"] == 1)

    def rank(self):
        return self.world.comm.rank

    def group_size(self):
        return self.world.comm.size

    def call_op(self, prim, args):
        run = dispatch.run_op if self._tensor_parallel() else _apply
        if self._slicing:
            # (Only trainable weights: a reduced gradient's slice, clip_by_global_norm's input, stays one.)
            sliced = [a for a in args if type(a) is Parameter and a.requires_grad and slices.is_sliced(a)]
            if sliced:  # a weight read outside the cell that owns it (a tied head at level3): whole for this op
                return level3.with_whole(sliced, run, (prim, args), self._slicing)
        return run(prim, args)

    def call_cell(self, cell, args, kwargs):
        run = dispatch.run_cell if self._tensor_parallel() else _construct
        if not self._slicing:
            return run(cell, args, kwargs)
        if any(reducer.level == "level3" for reducer in self._slicing):
            if run is dispatch.run_cell and dispatch.outermost():
                return run(cell, args, kwargs)  # (the dispatcher's outermost call: inputs tagged, outputs whole)
            return level3.call_cell(cell, args, kwargs, self._slicing)
        depth = getattr(self._cell_depth, "value", 0)
        if depth == 0:  # the outermost call: sliced weights become whole for this step's forward and backward
            for reducer in list(self._slicing):
                reducer.gather_weights()
        self._cell_depth.value = depth + 1
        try:
            return run(cell, args, kwargs)
        finally:
            self._cell_depth.value = depth

    def grad_reducer(self, parameters):
        settings = self.world.settings
        if settings["enable_parallel_optimizer"] and self._tensor_parallel():
            reducer = OptimizerParallelReducer(parameters, settings["parallel_optimizer_config"], tensor_parallel=True)
            self._slicing.add(reducer)
            return reducer
        if settings["parallel_mode"] != context.ParallelMode.DATA_PARALLEL:
            return None
        if settings["enable_parallel_optimizer"]:
            reducer = OptimizerParallelReducer(
                parameters, settings["parallel_optimizer_config"], mean=settings["gradients_mean"],
                parameter_broadcast=settings["parameter_broadcast"],
                backward_passes_per_step=settings["grad_accumulation_step"],
                compression=settings["gradient_compression"],
                gradient_predivide_factor=settings["gradient_predivide_factor"])
            self._slicing.add(reducer)
            return reducer
        return DistributedGradReducer(parameters, mean=settings["gradients_mean"],
                                      parameter_broadcast=settings["parameter_broadcast"],
                                      backward_passes_per_step=settings["grad_accumulation_step"],
                                      compression=settings["gradient_compression"],
                                      gradient_predivide_factor=settings["gradient_predivide_factor"])

    def full_value(self, tensor):
        if slices.is_sliced(tensor):
            inner = tensor.placement.inner
            array = slices.whole(tensor)  # the rows gathered: whole, or the tensor-parallel block
            if inner is None:
                return array
            tensor = _holding(array, inner)
        if tensor.placement is None:
            return tensor.data
        return parameters.whole(tensor, self._cut_over(), dispatch.groups())

    def local_value(self, tensor, value):
        if slices.is_sliced(tensor):
            inner = tensor.placement.inner
            if inner is not None:  # the whole value's tensor-parallel block first, then its rows
                value = parameters.block_of(_holding(tensor.data, inner), value, self.world.comm.rank)
            return slices.block_of(tensor, value)
        if tensor.placement is None:
            return value
        return parameters.block_of(tensor, value, self._cut_over().rank)

    def follow(self, param, buffer):
        if slices.is_sliced(param):
            return slices.follow(param, buffer, self.world.comm.rank)
        return parameters.follow(param, buffer, self._cut_over().rank)

    def _cut_over(self):
        """The ranks a tensor-parallel block's layout spans: the world, or under a pipeline the stage's
        ranks (a stage's cells are cut over its own group)."""
        stages = self.world.settings["pipeline_stages"]
        return self.world.comm if stages == 1 else stage_group(self.world.comm, stages)[1]

    def sum_over_slices(self, tensors, partials, who):
        sliced = [i for i, t in enumerate(tensors) if slices.is_sliced(t)]
        for t in tensors:
            if t.placement is not None and (not slices.is_sliced(t) or t.placement.inner is not None):
                raise ValueError(f"{who}: parameter {getattr(t, 'name', None)!r} of shape {tuple(t.shape)} is sharded "
                                 f"(this rank holds a tensor-parallel block of shape {tuple(t.data.shape)}, which "
                                 f"may repeat on several ranks: its sum over ranks is not defined)")
        if not sliced:
            return partials
        # One all-reduce of the sliced tensors' partial sums (every sliced tensor shares the shard group).
        xp = get_array_module(tensors[sliced[0]].data)
        parts = xp.stack([xp.asarray(partials[i], dtype=xp.float64) for i in sliced])
        summed = tensors[sliced[0]].placement.comm.allreduce(parts, "sum")
        out = list(partials)
        for k, i in enumerate(sliced):
            out[i] = summed[k]
        return out

    def sum_over_ranks(self, values):
        values = numpy.ascontiguousarray(values, dtype=numpy.float64)
        return numpy.asarray(self.world.comm.allreduce(values, "sum"))

    def agree(self, value):
        mine = numpy.array([int(value)], dtype=numpy.int64)
        decided = int(numpy.asarray(self.world.comm.broadcast(mine, 0))[0])
        return type(value)(decided) if isinstance(value, (bool, int)) else decided

    def gather(self, value):
        return list(self.world.comm.allgather_object(value))

    def reports_loss(self):
        # The stages of one pipeline report the same loss (the last stage's): the first stage's ranks print
        # it, ranks 0..k-1, so the lines are those of k data-parallel replicas.
        stages = self.world.settings["pipeline_stages"]
        return stages == 1 or context.stage_layout(self.world.comm.size, self.world.comm.rank, stages)[0] == 0

    def trains_in_lockstep(self):
        return self.world.comm.size > 1 and self.world.settings["parallel_mode"] != context.ParallelMode.STAND_ALONE

    def __repr__(self):
        return (f"<ParallelRuntime {self.world.backend}: rank {self.rank()} of {self.group_size()}, "
                f"{self.world.settings['parallel_mode']}>")

    def checkpoint_segment(self, network):
        # Under a pipeline this rank's copies of the other stages' parameters are stale: its file holds
        # its stage's part (minidl_parallel/pipeline/checkpoint.py). pipeline_stages is inert in the
        # modes that run no pipeline, so a checkpoint there holds everything, as before.
        settings = self.world.settings
        stages = settings["pipeline_stages"]
        if stages == 1 or settings["parallel_mode"] not in (context.ParallelMode.SEMI_AUTO_PARALLEL,
                                                             context.ParallelMode.AUTO_PARALLEL):
            return None
        from .pipeline.checkpoint import stage_segment  # (at use: only pipelined runs need it)
        stage, _, _ = context.stage_layout(self.world.comm.size, self.world.comm.rank, stages)
        return stage_segment(network, stages, stage)
