"""Details of the pipeline the "pipeline" mutation target's re-run found untested (issue 32): the whole
network gathered from stages cut by shard(), a loss left partial on the last stage's ranks, which
stages hold a weight taken in on another stage, and the words of a shared table cut differently.
Threads worlds of 2 or 4 ranks, float64 (one device's sums in another order: within 1e-10).
"""
import re

import numpy as np
import pytest

import minidl_parallel as mp
from minidl import Tensor, backend, nn, ops
from minidl_parallel.nn import PipelineCell
from minidl_parallel.pipeline.cell import _block_of
from minidl_parallel.pipeline.stages import StagePlan
from minidl_parallel.tensor_parallel.dispatch import gather_like

from . import pipeline_models as models
from .test_pipeline_tensor_parallel import BATCH, COLUMN, ROW, local_batch


def _numpy(t):
    return backend.to_numpy(t.data)


def test_gather_parameters_gives_every_rank_the_whole_network_of_stages_cut_by_shard():
    """2 stages x 2 tensor-parallel ranks: after gather_parameters each rank holds every parameter
    whole, the trained values of one device: its own stage's blocks (gathered here) and the other
    stage's parameters (made whole by their stage before the broadcast)."""
    strategies = (COLUMN, ROW, None, BATCH)
    build = lambda s: models.mlp_cut(s, strategies)  # noqa: E731
    data = models.batches("mlp_cut", 2, 16)

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                                     dataset_strategy="data_parallel")
        k = mp.get_rank() % 2
        net = build(2)
        cell = PipelineCell(net, 2)
        step = nn.TrainOneStepCell(cell, models.optimizer(net))
        for x, y in data:
            step(*(Tensor(local_batch(t.data, 2, 2, k)) for t in (x, y)))
        cell.gather_parameters()
        own = StagePlan(net, 2).stage_of_parameter
        stage = mp.get_rank() // 2
        return {name: (backend.to_numpy(gather_like(p.data, p)) if own[id(p)] == stage else _numpy(p))
                for name, p in net.parameters_and_names()}

    _, ref = models.reference(build, data, 2)
    for rank, whole in enumerate(mp.run_threads(4, body, timeout=120)):
        assert set(whole) == set(ref)
        for name, value in whole.items():
            np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-13, err_msg=f"{name} on rank {rank}")


class _SquaresSummed(nn.Cell):
    def construct(self, h):
        return ops.ReduceSum()(h * h)


