"""Uneven inputs: training on with the ranks that still have data (PyTorch DDP's ``Join``).

Under data parallelism every step all-reduces the gradients, so every rank must run the same
number of steps: a rank whose data ends first stops calling the all-reduce and the others
wait for it forever. ``Model.train`` therefore agrees the step counts at its start and raises
when they differ; a join block is the way to train on anyway:

    reducer = DistributedGradReducer(opt.parameters, mean=True)
    with mp.join(reducer, opt):            # or reducer.join(opt)
        for x, y in my_batches:            # each rank its own number of batches
            loss, grads = grad_fn(x, y)
            opt(reducer(grads))

``Model.train(..., uneven_inputs=True)`` opens one such block per epoch.

The protocol, on the reducer's communicator:

- inside the block, each reduction first all-reduces one number, 1: "this rank still has data"
  (one small collective per step, only inside join blocks);
- a rank leaving the block (its loop ended) "shadows" the others: it votes 0 and, while the
  sum of the votes says some rank still has data, takes part in that step's gradient
  all-reduce with zero gradients and applies ``optimizer`` to the reduced gradients, exactly
  as the ranks with data do, so every rank's parameters and optimizer state stay identical;
- once every rank has left, the votes sum to 0 and every rank leaves the block together.

With ``gradients_mean`` the divisor stays the world size (as DDP's default): a step in which
only k of n ranks had data adds the k ranks' gradients and divides by n, the zeros of the
finished ranks averaged in. Pass ``mean=False`` and scale yourself for another divisor.

Only the reducer's collectives are shadowed: its reduction, and a reducer's own gathers of the
step (``shadow_step``: optimizer parallelism's level3 replays each cell's gathers as the rank's own
last step made them). Other collectives of a step cannot be: SyncBatchNorm
statistics, tensor-parallel operators, a metric or checkpoint decision taken inside the step
(``ModelCheckpoint(save_checkpoint_seconds=...)``) would meet a finished rank's vote instead,
so they are not supported inside a join block. Step callbacks run only on the ranks that ran
the step. An exception inside the block leaves at once without shadowing (the other ranks then
fail at their next collective, under the communicator's timeout).
"""
import numpy

__all__ = ["Join", "join", "count_ranks_with_data"]


class Join:
    """The join block of one reducer (see the module docstring).

    Args:
        reducer: a :class:`~minidl_parallel.grad_reducer.DistributedGradReducer`.
        optimizer: called with the reduced gradients of each shadowed step (None: the
            finished rank's parameters are left as they are, and drift from the others').

    Attributes:
        shadowed_steps: the steps this rank took part in with zero gradients, after its data ended.
    """

    def __init__(self, reducer, optimizer=None):
        if not (callable(getattr(reducer, "agree_on_parameters", None)) and hasattr(reducer, "_joined")):
            raise TypeError(f"join: reducer must be a DistributedGradReducer, got {type(reducer).__name__}")
        if optimizer is not None and not callable(optimizer):
            raise TypeError(f"join: optimizer must be an Optimizer (callable with the gradients) or None, got "
                            f"{type(optimizer).__name__}")
        self.reducer = reducer
        self.optimizer = optimizer
        self.shadowed_steps = 0

    def __enter__(self):
        if self.reducer._joined is not None:
            raise RuntimeError("join: this reducer is already inside a join block")
        self.reducer._joined = self
        return self

    def __exit__(self, exc_type, exc, tb):
        reducer = self.reducer
        try:
            if exc_type is None:
                self._shadow_until_every_rank_is_done()
        finally:
            reducer._joined = None
            reducer._vote_before_reducing = True
        return False

    def _shadow_until_every_rank_is_done(self):
        reducer = self.reducer
        if reducer._pending is not None:
            raise RuntimeError("join: the block ended with a reduction in flight; call reducer.finish() inside it")
        zeros = (None,) * len(reducer.parameters)
        while True:
            reducer.agree_on_parameters()  # a rank that had no data at all checks here, with the others
            if count_ranks_with_data(reducer.comm, False) == 0:
                return
            reducer._vote_before_reducing = False
            try:
                shadow = getattr(reducer, "shadow_step", None)
                if shadow is not None:  # (a reducer whose step has more collectives than its reduction)
                    shadow()
                grads = reducer(zeros)
            finally:
                reducer._vote_before_reducing = True
            if self.optimizer is not None:
                self.optimizer(grads)
            self.shadowed_steps += 1


def count_ranks_with_data(comm, has_data):
    """The number of ranks that still have data: this rank's vote (``has_data``), all-reduced.

    One one-number all-reduce, made by every rank inside a join block before each reduction
    (the reducer, with True) and by a rank shadowing its peers (with False).
    """
    return int(round(float(comm.allreduce(numpy.array([float(has_data)]), "sum")[0])))


def join(reducer, optimizer=None):
    """``with join(reducer, optimizer):`` trains on with uneven inputs (see :class:`Join`)."""
    return Join(reducer, optimizer)
