"""The first code a worker of ``python -m minidl_parallel.run`` or ``minidl_parallel.spawn`` runs.

The launcher starts it with ``MPI.COMM_SELF.Spawn(sys.executable, [this file's path, mode,
log_dir])``; the workers share their own ``MPI.COMM_WORLD`` (rank 0..n-1, so
``minidl_parallel.init()`` there gives the mpi backend, as under mpirun) and reach the
launcher through ``MPI.Comm.Get_parent()``, an intercommunicator whose remote group is the
launcher alone (its rank 0).

It runs by path, not as ``-m minidl_parallel._spawn_worker``: importing the package (minidl,
NumPy) before the hello would leave the launcher blind to a worker that fails while
importing (see "Seeing a worker fail"). Before the hello only the standard library and
mpi4py are imported.

Protocol, all over the parent intercommunicator:

1. HELLO (worker -> launcher): ``(pid, host)``, as soon as MPI is up (in run mode after the
   worker's output is redirected, so the launcher can follow rank 0's log from its start).
2. JOB (launcher -> worker): what to run, a dict: ``{"script", "argv", "sys_path_append"}``
   for run, ``{"main", "sys_path", "sys_argv", "call"}`` (``call``: the pickled fn and args) for spawn;
   both with ``"env"``, variables set before the user's code runs (``MINIDL_RESTART_COUNT``).
3. HEAD + BODY (worker -> launcher): the exit record when the user's code has ended: HEAD is
   8 bytes (the body's length), BODY the pickled dict ``{"kind": "ok" |
   "raised" | "exit", "status", "error", "traceback", "result"}``. Both are synchronous
   sends (Issend, bounded), so a worker that aborts right after has delivered its record.
4. At exit, after minidl_parallel's exit guard (atexit runs last-registered first):
   ``MPI_Comm_disconnect``, which the launcher matches once every record has come.

Seeing a worker fail. The launcher runs with Open MPI's fault tolerance on (ULFM,
``mpi_ft_enable``), so a worker's death is an error on the launcher's pending receives from
that worker instead of Open MPI ending the launcher too. That error needs a connection
between the two, which the HELLO (worker side) and the JOB send (launcher side) open. A
worker that raises or calls ``sys.exit(n)`` (n != 0) reports first, then aborts the
workers' world (``MPI.COMM_WORLD.Abort``), as minidl_parallel's hooks do under mpirun; one
killed by a signal or ``os._exit`` reports nothing, and the launcher names it as the first
worker lost. When one worker ends abnormally, the MPI runtime (PRRTE) ends the others.
"""
import atexit
import os
import runpy
import socket
import struct
import sys
import time
import traceback

TAG_HELLO, TAG_JOB, TAG_HEAD, TAG_BODY = 0x5A1, 0x5A2, 0x5A3, 0x5A4
HEAD = struct.Struct("<q")  # the body's length, so the launcher can post a receive that fits
REPORT_WAIT_S = 30.0  # how long a worker waits for the launcher to take its record


def status_code(status):
    """The process exit code ``sys.exit(status)`` gives: None -> 0, an int -> itself, else 1."""
    if status is None:
        return 0
    return status if isinstance(status, int) and not isinstance(status, bool) else 1


def abort_code(code):
    """An MPI_Abort code the shell reads as a failure (256 would read as 0)."""
    return code if 0 < code < 256 else 1


