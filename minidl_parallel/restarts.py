"""Restarting a failed job: ``python -m minidl_parallel.run --max-restarts K`` and
``spawn(..., max_restarts=K)`` (torchrun's ``--max-restarts``).

When an attempt fails (a worker raised, exited non-zero, was killed, or a collective timed out and
its ranks raised), the launcher has already ended the other workers; it waits a backoff, then
starts the whole world again, up to K times. Attempt r (r = 0 the first) runs with
``MINIDL_RESTART_COUNT=r`` and the job's ``MINIDL_RUN_ID``, from which ``Model.train`` with a ``ModelCheckpoint`` (and a custom
loop through ``minidl.train.resume_after_restart``) resumes from the newest checkpoint every rank
has whole (minidl/train/restart.py); rank 0 appends where it resumed to the file named by
``MINIDL_RESTART_LOG``, which the launcher reads and reports.

The backoff before restart r is ``restart_delay * 2 ** (r - 1)`` seconds, at most
MAX_RESTART_DELAY_S: 1, 2, 4, ... s by default. A failure of the last allowed attempt ends the
job with that failure's exit status and a summary of every attempt's cause; an interrupt (Ctrl-C)
or a start that left MPI unusable in this process is not restarted.
"""
import json
import os
import time
import uuid

__all__ = ["RESTART_DELAY_S", "MAX_RESTART_DELAY_S", "check_restart_options", "backoff", "RestartLog",
           "with_restarts"]

RESTART_DELAY_S = 1.0
MAX_RESTART_DELAY_S = 60.0


def check_restart_options(who, max_restarts, restart_delay):
    """ValueError naming the bad option and the expected value."""
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"{who}: max_restarts must be an int >= 0 (0: no restarts), got {max_restarts!r}")
    if (isinstance(restart_delay, bool) or not isinstance(restart_delay, (int, float))
            or not 0 <= restart_delay < float("inf")):
        raise ValueError(f"{who}: restart_delay must be a number of seconds >= 0, got {restart_delay!r}")


def backoff(restart_delay, restart):
    """Seconds to wait before restart ``restart`` (1, 2, ...)."""
    return min(restart_delay * 2 ** (restart - 1), MAX_RESTART_DELAY_S)


class RestartLog:
    """The file rank 0 of a restarted attempt appends where it resumed to (one JSON line each)."""

    def __init__(self, path):
        self.path = path
        self._read = 0
        with open(path, "w"):
            pass
        # This job's name in its checkpoints: a restart resumes from this job's files only, never from
        # those an earlier job left in the same directory (TorchElastic's TORCHELASTIC_RUN_ID).
        self.run_id = uuid.uuid4().hex

    def env(self, attempt):
        """The variables attempt ``attempt`` runs with."""
        return {"MINIDL_RESTART_COUNT": str(attempt), "MINIDL_RESTART_LOG": self.path, "MINIDL_RUN_ID": self.run_id}

    def news(self):
        """What was resumed since the last call, in words (one line per entry)."""
        try:
            with open(self.path) as f:
                f.seek(self._read)
                text = f.read()
        except OSError:
            return []
        complete = text[:text.rfind("\n") + 1]  # a line still being written waits for the next call
        self._read += len(complete.encode())
        lines = []
        for line in complete.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("checkpoint"):
                lines.append(f"restart {entry['restart']} resumes after step {entry['step']}, from "
                             f"{entry['checkpoint']}")
            else:
                lines.append(f"restart {entry['restart']} found no checkpoint every rank has whole: it trains "
                             f"from the start")
        return lines

    def close(self):
        try:
            os.remove(self.path)
        except OSError:
            pass


def _cause(error, who):
    """The first line of a failure, without the launcher's name in front."""
    return str(error).splitlines()[0].removeprefix(f"{who}: ")


def _attempt_name(r):
    return "the first attempt" if r == 0 else f"restart {r}"


def with_restarts(attempt, max_restarts, restart_delay, say, who, can_restart=lambda error: True):
    """Runs ``attempt(r)`` for r = 0, 1, ... until one returns None (success) or max_restarts
    restarts have failed; returns None or the last failure, whose message then ends with the
    summary of every attempt's cause. ``say`` prints a line; ``can_restart(error)`` False stops
    at once (the error is returned as it is)."""
    causes = []
    for r in range(max_restarts + 1):
        error = attempt(r)
        if error is None:
            if causes:
                say(f"finished on restart {r} (of at most {max_restarts}); the attempts that failed:\n  "
                    + "\n  ".join(causes))
            return None
        causes.append(f"{_attempt_name(r)}: {_cause(error, who)}")
        if r == max_restarts or not can_restart(error):
            break
        delay = backoff(restart_delay, r + 1)
        say(f"restart {r + 1} of at most {max_restarts} in {delay:g} s, after {_attempt_name(r)} failed: "
            f"{_cause(error, who)}")
        time.sleep(delay)
    if len(causes) > 1:
        error.args = (f"{error}\n\n{len(causes)} attempts failed (at most {max_restarts} restarts allowed):\n  "
                      + "\n  ".join(causes),) + error.args[1:]
    return error
