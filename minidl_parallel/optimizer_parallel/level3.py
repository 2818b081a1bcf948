"""level3: a cell's sliced weights are whole only while that cell runs, in forward and in backward.

MindSpore's level3 releases the weights gathered for forward and gathers them again before
backward. In minidl the ops of a cell keep what their backward reads (the weights among it), so
releasing a weight after forward frees nothing unless the cell keeps nothing: each cell that owns
sliced parameters runs as a recomputed cell (minidl/nn/recompute.py) whose forward and whose
re-run in backward each gather the cell's weights and give them back when they end. A step
therefore all-gathers every sliced weight twice (forward and backward) and reduce-scatters its
gradient once: 1.5x an all-reduce, as ZeRO-3; it also runs those cells' forward twice (the cost
recompute states), which MindSpore's graph compiler avoids.

Under SEMI_AUTO / AUTO the outermost Cell call stays the dispatcher's (it tags the inputs) and
the cells below it run so, gathering their tensor-parallel blocks.

A weight read by an op outside the cell that owns it (GPT's head tied to the token embedding,
read in the GPT cell's construct) is gathered for that op alone (:func:`with_whole`, from the
runtime's ``call_op``), at any level: the op keeps the whole array for its backward.
"""
import contextlib

from minidl.nn.recompute import run_recomputed

from . import slices

__all__ = ["call_cell", "with_whole"]


def _own_sliced(cell):
    """The cell's own parameters (not its sub-cells') now held as slices."""
    return [p for p in cell.__dict__.get("_params", {}).values() if slices.is_sliced(p)]


@contextlib.contextmanager
def _gathered(params, reducer=None):
    """The params whole inside the block, their slices back (the same arrays) after it.

    In a join block (uneven inputs) ``reducer``, the level3 reducer of these parameters, votes
    before the step's first gather and records every gather of the step, which a rank whose data
    ended replays with its slices (``OptimizerParallelReducer.shadow_step``)."""
    if reducer is not None:
        reducer.before_gather(params)
    placements = [p.placement for p in params]
    kept = [p.data for p in params]
    for p, s, array in zip(params, placements, slices.gather_into(params, placements, phase="weights")):
        p.data = array
        p.placement = s.inner
    try:
        yield
    finally:
        for p, s, array in zip(params, placements, kept):
            p.data = array
            p.placement = s


def _owner(params, reducers):
    """The level3 reducer among ``reducers`` that slices ``params`` (None: no join block needs it)."""
    return next((r for r in reducers if r.level == "level3" and r.owns(params[0])), None)


def with_whole(params, fn, args, reducers=()):
    """``fn(*args)`` with the sliced ``params`` whole while it runs."""
    with _gathered(params, _owner(params, reducers)):
        return fn(*args)


def call_cell(cell, args, kwargs, reducers=()):
    """Runs ``cell`` with its sliced weights gathered for its forward and again for its backward."""
    own = _own_sliced(cell)
    if not own:
        return cell.construct(*args, **kwargs)
    reducer = _owner(own, reducers)
    # (The weights go back to their rows before the re-run's backward: its ops read the arrays they
    # saved, and autograd takes a sliced weight's whole, or block-shaped, gradient.)
    return run_recomputed(cell, args, kwargs, lambda: (_gathered(own, reducer), _gathered(own, reducer)))
