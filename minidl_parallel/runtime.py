"""The parallel runtime: minidl's one seam, answered for one rank of a parallel world.

``init()`` (minidl_parallel/world.py) installs a :class:`ParallelRuntime` around this rank's
:class:`~minidl_parallel.context.World` and ``release()`` removes it. minidl asks it at the
moment of use, and every answer reads the world's settings then, so a mode set after a Model
was built is the mode its next ``train`` runs in:

- operators and Cells run through the tensor-parallel dispatcher under SEMI_AUTO_PARALLEL /
  AUTO_PARALLEL, and locally otherwise;
- ``Model.train`` gets a DistributedGradReducer under DATA_PARALLEL;
- the rank and world size come from the world's communicator;
- sharded tensors become whole (checkpoints) and whole values become blocks (loading,
  optimizer state) through tensor_parallel/parameters.py;
- metric sums, shared decisions and gathered small values are small collectives over the world;
- training steps are collective (``trains_in_lockstep``) in every mode but STAND_ALONE.
"""
import numpy

from minidl.runtime import Runtime

from . import context
from .grad_reducer import DistributedGradReducer
from .tensor_parallel import dispatch, parameters

__all__ = ["ParallelRuntime"]


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

    @property
    def intercepts_ops(self):
        return self._tensor_parallel()

    def _tensor_parallel(self):
        return self.world.settings["parallel_mode"] in (context.ParallelMode.SEMI_AUTO_PARALLEL,
                                                        context.ParallelMode.AUTO_PARALLEL)

    def rank(self):
        return self.world.comm.rank

    def group_size(self):
        return self.world.comm.size

    def call_op(self, prim, args):
        if self._tensor_parallel():
            return dispatch.run_op(prim, args)
        return prim.apply(*args)

    def call_cell(self, cell, args, kwargs):
        if self._tensor_parallel():
            return dispatch.run_cell(cell, args, kwargs)
        return cell.construct(*args, **kwargs)

    def grad_reducer(self, parameters):
        settings = self.world.settings
        if settings["parallel_mode"] != context.ParallelMode.DATA_PARALLEL:
            return None
        return DistributedGradReducer(parameters, mean=settings["gradients_mean"],
                                      parameter_broadcast=settings["parameter_broadcast"],
                                      backward_passes_per_step=settings["grad_accumulation_step"],
                                      compression=settings["gradient_compression"],
                                      gradient_predivide_factor=settings["gradient_predivide_factor"])

    def full_value(self, tensor):
        return parameters.whole(tensor, self.world.comm, dispatch.groups())

    def local_value(self, tensor, value):
        return parameters.block_of(tensor, value, self.world.comm.rank)

    def follow(self, param, buffer):
        return parameters.follow(param, buffer, self.world.comm.rank)

    def sum_over_ranks(self, values):
        values = numpy.ascontiguousarray(values, dtype=numpy.float64)
        return numpy.asarray(self.world.comm.allreduce(values, "sum"))

    def agree(self, value):
        mine = numpy.array([int(value)], dtype=numpy.int64)
        decided = int(numpy.asarray(self.world.comm.broadcast(mine, 0))[0])
        return type(value)(decided) if isinstance(value, (bool, int)) else decided

    def gather(self, value):
        return list(self.world.comm.allgather_object(value))

    def trains_in_lockstep(self):
        return self.world.comm.size > 1 and self.world.settings["parallel_mode"] != context.ParallelMode.STAND_ALONE

    def __repr__(self):
        return (f"<ParallelRuntime {self.world.backend}: rank {self.rank()} of {self.group_size()}, "
                f"{self.world.settings['parallel_mode']}>")