class _Worker:
    def __init__(self, MPI, mode, log_dir):
        self.MPI = MPI
        self.mode = mode
        self.parent = MPI.Comm.Get_parent()
        self.rank = MPI.COMM_WORLD.Get_rank()
        self.size = MPI.COMM_WORLD.Get_size()
        self.log_dir = log_dir

    # ---- start --------------------------------------------------------------------------

    def redirect_output(self):
        """stdout and stderr of this process (fds 1 and 2, so C code and Open MPI's own
        messages too) into ``<log_dir>/rank.<r>/stdout`` and ``.../stderr``, line-buffered so
        the launcher can follow rank 0 and a killed worker loses at most a partial line."""
        rank_dir = os.path.join(self.log_dir, f"rank.{self.rank}")
        os.makedirs(rank_dir, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(os.path.join(rank_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)

    def hello(self):
        self.parent.send((os.getpid(), socket.gethostname()), dest=0, tag=TAG_HELLO)
        return self.parent.recv(source=0, tag=TAG_JOB)

    # ---- end ----------------------------------------------------------------------------

    def report(self, record):
        """Sends the exit record to the launcher; waits at most REPORT_WAIT_S for it to be taken."""
        import pickle
        body = pickle.dumps(record, protocol=pickle.HIGHEST_PROTOCOL)
        deadline = time.monotonic() + REPORT_WAIT_S
        for data, tag in ((HEAD.pack(len(body)), TAG_HEAD), (body, TAG_BODY)):
            request = self.parent.Issend(data, dest=0, tag=tag)
            while not request.Test():
                if time.monotonic() > deadline:
                    sys.stderr.write(f"minidl_parallel: rank {self.rank} of {self.size} could not hand its exit "
                                     f"record to the launcher within {REPORT_WAIT_S:g} s\n")
                    sys.stderr.flush()
                    return
                time.sleep(1e-3)

    def abort(self, code):
        """Ends every worker now: the others may be waiting for this one in a collective."""
        sys.stdout.flush()
        sys.stderr.flush()
        self.MPI.COMM_WORLD.Abort(abort_code(code))

    def disconnect_at_exit(self):
        # Registered before the user's code runs, so it runs after minidl_parallel's exit
        # guard (which waits, bounded, for the other workers) and before MPI_Finalize.
        def disconnect():
            try:
                self.parent.Disconnect()
            except self.MPI.Exception as exc:  # the launcher is gone: nothing left to tell
                sys.stderr.write(f"minidl_parallel: rank {self.rank} could not disconnect from the launcher: "
                                 f"{exc}\n")
        atexit.register(disconnect)

    def finish(self, record):
        """Reports ``record``; a failure then ends all workers (as mpirun would), an exit 0 returns."""
        self.report(record)
        if record["kind"] == "ok":
            return
        if record["kind"] == "exit":
            sys.stderr.write(f"minidl_parallel: rank {self.rank} of {self.size} called sys.exit({record['error']}); "
                             f"aborting the MPI job so the other ranks do not wait for it\n")
        self.abort(record["status"])

    # ---- the user's code ----------------------------------------------------------------

    def run_script(self, job):
        """Runs the script as ``__main__``, as ``python script.py args`` would."""
        script = job["script"]
        sys.argv = [script, *job["argv"]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        sys.path.extend(p for p in job["sys_path_append"] if p not in sys.path)
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            code = status_code(exc.code)
            if not isinstance(exc.code, (int, type(None))):
                sys.stderr.write(f"{exc.code}\n")  # what Python prints for sys.exit("message")
            self.finish(_record("ok" if code == 0 else "exit", code, error=repr(exc.code)))
            raise
        except BaseException as exc:  # noqa: B902 - KeyboardInterrupt ends the job too
            tb = _user_traceback(exc.__traceback__)
            self.report(_record("raised", 1, error=_one_line(exc),
                                tb="".join(traceback.format_exception(type(exc), exc, tb))))
            # Whatever hook the script installed prints it (minidl_parallel's also aborts).
            sys.excepthook(type(exc), exc, tb)
            self.abort(1)
        self.finish(_record("ok", 0))

    def run_fn(self, job):
        """Imports the parent's main module as ``__mp_main__``, unpickles fn and args, and
        reports ``fn(rank, *args)``'s value (pickled) or its exception."""
        import pickle
        sys.path[:] = job["sys_path"]
        sys.argv[:] = job["sys_argv"]  # as multiprocessing's spawn: the worker sees the parent's argv
        try:
            _import_parent_main(job["main"])
            fn, args = pickle.loads(job["call"])
        except BaseException as exc:  # noqa: B902
            self.fail(exc, f"could not load fn and args from the parent ({_one_line(exc)})")
        try:
            value = fn(self.rank, *args)
        except SystemExit as exc:
            code = status_code(exc.code)
            self.finish(_record("ok" if code == 0 else "exit", code, error=repr(exc.code)))
            return
        except BaseException as exc:  # noqa: B902
            self.fail(exc, _one_line(exc))
        try:
            result = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: B902 - any pickling error
            self.fail(exc, f"its return value {type(value).__name__} could not be pickled ({_one_line(exc)})")
        self.finish(_record("ok", 0, result=result))

    def fail(self, exc, error):
        tb = "".join(traceback.format_exception(type(exc), exc, _user_traceback(exc.__traceback__)))
        sys.stderr.write(f"minidl_parallel.spawn: rank {self.rank} of {self.size} failed; aborting the "
                         f"workers\n{tb}")
        self.report(_record("raised", 1, error=error, tb=tb))
        self.abort(1)


def _record(kind, status, error=None, tb=None, result=None):
    return {"kind": kind, "status": status, "error": error, "traceback": tb, "result": result}


def _user_traceback(tb):
    """tb from its first frame outside this file and runpy: what ``python script.py`` would show."""
    here = os.path.realpath(__file__)
    start = tb
    while start is not None and (os.path.realpath(start.tb_frame.f_code.co_filename) == here
                                 or start.tb_frame.f_code.co_filename in ("<frozen runpy>", runpy.__file__)):
        start = start.tb_next
    return start or tb


def _one_line(exc):
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _import_parent_main(main):
    """Makes the parent's ``__main__`` importable here, as multiprocessing's spawn start
    method does: the parent's main script (or module) runs under the name ``__mp_main__``,
    so its ``if __name__ == "__main__":`` block does not, and becomes ``sys.modules["__main__"]``,
    where pickle looks for ``__main__.fn``."""
    import types
    name, path = main.get("name"), main.get("path")
    if name is not None:
        content = runpy.run_module(name, run_name="__mp_main__", alter_sys=True)
    elif path is not None:
        content = runpy.run_path(path, run_name="__mp_main__")
    else:
        return  # an interactive parent: fn must come from an importable module
    module = types.ModuleType("__mp_main__")
    module.__dict__.update(content)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def main(argv):
    # Run by path, this file's folder is sys.path[0]: it would shadow top-level modules with
    # minidl_parallel's own (ops, nn, ...). The job says what goes there.
    if sys.path and os.path.realpath(sys.path[0] or ".") == os.path.dirname(os.path.realpath(__file__)):
        del sys.path[0]
    mode, log_dir = argv
    from mpi4py import MPI
    if MPI.Comm.Get_parent() == MPI.COMM_NULL:
        sys.stderr.write("minidl_parallel/_spawn_worker.py is started by `python -m minidl_parallel.run` or "
                         "minidl_parallel.spawn(), not by hand\n")
        return 2
    worker = _Worker(MPI, mode, log_dir)
    if log_dir:
        worker.redirect_output()
    job = worker.hello()
    # The launcher's word for the user's code (MINIDL_RESTART_COUNT: which restart this is). It travels in
    # the job: after the first spawn, Open MPI's runtime starts workers with its own, older environment.
    os.environ.update(job.get("env", {}))
    worker.disconnect_at_exit()
    if mode == "script":
        worker.run_script(job)
    else:
        worker.run_fn(job)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
