"""What a pipeline stage holds in memory during a step, measured with tracemalloc in a process per stage
(tests/mpi/pipeline_memory.py, mpirun -n 2, M = 8 micro-batches): GPipe holds every micro-batch's
activations, 1F1B at most min(p - s, m) of them on stage s.

Units: ``micro``, the traced bytes of one micro-batch's forward graph on that stage (measured by the
worker: four activations of 256 KiB on stage 0, six on stage 1). Tolerances, in those units:
- at least (held - 1): at its peak the stage holds ``held`` graphs; one unit of slack for what the
  step frees of the step before it (its gradients and loss) while the baseline still counted it;
- at most (held + 1.5): on top of the graphs, a backward's passing arrays (the gradient received,
  a layer's ReLU gradient and its input's gradient: about three activations, 0.75 unit on stage 0,
  0.5 on stage 1), the stage's gradient sums (its weights, 4 x 16 KiB) and the 80-byte headers.
So the bounds tell m graphs from min(p - s, m) ones, and StepLog.peak_held gives the exact count.
"""
import json

import pytest

from comm.test_mpi import ROOT, mpirun  # tests/minidl_parallel/comm: the suite's mpirun runner

SCRIPT = ROOT / "tests" / "mpi" / "pipeline_memory.py"
STAGES, MICRO_BATCHES = 2, 8

# (a fresh CPU process per rank: the device double is not installed there, and tracemalloc sees host
# memory only, so a device-pinned run would measure the same thing again)
pytestmark = pytest.mark.cpu_only


@pytest.fixture(scope="module")
def measured():
    """{stage: the worker's figures}, from one mpirun job (about 10 s)."""
    proc = mpirun(STAGES, SCRIPT, 120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("rank "):
            rank, figures = line[len("rank "):].split(": ", 1)
            out[int(rank)] = json.loads(figures)
    assert sorted(out) == list(range(STAGES)), proc.stdout + proc.stderr
    return out


def _in_micro_batches(figures, scheduler):
    return figures[scheduler]["peak"] / figures["micro"]


@pytest.mark.parametrize("scheduler", ["gpipe", "1f1b"])
def test_the_step_log_counts_the_micro_batches_the_schedule_holds(measured, scheduler):
    for stage, figures in measured.items():
        expected = MICRO_BATCHES if scheduler == "gpipe" else min(STAGES - stage, MICRO_BATCHES)
        assert figures[scheduler]["schedule_held"] == expected, (stage, figures)
        assert figures[scheduler]["held"] == expected, (stage, figures)


def test_gpipe_holds_every_micro_batchs_activations_on_every_stage(measured):
    for stage, figures in measured.items():
        peak = _in_micro_batches(figures, "gpipe")
        assert MICRO_BATCHES - 1 <= peak <= MICRO_BATCHES + 1.5, (stage, peak, figures)


# The executor lets go of each array it sent once its send has completed (Request.test at every
# receive): before it did, 1F1B's stage 0 kept all m outputs it sent until the step's end, as GPipe.
def test_1f1b_holds_at_most_p_minus_s_micro_batches_and_less_than_gpipe(measured):
    for stage, figures in measured.items():
        held = min(STAGES - stage, MICRO_BATCHES)
        peak = _in_micro_batches(figures, "1f1b")
        assert held - 1 <= peak <= held + 1.5, (stage, peak, figures)
    # Stage 0 holds all m graphs under GPipe and p under 1F1B: (m - p) graphs fewer, 0.8 of it at least
    # (the passing arrays of a backward are the same in both).
    stage0 = measured[0]
    saved = stage0["gpipe"]["peak"] - stage0["1f1b"]["peak"]
    assert saved >= 0.8 * (MICRO_BATCHES - STAGES) * stage0["micro"], (saved, stage0)
