"""``python -m minidl_parallel.run``'s restart loop in this process (run.main with stand-in
workers): which attempts start, with how many workers, where their logs go, what they are told,
what is said, and the exit status. The real jobs are in test_restarts.py and test_elastic.py."""
import json
import os

import pytest

from minidl_parallel import elastic, restarts, run
from minidl_parallel.spawning import SpawnError

from test_restarts import SCRIPTS

SCRIPT = str(SCRIPTS / "train.py")


class _Workers:
    """What start_workers returns: wait() runs ``on_wait(workers, tick)`` (by default one tick) and gives the
    attempt's outcome, raising it when it is a KeyboardInterrupt (Ctrl-C while waiting)."""

    def __init__(self, outcome, n, job, on_wait):
        self.outcome, self.job, self.on_wait = outcome, job, on_wait
        self.pids, self.hosts = [None] * n, ["elsewhere"] * n
        self.closed = self.abandoned = False
        self.bounds = None  # the timeout and start_timeout wait() was given

    def wait(self, timeout, start_timeout, on_tick):
        self.bounds = (timeout, start_timeout)
        self.on_wait(self, on_tick)
        if isinstance(self.outcome, KeyboardInterrupt):
            raise self.outcome
        return self.outcome

    def close(self):
        self.closed = True

    def abandon(self):
        self.abandoned = True


def _one_tick(workers, tick):
    tick(workers)


def _failure(message, status=None):
    error = SpawnError(f"{run.PROG}: {message}")
    error.status = status
    return error


@pytest.fixture
def launcher(monkeypatch, tmp_path):
    """run.main with start_workers replaced: ``outcomes`` are the attempts' results in order (None:
    success; a SpawnError: that failure; a KeyboardInterrupt: Ctrl-C while waiting; ("start", error):
    start_workers raises it). Returns (run's status, the starts: what start_workers was given and the
    workers it returned, the sleeps)."""
    monkeypatch.chdir(tmp_path)
    for name in ("PRTE_ALLOW_RUN_AS_ROOT", "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM"):
        monkeypatch.setenv(name, "1")
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "OMPI_PARENT_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(run, "init_mpi", lambda who: "MPI")
    monkeypatch.setattr(run, "spawning_stuck", lambda: False)
    slept = []
    monkeypatch.setattr(restarts.time, "sleep", slept.append)  # (elastic.py's waits too: the same module)

    def main(argv, outcomes, on_wait=_one_tick, script_args=()):
        starts = []
        queue = list(outcomes)

        def start_workers(MPI, n, mode, jobs, *, who, log_dir, hostfile, start_timeout):
            start = {"MPI": MPI, "n": n, "mode": mode, "who": who, "log_dir": log_dir, "hostfile": hostfile,
                     "start_timeout": start_timeout, "env": jobs[0]["env"], "jobs": jobs}
            starts.append(start)
            outcome = queue.pop(0)
            if isinstance(outcome, tuple):
                raise outcome[1]
            start["workers"] = _Workers(outcome, n, jobs[0], on_wait)
            return start["workers"]
        monkeypatch.setattr(run, "start_workers", start_workers)
        status = run.main(argv + [SCRIPT, *script_args])
        return status, starts, slept
    return main


def test_two_failures_then_success_restart_twice_each_attempt_told_its_count(launcher, tmp_path, capsys):
    outcomes = [_failure("rank 1 of 2 was killed"), ("start", _failure("the workers did not start")), None]
    status, starts, slept = launcher(["-n", "2", "--max-restarts", "3"], outcomes)
    assert status == 0
    logs = str(tmp_path / "log_output")
    assert [s["log_dir"] for s in starts] == [logs, os.path.join(logs, "restart.1"), os.path.join(logs, "restart.2")]
    assert [s["env"]["MINIDL_RESTART_COUNT"] for s in starts] == ["0", "1", "2"]
    assert len({s["env"]["MINIDL_RUN_ID"] for s in starts}) == 1  # one job
    assert all(s["env"]["MINIDL_RESTART_LOG"] == os.path.join(logs, "restarts.jsonl") for s in starts)
    assert [s["n"] for s in starts] == [2, 2, 2] and all(len(s["jobs"]) == 2 for s in starts)
    assert slept == [1.0, 2.0]  # the default delay, doubled
    err = capsys.readouterr().err
    assert f"{run.PROG}: restart 1 of at most 3 in 1 s, after the first attempt failed: rank 1 of 2 was killed" in err
    assert "restart 2 of at most 3 in 2 s, after restart 1 failed: the workers did not start" in err
    assert "finished on restart 2 (of at most 3); the attempts that failed:" in err
    assert not os.path.exists(os.path.join(logs, "restarts.jsonl"))  # removed at the end


