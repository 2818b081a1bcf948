"""The sub-communicators of a pipeline, split from the world once and shared by everything that asks.

A world of n ranks in p stages has, per rank, a *stage group* (the n // p ranks of its stage: its
data-parallel replicas, or the ranks its shard() strategies cut over) and a *pipeline group* (one rank of
each stage: the ranks its activations travel through). The executor, PipelineCell and the parallel runtime
(checkpoints gather a stage's sharded parameters over its stage group) must use the same objects: the
tensor-parallel dispatcher caches its own groups per communicator.
"""
import weakref

from . import context

__all__ = ["group_of", "stage_group", "pipeline_group"]

_split = weakref.WeakKeyDictionary()  # world communicator -> {ranks: its sub-communicator}


def group_of(world, ranks):
    """The communicator over ``ranks`` of ``world`` (``world`` itself for all of them); made by
    ``world.split`` at the first call, which only the members make, together."""
    ranks = tuple(ranks)
    if ranks == tuple(range(world.size)):
        return world
    groups = _split.setdefault(world, {})
    if ranks not in groups:
        groups[ranks] = world.split(list(ranks))
    return groups[ranks]


def stage_group(world, stages):
    """(this rank's stage, the communicator of its stage's ranks)."""
    stage, stage_ranks, _ = context.stage_layout(world.size, world.rank, stages)
    return stage, group_of(world, stage_ranks)


def pipeline_group(world, stages):
    """(this rank's stage, the communicator of its pipeline: one rank per stage, group rank = stage)."""
    stage, _, pipeline_ranks = context.stage_layout(world.size, world.rank, stages)
    return stage, group_of(world, pipeline_ranks)
