"""The parallel context: this rank's world (its communicator) and the auto-parallel settings.

A rank's state is a :class:`World`, held by the parallel runtime that ``init()`` installs
(minidl_parallel/world.py): for the process under mpirun, for one thread in the threads world
of tests. Everything here reads the calling thread's active runtime at the moment of the call,
so nothing is captured when a Model, dataset or optimizer is built. Settings made before
``init()`` live in the process's unjoined world and carry over into ``init()``'s.
"""
import os
import sys

from minidl.runtime import get_runtime

from . import optimizer_parallel_config, pipeline_config

__all__ = ["get_rank", "get_group_size", "get_local_rank", "get_local_rank_size",
           "get_communicator", "is_initialized", "launched_under_mpi", "ParallelMode", "set_auto_parallel_context",
           "get_auto_parallel_context", "reset_auto_parallel_context", "World"]


class ParallelMode:
    """The parallel modes of ``set_auto_parallel_context(parallel_mode=...)`` (MindSpore names)."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    MODES = (STAND_ALONE, DATA_PARALLEL, SEMI_AUTO_PARALLEL, AUTO_PARALLEL)


# MindSpore 2.10's strategy_ckpt_config and its defaults. Settings hold one such dict, replaced,
# never changed in place, so the copies that init() and reset make may share it.
STRATEGY_CKPT_DEFAULTS = {"load_file": "", "save_file": "", "only_trainable_params": True}
_DEFAULTS = {"parallel_mode": ParallelMode.STAND_ALONE, "gradients_mean": False, "parameter_broadcast": False,
             "device_num": None, "global_rank": None, "dataset_strategy": "data_parallel",
             "search_mode": "sharding_propagation", "grad_accumulation_step": 1, "gradient_compression": None,
             "gradient_predivide_factor": 1.0, "strategy_ckpt_config": STRATEGY_CKPT_DEFAULTS,
             "enable_parallel_optimizer": False, "parallel_optimizer_config": optimizer_parallel_config.DEFAULTS,
             "pipeline_stages": 1, "pipeline_config": pipeline_config.DEFAULTS}
# MindSpore's older keys: each reads and writes one entry of strategy_ckpt_config, as in MindSpore,
# where both spellings set the same value.
_STRATEGY_CKPT_ALIASES = {"strategy_ckpt_load_file": "load_file", "strategy_ckpt_save_file": "save_file"}
# MindSpore reads the entries of pipeline_config under their own names and sets them only through
# pipeline_config (get_auto_parallel_context("pipeline_scheduler"); there is no get of
# "pipeline_config" in MindSpore, which minidl adds).
_PIPELINE_CONFIG_READ_KEYS = tuple(pipeline_config.DEFAULTS)
DATASET_STRATEGIES = ("data_parallel", "full_batch")
SEARCH_MODES = ("sharding_propagation",)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _check_setting(key, value):
    if key == "parallel_mode":
        if value not in ParallelMode.MODES:
            raise ValueError(f"set_auto_parallel_context: parallel_mode must be one of {ParallelMode.MODES}, "
                             f"got {value!r}")
    elif key in ("gradients_mean", "parameter_broadcast", "enable_parallel_optimizer"):
        if not isinstance(value, bool):
            raise ValueError(f"set_auto_parallel_context: {key} must be True or False, got {value!r}")
    elif key == "grad_accumulation_step":
        if not _is_int(value) or value < 1:
            raise ValueError(f"set_auto_parallel_context: grad_accumulation_step must be an int >= 1, got {value!r}")
    elif key == "gradient_compression":
        from .compression import Compression
        Compression.resolve(value, "set_auto_parallel_context: gradient_compression")
    elif key == "gradient_predivide_factor":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            raise ValueError(f"set_auto_parallel_context: gradient_predivide_factor must be a finite number > 0, "
                             f"got {value!r}")
    elif key == "device_num":
        if value is not None and (not _is_int(value) or value < 1):
            raise ValueError(f"set_auto_parallel_context: device_num must be None or an int >= 1, got {value!r}")
    elif key == "dataset_strategy":
        if value not in DATASET_STRATEGIES:
            raise ValueError(f"set_auto_parallel_context: dataset_strategy must be one of {DATASET_STRATEGIES}, "
                             f"got {value!r}")
    elif key == "search_mode":
        if value not in SEARCH_MODES:
            raise ValueError(f"set_auto_parallel_context: search_mode must be one of {SEARCH_MODES} (the only "
                             f"search minidl implements), got {value!r}")
    elif key == "global_rank":
        if value is not None and (not _is_int(value) or value < 0):
            raise ValueError(f"set_auto_parallel_context: global_rank must be None or an int >= 0, got {value!r}")
    elif key == "pipeline_stages":
        pipeline_config.check_stages(value)


def _check_path(value, who):
    """A strategy file's path: a str (MindSpore's type) or an os.PathLike; "" means none."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise TypeError(f"{who} must be a str (a file path, or '' for none), got {type(value).__name__} {value!r}")
    return value


