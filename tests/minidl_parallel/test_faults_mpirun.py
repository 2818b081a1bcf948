"""Faults under real mpirun end the job, fast and naming the rank: no fault may hang it.

Each test runs tests/mpi/fault_on_rank.py under ``mpirun -n 2`` with a 2 s collective timeout
and a 0.5 s stall warning, in its own process group bounded by HANG_LIMIT_S: code that hangs
fails the test (and its processes are killed) instead of hanging the suite. Every test
measures the fault-to-end time: from the "t0" line the driver prints just before the fault
to the end of mpirun. Run with ``-s`` to see the table of them; set MINIDL_FAULT_TIMES=path
to have it written there too (JSON lines). Skipped without mpirun/mpi4py.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# mpirun starts fresh processes: they import the machine's own CuPy, not the device double.
pytestmark = pytest.mark.cpu_only

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "tests" / "mpi" / "fault_on_rank.py"
TIMEOUT_S = 2.0  # MINIDL_COLLECTIVE_TIMEOUT in these jobs
STALL_S = 0.5  # MINIDL_STALL_WARNING_SECONDS
HANG_LIMIT_S = 30  # a job still running then has hung: it is killed and the test fails
# Fault to end of the job. A fault that kills or aborts at once: 10 s (mpirun's teardown
# takes ~1 s). One caught by the timeout: the timeout, plus the question window of the
# warning and of the timeout (0.5 s each at a 2 s timeout), plus that teardown.
FAST_END_S = 10.0
TIMEOUT_END_S = TIMEOUT_S + 8.0

_times = []


def _mpirun_path():
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")


class Job:
    def __init__(self, mode, returncode, stdout, stderr, seconds_after_t0):
        self.mode, self.returncode, self.stdout, self.stderr = mode, returncode, stdout, stderr
        self.seconds_after_t0 = seconds_after_t0

    @property
    def output(self):
        return self.stdout + self.stderr

    def lines(self, prefix):
        return [line for line in self.output.splitlines() if line.startswith(prefix)]


def run_fault(mode, debug=None, timeout=TIMEOUT_S, stall=STALL_S):
    """Runs the driver in ``mode`` under mpirun -n 2; fails the test if it is still running
    after HANG_LIMIT_S (and kills its whole process group, so no rank is left spinning)."""
    if _mpirun_path() is None:
        pytest.skip("mpirun is not on PATH (pip install 'minidl[mpi]')")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'minidl[mpi]')")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINIDL_")}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MINIDL_COLLECTIVE_TIMEOUT=str(timeout), MINIDL_STALL_WARNING_SECONDS=str(stall))
    if debug is not None:
        env["MINIDL_DIST_DEBUG"] = debug
    cmd = [_mpirun_path(), "--oversubscribe", "-n", "2", sys.executable, str(DRIVER), mode]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=HANG_LIMIT_S)
    except subprocess.TimeoutExpired:
        _end_session(proc)
        stdout, stderr = proc.communicate()
        pytest.fail(f"mode {mode!r} (MINIDL_DIST_DEBUG={debug}): the job hung: still running after {HANG_LIMIT_S} s "
                    f"(killed)\n{stdout[-2000:]}{stderr[-2000:]}")
    ended = time.time()
    t0 = [float(m) for m in re.findall(r"^rank \d: t0=([0-9.]+)$", stdout, re.M)]
    assert len(t0) == 2, f"both ranks must print t0 before the fault:\n{stdout}{stderr}"
    job = Job(mode, proc.returncode, stdout, stderr, ended - max(t0))
    return job


def _end_session(proc):
    """Ends a hung job: SIGTERM makes mpirun kill its ranks; what is left of the session after
    5 s (the ranks have process groups of their own, but share mpirun's session) is killed."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == proc.pid:
                    os.kill(int(entry), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(scope="module", autouse=True)
def fault_time_table():
    """Prints (with -s) and optionally writes the fault-to-end times of the tests that ran."""
    yield
    if not _times:
        return
    print("\nfault                                    end (s)  rc  message")
    for row in _times:
        print(f"{row['fault']:<40s} {row['seconds']:7.2f} {row['rc']:3d}  {row['message'][:160]}")
    path = os.environ.get("MINIDL_FAULT_TIMES")
    if path:
        with open(path, "a") as f:
            for row in _times:
                f.write(json.dumps(row) + "\n")


def record(fault, job, message):
    _times.append({"fault": fault, "seconds": round(job.seconds_after_t0, 3), "rc": job.returncode,
                   "message": message})


def first_line(job, needle):
    for line in job.output.splitlines():
        if needle in line:
            return line.strip()
    return ""


def test_sys_exit_3_on_a_rank_ends_the_job_at_once_with_its_status():
    job = run_fault("exit3")
    record("sys.exit(3) on rank 1", job, first_line(job, "called sys.exit"))
    assert job.returncode == 3, job.output
    assert "minidl_parallel: rank 1 of 2 called sys.exit(3); aborting the MPI job" in job.stderr
    assert job.seconds_after_t0 < FAST_END_S, job.output


def test_sys_exit_0_on_a_rank_ends_the_waiting_rank_at_the_timeout_naming_it():
    job = run_fault("exit0")
    message = first_line(job, "timed out after")
    record("sys.exit(0) on rank 1", job, message)
    assert job.returncode != 0, job.output
    assert re.search(r"rank 0 of 2 \(mpi backend\): allreduce #1\(shape=\(3, 5\), dtype=float32\) timed out after "
                     r"\d+\.\d s", message), message
    assert "ranks that have not arrived: [1]" in message
    assert "rank 1 has left the program (exit status 0)" in message
    assert "rank 0: returned" not in job.stdout
    assert TIMEOUT_S <= job.seconds_after_t0 < TIMEOUT_END_S, job.output


def test_a_stalled_rank_is_warned_about_then_named_at_the_timeout():
    job = run_fault("stall")
    message = first_line(job, "timed out after")
    record("rank 1 sleeps 60 s (stall)", job, message)
    assert job.returncode != 0, job.output
    warning = first_line(job, "CollectiveStallWarning")
    assert re.search(r"allreduce #1\(shape=\(3, 5\), dtype=float32\) has waited \d+\.\d s; "
                     r"ranks that have not arrived: \[1\]", warning), warning
    assert re.search(r"allreduce #1\(shape=\(3, 5\), dtype=float32\) timed out after \d+\.\d s; "
                     r"ranks that have not arrived: \[1\]", message), message
    # The watchdog of the stalled rank answers for it: busy outside any collective.
    assert "rank 1 is running outside any collective" in message
    assert job.stderr.index("CollectiveStallWarning") < job.stderr.index("timed out after")
    # The warning points at the line where rank 0 waits (the watchdog thread warns for it).
    waiting_line = DRIVER.read_text().splitlines().index("comm.allreduce(np.ones((3, 5), dtype=np.float32))") + 1
    assert warning.startswith(f"{DRIVER}:{waiting_line}: CollectiveStallWarning"), warning
    assert TIMEOUT_S <= job.seconds_after_t0 < TIMEOUT_END_S, job.output


@pytest.mark.parametrize("debug", [None, "1"])
def test_one_extra_collective_on_a_rank_ends_at_the_timeout_naming_the_missing_rank(debug):
    job = run_fault("extra", debug=debug)
    message = first_line(job, "timed out after")
    record(f"extra all-reduce on rank 0 (MINIDL_DIST_DEBUG={debug or 'unset'})", job, message)
    assert job.returncode != 0, job.output
    phase = " (debug check)" if debug else ""
    assert re.search(re.escape(f"rank 0 of 2 (mpi backend): allreduce #2(shape=(7,), dtype=int64){phase} ") +
                     r"timed out after \d+\.\d s", message), message
    assert "ranks that have not arrived: [1]; rank 1 has left the program" in message
    assert "rank 1: returned" in job.stdout and "rank 0: returned" not in job.stdout
    assert TIMEOUT_S <= job.seconds_after_t0 < TIMEOUT_END_S, job.output


def _reorder_sites():
    """file:line of each rank's first call in the driver's reorder block."""
    lines = DRIVER.read_text().splitlines()
    return [f"{DRIVER}:{lines.index(line) + 1}" for marker in ("# rank 0's first call", "# rank 1's first call")
            for line in lines if line.rstrip().endswith(marker)]


def test_reordered_same_shape_collectives_raise_on_both_ranks_naming_both_call_sites_at_debug_2():
    job = run_fault("reorder", debug="2")
    raised = job.lines("rank 0: raised") + job.lines("rank 1: raised")
    record("reorder, MINIDL_DIST_DEBUG=2", job, raised[0] if raised else "")
    assert job.returncode == 0, job.output
    assert len(raised) == 2, job.output
    site0, site1 = _reorder_sites()
    for line in raised:
        assert "MINIDL_DIST_DEBUG=2: ranks disagree at collective #1" in line
        assert f"rank 0: #1 allreduce(shape=(4, 3), dtype=float64, op='sum') at {site0}" in line
        assert f"rank 1: #1 allreduce(shape=(4, 3), dtype=float64, op='sum') at {site1}" in line


def test_reordered_same_shape_collectives_pass_unnoticed_at_debug_1():
    """The blind spot level 2 exists for: same name, shape and dtype match, so the calls pair up
    wrongly and rank 0's weights are summed with rank 1's biases (1 + 20, not 1 + 2)."""
    job = run_fault("reorder", debug="1")
    record("reorder, MINIDL_DIST_DEBUG=1 (blind spot)", job, first_line(job, "rank 0: no error"))
    assert job.returncode == 0, job.output
    assert "rank 0: no error raised; the first all-reduce returned 21" in job.stdout
    assert "rank 1: no error raised; the first all-reduce returned 21" in job.stdout


def test_an_exception_on_a_rank_ends_the_job_at_once():
    job = run_fault("raise")
    record("ValueError raised on rank 1", job, first_line(job, "uncaught exception"))
    assert job.returncode != 0, job.output
    assert "minidl_parallel: uncaught exception on rank 1 of 2; aborting the MPI job" in job.stderr
    assert "ValueError: rank 1 fails on purpose" in job.stderr
    assert job.seconds_after_t0 < FAST_END_S, job.output


def test_a_rank_killed_by_sigkill_ends_the_job():
    job = run_fault("kill9")
    # mpirun (prterun) itself notices the death and ends the job: no minidl code runs on rank 1.
    noticed = re.search(r"process rank 1 with PID \d+ on node \S+ exited on\s+signal 9", job.output)
    record("kill -9 of rank 1", job, " ".join(noticed.group(0).split()) if noticed else "")
    assert job.returncode != 0, job.output
    assert noticed, job.output
    assert "rank 0: returned" not in job.stdout
    assert job.seconds_after_t0 < FAST_END_S, job.output


def test_a_normal_end_after_release_is_not_delayed_by_the_exit_guard():
    job = run_fault("normal")
    record("no fault: release() and exit on both ranks", job, "")
    assert job.returncode == 0, job.output
    assert sorted(line for line in job.stdout.splitlines() if "released" in line) == \
        ["rank 0: released", "rank 1: released"]
    # The exit guard's barrier completes as soon as both ranks reach it: the end takes
    # mpirun's teardown only (measured 0.1-0.3 s); a guard that waited for its limit would
    # take the timeout + 5 s = 7 s.
    assert job.seconds_after_t0 < 5.0, job.output


def test_a_rank_working_alone_after_the_others_finished_is_not_cut_short():
    """Rank 0 evaluating or saving after training, past the timeout, while rank 1 has left: rank
    1's exit guard sees rank 0 computing outside any collective and keeps waiting."""
    job = run_fault("slow_finish")
    record("no fault: rank 0 works 10 s alone after rank 1 left (timeout 2 s)", job, "")
    assert job.returncode == 0, job.output
    assert "rank 0: finished its work" in job.stdout, job.output
    assert "aborting" not in job.stderr, job.output
