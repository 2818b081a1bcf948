"""Restarts after a lost rank (minidl_parallel/restarts.py, run.py's --max-restarts, spawn's
max_restarts; minidl/train/restart.py resumes): the job restarts, resumes from the newest
checkpoint every rank has whole, and ends bit-identical to the run that never failed.

The subprocess tests run real jobs under ``python -m minidl_parallel.run`` with faults injected by
tests/launcher_scripts/with_faults.py (kill -9, sys.exit(1), a stall past the 3 s collective
timeout, kill -9 halfway through writing a checkpoint), each job bounded by a timeout. The slow
test draws 20 faults in a row from a seed (``MINIDL_SLOW=1 pytest -m slow``).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from minidl_parallel import restarts, run
from minidl_parallel.restarts import RestartLog, backoff, check_restart_options, with_restarts

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "launcher_scripts"
RESNET = ["--epochs", "2", "--num-samples", "64", "--batch-size", "8", "--ckpt-steps", "2"]
GPT = ["--steps", "40", "--batch", "4", "--eval-every", "10", "--sample", "0", "--ckpt-steps", "5"]
COLLECTIVE_TIMEOUT_S = 3


# ---- the policy, without MPI ----------------------------------------------------------------

class Failure(RuntimeError):
    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


def test_the_backoff_doubles_from_the_delay_up_to_a_minute():
    assert [backoff(1.0, r) for r in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 8.0]
    assert backoff(1.0, 7) == 60.0 == restarts.MAX_RESTART_DELAY_S
    assert backoff(0.25, 2) == 0.5 and backoff(0, 5) == 0


@pytest.mark.parametrize("max_restarts, delay, message", [
    (-1, 1.0, "who: max_restarts must be an int >= 0 (0: no restarts), got -1"),
    (1.5, 1.0, "who: max_restarts must be an int >= 0 (0: no restarts), got 1.5"),
    (True, 1.0, "who: max_restarts must be an int >= 0 (0: no restarts), got True"),
    (1, -0.5, "who: restart_delay must be a number of seconds >= 0, got -0.5"),
    (1, float("inf"), "who: restart_delay must be a number of seconds >= 0, got inf"),
    (1, "1", "who: restart_delay must be a number of seconds >= 0, got '1'"),
    (1, False, "who: restart_delay must be a number of seconds >= 0, got False"),
])
def test_restart_options_are_checked_naming_the_expected_value(max_restarts, delay, message):
    with pytest.raises(ValueError) as err:
        check_restart_options("who", max_restarts, delay)
    assert str(err.value) == message
    check_restart_options("who", 0, 0)  # the smallest allowed


def _attempts(outcomes, said, slept, monkeypatch):
    monkeypatch.setattr(restarts.time, "sleep", slept.append)
    ran = []

    def attempt(r):
        ran.append(r)
        return outcomes[r]
    return attempt, ran


def test_a_job_that_fails_twice_is_restarted_with_backoff_and_says_why(monkeypatch):
    said, slept = [], []
    outcomes = [Failure("launcher: rank 1 was killed\ntraceback", None), Failure("launcher: rank 0 exited 3", 3), None]
    attempt, ran = _attempts(outcomes, said, slept, monkeypatch)
    assert with_restarts(attempt, 5, 0.5, said.append, "launcher") is None
    assert ran == [0, 1, 2] and slept == [0.5, 1.0]
    assert said == ["restart 1 of at most 5 in 0.5 s, after the first attempt failed: rank 1 was killed",
                    "restart 2 of at most 5 in 1 s, after restart 1 failed: rank 0 exited 3",
                    "finished on restart 2 (of at most 5); the attempts that failed:\n"
                    "  the first attempt: rank 1 was killed\n  restart 1: rank 0 exited 3"]


def test_k_plus_one_failures_return_the_last_one_with_every_cause(monkeypatch):
    said, slept = [], []
    outcomes = [Failure("launcher: first", 2), Failure("launcher: second", 3), Failure("launcher: third\ntb", 4)]
    attempt, ran = _attempts(outcomes, said, slept, monkeypatch)
    error = with_restarts(attempt, 2, 1.0, said.append, "launcher")
    assert ran == [0, 1, 2] and slept == [1.0, 2.0] and error is outcomes[2] and error.status == 4
    assert str(error) == ("launcher: third\ntb\n\n3 attempts failed (at most 2 restarts allowed):\n"
                          "  the first attempt: first\n  restart 1: second\n  restart 2: third")
    assert len(said) == 2  # the two restarts, no "finished"


def test_no_restarts_and_a_failure_that_cannot_be_restarted_stop_at_once(monkeypatch):
    said, slept = [], []
    attempt, ran = _attempts([Failure("launcher: once", 1)], said, slept, monkeypatch)
    error = with_restarts(attempt, 0, 1.0, said.append, "launcher")
    assert (ran, said, slept, str(error)) == ([0], [], [], "launcher: once")
    attempt, ran = _attempts([Failure("launcher: interrupted", 130), None], said, slept, monkeypatch)
    error = with_restarts(attempt, 3, 1.0, said.append, "launcher", can_restart=lambda e: e.status != 130)
    assert (ran, said, slept, str(error)) == ([0], [], [], "launcher: interrupted")
    assert with_restarts(lambda r: None, 3, 1.0, said.append, "launcher") is None and said == []


def test_the_restart_log_reports_each_complete_line_once(tmp_path):
    log = RestartLog(str(tmp_path / "restarts.jsonl"))
    env = log.env(2)
    assert env["MINIDL_RESTART_COUNT"] == "2" and env["MINIDL_RESTART_LOG"] == log.path
    assert len(env["MINIDL_RUN_ID"]) == 32 and env["MINIDL_RUN_ID"] == log.env(3)["MINIDL_RUN_ID"]
    assert RestartLog(str(tmp_path / "other.jsonl")).run_id != log.run_id  # one per job
    assert log.news() == []
    with open(log.path, "a") as f:  # a line that is not JSON is skipped, and the ones after it still read
        f.write(json.dumps({"restart": 1, "checkpoint": "ckpt/a-1_4.ckpt", "step": 4}) + "\nnot json\n")
        f.write(json.dumps({"restart": 2, "checkpoint": None, "step": 0}) + "\n{\"restart\": 3")
    assert log.news() == ["restart 1 resumes after step 4, from ckpt/a-1_4.ckpt",
                          "restart 2 found no checkpoint every rank has whole: it trains from the start"]
    assert log.news() == []
    with open(log.path, "a") as f:
        f.write(', "checkpoint": "b", "step": 9}\n')
    assert log.news() == ["restart 3 resumes after step 9, from b"]
    log.close()
    assert not os.path.exists(log.path)
    assert log.news() == []
    log.close()  # twice: nothing left to remove


@pytest.mark.parametrize("argv, message", [
    (["--max-restarts", "-1"], "--max-restarts must be >= 0 (0: no restarts), got -1"),
    (["--restart-delay", "-2"], "--restart-delay must be a number of seconds >= 0, got -2.0"),
])
def test_run_refuses_bad_restart_options(argv, message, capsys):
    with pytest.raises(SystemExit) as err:
        run.main(["-n", "2", *argv, str(SCRIPTS / "train.py")])
    assert err.value.code == 2
    assert message in capsys.readouterr().err


# ---- real jobs under the launcher -----------------------------------------------------------

def _env(faults=()):
    pytest.importorskip("mpi4py")
    env = {k: v for k, v in os.environ.items()
           if k not in ("MINIDL_DIST_DEBUG", "MINIDL_DEVICE", "PRTE_ALLOW_RUN_AS_ROOT", "PRTE_ALLOW_RUN_AS_ROOT_CONFIRM",
                        "MINIDL_RESTART_COUNT", "MINIDL_RESTART_LOG", "MINIDL_RUN_ID")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    env["MINIDL_COLLECTIVE_TIMEOUT"] = str(COLLECTIVE_TIMEOUT_S)
    env["MINIDL_TEST_FAULTS"] = json.dumps(list(faults))
    return env


def launch(tmp_path, example, args, faults=(), max_restarts=0, timeout=600):
    """The example under ``python -m minidl_parallel.run -n 2`` (through with_faults.py), in tmp_path."""
    cmd = [sys.executable, "-m", "minidl_parallel.run", "-n", "2", "--allow-run-as-root", "--max-restarts",
           str(max_restarts), "--restart-delay", "0", str(SCRIPTS / "with_faults.py"), str(ROOT / "examples" / example),
           *args]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(faults), capture_output=True, text=True, timeout=timeout)
    proc.seconds = time.monotonic() - start
    return proc


PREFIXES = {"resnet_cifar.py": "resnet20", "gpt_char.py": "gpt"}


def _final_files(directory, example):
    """Each rank's newest checkpoint in directory (ModelCheckpoint's or the GPT example's names)."""
    from minidl.train.restart import _candidates
    found = _candidates(directory, PREFIXES[example])
    newest = os.path.join(directory, found[max(found)])
    return [newest, newest.replace(".ckpt", "_rank1.ckpt")]