def _strategy_ckpt_update(key, value):
    """The entries of strategy_ckpt_config that ``key=value`` sets, checked (MindSpore's rules)."""
    who = "set_auto_parallel_context"
    if key in _STRATEGY_CKPT_ALIASES:
        return {_STRATEGY_CKPT_ALIASES[key]: _check_path(value, f"{who}: {key}")}
    if not isinstance(value, dict):
        raise TypeError(f"{who}: strategy_ckpt_config must be a dict with keys from {tuple(STRATEGY_CKPT_DEFAULTS)}, "
                        f"got {type(value).__name__} {value!r}")
    unknown = [k for k in value if k not in STRATEGY_CKPT_DEFAULTS]
    if unknown:
        raise ValueError(f"{who}: strategy_ckpt_config has unknown key(s) {unknown}; valid keys are "
                         f"{tuple(STRATEGY_CKPT_DEFAULTS)}")
    update = {}
    for name, entry in value.items():
        if name == "only_trainable_params":
            if not isinstance(entry, bool):
                raise TypeError(f"{who}: strategy_ckpt_config['only_trainable_params'] must be True or False, "
                                f"got {entry!r}")
            update[name] = entry
        else:
            update[name] = _check_path(entry, f"{who}: strategy_ckpt_config[{name!r}]")
    return update


def _check_key(key, who):
    if key in _PIPELINE_CONFIG_READ_KEYS:
        if who == "get_auto_parallel_context":
            return
        raise ValueError(f"{who}: {key!r} is set through pipeline_config (as in MindSpore), e.g. "
                         f"pipeline_config={pipeline_config.DEFAULTS}")
    if key not in _DEFAULTS and key not in _STRATEGY_CKPT_ALIASES:
        valid = tuple(_DEFAULTS) + tuple(_STRATEGY_CKPT_ALIASES)
        raise ValueError(f"{who}: unknown key {key!r}; valid keys are {valid}")


class World:
    """One rank's parallel state: its world communicator (None before init), backend and settings."""

    def __init__(self, comm=None, backend=None, settings=None):
        self.comm = comm
        self.backend = backend
        self.settings = dict(_DEFAULTS if settings is None else settings)


_unjoined = World()  # the process's settings before init()


def current_world():
    """The calling thread's World: its runtime's, else the process's unjoined one."""
    return getattr(get_runtime(), "world", None) or _unjoined


def launched_under_mpi():
    """True when this process is one of several started by mpirun/mpiexec (before any init)."""
    if any(int(os.environ.get(k, "1") or 1) > 1 for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")):
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1)


def is_initialized():
    """Whether init() has run (in this thread's context under the threads backend)."""
    return current_world().comm is not None


def get_communicator():
    """The communicator of this rank; init() must have run."""
    comm = current_world().comm
    if comm is None:
        raise RuntimeError("get_communicator: call minidl_parallel.init() first")
    return comm


