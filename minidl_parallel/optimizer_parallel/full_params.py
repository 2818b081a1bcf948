"""``summon_full_params(cell)``: a cell's sliced weights whole inside a block (PyTorch FSDP's name).

Under optimizer parallelism a rank holds its rows of each sliced weight between steps, and the
weights become whole when every rank calls a Cell (a collective). Work that one rank does alone
with the whole network (sampling text on rank 0, saving a plain checkpoint from rank 0, reading
``p.asnumpy()``) goes inside this block, which every rank enters together: the weights are
gathered on entry and given back as slices on exit.

Example:
    >>> with summon_full_params(net):      # on every rank
    ...     if get_rank() == 0:
    ...         text = net.generate(prompt, 300)
"""
import contextlib

from . import slices

__all__ = ["summon_full_params"]


@contextlib.contextmanager
def summon_full_params(cell):
    """Every sliced parameter of ``cell`` whole inside the block (a collective on entry); on exit each
    becomes this rank's rows of its value then, so changes made inside the block (a loaded
    checkpoint) are kept."""
    params = [p for _, p in cell.parameters_and_names() if slices.is_sliced(p)]
    placements = [p.placement for p in params]
    if params:
        for p, s, array in zip(params, placements, slices.gather_into(params, placements, phase="weights")):
            p.data = array
            p.placement = s.inner
    try:
        yield cell
    finally:
        for p, s in zip(params, placements):
            if not slices.is_sliced(p):
                p.data = slices.cut(p.data, s)
                p.placement = s
