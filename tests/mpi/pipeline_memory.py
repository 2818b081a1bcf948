"""Run under mpirun -n 2: what one pipeline step holds in memory on each stage, measured with tracemalloc.

A process per rank, so that tracemalloc (one per process) sees only its own stage. The network is an
MLP whose activations dominate its weights (micro-batches of ROWS = 1024 rows, WIDTH = 64 features:
an activation is 256 KiB, a weight 16 KiB), cut into two stages of four Dense layers each. For each
scheduler (gpipe, then 1f1b), on every rank:

- ``micro``: the bytes one micro-batch's forward graph holds on this stage. The stage's own cells
  (taken from an unstaged copy of the network, the same weights) run the forward of one micro-batch
  as the executor's forward action does: stage 0 from its slice of the batch (a view: no bytes),
  the last stage from a fresh input buffer (what a receive allocates) through the loss. The figure
  is the traced bytes while its output (the graph's root) is alive, less those before.
- ``peak``: the most traced bytes during one TrainOneStepCell step of nn.PipelineCell with M = 8
  micro-batches, less the traced bytes just before it (after a warm-up step, so the optimizer's
  state and every cache exist already).
- ``held`` and ``schedule_held``: StepLog.peak_held and Schedule.peak_activations(stage).

The kernels' pool of reused blocks is off throughout: every array is NumPy's, allocated when made,
and NumPy reports its allocations to tracemalloc.

Prints one line per rank, ``rank r: {json}``; tests/minidl_parallel/pipeline/test_pipeline_memory.py
asserts on them.
"""
import gc
import json
import os
import sys
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "minidl_parallel"))

import minidl_parallel as mp  # noqa: E402
from minidl import kernels, nn, Tensor  # noqa: E402
from minidl.runtime import LOCAL  # noqa: E402
from minidl_parallel.nn import PipelineCell  # noqa: E402
from minidl_parallel.pipeline.executor import split_micro_batches  # noqa: E402
from pipeline import pipeline_models as models  # noqa: E402

ROWS, WIDTH, MICRO_BATCHES, CLASSES = 1024, 64, 8, 64
# Seven Dense + ReLU layers and the classifier: four layers per stage, so that a micro-batch's graph
# (four activations on stage 0, six on stage 1) outweighs a backward's passing gradients (two or three).
WIDTHS = (WIDTH,) * 8


def batch(seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ROWS * MICRO_BATCHES, WIDTH)).astype(np.float32)
    y = rng.integers(0, CLASSES, ROWS * MICRO_BATCHES).astype(np.int32)
    return Tensor(x), Tensor(y)


def build(stages):
    """pipeline_models.mlp at this width, its weights scaled to a standard deviation of 1/8 (about
    1/sqrt(WIDTH)): the activations keep their scale, and Momentum's steps stay finite."""
    net = models.mlp(stages, widths=WIDTHS, classes=CLASSES)
    for p in net.trainable_params():
        p.set_data(Tensor(p.data * np.float32(0.25)))
    return net


def traced():
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def one_micro_batch_bytes(stage, stages, x, y):
    """The traced bytes of one micro-batch's forward graph on ``stage`` (see the module docstring)."""
    net = build(1)  # every cell on stage 0: a plain network
    layers = [cell for k, cell in enumerate(net._backbone) if models.stage_of(k, len(net._backbone), stages) == stage]
    xs, ys = split_micro_batches((x, y), MICRO_BATCHES)[0]
    before = traced()
    # On the runtime the executor runs a stage's own cells on (the parallel world's would run
    # Dense and its ReLU as separate ops, each keeping its output, where LOCAL fuses them).
    with LOCAL:
        if stage == 0:
            out = xs
        else:  # what the executor's receive allocates and differentiates for
            out = Tensor(np.zeros((ROWS, WIDTH), np.float32), requires_grad=True)
        for layer in layers:
            out = layer(out)
        if stage == stages - 1:
            out = net._loss_fn(out, ys)
    alive = traced() - before
    del out
    return alive


def step_peak(scheduler, stages, x, y):
    """(the step's traced peak over the bytes before it, StepLog.peak_held)."""
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                 pipeline_config={"pipeline_scheduler": scheduler})
    net = build(stages)
    pipe = PipelineCell(net, MICRO_BATCHES)
    step = nn.TrainOneStepCell(pipe, models.optimizer(net))
    step(x, y)  # warm-up: the optimizer's state, the schedule's caches
    before = traced()
    tracemalloc.reset_peak()
    step(x, y)
    peak = tracemalloc.get_traced_memory()[1] - before
    mp.set_auto_parallel_context(parallel_mode="stand_alone", pipeline_stages=1)
    return peak, pipe.last_step.peak_held


def main():
    comm = mp.init("mpi")
    rank, stages = comm.rank, comm.size
    x, y = batch()
    out = {}
    # Without the kernels' pool of reused blocks every array is NumPy's, allocated when made, so
    # tracemalloc sees it (NumPy reports its allocations); with it, a step after the first reuses blocks.
    with kernels.option("buffer_pool", False):
        tracemalloc.start()
        one_micro_batch_bytes(rank, stages, x, y)  # warm-up: first calls fill caches
        out["micro"] = one_micro_batch_bytes(rank, stages, x, y)
        for scheduler in ("gpipe", "1f1b"):
            peak, held = step_peak(scheduler, stages, x, y)
            out[scheduler] = {"peak": peak, "held": held, "schedule_held":
                              mp.pipeline_schedule(stages, MICRO_BATCHES, scheduler).peak_activations(rank)}
        tracemalloc.stop()
    print(f"rank {rank}: {json.dumps(out)}", flush=True)
    mp.release()


if __name__ == "__main__":
    main()
