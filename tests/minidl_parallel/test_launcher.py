"""Launching without mpirun: ``python -m minidl_parallel.run`` and ``minidl_parallel.spawn``
(minidl_parallel/run.py, spawning.py, _spawn_worker.py).

The subprocess tests start real MPI jobs (an MPI singleton that spawns its workers), each
under a generous timeout so nothing can hang CI; the worker scripts are in
tests/launcher_scripts/. Faults are injected there: rank 1 raises, rank 2 calls sys.exit(3),
rank 1 kills itself with SIGKILL, rank 1 stalls, the workers end before MPI_Init.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from minidl_parallel import run, spawning
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


def test_spawn_as_root_without_the_variables_names_them(monkeypatch):
    _as_root_without_variables(monkeypatch)
    with pytest.raises(RuntimeError, match=r"PRTE_ALLOW_RUN_AS_ROOT=1 and PRTE_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set "
                                           r"\(missing: PRTE_ALLOW_RUN_AS_ROOT, PRTE_ALLOW_RUN_AS_ROOT_CONFIRM\)"):
        spawn(print, 2)


def test_spawn_refuses_inside_an_mpi_job(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"already a rank of an MPI job .* `if __name__ == \"__main__\":`"):
        spawn(print, 2)
