"""Runs a training script with a fault injected: ``with_faults.py script.py [its arguments]``.

The plan is the JSON list in MINIDL_TEST_FAULTS, one entry per attempt of the job (the launcher's
MINIDL_RESTART_COUNT picks it; null or a missing entry: no fault), each
``{"step": s, "rank": r, "kind": k}``: after global step s, rank r

- ``kill``: kills itself with SIGKILL (as the OOM killer or a lost node would),
- ``exit``: calls sys.exit(1),
- ``stall``: sleeps for an hour, so the other ranks' next collective times out
  (MINIDL_COLLECTIVE_TIMEOUT) and they raise.
- ``kill_saving``: kills itself with SIGKILL halfway through writing its next checkpoint
  file (the one of step s, when one is due then).

The step is seen where the script trains, before that step's checkpoint: a callback put first in
every ``Model.train``/``fit`` (its ``cur_step_num``), and, for a hand-written loop, after each call of a
``nn.TrainOneStepCell`` (its optimizer's ``global_step``). The script itself is unchanged: it
runs as ``__main__`` with its own arguments, as ``python script.py ...`` would run it.
"""
import io
import json
import os
import runpy
import signal
import sys
import time

from minidl import nn
from minidl.io import safetensors
from minidl.train import Callback, Model

plan = json.loads(os.environ.get("MINIDL_TEST_FAULTS", "[]"))
attempt = int(os.environ.get("MINIDL_RESTART_COUNT", "0"))
fault = plan[attempt] if attempt < len(plan) else None


def _rank():
    import minidl_parallel as mp
    return mp.get_rank() if mp.is_initialized() else 0


def _after_step(step):
    if fault is None or step != fault["step"] or _rank() != fault["rank"]:
        return
    print(f"with_faults: attempt {attempt}, rank {fault['rank']}: {fault['kind']} after step {step}", flush=True)
    if fault["kind"] == "kill_saving":
        _saving_kills[0] = True
    elif fault["kind"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault["kind"] == "exit":
        sys.exit(1)
    elif fault["kind"] == "stall":
        time.sleep(3600)
    else:
        raise ValueError(f"with_faults: unknown fault kind {fault['kind']!r}")


class _FaultAt(Callback):
    def on_train_step_end(self, run_context):
        _after_step(run_context.original_args().cur_step_num)


_run = Model._run


def _run_with_fault(self, epoch, dataset, valid_dataset, valid_frequency, callbacks, *rest):
    if callbacks is None:
        callbacks = []
    elif isinstance(callbacks, Callback):
        callbacks = [callbacks]
    return _run(self, epoch, dataset, valid_dataset, valid_frequency, [_FaultAt()] + list(callbacks), *rest)


_step_call = nn.TrainOneStepCell.__call__
_in_model = [False]  # inside Model.train, whose callback sees its steps


def _step_with_fault(self, *args, **kwargs):
    out = _step_call(self, *args, **kwargs)
    if not _in_model[0]:
        _after_step(self.optimizer.global_step)
    return out



def _model_run(self, *args, **kwargs):
    _in_model[0] = True  # Model's own steps are seen by the callback
    try:
        return _run_with_fault(self, *args, **kwargs)
    finally:
        _in_model[0] = False


_saving_kills = [False]
_atomic_write = safetensors.atomic_write


def _atomic_write_killed_halfway(filename, write):
    if not _saving_kills[0]:
        return _atomic_write(filename, write)

    def half_then_kill(f):
        whole = io.BytesIO()
        write(whole)
        f.write(whole.getvalue()[:len(whole.getvalue()) // 2])
        f.flush()
        os.fsync(f.fileno())
        print(f"with_faults: killed halfway through writing {filename}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return _atomic_write(filename, half_then_kill)


if fault is not None:
    Model._run = _model_run
    nn.TrainOneStepCell.__call__ = _step_with_fault
    safetensors.atomic_write = _atomic_write_killed_halfway

script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
