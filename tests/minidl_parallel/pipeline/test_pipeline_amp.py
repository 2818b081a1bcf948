"""Mixed precision inside a pipeline: ``auto_mixed_precision`` on the backbone casts each stage's cells as
on one device, float16 activations cross the stage boundaries (their header carries the dtype), and the
training equals one device's with the same levels and micro-batches, bit for bit."""
import numpy as np
import pytest

import minidl_parallel as mp
from minidl import backend, nn
from minidl.amp import auto_mixed_precision
from minidl_parallel.nn import PipelineCell
from minidl_parallel.pipeline.stages import StagePlan

from . import pipeline_models as models


def _mixed(builder, level):
    def build(stages):
        net = builder(stages)
        auto_mixed_precision(net._backbone, level)
        return net
    return build


@pytest.mark.parametrize("kind, level, scheduler", [("resnet", "O1", "1f1b"), ("resnet", "O2", "gpipe"),
                                                    ("gpt", "O2", "1f1b"), ("mlp", "O3", "1f1b")])
def test_a_mixed_precision_pipeline_trains_as_one_device(kind, level, scheduler):
    build = _mixed({"resnet": models.resnet, "gpt": models.gpt, "mlp": models.mlp}[kind], level)
    data = models.batches(kind, 2, 8)
    ref_losses, ref = models.reference(build, data, 4)

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                                     pipeline_config={"pipeline_scheduler": scheduler})
        net = build(2)
        step = nn.TrainOneStepCell(PipelineCell(net, 4), models.optimizer(net))
        losses = [backend.to_numpy(step(x, y).data) for x, y in data]
        plan = StagePlan(net, 2)
        return losses, {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()
                        if plan.stage_of_parameter[id(p)] == mp.get_rank()}

    for rank, (losses, mine) in enumerate(mp.run_threads(2, body, timeout=120)):
        for got, want in zip(losses, ref_losses):
            assert got.dtype == want.dtype and np.array_equal(got, want), (rank, losses, ref_losses)
        for name, value in mine.items():
            np.testing.assert_array_equal(value, ref[name], err_msg=f"{kind} {level}: {name} on rank {rank}")