def test_after_max_restarts_the_last_failures_status_and_every_cause(launcher, capsys):
    outcomes = [_failure("rank 0 of 2 exited with status 2", 2), _failure("rank 1 of 2 exited with status 5", 5)]
    status, starts, slept = launcher(["-n", "2", "--max-restarts", "1", "--restart-delay", "0.5"], outcomes)
    assert (status, len(starts), slept) == (5, 2, [0.5])
    assert [s["workers"].abandoned for s in starts] == [True, True]
    assert capsys.readouterr().err == (
        f"{run.PROG}: starting 2 workers; their output goes to log_output/rank.N/stdout and stderr, rank 0's also "
        f"here\n"
        f"{run.PROG}: restart 1 of at most 1 in 0.5 s, after the first attempt failed: rank 0 of 2 exited with "
        f"status 2\n"
        f"{run.PROG}: starting 2 workers; their output goes to log_output/restart.1/rank.N/stdout and stderr, rank 0's "
        f"also here\n"
        f"{run.PROG}: rank 1 of 2 exited with status 5\n"
        f"(each rank's output: log_output/restart.1/rank.N/stdout and stderr)\n\n"
        f"2 attempts failed (at most 1 restarts allowed):\n"
        f"  the first attempt: rank 0 of 2 exited with status 2\n"
        f"  restart 1: rank 1 of 2 exited with status 5\n")


# A failure's status is the launcher's when it is one a process can exit with (1..255), else 1.
@pytest.mark.parametrize("status, expected", [(130, 130), (None, 1), (300, 1), (0, 1), (1, 1), (255, 255),
                                              (256, 1), (-9, 1)])
def test_an_interrupt_is_not_restarted_and_statuses_outside_1_255_exit_1(launcher, status, expected):
    outcomes = [_failure("interrupted; ending the workers", status), _failure("again", status)]
    got, starts, _ = launcher(["-n", "2", "--max-restarts", "1", "--restart-delay", "0"], outcomes)
    assert got == expected and len(starts) == (1 if status == 130 else 2)


def test_no_restart_once_mpi_is_stuck_in_this_process(launcher, monkeypatch):
    monkeypatch.setattr(run, "spawning_stuck", lambda: True)
    status, starts, _ = launcher(["-n", "2", "--max-restarts", "3"], [("start", _failure("did not start"))])
    assert (status, len(starts)) == (1, 1)


def test_ctrl_c_in_the_backoff_ends_the_job_without_restarting(launcher, monkeypatch, capsys, tmp_path):
    def interrupted(seconds):
        raise KeyboardInterrupt
    monkeypatch.setattr(restarts.time, "sleep", interrupted)
    status, starts, _ = launcher(["-n", "2", "--max-restarts", "3"], [_failure("rank 1 of 2 was killed"), None])
    assert (status, len(starts)) == (130, 1)
    assert capsys.readouterr().err.splitlines()[-2:] == [
        f"{run.PROG}: restart 1 of at most 3 in 1 s, after the first attempt failed: rank 1 of 2 was killed",
        f"{run.PROG}: interrupted; not restarting"]
    assert not (tmp_path / "log_output" / "restarts.jsonl").exists()  # removed on the way out too


