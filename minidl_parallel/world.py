"""Joining and leaving the parallel world: ``init``, ``release`` and ``run_threads``.

``init()`` makes this rank's communicator, wraps it with the auto-parallel settings in a
:class:`~minidl_parallel.context.World`, and installs a
:class:`~minidl_parallel.runtime.ParallelRuntime` around it: for the whole process (one rank
per process under mpirun), or for the calling thread inside :func:`run_threads` (one rank per
thread, for tests). ``release()`` removes it, and minidl runs single-device again.

Under mpirun ``init`` also
- installs a ``sys.excepthook`` that prints the failing rank's traceback and calls
  ``MPI.COMM_WORLD.Abort(1)``, so one rank's exception ends the whole job at once instead
  of leaving the others hanging in a collective (as ChainerMN's global_except_hook);
- installs an exit guard, because ``SystemExit`` never reaches ``sys.excepthook`` and
  MPI_Finalize waits for every rank: ``sys.exit`` is wrapped to remember its status, and an
  ``atexit`` handler (it runs before mpi4py's finalize, which is a C-level exit hook) aborts
  the job at once after a non-zero ``sys.exit``; after status 0 (or an exit it cannot see:
  ``raise SystemExit(n)``, falling off the end) it stops the mpi watchdog thread and waits,
  at most the collective timeout + 5 s, until every rank leaves, answering the others'
  "where are you?" so their timeout names it;
- limits BLAS threads to ``max(1, cores // local ranks)`` through threadpoolctl when it is
  installed (optional; skipped when OMP_NUM_THREADS is set), and minidl's intra-op threads
  (``minidl.set_num_threads``) to the same unless MINIDL_NUM_THREADS is set, so 8 ranks on
  a small machine do not thrash.

These are the process's own hooks, so they last only while the world does: ``release()`` puts
back the very ``sys.excepthook`` and ``sys.exit`` the user had before ``init`` (unless something
replaced minidl's since, which then stays), unregisters the atexit guard and restores the BLAS
thread limits.
"""
import atexit
import os
import sys
import threading
import time
import traceback
import warnings

import minidl
from minidl.runtime import get_runtime, set_runtime

from . import context
from .comm import BACKENDS, create_communicator
from .comm.threads import run_ranks
from .runtime import ParallelRuntime

__all__ = ["init", "release", "run_threads"]

# What init installed, and what it replaced ("user_*"), for release() to put back.
_hooks = {"excepthook": None, "user_excepthook": None, "blas": None, "exit_guard": None, "sys_exit": None,
          "user_sys_exit": None}


def _default_backend():
    # Outside a launcher there is one process, whatever the device: a world of one (nccl
    # would need mpi4py, which the gpu extra does not install, and would join no one).
    if not context.launched_under_mpi():
        return "local"
    from minidl.backend import get_device_target
    return "nccl" if get_device_target() == "GPU" else "mpi"


def _device_follows_backend(name):
    """The default device follows the backend: CPU for mpi, GPU for nccl.

    The user's choice (set_context, $MINIDL_DEVICE) wins: a GPU job on mpi works, its
    collectives staged through host memory (comm/mpi.py). nccl moves only device arrays, so a
    CPU device target there is refused. A GPU default already used before ``init("mpi")``
    stays (tensors live there), with a warning that says how to get the CPU.
    """
    from minidl import backend
    if name == "mpi":
        if backend.prefer_device_target("CPU") == "GPU" and not backend.device_target_chosen():
            warnings.warn(
                "init('mpi'): the device target had already defaulted to GPU (CuPy sees a GPU) before init, so "
                "tensors stay on the GPU and every collective is staged through host memory; to train on the CPU "
                "call minidl.set_context(device_target='CPU') before building the network, or use init('nccl') "
                "to keep collectives on the GPU", RuntimeWarning, stacklevel=3)
    elif name == "nccl" and backend.prefer_device_target("GPU") != "GPU":
        why = ("the device target is CPU (minidl.set_context or $MINIDL_DEVICE)" if backend.device_target_chosen()
               else f"no GPU can be used: {backend.gpu_unavailable_reason()}")
        raise RuntimeError(f"init('nccl'): NCCL moves GPU (CuPy) arrays, but {why}; expected device_target='GPU' "
                           f"(minidl.set_context(device_target='GPU')), or init('mpi') for training on the CPU")


