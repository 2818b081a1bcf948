"""The parallel context: which communicator this rank uses and the auto-parallel settings.

The state is process-global, except under the threads backend where each thread-rank of
:func:`minidl_parallel.comm.threads.run_threads` has its own (bound to the thread).

``init`` under mpirun also
- installs a ``sys.excepthook`` that prints the failing rank's traceback and calls
  ``MPI.COMM_WORLD.Abort(1)``, so one rank's exception ends the whole job at once instead
  of leaving the others hanging in a collective (as ChainerMN's global_except_hook);
- limits BLAS threads to ``max(1, cores // local ranks)`` through threadpoolctl when it is
  installed (optional; skipped when OMP_NUM_THREADS is set), and minidl's intra-op threads
  (``minidl.set_num_threads``) to the same unless MINIDL_NUM_THREADS is set, so 8 ranks on
  a small machine do not thrash.

When the mode is DATA_PARALLEL (set before or after ``init``), ``minidl.train`` builds
Models with a DistributedGradReducer and ``minidl.dataset`` sources shard by rank: the
registered factory and shards provider read the calling thread's context when called.
"""
import os
import sys
import threading
import traceback

import minidl

__all__ = ["init", "release", "get_rank", "get_group_size", "get_local_rank", "get_local_rank_size",
           "get_communicator", "is_initialized", "launched_under_mpi", "ParallelMode", "set_auto_parallel_context",
           "get_auto_parallel_context", "reset_auto_parallel_context"]


class ParallelMode:
    """The parallel modes of ``set_auto_parallel_context(parallel_mode=...)`` (MindSpore names)."""

    STAND_ALONE = "stand_alone"
    DATA_PARALLEL = "data_parallel"
    SEMI_AUTO_PARALLEL = "semi_auto_parallel"
    AUTO_PARALLEL = "auto_parallel"
    MODES = (STAND_ALONE, DATA_PARALLEL, SEMI_AUTO_PARALLEL, AUTO_PARALLEL)


_DEFAULTS = {"parallel_mode": ParallelMode.STAND_ALONE, "gradients_mean": False, "parameter_broadcast": False,
             "device_num": None, "global_rank": None, "dataset_strategy": "data_parallel",
             "search_mode": "sharding_propagation"}
DATASET_STRATEGIES = ("data_parallel", "full_batch")
SEARCH_MODES = ("sharding_propagation",)


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _check_setting(key, value):
    if key == "parallel_mode":
        if value not in ParallelMode.MODES:
            raise ValueError(f"set_auto_parallel_context: parallel_mode must be one of {ParallelMode.MODES}, "
                             f"got {value!r}")
    elif key in ("gradients_mean", "parameter_broadcast"):
        if not isinstance(value, bool):
            raise ValueError(f"set_auto_parallel_context: {key} must be True or False, got {value!r}")
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


def _check_key(key, who):
    if key not in _DEFAULTS:
        raise ValueError(f"{who}: unknown key {key!r}; valid keys are {tuple(_DEFAULTS)}")


class _State:
    def __init__(self, comm=None, backend=None):
        self.comm = comm
        self.backend = backend
        self.settings = dict(_DEFAULTS)


_global = _State()
_tls = threading.local()
_hooks = {"excepthook": None, "blas": None}


def _state():
    return getattr(_tls, "state", None) or _global


def _bind_thread(comm):
    """Gives the calling thread its own context around ``comm`` (used by run_threads)."""
    _tls.state = _State(comm, "threads")
    _register_rank_provider()
    _register_data_parallel()


def _unbind_thread():
    _tls.state = None


# ---- init / release ---------------------------------------------------------------------

def launched_under_mpi():
    """True when this process is one of several started by mpirun/mpiexec (before any init)."""
    return _under_mpirun()