def get_rank():
    """This rank in the world; 0 before init (a world of one)."""
    comm = current_world().comm
    return 0 if comm is None else comm.rank


def get_group_size():
    """The number of ranks in the world; 1 before init."""
    comm = current_world().comm
    return 1 if comm is None else comm.size


def get_local_rank():
    """This rank among the ranks on this machine (the GPU it uses under nccl); 0 before init."""
    comm = current_world().comm
    return 0 if comm is None else comm.local_rank


def get_local_rank_size():
    """The number of ranks on this machine; 1 before init."""
    comm = current_world().comm
    return 1 if comm is None else comm.local_size


# ---- auto-parallel context --------------------------------------------------------------

def set_auto_parallel_context(**kwargs):
    """Sets parallel_mode, gradients_mean, parameter_broadcast, device_num, global_rank,
    dataset_strategy, search_mode, grad_accumulation_step, gradient_compression,
    gradient_predivide_factor, strategy_ckpt_config (strategy_ckpt_save_file,
    strategy_ckpt_load_file), enable_parallel_optimizer, parallel_optimizer_config,
    pipeline_stages and/or pipeline_config.

    The last three configure DATA_PARALLEL's gradient reducer (Model.train's): reduce once per
    ``grad_accumulation_step`` steps (MindSpore's name; the steps in between only accumulate,
    and the optimizer runs on the reduced step), send gradients as ``gradient_compression``
    "fp16"/"bf16" (Horovod's Compression; None or "none": as they are), and Horovod's
    ``gradient_predivide_factor`` (minidl_parallel/grad_reducer.py).

SEMI_AUTO_PARALLEL and AUTO_PARALLEL turn on operator-level tensor parallelism (see
    minidl_parallel.tensor_parallel). ``dataset_strategy`` says what each rank's network is
    fed: "data_parallel" (the default): its slice of the global batch, global = local x ranks
    along dimension 0 (the script shards its dataset, ``num_shards=get_group_size(),
    shard_id=get_rank()``; the framework neither shards nor slices it); "full_batch": the
    whole batch on every rank, and the framework slices it, as MindSpore does.
    ``search_mode`` "sharding_propagation" (AUTO: ops without a strategy follow their inputs).

    ``enable_parallel_optimizer=True`` slices the weights and the optimizer state (and at level2
    the gradients) over the data-parallel ranks, with ``parallel_optimizer_config`` (MindSpore's
    dict: "optimizer_level", "parallel_optimizer_threshold", "optimizer_weight_shard_size",
    "gradient_accumulation_shard"; keys not given keep their value): see
    minidl_parallel/optimizer_parallel/. Under SEMI_AUTO/AUTO (MindSpore's modes) each
    tensor-parallel block is sliced over the ranks holding it; under DATA_PARALLEL (a minidl
    extension) each whole parameter over the world.

    ``strategy_ckpt_config`` (MindSpore's dict: "save_file", "load_file" and
    "only_trainable_params", defaults "", "" and True; keys not given keep their value) and the
    older ``strategy_ckpt_save_file`` / ``strategy_ckpt_load_file`` (the same two entries) save
    the tensor-parallel plan as a JSON file at a network's first call, or load one: operators
    without ``shard()`` take the file's strategy, and a parameter whose layout then differs from
    the file's raises (minidl_parallel/tensor_parallel/strategy_file.py).

    ``pipeline_stages`` (an int >= 1, default 1) cuts the world into that many pipeline stages, and
    ``pipeline_config`` (MindSpore's dict: "pipeline_scheduler", "1f1b" (the default) or "gpipe", and
    "pipeline_interleave", which must be False: minidl runs one stage per rank) chooses the schedule
    (minidl_parallel/pipeline_config.py). More than one stage needs SEMI_AUTO_PARALLEL or
    AUTO_PARALLEL, and a world size that pipeline_stages divides, checked when the pipeline runs.

    Settings are read when they are used (each op call, each ``Model.train``), so they may be
    set before or after ``init()`` and after a Model was built. Datasets are never sharded
    implicitly.

    Example:
        >>> set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True)
    """
    settings = {}
    strategy_ckpt = dict(current_world().settings["strategy_ckpt_config"])
    for key, value in kwargs.items():
        _check_key(key, "set_auto_parallel_context")
        if key == "strategy_ckpt_config" or key in _STRATEGY_CKPT_ALIASES:
            strategy_ckpt.update(_strategy_ckpt_update(key, value))  # only the entries given change
            settings["strategy_ckpt_config"] = strategy_ckpt
        elif key == "parallel_optimizer_config":  # only the entries given change
            settings[key] = optimizer_parallel_config.updated(
                settings.get(key, current_world().settings[key]), value)
        elif key == "pipeline_config":
            settings[key] = pipeline_config.checked(value)
        else:
            _check_setting(key, value)
            settings[key] = value
    current_world().settings.update(settings)  # all checked first: a bad value changes nothing


