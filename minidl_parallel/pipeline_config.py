"""``pipeline_stages`` and ``pipeline_config``: MindSpore 2.10's keys, checked when set; the pipeline
they describe resolved when it is used.

- ``pipeline_stages``: the number of stages the world is cut into by depth (int >= 1, default 1).
- ``pipeline_config``: {"pipeline_interleave": bool, "pipeline_scheduler": "1f1b" | "gpipe"}, default
  {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}.

Setting them checks only their own values. Whether they fit the rest of the state (the parallel
mode, the world size) is decided when a pipeline runs, by :func:`resolved` and :func:`layout`, as
every parallel setting is read when used: they may be set in any order, before or after ``init()``.

The setting holds one dict, replaced and never changed in place, so copies of the settings may share it.
"""
__all__ = ["DEFAULTS", "PIPELINE_MODES", "check_stages", "checked", "resolved", "layout"]

DEFAULTS = {"pipeline_interleave": False, "pipeline_scheduler": "1f1b"}
# MindSpore's spelling, lowercase only: set_auto_parallel_context(pipeline_config=...) refuses "1F1B".
# Here, not in pipeline/schedules.py (which imports it): context.py imports this module, and the
# pipeline package imports context.py.
SCHEDULERS = ("1f1b", "gpipe")
# The modes in which MindSpore runs a pipeline: SEMI_AUTO_PARALLEL and AUTO_PARALLEL. These are the
# values of context.ParallelMode, written out here because this file must not import context.py
# (context.py imports this file).
PIPELINE_MODES = ("semi_auto_parallel", "auto_parallel")
_WHO = "set_auto_parallel_context"


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_stages(value):
    """Raises unless ``value`` is a valid ``pipeline_stages``: an int >= 1 (bool refused, as MindSpore)."""
    if not _is_int(value):
        raise TypeError(f"{_WHO}: pipeline_stages must be an int >= 1, got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{_WHO}: pipeline_stages must be an int >= 1, got {value}")


def checked(value):
    """The config that ``pipeline_config=value`` sets, checked; a new dict.

    MindSpore requires both keys and raises a bare KeyError for a missing one; here
    ``pipeline_scheduler`` is required and named when missing, and ``pipeline_interleave`` may be
    left out: it means False, the only value minidl accepts. So every accepted value is a whole
    config, and nothing of the previous one is kept.
    """
    who = f"{_WHO}: pipeline_config"
    if not isinstance(value, dict):
        raise TypeError(f"{who} must be a dict with keys {tuple(DEFAULTS)}, e.g. {DEFAULTS}, "
                        f"got {type(value).__name__} {value!r}")
    unknown = [k for k in value if k not in DEFAULTS]
    if unknown:
        raise ValueError(f"{who} has unknown key(s) {unknown}; valid keys are {tuple(DEFAULTS)}")
    if "pipeline_scheduler" not in value:
        raise ValueError(f"{who} is missing the key 'pipeline_scheduler' (one of {SCHEDULERS}); valid keys are "
                         f"{tuple(DEFAULTS)}, e.g. {DEFAULTS}")
    interleave = value.get("pipeline_interleave", False)
    if not isinstance(interleave, bool):
        raise TypeError(f"{who}['pipeline_interleave'] must be True or False, got {interleave!r}")
    if interleave:
        raise ValueError(f"{who}['pipeline_interleave'] is True: interleaved pipelines (several virtual stages "
                         f"per rank) are not built in minidl; each rank runs one stage, so use False")
    scheduler = value["pipeline_scheduler"]
    if not isinstance(scheduler, str):
        raise TypeError(f"{who}['pipeline_scheduler'] must be one of {SCHEDULERS}, got "
                        f"{type(scheduler).__name__} {scheduler!r}")
    if scheduler not in SCHEDULERS:
        hint = (f" (names are lowercase, as MindSpore's: use {scheduler.lower()!r})"
                if scheduler.lower() in SCHEDULERS else " (the schedulers minidl builds)")
        raise ValueError(f"{who}['pipeline_scheduler'] must be one of {SCHEDULERS}{hint}, got {scheduler!r}")
    # MindSpore 2.10 refuses "gpipe" unless pipeline_interleave is True (its non-interleaved pipeline
    # runs 1F1B only). minidl's GPipe and 1F1B both run one stage per rank, with no interleaving
    # (minidl_parallel/pipeline/schedules.py), so the rule has no reason here and is not copied.
    return {"pipeline_interleave": False, "pipeline_scheduler": scheduler}


def resolved(parallel_mode, stages, config):
    """(stages, scheduler) of the pipeline that these settings describe, checked against the mode.

    This is called when a pipeline is used, never when a setting is made. A pipeline of more than one
    stage needs SEMI_AUTO_PARALLEL or AUTO_PARALLEL, as in MindSpore. One stage is no pipeline and
    fits any mode.
    """
    if stages > 1 and parallel_mode not in PIPELINE_MODES:
        raise RuntimeError(f"pipeline_stages is {stages}, which needs parallel_mode one of {PIPELINE_MODES} (as in "
                           f"MindSpore), got parallel_mode {parallel_mode!r}: call "
                           f"set_auto_parallel_context(parallel_mode=ParallelMode.SEMI_AUTO_PARALLEL)")
    return stages, config["pipeline_scheduler"]


def layout(world_size, rank, stages):
    """Where ``rank`` sits in a world of ``world_size`` ranks cut into ``stages`` pipeline stages.

    MindSpore's order (its DeviceManager): with k = world_size // stages ranks per stage, stage s
    holds the contiguous ranks [s*k, (s+1)*k), and a rank's pipeline group (the ranks that pass its
    micro-batches from stage to stage, one per stage) is {rank % k + j*k for j in range(stages)}.
    So the ranks of one stage are the data/tensor-parallel ranks of that stage.

    Returns:
        (stage, stage_ranks, pipeline_ranks): this rank's stage, the ranks of its stage and the
        ranks of its pipeline group, ordered by stage, each a tuple.

    Example:
        >>> layout(4, 3, 2)
        (1, (2, 3), (1, 3))
    """
    for name, value in (("world_size", world_size), ("pipeline_stages", stages)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"pipeline layout: {name} must be an int >= 1, got {value!r}")
    if world_size % stages:
        divisors = tuple(d for d in range(1, world_size + 1) if world_size % d == 0)
        raise ValueError(f"pipeline_stages is {stages}, which does not divide the world size {world_size}: "
                         f"each stage runs on world_size // pipeline_stages ranks; expected pipeline_stages "
                         f"one of {divisors}, or a world size that is a multiple of {stages}")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"pipeline layout: rank must be an int in [0, {world_size - 1}], got {rank!r}")
    per_stage = world_size // stages
    stage = rank // per_stage
    stage_ranks = tuple(range(stage * per_stage, (stage + 1) * per_stage))
    pipeline_ranks = tuple(rank % per_stage + j * per_stage for j in range(stages))
    return stage, stage_ranks, pipeline_ranks