def _assert_same_state(files, reference_files):
    from minidl.io.safetensors import load_file
    for got_path, want_path in zip(files, reference_files):
        got, want = load_file(got_path), load_file(want_path)
        assert got.keys() == want.keys()
        differ = [name for name in got if not np.array_equal(got[name], want[name])]
        assert not differ, (got_path, differ[:5])


_REFERENCES = {}


def _reference(tmp_path_factory, example, args):
    """The uninterrupted run's final checkpoint files (each rank's), once per example."""
    if example not in _REFERENCES:
        folder = tmp_path_factory.mktemp("reference")
        proc = launch(folder, example, [*args, "--ckpt-dir", "ckpt"])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        _REFERENCES[example] = _final_files(folder / "ckpt", example)
    return _REFERENCES[example]


def _resumed_steps(proc):
    return [int(line.split("after step ")[1].split(",")[0]) for line in proc.stderr.splitlines()
            if " resumes after step " in line]


@pytest.mark.cpu_only
def test_resnet20_restarts_after_a_kill_an_exit_and_a_stall_and_ends_bit_identical(tmp_path, tmp_path_factory):
    example = "resnet_cifar.py"
    reference = _reference(tmp_path_factory, "resnet_cifar.py", RESNET)
    faults = [{"step": 3, "rank": 1, "kind": "kill"}, {"step": 5, "rank": 0, "kind": "exit"},
              {"step": 7, "rank": 1, "kind": "stall"}]
    proc = launch(tmp_path, "resnet_cifar.py", [*RESNET, "--ckpt-dir", "ckpt"], faults, max_restarts=3)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # checkpoints every 2 steps; each fault comes after its step, before that step's checkpoint
    assert _resumed_steps(proc) == [2, 4, 6]
    # rank 0 says it (its output is the launcher's), once per restart
    assert [line.split(" (after")[0].rsplit("/", 1)[1] for line in proc.stdout.splitlines()
            if line.startswith("Model.train: restart ")] == ["resnet20-1_2.ckpt", "resnet20_1-1_4.ckpt",
                                                              "resnet20_2-2_2.ckpt"]
    causes = [line for line in proc.stderr.splitlines() if " failed: " in line and line.startswith("python -m")]
    assert len(causes) == 3
    assert "rank 1 of 2" in causes[0] and "killed by a signal" in causes[0]
    assert "rank 0 of 2" in causes[1] and "exited with status 1 (sys.exit(1))" in causes[1]
    assert "finished on restart 3 (of at most 3); the attempts that failed:" in proc.stderr
    # the stalled rank's partner named it when the collective timed out
    stalled = (tmp_path / "log_output" / "restart.2" / "rank.0" / "stderr").read_text()
    assert "timed out after 3.0 s; ranks that have not arrived: [1]" in stalled
    _assert_same_state(_final_files(tmp_path / "ckpt", example), reference)


