"""Mixed precision inside a pipeline: ``auto_mixed_precision`` on the backbone casts each stage's cells as
on one device, float16 activations cross the stage boundaries (their header carries the dtype), and the
training equals one device's with the same levels and micro-batches, bit for bit."""
import numpy as np
import pytest

import minidl_parallel as mp
from minidl import Tensor, backend, nn
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


def _trained_whole(build, data, micro):
    """Per rank of 2 stages: (the steps' losses, {name: every parameter}, after gather_parameters)."""
    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)
        net = build(2)
        pipe = PipelineCell(net, micro)
        step = nn.TrainOneStepCell(pipe, models.optimizer(net))
        losses = [backend.to_numpy(step(x, y).data) for x, y in data]
        pipe.gather_parameters()
        return losses, {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()}

    return mp.run_threads(2, body, timeout=120)


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


def test_a_tied_head_under_o2_shares_the_table_its_cast_is_made_from():
    """Under O2 GPT casts its tied table to the activations' float16 before the head: an op of the weight
    alone, which every stage computes; the last stage takes it in, so it shares the table, and the table's
    gradients from both stages are summed (float64 master weights: within 1e-10, the sums' order differs)."""
    build = _mixed(models.gpt_tied, "O2")
    data = models.batches("gpt", 2, 8)
    ref_losses, ref = models.reference(build, data, 4)

    for rank, (losses, values) in enumerate(_trained_whole(build, data, 4)):
        np.testing.assert_array_equal(np.array(losses), np.array(ref_losses), err_msg=f"rank {rank}")
        for name, value in values.items():
            np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-14, err_msg=f"{name} on rank {rank}")


class _TiedHead(nn.Cell):
    """Glue without parameters of its own that takes the embedding table as an argument (the last stage)."""

    def __init__(self):
        super().__init__()
        from minidl import ops
        self.matmul = ops.MatMul(transpose_b=True)

    def construct(self, x, table):
        return self.matmul(x, table)


def test_a_weight_passed_to_a_glue_cell_of_a_later_stage_is_shared_with_it():
    """The head is a cell without a stage that takes the table: it runs on the last stage (where x lives),
    which shares the table; without that its gradient there would be lost. Equal to one device in float64."""
    import numpy

    class Net(nn.Cell):
        def __init__(self, stages):
            super().__init__()
            self.embed = nn.Dense(6, 8, dtype=numpy.float64)
            self.mix = nn.Dense(8, 8, activation="relu", dtype=numpy.float64)  # its weight is the head's too
            self.body = nn.Dense(8, 8, activation="relu", dtype=numpy.float64)
            self.head = _TiedHead()
            self.embed.pipeline_stage = self.mix.pipeline_stage = 0
            self.body.pipeline_stage = stages - 1

        def construct(self, x):
            return self.head(self.body(self.mix(self.embed(x))), self.mix.weight)

    def build(stages):
        net = Net(stages)
        rng = np.random.default_rng(4)
        for p in net.trainable_params():
            p.set_data(Tensor(0.5 * rng.standard_normal(p.shape)))
        return nn.WithLossCell(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))

    data = [(Tensor(x.data.astype(np.float64)), y) for x, y in models.batches("mlp", 2, 8)]
    ref_losses, ref = models.reference(build, data, 2)

    for rank, (losses, values) in enumerate(_trained_whole(build, data, 2)):
        np.testing.assert_allclose(np.array(losses, dtype=np.float64), np.array(ref_losses, dtype=np.float64),
                                   rtol=1e-10)
        for name, value in values.items():
            np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-14, err_msg=f"{name} on rank {rank}")
