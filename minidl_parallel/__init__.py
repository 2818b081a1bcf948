"""minidl_parallel: distributed training for minidl (communicators, data parallel, tensor parallel).

minidl never imports this package; ``init()`` plugs it in by installing a parallel runtime
(minidl_parallel/runtime.py), the one object minidl asks at the moment of use, and
``release()`` removes it. Before ``init()`` (or without mpirun) the world is one process: ``get_rank()`` is 0
and ``get_group_size()`` 1, so scripts written for parallel runs work unchanged.

Example:
    >>> import minidl_parallel as mp
    >>> comm = mp.init()          # nccl on GPU, mpi under mpirun, else a world of one
    >>> mp.get_rank(), mp.get_group_size()
    (0, 1)
"""
from .context import (get_rank, get_group_size, get_local_rank, get_local_rank_size,
                      get_communicator, is_initialized, ParallelMode, set_auto_parallel_context,
                      get_auto_parallel_context, reset_auto_parallel_context, launched_under_mpi)
from .world import init, release, run_threads
from .spawning import spawn, SpawnError
from .grad_reducer import DistributedGradReducer
from .compression import Compression
from .dist_opt import DistOpt
from .distributed_optimizer import (DistributedOptimizer, broadcast_parameters, broadcast_optimizer_state, Average,
                                    Sum, Adasum)
from .join import Join, join
from .collectives import AllReduce, AllGather, ReduceScatter, Broadcast
from .sync_batchnorm import SyncBatchNorm
from .tensor_parallel import (Layout, CommCounter, explain, StrategyError, NoRuleError, redistribute, full_value,
                              get_layout)
from .optimizer_parallel.full_params import summon_full_params
from .pipeline import pipeline_schedule
from .pipeline.checkpoint import load_segmented_checkpoints
from . import ops, nn

__all__ = ["init", "release", "run_threads", "spawn", "SpawnError", "get_rank", "get_group_size", "get_local_rank", "get_local_rank_size",
           "get_communicator", "is_initialized", "ParallelMode", "set_auto_parallel_context",
           "get_auto_parallel_context", "reset_auto_parallel_context", "launched_under_mpi", "DistributedGradReducer", "Compression", "DistOpt",
           "DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "Average", "Sum", "Adasum",
           "Join", "join",
           "AllReduce", "AllGather", "ReduceScatter", "Broadcast", "SyncBatchNorm", "Layout", "CommCounter", "explain",
           "StrategyError", "NoRuleError", "redistribute", "full_value", "get_layout", "summon_full_params", "pipeline_schedule",
           "load_segmented_checkpoints", "ops", "nn"]
