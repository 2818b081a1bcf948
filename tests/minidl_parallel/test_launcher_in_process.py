"""``python -m minidl_parallel.run``'s own behaviour in this process (run.main with stand-in workers,
the ``launcher`` fixture of test_restart_launcher.py): its refusals and their messages in full, what
start_workers and wait are given, following rank 0's log, Ctrl-C and the exit status. The same
paths with real MPI jobs are in test_launcher.py (subprocesses, which mutation testing cannot see)."""
import importlib.util
import os
import socket

import pytest

from minidl_parallel import run, spawning
from minidl_parallel.spawning import START_TIMEOUT_S

from test_restart_launcher import SCRIPT, _failure, launcher  # noqa: F401 (launcher: a fixture)

PROG = run.PROG


def _refusal(argv, capsys):
    """The last line argparse prints when run.main refuses argv (after the usage), checking status 2."""
    with pytest.raises(SystemExit) as exit_info:
        run.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("argv, message", [
    (["-n", "0", SCRIPT], "-n must be >= 1, got 0"),
    (["-n", "2", "missing.py"], "script 'missing.py': no such file (relative to {cwd})"),
    (["-n", "2", "--hostfile", "nohosts", SCRIPT], "--hostfile 'nohosts': no such file (relative to {cwd})"),
    (["-n", "2", "--timeout", "-1", SCRIPT], "--timeout must be a number of seconds >= 0 (0: no limit), got -1.0"),
    (["-n", "2", "--start-timeout", "inf", SCRIPT], "--start-timeout must be a number of seconds >= 0 (0: no limit), "
                                                    "got inf"),
    (["-n", "2", "--restart-delay", "inf", SCRIPT], "--restart-delay must be a number of seconds >= 0, got inf"),
])
def test_bad_arguments_are_refused_naming_the_expected_value(tmp_path, monkeypatch, argv, message, capsys):
    monkeypatch.chdir(tmp_path)
    assert _refusal(argv, capsys) == f"{PROG}: error: " + message.format(cwd=tmp_path)


def test_one_worker_is_a_job(launcher):
    status, starts, _ = launcher(["-n", "1"], [None])
    assert (status, [s["n"] for s in starts]) == (0, [1])


def test_workers_get_the_script_its_arguments_and_this_minidl_parallel(launcher, tmp_path):
    status, starts, _ = launcher(["-n", "2"], [None], script_args=["--epochs", "3"])
    assert status == 0
    (start,) = starts
    assert {k: start[k] for k in ("MPI", "mode", "who", "hostfile")} == {
        "MPI": "MPI", "mode": "script", "who": PROG, "hostfile": None}  # MPI: what init_mpi returned
    first, second = start["jobs"]
    assert first == second and set(first) == {"script", "argv", "sys_path_append", "env"}
    assert (first["script"], first["argv"]) == (SCRIPT, ["--epochs", "3"])
    (package_root,) = first["sys_path_append"]  # where the launcher's own minidl_parallel is
    assert os.path.samefile(os.path.join(package_root, "minidl_parallel", "run.py"), run.__file__)
    assert start["workers"].closed and not start["workers"].abandoned


def test_the_hostfile_and_the_bounds_reach_the_workers(launcher, tmp_path):
    (tmp_path / "hosts").write_text("localhost slots=2\n")
    status, starts, _ = launcher(["-n", "2", "--hostfile", "hosts", "--timeout", "5", "--start-timeout", "7"], [None])
    assert (status, starts[0]["hostfile"], starts[0]["start_timeout"]) == (0, str(tmp_path / "hosts"), 7.0)
    assert starts[0]["workers"].bounds == (5.0, 7.0)
    _, starts, _ = launcher(["-n", "2"], [None])  # the defaults: no limit on the run, a minute to start
    assert (starts[0]["start_timeout"], starts[0]["workers"].bounds) == (START_TIMEOUT_S, (0.0, START_TIMEOUT_S))


def test_a_rank_of_an_mpi_job_is_told_to_run_the_script_directly(launcher, monkeypatch, capsys):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    status, starts, _ = launcher(["-n", "2"], [None])
    assert (status, starts) == (2, [])
    assert capsys.readouterr().err == (f"{PROG}: this process is already a rank of an MPI job (under mpirun?); run the "
                                       f"script directly there, or start this launcher without mpirun\n")


