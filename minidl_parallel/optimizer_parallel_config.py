"""``parallel_optimizer_config``: MindSpore 2.10's keys, defaults and rules, checked when set.

- ``optimizer_level``: "level1" (weights and optimizer state kept as slices), "level2" (also the
  gradients: reduce-scattered, and accumulated as slices), "level3" (also the weights released
  after each cell's forward and gathered again for its backward).
- ``parallel_optimizer_threshold``: in KB; a parameter of fewer bytes stays whole (default 64).
- ``optimizer_weight_shard_size``: the ranks one parameter is sliced over (-1: every
  data-parallel rank); it must divide the world size.
- ``gradient_accumulation_shard``: accumulated gradients kept as slices; MindSpore ties it to
  level2 (level2 turns it on, level3 off, and it cannot be True with another level).

The setting holds one dict, replaced and never changed in place, so copies of the settings may share it.
"""
__all__ = ["DEFAULTS", "LEVELS", "updated"]

DEFAULTS = {"gradient_accumulation_shard": False, "parallel_optimizer_threshold": 64,
            "optimizer_weight_shard_size": -1, "optimizer_level": "level1"}
LEVELS = ("level1", "level2", "level3")
_WHO = "set_auto_parallel_context: parallel_optimizer_config"


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def updated(current, value):
    """The config after ``parallel_optimizer_config=value`` (keys not given keep their value)."""
    if not isinstance(value, dict):
        raise TypeError(f"{_WHO} must be a dict with keys from {tuple(DEFAULTS)}, got {type(value).__name__} {value!r}")
    unknown = [k for k in value if k not in DEFAULTS]
    if unknown:
        raise ValueError(f"{_WHO} has unknown key(s) {unknown}; valid keys are {tuple(DEFAULTS)}")
    new = dict(current)
    level = value.get("optimizer_level")
    if "gradient_accumulation_shard" in value:
        shard = value["gradient_accumulation_shard"]
        if not isinstance(shard, bool):
            raise TypeError(f"{_WHO}['gradient_accumulation_shard'] must be True or False, got {shard!r}")
        if shard and level is not None and level != "level2":
            raise ValueError(f"{_WHO}: gradient_accumulation_shard=True is optimizer_level 'level2' (MindSpore's "
                             f"rule), but optimizer_level={level!r} was given with it")
        new["gradient_accumulation_shard"] = shard
    if "parallel_optimizer_threshold" in value:
        threshold = value["parallel_optimizer_threshold"]
        if not _is_int(threshold) or threshold < 0:
            raise ValueError(f"{_WHO}['parallel_optimizer_threshold'] must be an int >= 0 (KB), got {threshold!r}")
        new["parallel_optimizer_threshold"] = threshold
    if "optimizer_weight_shard_size" in value:
        size = value["optimizer_weight_shard_size"]
        if not _is_int(size) or (size != -1 and size < 1):
            raise ValueError(f"{_WHO}['optimizer_weight_shard_size'] must be -1 (every data-parallel rank) or an "
                             f"int >= 1, got {size!r}")
        new["optimizer_weight_shard_size"] = size
    if level is not None:
        if level not in LEVELS:
            raise ValueError(f"{_WHO}['optimizer_level'] must be one of {LEVELS}, got {level!r}")
        if new["gradient_accumulation_shard"] and level != "level2":
            raise ValueError(f"{_WHO}: gradient_accumulation_shard is True, which needs optimizer_level 'level2', "
                             f"got {level!r}; set gradient_accumulation_shard=False first")
        if level == "level2":
            new["gradient_accumulation_shard"] = True
        if level == "level3":
            new["gradient_accumulation_shard"] = False
        new["optimizer_level"] = level
    return new