def _check_rank_args(rank, world_size):
    for name, value, low in (("rank", rank, 0), ("world_size", world_size, 1)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise ValueError(f"init: {name} must be None or an int >= {low}, got {value!r}")
    if rank is not None and world_size is not None and rank >= world_size:
        raise ValueError(f"init: rank must be in [0, {world_size - 1}] for world_size={world_size}, got {rank}")


def _check_world(comm, name, rank, world_size):
    """Raises when the world built is not the one the caller stated."""
    if world_size is not None and comm.size != world_size:
        if comm.size == 1 and not context.launched_under_mpi():
            raise RuntimeError(
                f"init: world_size={world_size} was asked, but this process was not started by a launcher "
                f"(no mpirun/mpiexec environment), so backend {name!r} can only build a world of one rank; "
                f"start the {world_size} workers with `mpirun -n {world_size} python script.py`, or run ranks "
                f"as threads with minidl_parallel.run_threads({world_size}, fn) in one process")
        raise RuntimeError(f"init: world_size={world_size} was asked, but backend {name!r} built a world of "
                           f"{comm.size} rank(s); launch {world_size} processes (mpirun -n {world_size}) or pass "
                           f"world_size={comm.size}")
    if rank is not None and comm.rank != rank:
        raise RuntimeError(f"init: rank={rank} was asked, but backend {name!r} gave this process rank {comm.rank} "
                           f"of {comm.size}; the launcher decides the ranks (pass rank=None, or the launcher's "
                           f"rank)")


def init(backend_name=None, *, rank=None, world_size=None, timeout=None, stall_warning=None, unique_id=None):
    """Joins the parallel world and returns its communicator.

    Args:
        backend_name: "nccl" (one GPU per process, under mpirun), "mpi" (NumPy arrays over
            mpi4py), "threads" (inside run_threads: the thread's rank; elsewhere a world of
            one), "local" (a world of one), or None: under a launcher (mpirun) nccl when
            minidl's device target is GPU, else mpi; outside a launcher local. The default
            device follows the backend: mpi makes it CPU and nccl GPU, unless the user chose
            one (``minidl.set_context``, ``$MINIDL_DEVICE``): a GPU job on mpi stages its
            collectives through host memory; nccl with a CPU device target raises.
        rank, world_size: what the caller expects (SINGA's DistOpt passes them): when given,
            a world that differs raises, naming what is missing, instead of training alone.
        timeout: seconds any collective waits for the other ranks before the job ends with a
            message naming the collective and the ranks that have not arrived (default
            ``MINIDL_COLLECTIVE_TIMEOUT`` or 600; 0 = wait forever).
        stall_warning: seconds after which a waiting collective warns with the same names
            (default ``MINIDL_STALL_WARNING_SECONDS`` or 60; 0 = never).
        unique_id: nccl only: the NCCL unique id the launching process made and gave every
            rank (SINGA's ``nccl_id``); default rank 0 makes it and MPI hands it on.

    Calling it again with the same backend returns the same communicator (with ``timeout``
    and ``stall_warning`` updated when given).

    Raises:
        RuntimeError: the world built is not the stated one (e.g. ``world_size=2`` in a
            process started without mpirun), or init already ran with another backend.
    """
    if backend_name is not None and backend_name not in BACKENDS:
        raise ValueError(f"init: unknown backend_name {backend_name!r}; expected one of {BACKENDS} or None")
    _check_rank_args(rank, world_size)
    _check_waits(timeout, stall_warning)  # before a communicator exists that would leak
    world = context.current_world()
    if world.comm is not None:
        if backend_name is not None and backend_name != world.backend:
            raise RuntimeError(f"init: already initialised with backend {world.backend!r}; call release() before "
                               f"init({backend_name!r})")
        _check_world(world.comm, world.backend, rank, world_size)
        _set_waits(world.comm, timeout, stall_warning)
        return world.comm
    name = backend_name or _default_backend()
    if unique_id is not None and name != "nccl":
        raise ValueError(f"init: unique_id is NCCL's and needs backend 'nccl', got backend {name!r}")
    _device_follows_backend(name)  # before the communicator: a refusal leaves nothing to release
    comm = create_communicator(name, **({} if unique_id is None else {"unique_id": unique_id}))
    _set_waits(comm, timeout, stall_warning)
    try:
        _check_world(comm, name, rank, world_size)
    except RuntimeError:
        comm.release()
        raise
    set_runtime(ParallelRuntime(context.World(comm, name, context.current_world().settings), scope="process"),
                scope="process")
    if name in ("mpi", "nccl"):
        _install_except_hook(comm)
        _install_exit_guard(comm)
        _limit_blas_threads(comm.local_size)
    return comm


def _check_waits(timeout, stall_warning):
    from .comm.base import _check_seconds
    if timeout is not None:
        _check_seconds(timeout, "init: timeout")
    if stall_warning is not None:
        _check_seconds(stall_warning, "init: stall_warning")


def _set_waits(comm, timeout, stall_warning):
    if timeout is not None:
        comm.timeout = float(timeout)
    if stall_warning is not None:
        comm.stall_warning = float(stall_warning)


def release():
    """Leaves the parallel world: frees the communicator and removes the runtime init installed.

    The auto-parallel settings stay (as MindSpore's context does) for a later ``init()``.
    """
    runtime = get_runtime()
    world = getattr(runtime, "world", None)
    if world is None:
        return
    world.comm.release()
    set_runtime(None, scope=runtime.scope)
    if runtime.scope == "process":
        context.current_world().settings = dict(world.settings)
        _remove_except_hook()
        _remove_exit_guard()
        if _hooks["blas"] is not None:
            _hooks["blas"].restore_original_limits()
            _hooks["blas"] = None


def run_threads(n, fn, *args, timeout=300.0):
    """Runs ``fn(*args)`` on n threads, each a rank of a threads-backend world; returns the results.

    Inside each thread ``init("threads")`` has already run: the thread has its own parallel
    runtime, so ``get_rank()``, ``get_group_size()`` and the auto-parallel context are that
    thread's own, and minidl's ops, Models and checkpoints see that rank.

    An exception in any rank aborts the others' pending collectives and is re-raised here,
    with "rank r of n" prefixed to its message.

    Args:
        n: number of ranks (>= 1).
        fn: the per-rank function.
        timeout: seconds to wait for all ranks before raising TimeoutError.

    Returns:
        ``[fn result on rank 0, ..., on rank n - 1]``.

    Example:
        >>> run_threads(2, get_rank)
        [0, 1]
    """
    def rank_main(comm):
        set_runtime(ParallelRuntime(context.World(comm, "threads"), scope="thread"), scope="thread")
        try:
            return fn(*args)
        finally:
            set_runtime(None, scope="thread")

    return run_ranks(n, rank_main, timeout=timeout)


# ---- MPI job hygiene --------------------------------------------------------------------

_exit = {"status": None, "called": False, "comm": None}


def _install_exit_guard(comm):
    """``sys.exit`` remembers its status; at exit a non-zero one aborts the job, status 0 waits
    (bounded) for the other ranks to leave too, so MPI_Finalize cannot wait forever."""
    _exit["comm"] = comm  # the latest world's timeout bounds the wait at exit
    if comm.size <= 1 or _hooks["exit_guard"] is not None:
        return
    real_exit = sys.exit

    def exit_remembering_status(status=None):
        if threading.current_thread() is threading.main_thread():  # sys.exit in a thread ends only it
            _exit["status"], _exit["called"] = status, True
        real_exit(status)

    exit_remembering_status.__wrapped__ = real_exit
    _hooks["user_sys_exit"] = real_exit
    _hooks["sys_exit"] = sys.exit = exit_remembering_status
    _hooks["exit_guard"] = _exit_guard
    atexit.register(_exit_guard)


def _remove_exit_guard():
    """Undoes :func:`_install_exit_guard`: with no world left, an exit has no job to abort or
    wait for, and the user's ``sys.exit`` is theirs again."""
    if _hooks["exit_guard"] is not None:
        atexit.unregister(_hooks["exit_guard"])
    if _hooks["sys_exit"] is not None and sys.exit is _hooks["sys_exit"]:
        sys.exit = _hooks["user_sys_exit"]
    _hooks["exit_guard"] = _hooks["sys_exit"] = _hooks["user_sys_exit"] = None
    _exit.update(status=None, called=False, comm=None)


def _status_code(status):
    """The process exit code ``sys.exit(status)`` gives: None -> 0, an int -> itself, else 1."""
    if status is None:
        return 0
    return status if isinstance(status, int) else 1


def _abort_code(code):
    """The MPI_Abort error code for a non-zero exit status: itself when a shell can read it,
    else 1 (256 would reach the shell as 0: a failed job must never look successful)."""
    return code if 0 < code < 256 else 1


def _exit_guard():
    from .comm.mpi import import_mpi, stop_watchdog, watch
    MPI = import_mpi()
    if MPI.Is_finalized():
        return
    # The watchdog thread must not be inside MPI when MPI_Finalize runs; from here on this
    # thread answers the peers' questions itself.
    stop_watchdog()
    comm, code = _exit["comm"], _status_code(_exit["status"])
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if code != 0:
        sys.stderr.write(f"minidl_parallel: rank {rank} of {size} called sys.exit({_exit['status']!r}); "
                         f"aborting the MPI job so the other ranks do not wait for it\n")
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(_abort_code(code))
    side = watch()
    if side is None:
        return
    # The others may still compute and then leave too (the normal end), or wait for this rank
    # in a collective that will never come: answer their questions while waiting for them.
    # The wait outlasts their timeout plus their question window, so the rank that waits in a
    # collective is the one that reports (it knows which collective). Peers that answer that
    # they compute outside any collective (rank 0 evaluating or saving after training) are
    # alive and wait for no one: each such answer restarts the limit, so long work there is
    # never cut short; only peers that stop answering make this rank end the job.
    timeout = getattr(comm, "timeout", 0.0)
    limit = timeout + 5.0 if timeout else float("inf")
    survey_every = min(5.0, limit / 4)
    # None: the exit status is unknown here (the script returned, or raised SystemExit).
    side.state = ("exiting", code if _exit["called"] else None)
    request = side.comm.Ibarrier()
    start = next_survey = time.monotonic()
    deadline = start + limit
    while not request.Test():
        side.serve()
        now = time.monotonic()
        if now >= next_survey + survey_every:
            next_survey = now
            if _peers_busy_elsewhere(side, rank, size, request):
                deadline = now + limit
        if now > deadline:
            sys.stderr.write(f"minidl_parallel: rank {rank} of {size} finished (exit status {code}), but other "
                             f"ranks did not finish within {limit:g} s; aborting the MPI job\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        time.sleep(1e-3)


def _peers_busy_elsewhere(side, rank, size, request):
    """Whether every other rank answers that it runs outside any collective or is leaving too
    (so none waits for this rank); False when one waits in a collective or does not answer."""
    answers = side.survey(range(size), window=1.0)
    if request.Test():
        return True  # everybody arrived meanwhile
    return len(answers) == size and all(state is None or state[0] in ("outside", "exiting")
                                        for r, state in answers.items() if r != rank)

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

    _hooks["user_excepthook"] = sys.excepthook
    _hooks["excepthook"] = sys.excepthook = global_except_hook


def _remove_except_hook():
    """Undoes :func:`_install_except_hook`: the user's own hook, the very object, is back."""
    if _hooks["excepthook"] is not None and sys.excepthook is _hooks["excepthook"]:
        sys.excepthook = _hooks["user_excepthook"]
    _hooks["excepthook"] = _hooks["user_excepthook"] = None


def _limit_blas_threads(local_size):
    if local_size <= 1 or "OMP_NUM_THREADS" in os.environ or _hooks["blas"] is not None:
        return
    limit = max(1, (os.cpu_count() or 1) // local_size)
    if "MINIDL_NUM_THREADS" not in os.environ:
        # minidl's own intra-op threads (conv chunks, BatchNorm blocks) share the cores too.
        minidl.set_num_threads(min(limit, minidl.get_num_threads()))
    try:
        threadpoolctl = _import_threadpoolctl()
    except ImportError:
        return
    _hooks["blas"] = threadpoolctl.threadpool_limits(limits=limit, user_api="blas")


def _import_threadpoolctl():
    """threadpoolctl, imported so that its import leaves ``os.environ`` as it was: it sets
    ``KMP_DUPLICATE_LIB_OK=True`` there, which every child process would inherit, and minidl
    changes no environment the user did not set."""
    before = os.environ.get("KMP_DUPLICATE_LIB_OK")
    try:
        import threadpoolctl
    finally:
        if before is None:
            os.environ.pop("KMP_DUPLICATE_LIB_OK", None)
        else:
            os.environ["KMP_DUPLICATE_LIB_OK"] = before
    return threadpoolctl