def _as_root_without_variables(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    for name in spawning.ROOT_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def test_as_root_the_launcher_needs_the_flag_which_sets_prrtes_variables(launcher, monkeypatch, capsys):
    _as_root_without_variables(monkeypatch)
    status, starts, _ = launcher(["-n", "2"], [None])
    assert (status, starts) == (2, [])
    assert capsys.readouterr().err == (
        f"{PROG}: this process runs as root, and Open MPI's runtime (PRRTE) refuses to start workers as root unless "
        f"both PRTE_ALLOW_RUN_AS_ROOT=1 and PRTE_ALLOW_RUN_AS_ROOT_CONFIRM=1 are set (missing: PRTE_ALLOW_RUN_AS_ROOT, "
        f"PRTE_ALLOW_RUN_AS_ROOT_CONFIRM); pass --allow-run-as-root (as mpirun needs), or export both. mpirun's "
        f"OMPI_ALLOW_RUN_AS_ROOT and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM do not cover MPI_Comm_spawn\n")
    status, starts, _ = launcher(["-n", "2", "--allow-run-as-root"], [None])
    assert (status, len(starts)) == (0, 1)
    assert [os.environ.get(name) for name in spawning.ROOT_VARIABLES] == ["1", "1"]


def test_a_log_dir_is_reused_and_one_that_cannot_be_made_is_named(launcher, tmp_path, capsys):
    assert launcher(["-n", "2"], [None])[0] == 0
    assert launcher(["-n", "2"], [None])[0] == 0  # a second run into the same folder
    (tmp_path / "afile").write_text("")
    with pytest.raises(OSError) as cause:
        os.makedirs(tmp_path / "afile" / "logs")
    capsys.readouterr()
    status, starts, _ = launcher(["-n", "2", "--log-dir", "afile/logs"], [None])
    assert (status, starts) == (2, [])
    assert capsys.readouterr().err == f"{PROG}: --log-dir 'afile/logs' cannot be made: {cause.value}\n"


def test_without_mpi4py_the_launcher_names_the_extra_to_install(launcher, monkeypatch, capsys):
    monkeypatch.setattr(run, "init_mpi", spawning.init_mpi)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "mpi4py" else find_spec(name, *rest))
    status, starts, _ = launcher(["-n", "2"], [None])
    assert (status, starts) == (2, [])
    assert capsys.readouterr().err == f"{PROG}: needs mpi4py and Open MPI: pip install 'minidl[mpi]'\n"


def test_a_log_dir_outside_the_working_directory_is_shown_whole(launcher, tmp_path, monkeypatch, capsys):
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    status, _, _ = launcher(["-n", "2", "--log-dir", "../logs"], [_failure("rank 1 of 2 was killed")])
    logs = tmp_path / "logs"
    assert status == 1
    assert capsys.readouterr().err == (
        f"{PROG}: starting 2 workers; their output goes to {logs}/rank.N/stdout and stderr, rank 0's also here\n"
        f"{PROG}: rank 1 of 2 was killed\n(each rank's output: {logs}/rank.N/stdout and stderr)\n")


def _ticks(*states):
    """An on_wait that ticks once per state (pids, hosts, what rank 0 has written to stdout by then), then
    writes 'end' (which only the final copy after the wait shows)."""
    def on_wait(workers, tick):
        rank0 = os.path.join(workers.job["env"]["MINIDL_RESTART_LOG"].rsplit(os.sep, 1)[0], "rank.0")
        os.makedirs(rank0, exist_ok=True)
        with open(os.path.join(rank0, "stdout"), "a") as out:
            for pids, hosts, text in states:
                workers.pids, workers.hosts = pids, hosts
                out.write(text)
                out.flush()
                tick(workers)
            out.write("end\n")
    return on_wait


def test_rank_0s_output_on_this_host_is_copied_here_once(launcher, tmp_path, capsys):
    here = socket.gethostname()
    on_wait = _ticks(([None, None], [None, None], "a\n"), ([11, None], [here, None], "b\n"),
                     ([11, 12], [here, "far"], "c\n"), ([11, 12], [here, "far"], ""))
    status, _, _ = launcher(["-n", "2"], [None], on_wait=on_wait)
    assert status == 0
    out, err = capsys.readouterr()
    assert out == "a\nb\nc\nend\n"
    assert "rank 0 runs on" not in err


def test_rank_0_elsewhere_is_said_once_with_where_its_output_is(launcher, tmp_path, capsys):
    on_wait = _ticks(([None, 12], [None, "far1"], ""), ([11, 12], ["far0", "far1"], "a\n"),
                     ([11, 12], ["far0", "far1"], "b\n"))
    status, _, _ = launcher(["-n", "2"], [None], on_wait=on_wait)
    assert status == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert [line for line in err.splitlines() if "rank 0 runs on" in line] == [
        f"{PROG}: rank 0 runs on far0: its output is in {tmp_path / 'log_output'}/rank.0/ there"]


def test_ctrl_c_while_waiting_ends_the_workers_and_exits_130_without_restarting(launcher, capsys):
    status, starts, slept = launcher(["-n", "2", "--max-restarts", "2"], [KeyboardInterrupt(), None])
    assert (status, len(starts), slept) == (130, 1, [])
    assert starts[0]["workers"].abandoned
    assert capsys.readouterr().err.splitlines()[-2:] == [
        f"{PROG}: interrupted; ending the workers", "(each rank's output: log_output/rank.N/stdout and stderr)"]