def test_where_a_restart_resumed_is_said_as_rank_0_logs_it(launcher, capsys):
    def resumed(workers, tick):
        if workers.job["env"]["MINIDL_RESTART_COUNT"] == "1":
            with open(workers.job["env"]["MINIDL_RESTART_LOG"], "a") as f:
                f.write(json.dumps({"restart": 1, "checkpoint": "ckpt/a-1_4.ckpt", "step": 4}) + "\n")
        tick(workers)
    status, _, _ = launcher(["-n", "2", "--max-restarts", "1", "--restart-delay", "0"], [_failure("lost"), None],
                            on_wait=resumed)
    assert status == 0
    assert f"{run.PROG}: restart 1 resumes after step 4, from ckpt/a-1_4.ckpt" in capsys.readouterr().err


def _discovery(tmp_path, answers):
    """A discovery script printing answers[k] on its k-th call (the last one after that)."""
    calls = tmp_path / "calls"
    lines = "\n".join(f'[ "$n" -eq {k} ] && {{ printf "{a}"; exit 0; }}' for k, a in enumerate(answers[:-1]))
    path = tmp_path / "hosts.sh"
    path.write_text(f'#!/bin/sh\necho x >> "{calls}"\nn=$(($(wc -l < "{calls}") - 1))\n{lines}\n'
                    f'printf "{answers[-1]}"\n')
    path.chmod(0o755)
    return str(path)


def test_elastic_attempts_run_on_the_slots_discovered(launcher, tmp_path, capsys):
    script = _discovery(tmp_path, ["localhost:4\\n", "localhost:2\\n"])
    status, starts, _ = launcher(["-n", "4", "--min-np", "2", "--max-np", "4", "--host-discovery-script", script,
                                  "--max-restarts", "2", "--restart-delay", "0"], [_failure("rank 3 lost"), None])
    assert status == 0
    assert [s["n"] for s in starts] == [4, 2] and [len(s["jobs"]) for s in starts] == [4, 2]
    assert [open(s["hostfile"]).read() for s in starts] == ["localhost slots=4\n", "localhost slots=2\n"]
    assert "starting 4 workers" in capsys.readouterr().err


def test_too_few_slots_end_the_job_without_another_restart(launcher, tmp_path, capsys):
    script = _discovery(tmp_path, ["a:2\\n", "a:1\\n"])
    status, starts, _ = launcher(["-n", "2", "--host-discovery-script", script, "--elastic-timeout", "0",
                                  "--max-restarts", "3", "--restart-delay", "0"], [_failure("rank 1 lost")])
    assert (status, len(starts)) == (1, 1)
    err = capsys.readouterr().err
    assert "only 1 slot(s) on the discovered hosts (a:1), fewer than --min-np 2, for 0 s (--elastic-timeout)" in err
    assert "2 attempts failed (at most 3 restarts allowed)" in err


def test_an_elastic_launch_says_while_it_waits_for_hosts(launcher, tmp_path, capsys):
    script = _discovery(tmp_path, ["a:1\\n", "localhost:2\\n"])
    status, starts, slept = launcher(["-n", "2", "--host-discovery-script", script], [None])
    assert (status, [s["n"] for s in starts]) == (0, [2])
    # one wait between the two calls (slept may also hold subprocess's short polls while a call ends: the
    # fixture's stand-in replaces time.sleep itself)
    assert slept.count(elastic.DISCOVERY_INTERVAL_S) == 1
    assert f"{run.PROG}: waiting for hosts: 1 slot(s) discovered, --min-np is 2\n" in capsys.readouterr().err


@pytest.mark.parametrize("n, min_np", [(2, 1), (1, 1)])
def test_an_elastic_launch_may_go_down_to_one_worker(launcher, tmp_path, n, min_np):
    script = _discovery(tmp_path, ["localhost:2\\n", "localhost:1\\n"])
    status, starts, _ = launcher(["-n", str(n), "--min-np", str(min_np), "--host-discovery-script", script,
                                  "--max-restarts", "1", "--restart-delay", "0"], [_failure("rank 1 lost"), None])
    assert (status, [s["n"] for s in starts]) == (0, [n, 1])