def _under_mpirun():
    if any(int(os.environ.get(k, "1") or 1) > 1 for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE")):
        return True
    mpi = sys.modules.get("mpi4py.MPI")
    return bool(mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1)


def _default_backend():
    from minidl.backend import get_device_target
    if get_device_target() == "GPU":
        return "nccl"
    return "mpi" if _under_mpirun() else "local"


def init(backend_name=None):
    """Joins the parallel world and returns its communicator.

    Args:
        backend_name: "nccl" (one GPU per process, under mpirun), "mpi" (NumPy arrays over
            mpi4py), "threads" (inside run_threads: the thread's rank; elsewhere a world of
            one), "local" (a world of one), or None: nccl when minidl's device target is GPU,
            else mpi when launched by mpirun, else local.

    Calling it again with the same backend returns the same communicator.
    """
    from .comm import BACKENDS, create_communicator
    if backend_name is not None and backend_name not in BACKENDS:
        raise ValueError(f"init: unknown backend_name {backend_name!r}; expected one of {BACKENDS} or None")
    st = _state()
    if st.comm is not None:
        if backend_name is not None and backend_name != st.backend:
            raise RuntimeError(f"init: already initialised with backend {st.backend!r}; call release() before "
                               f"init({backend_name!r})")
        return st.comm
    name = backend_name or _default_backend()
    st.comm = create_communicator(name)
    st.backend = name
    if name in ("mpi", "nccl"):
        _install_except_hook(st.comm)
        _limit_blas_threads(st.comm.local_size)
    _register_rank_provider()
    _register_data_parallel()
    return st.comm


def release():
    """Leaves the parallel world: frees the communicator and undoes what init installed."""
    st = _state()
    if st.comm is not None:
        st.comm.release()
    st.comm, st.backend = None, None
    if st is _global:
        if _hooks["excepthook"] is not None and sys.excepthook is _hooks["excepthook"]:
            sys.excepthook = sys.__excepthook__
        _hooks["excepthook"] = None
        if _hooks["blas"] is not None:
            _hooks["blas"].restore_original_limits()
            _hooks["blas"] = None


def is_initialized():
    """Whether init() has run (in this thread's context under the threads backend)."""
    return _state().comm is not None


def get_communicator():
    """The communicator of this rank; init() must have run."""
    st = _state()
    if st.comm is None:
        raise RuntimeError("get_communicator: call minidl_parallel.init() first")
    return st.comm


def get_rank():
    """This rank in the world; 0 before init (a world of one)."""
    comm = _state().comm
    return 0 if comm is None else comm.rank


def get_group_size():
    """The number of ranks in the world; 1 before init."""
    comm = _state().comm
    return 1 if comm is None else comm.size


def get_local_rank():
    """This rank among the ranks on this machine (the GPU it uses under nccl); 0 before init."""
    comm = _state().comm
    return 0 if comm is None else comm.local_rank


def get_local_rank_size():
    """The number of ranks on this machine; 1 before init."""
    comm = _state().comm
    return 1 if comm is None else comm.local_size


# ---- auto-parallel context --------------------------------------------------------------

def set_auto_parallel_context(**kwargs):
    """Sets parallel_mode, gradients_mean, parameter_broadcast, device_num, global_rank,
    dataset_strategy and/or search_mode.

    SEMI_AUTO_PARALLEL and AUTO_PARALLEL turn on operator-level tensor parallelism (see
    minidl_parallel.tensor_parallel): ``dataset_strategy`` "data_parallel" (each rank feeds
    its slice of the batch; the default) or "full_batch" (every rank feeds the whole batch);
    ``search_mode`` "sharding_propagation" (AUTO: ops without a strategy follow their inputs).

    Example:
        >>> set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True)
    """
    for key, value in kwargs.items():
        _check_key(key, "set_auto_parallel_context")
        _check_setting(key, value)
    _state().settings.update(kwargs)
    _register_data_parallel()
    if _state().settings["parallel_mode"] in (ParallelMode.SEMI_AUTO_PARALLEL, ParallelMode.AUTO_PARALLEL):
        from .tensor_parallel.dispatch import install
        install()


def get_auto_parallel_context(key):
    """One auto-parallel setting; device_num and global_rank default to the world's size and rank."""
    _check_key(key, "get_auto_parallel_context")
    value = _state().settings[key]
    if value is None and key == "device_num":
        return get_group_size()
    if value is None and key == "global_rank":
        return get_rank()
    return value


def reset_auto_parallel_context():
    """Back to the defaults (STAND_ALONE, gradients_mean=False, parameter_broadcast=False)."""
    _state().settings = dict(_DEFAULTS)


def _data_parallel_active():
    st = _state()
    return st.comm is not None and st.settings["parallel_mode"] == ParallelMode.DATA_PARALLEL


def _grad_reducer_factory(parameters):
    if not _data_parallel_active():
        return None
    from .grad_reducer import DistributedGradReducer
    return DistributedGradReducer(parameters, mean=get_auto_parallel_context("gradients_mean"),
                                  parameter_broadcast=get_auto_parallel_context("parameter_broadcast"))


def tensor_parallel_active():
    """True when this rank runs SEMI_AUTO_PARALLEL or AUTO_PARALLEL after init()."""
    st = _state()
    return st.comm is not None and st.settings["parallel_mode"] in (ParallelMode.SEMI_AUTO_PARALLEL,
                                                                    ParallelMode.AUTO_PARALLEL)


def _shards_provider():
    # Data parallel, and tensor parallel with dataset_strategy="data_parallel": each rank
    # reads its slice of every batch.
    if _data_parallel_active() or (tensor_parallel_active()
                                   and _state().settings["dataset_strategy"] == "data_parallel"):
        return get_group_size(), get_rank()
    return None


def _register_rank_provider():
    # LossMonitor(rank0_only=True) asks minidl.train for the rank; get_rank reads the calling
    # thread's context, so one registration serves every thread-rank too.
    from minidl.train import callbacks
    callbacks.set_rank_provider(get_rank)


def _register_data_parallel():
    # minidl's registries are process-global; what we register resolves the calling
    # thread's context when called, so registering once serves every thread-rank.
    if not (_data_parallel_active() or tensor_parallel_active()):
        return
    from minidl.dataset import sharding
    from minidl.train import model
    model.set_default_grad_reducer(_grad_reducer_factory)
    sharding.set_default_shards(_shards_provider)


# ---- MPI job hygiene --------------------------------------------------------------------

def _install_except_hook(comm):
    from .comm.mpi import import_mpi
    MPI = import_mpi()
    if comm.size <= 1 or _hooks["excepthook"] is not None:
        return

    def global_except_hook(exctype, value, tb):
        try:
            sys.stderr.write(f"minidl_parallel: uncaught exception on rank {comm.rank} of {comm.size}; "
                             f"aborting the MPI job\n")
            traceback.print_exception(exctype, value, tb)
            sys.stderr.flush()
        finally:
            MPI.COMM_WORLD.Abort(1)

    _hooks["excepthook"] = global_except_hook
    sys.excepthook = global_except_hook


def _limit_blas_threads(local_size):
    if local_size <= 1 or "OMP_NUM_THREADS" in os.environ or _hooks["blas"] is not None:
        return
    limit = max(1, (os.cpu_count() or 1) // local_size)
    if "MINIDL_NUM_THREADS" not in os.environ:
        # minidl's own intra-op threads (conv chunks, BatchNorm blocks) share the cores too.
        minidl.set_num_threads(min(limit, minidl.get_num_threads()))
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return
    _hooks["blas"] = threadpool_limits(limits=limit, user_api="blas")