@pytest.mark.cpu_only
def test_gpt_custom_loop_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(tmp_path, tmp_path_factory):
    example = "gpt_char.py"
    reference = _reference(tmp_path_factory, "gpt_char.py", GPT)
    faults = [{"step": 15, "rank": 1, "kind": "kill_saving"}, {"step": 22, "rank": 0, "kind": "kill"}]
    proc = launch(tmp_path, "gpt_char.py", [*GPT, "--ckpt-dir", "ckpt"], faults, max_restarts=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # rank 1 died writing step 15's file: rank 0's step-15 file alone is not a checkpoint of the job
    assert _resumed_steps(proc) == [10, 20]
    written = (tmp_path / "log_output" / "rank.1" / "stdout").read_text()
    assert "killed halfway through writing" in written and "gpt-1_15_rank1.ckpt" in written
    assert not [name for name in os.listdir(tmp_path / "ckpt") if name.endswith(".tmp")]  # the torn file went
    _assert_same_state(_final_files(tmp_path / "ckpt", example), reference)


@pytest.mark.cpu_only
def test_k_plus_one_faults_end_with_the_last_failures_status_and_every_cause(tmp_path):
    cmd = [sys.executable, "-m", "minidl_parallel.run", "-n", "3", "--allow-run-as-root", "--max-restarts", "2",
           "--restart-delay", "0.1", str(SCRIPTS / "fault.py"), "exit3"]
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert time.monotonic() - start < 60
    err = proc.stderr
    assert "restart 1 of at most 2 in 0.1 s, after the first attempt failed: rank 2 of 3" in err
    assert "restart 2 of at most 2 in 0.2 s, after restart 1 failed: rank 2 of 3" in err
    summary = err[err.index("3 attempts failed (at most 2 restarts allowed):"):].splitlines()
    assert [line.split(":")[0].strip() for line in summary[1:4]] == ["the first attempt", "restart 1", "restart 2"]
    assert all("exited with status 3 (sys.exit(3))" in line for line in summary[1:4])
    for r in (1, 2):  # each attempt's logs apart
        assert (tmp_path / "log_output" / f"restart.{r}" / "rank.2" / "stderr").exists()


@pytest.mark.cpu_only
def test_spawn_restarts_and_gives_up_after_max_restarts(tmp_path):
    env = _env()
    env.update(PRTE_ALLOW_RUN_AS_ROOT="1", PRTE_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    proc = subprocess.run([sys.executable, str(SCRIPTS / "spawn_cases.py"), "restarts", "exhausted"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = {line.split(":")[0]: line.split(" ", 2)[1:] for line in proc.stdout.splitlines()
               if line.startswith(("restarts:", "exhausted:"))}
    kind, details = results["restarts"]
    values = json.loads(details)["value"]
    assert kind == "ok" and [v["restart"] for v in values] == [2, 2]
    assert values[0]["run_id"] == values[1]["run_id"]
    kind, details = results["exhausted"]
    error = json.loads(details)
    assert kind == "SpawnError" and error["status"] == 3 and error["rank"] == 1
    assert "2 attempts failed (at most 1 restarts allowed):\n  the first attempt: rank 1 of 2" in error["message"]
    assert "spawn: restart 1 of at most 2 in 0 s, after the first attempt failed: rank 1 of 2" in proc.stderr


# ---- 20 faults in a row ---------------------------------------------------------------------

def _drawn_faults(seed, count, first_step, last_step):
    """count faults at increasing steps, each after a later checkpoint than the one before (so every
    restart makes progress), on a drawn rank, of a drawn kind."""
    rng = np.random.default_rng(seed)
    kinds = ["kill", "exit", "stall", "kill_saving"]
    steps = np.sort(rng.choice(np.arange(first_step, last_step), count, replace=False))
    return [{"step": int(s), "rank": int(rng.integers(2)), "kind": kinds[rng.integers(len(kinds))]} for s in steps]


@pytest.mark.slow
@pytest.mark.cpu_only
@pytest.mark.parametrize("example, args, steps", [
    ("resnet_cifar.py", ["--epochs", "6", "--num-samples", "64", "--batch-size", "8", "--ckpt-steps", "1"], 24),
    ("gpt_char.py", ["--steps", "60", "--batch", "4", "--eval-every", "10", "--sample", "0", "--ckpt-steps", "2"], 60),
])
def test_twenty_faults_in_a_row_lose_nothing(tmp_path, tmp_path_factory, example, args, steps):
    folder = tmp_path_factory.mktemp("reference")
    proc = launch(folder, example, [*args, "--ckpt-dir", "ckpt"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = _final_files(folder / "ckpt", example)
    faults = _drawn_faults(2026, 20, 2, steps)
    start = time.monotonic()
    proc = launch(tmp_path, example, [*args, "--ckpt-dir", "ckpt"], faults, max_restarts=20, timeout=1800)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "finished on restart 20 (of at most 20)" in proc.stderr
    print(f"\n{example}: 20 faults {sorted({f['kind'] for f in faults})} in {time.monotonic() - start:.0f} s")
    _assert_same_state(_final_files(tmp_path / "ckpt", example), reference)


@pytest.mark.slow
@pytest.mark.cpu_only
@pytest.mark.parametrize("mode", [["--zero", "level2"], ["--zero", "level3"], ["--pipeline", "2"]])
def test_gpt_restarts_with_optimizer_parallelism_or_a_pipeline_end_bit_identical(tmp_path, tmp_path_factory, mode):
    args = ["--steps", "20", "--batch", "4", "--eval-every", "10", "--sample", "0", "--ckpt-steps", "5", *mode]
    folder = tmp_path_factory.mktemp("reference")
    proc = launch(folder, "gpt_char.py", [*args, "--ckpt-dir", "ckpt"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    faults = [{"step": 7, "rank": 1, "kind": "kill"}, {"step": 13, "rank": 0, "kind": "kill_saving"}]
    proc = launch(tmp_path, "gpt_char.py", [*args, "--ckpt-dir", "ckpt"], faults, max_restarts=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert _resumed_steps(proc) == [5, 10]
    _assert_same_state(_final_files(tmp_path / "ckpt", "gpt_char.py"), _final_files(folder / "ckpt", "gpt_char.py"))
