"""Run under mpirun -n 4: 2 pipeline stages of 2 ranks each, the MLP's Dense layers cut by shard()
inside each stage (tests/minidl_parallel/pipeline/test_pipeline_tensor_parallel.py in processes).
Every rank trains 2 steps, then the single-device reference (gradient accumulation over the same
micro-batches), and compares the losses and its stage's parameters (gathered whole over the stage)
within float64 1e-10, and after gather_parameters every parameter on every rank; prints "rank r: ok" or
what differs.
"""
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "minidl_parallel"))

import minidl_parallel as mp  # noqa: E402
from minidl import Tensor, backend, nn  # noqa: E402
from minidl_parallel.nn import PipelineCell  # noqa: E402
from minidl_parallel.pipeline.stages import StagePlan  # noqa: E402
from minidl_parallel.tensor_parallel.dispatch import gather_like  # noqa: E402
from pipeline import pipeline_models as models  # noqa: E402
from pipeline.test_pipeline_tensor_parallel import COLUMN, ROW, local_batch  # noqa: E402

comm = mp.init("mpi")
rank, stages, ranks, micro = comm.rank, 2, comm.size // 2, 2
mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                             pipeline_config={"pipeline_scheduler": "1f1b"})
build = lambda s: models.mlp_cut(s, (ROW, COLUMN, ROW, COLUMN))  # noqa: E731
data = models.batches("mlp_cut", 2, 16)
net = build(stages)
step = nn.TrainOneStepCell(PipelineCell(net, micro), models.optimizer(net))
losses = [float(backend.to_numpy(step(*(Tensor(local_batch(t.data, micro, ranks, rank % ranks)) for t in (x, y))).data))
          for x, y in data]
plan = StagePlan(net, stages)
mine = {name: backend.to_numpy(gather_like(p.data, p) if p.placement is not None else p.data)
        for name, p in net.parameters_and_names() if plan.stage_of_parameter[id(p)] == rank // ranks}
ref_losses, ref = models.reference(build, data, micro)
problems = [f"loss {i}: {got} != {want}" for i, (got, want) in enumerate(zip(losses, ref_losses))
            if not np.isclose(got, float(want), rtol=1e-10, atol=0)]
problems += [f"{name} differs" for name, value in mine.items()
             if not np.allclose(value, ref[name], rtol=1e-10, atol=1e-13)]
# gather_parameters: every rank's network whole and trained (a stage's blocks gathered over its ranks, then
# broadcast from the stage's rank to the same rank of the other stages: MPI needs the right root)
step.network.gather_parameters()
problems += [f"{name} differs after gather_parameters" for name, p in net.parameters_and_names()
             if not np.allclose(backend.to_numpy(gather_like(p.data, p) if p.placement is not None else p.data),
                                ref[name], rtol=1e-10, atol=1e-13)]
print(f"rank {rank}: " + ("ok" if not problems else "; ".join(problems)), flush=True)
mp.release()
