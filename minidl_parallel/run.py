"""``python -m minidl_parallel.run -n 4 train.py [args]``: a launcher that needs no mpirun.

MindSpore's ``msrun`` and ``torchrun``, on MPI: this process becomes an MPI singleton and
starts the n workers itself with ``MPI_Comm_spawn`` (minidl_parallel/spawning.py), so
``minidl_parallel.init()`` in the script gives the mpi backend with ranks 0..n-1, exactly as
under ``mpirun -n 4 python train.py``; the script is the same for both.

- Each worker's stdout and stderr go to ``<log-dir>/rank.N/stdout`` and ``.../stderr``
  (Open MPI's ``--output-filename`` layout, kept apart so warnings do not mix into the
  printed results; the worker redirects its file descriptors 1 and 2, so C-level output lands
  there too). Rank 0's output is also copied here, to this terminal, as it comes.
- When one worker fails (raises, exits with a non-zero status, is killed), the others are
  ended, and the launcher prints which rank failed and how (with its traceback) and exits
  with that rank's status (1 when it has none).
- ``--hostfile`` goes to MPI_Comm_spawn (Open MPI's hostfile format: ``host slots=4``).
- As root, Open MPI's runtime refuses to start workers, as mpirun does, unless told:
  ``--allow-run-as-root`` (mpirun's flag) sets PRTE_ALLOW_RUN_AS_ROOT(_CONFIRM) for it.

``main(argv)`` returns the exit status (argument errors raise SystemExit(2), as argparse does).
"""
import argparse
import os
import socket
import sys

# Imported by name: once the package exports the function spawn, `from . import spawn` is that function.
from .elastic import ELASTIC_TIMEOUT_S, ElasticError, ElasticWorld
from .restarts import RESTART_DELAY_S, MAX_RESTART_DELAY_S, RestartLog, with_restarts
from .spawning import ROOT_VARIABLES, START_TIMEOUT_S, SpawnError, check_root, init_mpi, spawning_stuck, start_workers
from .context import launched_under_mpi

__all__ = ["main"]

PROG = "python -m minidl_parallel.run"


