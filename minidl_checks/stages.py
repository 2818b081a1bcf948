"""The stage runner of the GPU check and the one-line protocol between it and its workers.

Each stage is a command run in its own process group under a time limit (:func:`run_stage`), so
a crash or a hang ends that stage, never the report. A worker reports with one line starting
with RESULT_MARK and holding JSON (:func:`emit_result`); :func:`judge_worker` reads it back.
"""
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field

RESULT_MARK = "@@minidl_gpu_check_result "


@dataclass
class StageResult:
    """What one stage gave: status "passed", "failed" or "skipped", a one-line summary."""
    name: str
    status: str
    summary: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)
    output_tail: str = ""


def _tail(text, lines=40):
    return "\n".join(text.rstrip().splitlines()[-lines:])


def parse_results(output):
    """The result objects a worker printed (one per line starting with RESULT_MARK)."""
    found = []
    for line in output.splitlines():
        if line.startswith(RESULT_MARK):
            try:
                found.append(json.loads(line[len(RESULT_MARK):]))
            except ValueError:
                found.append({"status": "failed", "summary": f"unreadable result line: {line[:200]}"})
    return found


def judge_worker(returncode, output, expected=1):
    """(status, summary, data) of a worker stage: ``expected`` result lines, all passed, exit 0."""
    results = parse_results(output)
    if returncode != 0:
        return "failed", f"exited with status {returncode}", {}
    if len(results) != expected:
        return "failed", f"printed {len(results)} result(s), expected {expected}", {}
    bad = [r for r in results if r.get("status") not in ("passed", "skipped")]
    if bad:
        return "failed", "; ".join(str(r.get("summary")) for r in bad), results[0].get("data", {})
    status = "skipped" if all(r.get("status") == "skipped" for r in results) else "passed"
    return status, results[0].get("summary", ""), results[0].get("data", {})


def run_stage(name, argv, timeout, env=None, cwd=None, judge=judge_worker):
    """Runs one stage's command in its own process group and judges it; never raises.

    A crash (non-zero status, a signal) or running past ``timeout`` seconds fails the stage,
    with the tail of its output; on timeout the whole process group is killed (mpirun and
    its ranks, pytest and its children), so no orphan holds the output pipe open.
    """
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                env=env, cwd=cwd, start_new_session=True)
    except OSError as exc:
        return StageResult(name, "failed", f"could not start {argv[0]}: {exc}", time.monotonic() - start)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        return StageResult(name, "failed", f"timed out after {timeout:g} s (its process group was killed)",
                           time.monotonic() - start, output_tail=_tail(output or ""))
    seconds = time.monotonic() - start
    rc = proc.returncode
    if rc < 0:  # a signal: a segfault in a CUDA library, an abort, the OOM killer
        try:
            sig = signal.Signals(-rc).name
        except ValueError:
            sig = str(-rc)
        return StageResult(name, "failed", f"killed by signal {sig}", seconds, output_tail=_tail(output))
    status, summary, data = judge(rc, output)
    return StageResult(name, status, summary, seconds, data, _tail(output) if status == "failed" else "")


def _kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the group this runner created for the stage
    except (ProcessLookupError, PermissionError):
        proc.kill()


def skipped(name, reason):
    return StageResult(name, "skipped", reason)


def emit_result(status, summary, **data):
    """A worker's one result line, which the stage runner reads from its output."""
    print(RESULT_MARK + json.dumps({"status": status, "summary": summary, "data": data}, default=float), flush=True)
