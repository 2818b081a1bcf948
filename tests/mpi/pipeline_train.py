"""Run under mpirun -n N: a pipeline of N stages (one per rank); argv[1] is the case, argv[2] the model
(mlp, resnet, gpt), argv[3] the scheduler.

train: trains 2 steps of nn.PipelineCell in nn.TrainOneStepCell; every rank also trains the
       single-device reference (gradient accumulation over the same micro-batches) and compares its
       stage's parameters and the losses, bit for bit; prints "rank r: ok" or what differs.
train_dp: the same with N // 2 stages of 2 data-parallel replicas (gradients_mean): replica j trains
       on block j of each batch; the reference adds the replicas' sums in replica order, halved. Compared
       within 1e-10 (run it with the float64 "mlp64"): with NumPy and OpenBLAS alone (the README's
       install) their kernels round by the buffers' alignment, which the processes and the reference do
       not share, so the last bit may differ.
raise: stage 1's loss raises in micro-batch 1's forward: the job must end, naming the stage and action.
stall: stage 0 sleeps past the timeout before its step: stage 1's receive must time out, naming the
       stage, the action and the message it waited for.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "minidl_parallel"))

import minidl_parallel as mp  # noqa: E402
from minidl import Tensor, backend, nn  # noqa: E402
from minidl_parallel.nn import PipelineCell  # noqa: E402
from minidl_parallel.pipeline.stages import StagePlan  # noqa: E402
from pipeline import pipeline_models as models  # noqa: E402

case, kind, scheduler = sys.argv[1], sys.argv[2], sys.argv[3]
build = {"mlp": models.mlp, "resnet": models.resnet, "gpt": models.gpt,
         "mlp64": lambda stages: models.mlp_cut(stages, (None,) * 4)}[kind]  # (float64, no strategy)
comm = mp.init("mpi")
replicas = 2 if case == "train_dp" else 1
rank, stages = comm.rank, comm.size // replicas
mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages, gradients_mean=True,
                             pipeline_config={"pipeline_scheduler": scheduler})
micro = 4
data = models.batches("mlp_cut" if kind == "mlp64" else kind, 2, 8)
net = build(stages)

if case == "raise" and rank == 1:
    calls = {"n": 0}
    original = net._loss_fn.construct

    def failing(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise ValueError("the loss of stage 1 fails on purpose")
        return original(*args)
    net._loss_fn.construct = failing
if case == "stall" and rank == 0:
    print(f"rank 0: t0={time.time():.3f}", flush=True)
    time.sleep(60)

step = nn.TrainOneStepCell(PipelineCell(net, micro), models.optimizer(net))
replica, rows = rank % replicas, 8 // replicas
losses = [backend.to_numpy(step(Tensor(x.data[replica * rows:(replica + 1) * rows]),
                                Tensor(y.data[replica * rows:(replica + 1) * rows])).data) for x, y in data]
ref_losses, ref = models.reference(build, data, micro, replicas=replicas, mean=True)
plan = StagePlan(net, stages)
if replicas == 1:
    same = np.array_equal
else:
    def same(got, want):
        return np.allclose(got, want, rtol=1e-10, atol=1e-14)
problems = [f"loss {i}: {got} != {want}" for i, (got, want) in enumerate(zip(losses, ref_losses))
            if replica == 0 and (got.dtype != want.dtype or not same(got, want))]
for name, p in net.parameters_and_names():
    if plan.stage_of_parameter[id(p)] == rank // replicas and not same(backend.to_numpy(p.data), ref[name]):
        problems.append(f"{name} differs")
print(f"rank {rank}: " + ("ok" if not problems else "; ".join(problems)), flush=True)
mp.release()