def _parser():
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Start N workers of a training script without mpirun (MPI_Comm_spawn); the script is the "
                    "same as for `mpirun -n N python script.py`.")
    parser.add_argument("-n", "-np", "--np", "--worker_num", dest="n", type=int, required=True, metavar="N",
                        help="number of workers (ranks)")
    parser.add_argument("--hostfile", help="Open MPI hostfile (lines like `node1 slots=4`) for several machines")
    parser.add_argument("--log-dir", "--log_dir", dest="log_dir", default="log_output",
                        help="where rank.N/stdout and rank.N/stderr go (default: log_output)")
    parser.add_argument("--timeout", type=float, default=0.0,
                        help="seconds the whole run may take, then the workers are ended (default 0: no limit)")
    parser.add_argument("--start-timeout", dest="start_timeout", type=float, default=START_TIMEOUT_S,
                        help=f"seconds the workers may take to start (default {START_TIMEOUT_S:g})")
    parser.add_argument("--allow-run-as-root", dest="allow_run_as_root", action="store_true",
                        help="as mpirun's flag: let Open MPI start workers as root (sets "
                             + " and ".join(f"{v}=1" for v in ROOT_VARIABLES) + ")")
    parser.add_argument("--max-restarts", "--max_restarts", dest="max_restarts", type=int, default=0,
                        help="restart the whole job this many times when it fails (a worker raised, exited "
                             "non-zero, was killed, a collective timed out); Model.train with a ModelCheckpoint "
                             "resumes from the newest checkpoint every rank has (default 0)")
    parser.add_argument("--restart-delay", dest="restart_delay", type=float, default=RESTART_DELAY_S,
                        help=f"seconds before the first restart, doubled for each next one, at most "
                             f"{MAX_RESTART_DELAY_S:g} (default {RESTART_DELAY_S:g})")
    parser.add_argument("--min-np", dest="min_np", type=int,
                        help="elastic: the fewest workers a restart may run with (default -n; needs "
                             "--host-discovery-script)")
    parser.add_argument("--max-np", dest="max_np", type=int,
                        help="elastic: the most workers a restart may run with (default -n)")
    parser.add_argument("--host-discovery-script", dest="host_discovery_script",
                        help="elastic: an executable printing the hosts that can take workers now, one host:slots "
                             "per line (Horovod's); run before every attempt")
    parser.add_argument("--elastic-timeout", dest="elastic_timeout", type=float, default=ELASTIC_TIMEOUT_S,
                        help=f"elastic: seconds to wait for --min-np slots before giving up "
                             f"(default {ELASTIC_TIMEOUT_S:g})")
    parser.add_argument("script", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return parser


def _check(parser, args):
    if args.n < 1:
        parser.error(f"-n must be >= 1, got {args.n}")
    if not os.path.isfile(args.script):
        parser.error(f"script {args.script!r}: no such file (relative to {os.getcwd()})")
    if args.hostfile is not None and not os.path.isfile(args.hostfile):
        parser.error(f"--hostfile {args.hostfile!r}: no such file (relative to {os.getcwd()})")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0 (0: no restarts), got {args.max_restarts}")
    _check_elastic(parser, args)
    for name in ("timeout", "start_timeout", "restart_delay", "elastic_timeout"):
        value = getattr(args, name)
        if not 0 <= value < float("inf"):
            what = "" if name == "restart_delay" else " (0: no limit)"
            parser.error(f"--{name.replace('_', '-')} must be a number of seconds >= 0{what}, got {value}")


def _check_elastic(parser, args):
    elastic = [f"--{name.replace('_', '-')}" for name in ("min_np", "max_np") if getattr(args, name) is not None]
    if args.host_discovery_script is None:
        if elastic:
            parser.error(f"{' and '.join(elastic)} need --host-discovery-script (the hosts each restart may use)")
        return
    script = args.host_discovery_script
    if args.hostfile is not None:
        parser.error("--hostfile and --host-discovery-script do not combine: the discovery script names the hosts of "
                     "each attempt (the launcher writes their hostfile)")
    if not os.path.isfile(script) or not os.access(script, os.X_OK):
        parser.error(f"--host-discovery-script {script!r}: not an executable file (relative to {os.getcwd()})")
    args.min_np = args.n if args.min_np is None else args.min_np
    args.max_np = args.n if args.max_np is None else args.max_np
    if not 1 <= args.min_np <= args.n <= args.max_np:
        parser.error(f"expected 1 <= --min-np <= -n <= --max-np, got --min-np {args.min_np}, -n {args.n}, "
                     f"--max-np {args.max_np}")


class _Follow:
    """Copies what a worker writes to its log files onto this process's stdout and stderr."""

    def __init__(self, rank_dir):
        self.streams = [[os.path.join(rank_dir, "stdout"), sys.stdout, None],
                        [os.path.join(rank_dir, "stderr"), sys.stderr, None]]

    def pump(self):
        for stream in self.streams:
            path, sink, handle = stream
            if handle is None:
                try:
                    handle = stream[2] = open(path, "rb")
                except FileNotFoundError:
                    continue
            data = handle.read()
            if data:
                sink.flush()
                sink.buffer.write(data)
                sink.buffer.flush()

    def close(self):
        self.pump()  # what came after the last tick
        for stream in self.streams:
            if stream[2] is not None:
                stream[2].close()


def _say(message):
    sys.stdout.flush()
    sys.stderr.write(f"{PROG}: {message}\n")
    sys.stderr.flush()


def main(argv=None):
    """Runs the launcher; returns its exit status (0 when every worker finished with status 0)."""
    parser = _parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    if launched_under_mpi():
        _say("this process is already a rank of an MPI job (under mpirun?); run the script directly there, or "
             "start this launcher without mpirun")
        return 2
    if args.allow_run_as_root:
        for name in ROOT_VARIABLES:
            os.environ.setdefault(name, "1")
    try:
        check_root(PROG, "pass --allow-run-as-root (as mpirun needs), or export both")
    except RuntimeError as exc:
        _say(str(exc).removeprefix(f"{PROG}: "))
        return 2
    log_dir = os.path.abspath(args.log_dir)  # the workers get it absolute: their cwd may differ
    try:
        os.makedirs(log_dir, exist_ok=True)
    except OSError as exc:
        _say(f"--log-dir {args.log_dir!r} cannot be made: {exc}")
        return 2
    try:
        MPI = init_mpi(PROG)
    except ImportError as exc:
        _say(str(exc).removeprefix(f"{PROG} "))
        return 2
    # The launcher's own minidl_parallel stays importable in the workers (appended, so the
    # script's folder and PYTHONPATH come first, as under mpirun).
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    job = {"script": os.path.abspath(args.script), "argv": list(args.script_args), "sys_path_append": [package_root]}
    restart_log = RestartLog(os.path.join(log_dir, "restarts.jsonl"))

    elastic = None if args.host_discovery_script is None else ElasticWorld(
        os.path.abspath(args.host_discovery_script), args.n, args.min_np, args.max_np, log_dir, _say,
        args.elastic_timeout)

    def attempt(r):
        # Each attempt's logs apart: the first in log_dir, restart r's in log_dir/restart.r
        attempt_dir = log_dir if r == 0 else os.path.join(log_dir, f"restart.{r}")
        n, hostfile = args.n, None if args.hostfile is None else os.path.abspath(args.hostfile)
        if elastic is not None:
            try:
                n, hostfile = elastic.attempt(r)
            except ElasticError as exc:
                return exc
        return _attempt(MPI, args, n, hostfile, dict(job, env=restart_log.env(r)), attempt_dir, restart_log)

    try:
        error = with_restarts(attempt, args.max_restarts, args.restart_delay, _say, PROG,
                              can_restart=lambda e: e.status != 130 and not spawning_stuck()
                              and not isinstance(e, ElasticError))
    except KeyboardInterrupt:  # (in the backoff)
        _say("interrupted; not restarting")
        return 130
    finally:
        restart_log.close()
    if error is None:
        return 0
    _say(str(error).removeprefix(f"{PROG}: "))
    return error.status if isinstance(error.status, int) and 0 < error.status < 256 else 1


def _attempt(MPI, args, n, hostfile, job, log_dir, restart_log):
    """Starts n workers once and waits for them; returns None or the SpawnError saying what failed."""
    shown = os.path.relpath(log_dir)
    shown = log_dir if shown.startswith("..") else shown
    _say(f"starting {n} workers; their output goes to {shown}/rank.N/stdout and stderr, rank 0's also here")
    try:
        workers = start_workers(MPI, n, "script", [job] * n, who=PROG, log_dir=log_dir, hostfile=hostfile,
                                start_timeout=args.start_timeout)
    except SpawnError as exc:
        return exc
    follow = {"rank0": None, "noted": False}
    here = socket.gethostname()

    def tick(workers):
        if follow["rank0"] is None and workers.pids[0] is not None:
            if workers.hosts[0] == here:
                follow["rank0"] = _Follow(os.path.join(log_dir, "rank.0"))
            elif not follow["noted"]:
                follow["noted"] = True
                _say(f"rank 0 runs on {workers.hosts[0]}: its output is in {log_dir}/rank.0/ there")
        if follow["rank0"] is not None:
            follow["rank0"].pump()
        for line in restart_log.news():
            _say(line)

    try:
        error = workers.wait(timeout=args.timeout, start_timeout=args.start_timeout, on_tick=tick)
    except KeyboardInterrupt:
        error = SpawnError(f"{PROG}: interrupted; ending the workers")
        error.status = 130
    if follow["rank0"] is not None:
        follow["rank0"].close()
    if error is None:
        workers.close()
        return None
    error.args = (f"{error}\n(each rank's output: {shown}/rank.N/stdout and stderr)",) + error.args[1:]
    workers.abandon()
    return error

if __name__ == "__main__":
    sys.exit(main())
