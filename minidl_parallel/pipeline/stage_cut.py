"""Tensor parallelism inside a pipeline stage: the stage's cells cut over the stage's ranks.

When the network has ``shard()`` strategies, every stage runs its cells through the tensor-parallel
dispatcher, whose world under a pipeline is the stage's group (device_num // pipeline_stages ranks),
as MindSpore cuts each stage over its own devices. The pipeline's edges speak one layout, the one
``dataset_strategy`` gives a network's inputs over those ranks (each rank its block of the batch, or
the whole batch with "full_batch"):

- a stage's micro-batch inputs and the activation it receives are tagged with it;
- the activation a stage sends is first redistributed to it, so rank k of one stage hands its block
  to rank k of the next (the pipeline group pairs them), whatever cut the last operator left;
- the last stage's loss is made whole (its partial sums reduced), equal on the stage's ranks.

The dispatcher's layouts then reduce every parameter's gradient over the ranks that computed parts
of it (the batch axis included), so the stage's data-parallel ranks need no further reduction: the
gradients are those of the loss of the whole micro-batch, as one device computes them.
"""
from minidl.runtime import LOCAL, Layered

from ..tensor_parallel import dispatch
from ..tensor_parallel.layout import Layout
from ..tensor_parallel.tensors import get_layout, tag_input

__all__ = ["StageCut", "NO_CUT"]


class _Dispatched(Layered):
    """Runs a stage's ops and cells through the dispatcher (its world set by ``StageCut.running``); the
    rest (the rank, the world and its settings) is the parallel runtime's it wraps."""

    def call_op(self, prim, args):
        return dispatch.run_op(prim, args)

    def __init__(self, inner, network):
        super().__init__(inner)
        self.network = network  # (what the operators' paths in the dispatcher's messages start from)

    def call_cell(self, cell, args, kwargs):
        return dispatch.run_cell(cell, args, kwargs, root=self.network)


class StageCut:
    """The cells of ``network``'s stage cut over ``comm`` (the stage's ranks) with ``dataset_strategy``;
    ``parallel`` is this rank's parallel runtime."""

    def __init__(self, network, comm, dataset_strategy, parallel):
        self.comm, self.dataset_strategy = comm, dataset_strategy
        self.runtime = _Dispatched(parallel, network)

    def tag(self, tensor):
        """``tensor`` (a micro-batch input, a received activation) tagged as the edge's layout."""
        tag_input(tensor, self.dataset_strategy, self.comm.size)
        return tensor

    def to_edge(self, tensor):
        """``tensor`` in the edge's layout (differentiable: its gradient comes back in that layout)."""
        ndim = len(get_layout(tensor)[1]) if get_layout(tensor) is not None else tensor.data.ndim
        if self.dataset_strategy == "data_parallel" and ndim > 0:
            edge = Layout.batch_split(ndim, self.comm.size)
        else:
            edge = Layout.replicated(ndim, self.comm.size)
        return dispatch.redistribute(tensor, edge)

    def whole(self, tensor):
        """``tensor`` with its partial sums reduced (the loss: whole on every rank of the stage)."""
        entry = get_layout(tensor)
        if entry is None or not entry[0].partial:
            return tensor
        return dispatch.redistribute(tensor, entry[0].without_partial())


class _NoCut:
    """A stage whose ranks are data-parallel replicas: its cells run locally, tensors pass as they are."""

    runtime = LOCAL

    def tag(self, tensor):
        return tensor

    to_edge = whole = tag


NO_CUT = _NoCut()