def get_auto_parallel_context(key):
    """One auto-parallel setting; device_num and global_rank default to the world's size and rank."""
    _check_key(key, "get_auto_parallel_context")
    if key in _STRATEGY_CKPT_ALIASES:
        return current_world().settings["strategy_ckpt_config"][_STRATEGY_CKPT_ALIASES[key]]
    if key in _PIPELINE_CONFIG_READ_KEYS:
        return current_world().settings["pipeline_config"][key]
    value = current_world().settings[key]
    if key in ("strategy_ckpt_config", "parallel_optimizer_config", "pipeline_config"):
        return dict(value)  # a copy: changing it must not change the setting
    if value is None and key == "device_num":
        return get_group_size()
    if value is None and key == "global_rank":
        return get_rank()
    return value


def reset_auto_parallel_context():
    """Back to the defaults (STAND_ALONE, gradients_mean=False, parameter_broadcast=False)."""
    current_world().settings = dict(_DEFAULTS)


def data_parallel_active():
    """True when this rank runs DATA_PARALLEL after init()."""
    world = current_world()
    return world.comm is not None and world.settings["parallel_mode"] == ParallelMode.DATA_PARALLEL


def pipeline_settings():
    """(stages, scheduler) of this rank's pipeline, from ``pipeline_stages`` and ``pipeline_config``.

    For the pipeline's executor, at use: raises RuntimeError when pipeline_stages > 1 and the
    parallel mode is not SEMI_AUTO_PARALLEL or AUTO_PARALLEL, the modes of MindSpore's pipeline (the
    setting itself never raises for it: the mode may be set after it). One stage is no pipeline and
    fits any mode. Before init() it reads the process's settings, as every getter here does.
    """
    settings = current_world().settings
    return pipeline_config.resolved(settings["parallel_mode"], settings["pipeline_stages"],
                                    settings["pipeline_config"])


def stage_layout(world_size, rank, stages=None):
    """(stage, stage_ranks, pipeline_ranks) of ``rank`` in a world of ``world_size`` ranks cut into
    ``stages`` pipeline stages (None: the ``pipeline_stages`` setting), in MindSpore's rank order:
    stage s holds the contiguous ranks [s*k, (s+1)*k) with k = world_size // stages. Raises
    ValueError when stages does not divide world_size. See pipeline_config.layout.
    """
    if stages is None:
        stages = current_world().settings["pipeline_stages"]
    return pipeline_config.layout(world_size, rank, stages)


def tensor_parallel_active():
    """True when this rank runs SEMI_AUTO_PARALLEL or AUTO_PARALLEL after init()."""
    world = current_world()
    return world.comm is not None and world.settings["parallel_mode"] in (ParallelMode.SEMI_AUTO_PARALLEL,
                                                                          ParallelMode.AUTO_PARALLEL)