class _SumOfSquares(nn.Cell):
    """A loss without a mean: the sum over the rows, which the last stage's ranks each hold a block of
    (a partial sum the stage makes whole before it counts it). ``scale`` (not a Tensor) reaches the
    construct as it is."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.loss = _SquaresSummed()

    def construct(self, x, y, scale=2.0):
        return self.loss(self.backbone(x * scale))


def test_a_loss_left_partial_over_the_last_stages_ranks_is_made_whole_and_trains_as_one_device():
    build = lambda s: _SumOfSquares(models.mlp_cut(s, (COLUMN, ROW, COLUMN, ROW))._backbone)  # noqa: E731
    data = models.batches("mlp_cut", 2, 16)

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                                     dataset_strategy="data_parallel")
        k = mp.get_rank() % 2
        net = build(2)
        step = nn.TrainOneStepCell(PipelineCell(net, 2), models.optimizer(net))
        losses = [float(_numpy(step(*(Tensor(local_batch(t.data, 2, 2, k)) for t in (x, y)), 2.0)))
                  for x, y in data]
        plan = StagePlan(net, 2)
        stage = mp.get_rank() // 2
        return losses, {name: backend.to_numpy(gather_like(p.data, p)) for name, p in net.parameters_and_names()
                        if plan.stage_of_parameter[id(p)] == stage}

    ref_losses, ref = models.reference(build, data, 2)
    seen = set()
    for rank, (losses, mine) in enumerate(mp.run_threads(4, body, timeout=120)):
        np.testing.assert_allclose(losses, np.array(ref_losses, dtype=np.float64), rtol=1e-10, err_msg=f"rank {rank}")
        for name, value in mine.items():
            seen.add(name)
            np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-13, err_msg=f"{name} on rank {rank}")
    assert seen == set(ref)


class _Glue(nn.Cell):
    """A cell without parameters or stage: it runs where its inputs live."""

    def construct(self, h, a, b):
        return h * a + b


class _WeightsAcrossStages(nn.Cell):
    """Stage 0: first, second; stage 1: third. The construct adds stage 1's bias to stage 0's output
    (an op reading a parameter of a later stage than its input's: it runs on the parameter's stage,
    nothing shared) and hands two stage-0 biases to a glue cell on stage 1 (both then shared)."""

    def __init__(self, stages):
        super().__init__()
        self.first = nn.Dense(6, 4, activation="relu", dtype=np.float64)
        self.second = nn.Dense(4, 4, dtype=np.float64)
        self.third = nn.Dense(4, 4, dtype=np.float64)
        self.glue = _Glue()
        self.loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        models._set_weights(self, 21)
        self.first.pipeline_stage = self.second.pipeline_stage = 0
        self.third.pipeline_stage = stages - 1

    def construct(self, x, y):
        h = self.second(self.first(x)) + self.third.bias
        h = self.glue(self.third(h), self.first.bias, self.second.bias)
        return self.loss(h, y)


def test_which_stages_hold_a_weight_taken_in_on_another_stage_and_the_training_equals_one_device():
    data = models.batches("mlp_cut", 2, 8)

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)
        net = _WeightsAcrossStages(2)
        cell = PipelineCell(net, 2)
        step = nn.TrainOneStepCell(cell, models.optimizer(net))
        losses = [float(_numpy(step(x, y))) for x, y in data]
        plan = cell.last_plan
        held = {name: plan.stages_of(p) for name, p in net.parameters_and_names()}
        shared = sorted(p.name for p, _ in plan.shared.values())
        stage = mp.get_rank()
        return losses, held, shared, {name: _numpy(p) for name, p in net.parameters_and_names()
                                      if stage in plan.stages_of(p)}

    ref_losses, ref = models.reference(_WeightsAcrossStages, data, 2)
    for rank, (losses, held, shared, mine) in enumerate(mp.run_threads(2, body, timeout=60)):
        np.testing.assert_allclose(losses, np.array(ref_losses, dtype=np.float64), rtol=1e-10, err_msg=f"rank {rank}")
        assert held == {"first.weight": [0], "first.bias": [0, 1], "second.weight": [0], "second.bias": [0, 1],
                        "third.weight": [1], "third.bias": [1]}, rank
        assert shared == ["first.bias", "second.bias"], rank
        for name, value in mine.items():
            np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-13, err_msg=f"{name} on rank {rank}")


def test_a_tied_table_cut_differently_names_its_stages_and_the_fix():
    def body():
        mp.set_auto_parallel_context(parallel_mode="auto_parallel", pipeline_stages=2, dataset_strategy="full_batch")
        net = models.gpt_tied(2, vocab=12)
        net._backbone.shard(2)
        net._backbone.head.shard(((1, 2), (1, 2)))  # the table cut along its features on stage 1, rows on stage 0
        step = nn.TrainOneStepCell(PipelineCell(net, 2), models.optimizer(net))
        x, y = models.batches("gpt", 1, 4)[0]
        step(x, y)

    # (rank j of stage 0 holds rows j*6:(j+1)*6; rank j of stage 1 features j*4:(j+1)*4: whichever pair reports)
    words = (re.escape("parameter 'wte.embedding_table' is used by stages [0, 1] but cut differently by their shard() "
                       "strategies: rank ")
             + r"[01] of each stage holds \[(0:6|6:12), 0:8\] of \(12, 8\) on stage 0, "
             + r"\[0:12, (0:4|4:8)\] of \(12, 8\) "
             + re.escape("on stage 1; give the operators that use it strategies that cut it alike"))
    with pytest.raises(Exception, match=words):
        mp.run_threads(4, body, timeout=60)


def test_the_block_of_a_parameter_without_placement_is_all_of_it():
    """(A shared copy no dispatched op of its stage read has no placement: it is held whole.)"""
    param = nn.Dense(3, 5).weight
    assert param.placement is None
    assert _block_of(param, 1) == "[0:5, 0:3] of (5, 3)"


class _Doubled(nn.Cell):
    def construct(self, w):
        return w * 2.0


class _Product(nn.Cell):
    def construct(self, a, b):
        return a * b


class _ScaledByAStage0Weight(nn.Cell):
    """Stage 0: first; stage 1: second. A glue cell computes from a stage-0 weight alone (every rank
    runs it, as a constant) and stage 1 takes its output in: stage 1 shares the weight, as it does when
    an op computes the same (``first.bias * 2.0`` in the construct)."""

    def __init__(self, stages):
        super().__init__()
        self.first = nn.Dense(6, 4, dtype=np.float64)
        self.second = nn.Dense(4, 4, dtype=np.float64)
        self.doubled, self.product = _Doubled(), _Product()
        self.loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        models._set_weights(self, 21)
        self.first.pipeline_stage = 0
        self.second.pipeline_stage = stages - 1

    def construct(self, x, y):
        scale = self.doubled(self.first.bias)
        return self.loss(self.product(self.second(self.first(x)), scale), y)


def test_a_glue_cell_of_weights_alone_taken_in_on_a_later_stage_shares_the_weight():
    data = models.batches("mlp_cut", 2, 8)

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)
        net = _ScaledByAStage0Weight(2)
        cell = PipelineCell(net, 2)
        step = nn.TrainOneStepCell(cell, models.optimizer(net))
        losses = [float(_numpy(step(x, y))) for x, y in data]
        plan = cell.last_plan
        return losses, {name: plan.stages_of(p) for name, p in net.parameters_and_names()}, {
            name: _numpy(p) for name, p in net.parameters_and_names() if mp.get_rank() in plan.stages_of(p)}

    ref_losses, ref = models.reference(_ScaledByAStage0Weight, data, 2)
    for rank, (losses, held, mine) in enumerate(mp.run_threads(2, body, timeout=60)):
        assert held == {"first.weight": [0], "first.bias": [0, 1], "second.weight": [1], "second.bias": [1]}, rank
        np.testing.assert_allclose(losses, np.array(ref_losses, dtype=np.float64), rtol=1e-10, err_msg=f"rank {rank}")
        for name, value in mine.items():
            np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-13, err_msg=f"{name} on rank {rank}")
