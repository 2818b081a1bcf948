"""A pipeline's training equals one device's with gradient accumulation over the same micro-batches.

Each rank of a threads world runs one stage of ``nn.PipelineCell`` inside ``nn.TrainOneStepCell``
(SEMI_AUTO_PARALLEL, ``pipeline_stages`` = the world size); after k steps each rank's parameters,
BatchNorm statistics included, and every step's loss equal the single-device run of
pipeline_models.reference, bit for bit (the micro-batches' gradients are added in the same order).
CI draws a few configurations; the whole matrix is the slow set (MINIDL_SLOW=1).
"""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl_parallel as mp
from minidl import Tensor, backend, nn
from minidl_parallel.nn import PipelineCell
from minidl_parallel.pipeline.stages import StagePlan

from . import pipeline_models as models

BUILDERS = {"mlp": models.mlp, "resnet": models.resnet, "gpt": models.gpt}


def run_pipeline(kind, stages, micro_batches, scheduler, data, build=None, also=None):
    """Trains on ``stages`` thread ranks; returns per rank (losses, {name: array} of its stage), and
    ``also(net)`` third when given."""
    build = build or BUILDERS[kind]

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                     pipeline_config={"pipeline_scheduler": scheduler})
        net = build(stages)
        step = nn.TrainOneStepCell(PipelineCell(net, micro_batches), models.optimizer(net))
        losses = [step(x, y).asnumpy().copy() for x, y in data]
        plan = StagePlan(net, stages)
        mine = {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()
                if plan.stage_of_parameter[id(p)] == mp.get_rank()}
        return (losses, mine) if also is None else (losses, mine, also(net))

    return mp.run_threads(stages, body, timeout=240)


def check_equal(kind, stages, micro_batches, scheduler, steps=2, batch=8, build=None):
    data = models.batches(kind, steps, batch)
    ref_losses, ref = models.reference(build or BUILDERS[kind], data, micro_batches)
    ranks = run_pipeline(kind, stages, micro_batches, scheduler, data, build=build)
    seen = {}
    for rank, (losses, mine) in enumerate(ranks):
        for got, want in zip(losses, ref_losses):  # every rank reports the last stage's loss
            assert got.dtype == want.dtype and np.array_equal(got, want), (rank, losses, ref_losses)
        for name, value in mine.items():
            assert name not in seen, f"{name} is on two stages"
            seen[name] = value
            np.testing.assert_array_equal(value, ref[name], err_msg=f"{kind}: {name} on rank {rank}")
    assert sorted(seen) == sorted(ref)  # every parameter (and BatchNorm statistic) lives on one stage


@pytest.mark.parametrize("kind, stages, micro_batches, scheduler", [
    ("mlp", 2, 2, "1f1b"), ("mlp", 4, 4, "gpipe"), ("mlp", 4, 8, "1f1b"),
    ("resnet", 2, 4, "1f1b"), ("resnet", 4, 4, "gpipe"), ("gpt", 2, 2, "gpipe"), ("gpt", 2, 4, "1f1b"),
])
def test_a_pipeline_trains_as_one_device_accumulating_the_same_micro_batches(kind, stages, micro_batches,
                                                                              scheduler):
    check_equal(kind, stages, micro_batches, scheduler)


@pytest.mark.slow
@given(kind=st.sampled_from(sorted(BUILDERS)), stages=st.sampled_from([2, 4]), extra=st.integers(0, 4),
       scheduler=st.sampled_from(["gpipe", "1f1b"]), steps=st.integers(1, 3))
@settings(max_examples=40, deadline=None)
def test_every_drawn_pipeline_trains_as_one_device(kind, stages, extra, scheduler, steps):
    micro_batches = min(stages + extra, 8)
    check_equal(kind, stages, micro_batches, scheduler, steps=steps, batch=2 * micro_batches)


@pytest.mark.parametrize("kind, mean, scheduler", [("mlp", True, "1f1b"), ("resnet", False, "gpipe"),
                                                   ("gpt", True, "gpipe")])
def test_pipeline_times_data_parallel_equals_one_device_over_the_replicas_shards(kind, mean, scheduler):
    """4 ranks: 2 stages x 2 replicas. Replica j (ranks j and 2 + j) trains on block j of each batch; a
    stage's gradients are reduced over its replicas (summed, or averaged with gradients_mean)."""
    stages, replicas, micro = 2, 2, 2
    data = models.batches(kind, 2, 8)
    ref_losses, ref = models.reference(BUILDERS[kind], data, micro, replicas=replicas, mean=mean)

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                     gradients_mean=mean, pipeline_config={"pipeline_scheduler": scheduler})
        rank = mp.get_rank()
        replica, rows = rank % replicas, 8 // replicas
        net = BUILDERS[kind](stages)
        step = nn.TrainOneStepCell(PipelineCell(net, micro), models.optimizer(net))
        losses = [backend.to_numpy(step(Tensor(x.data[replica * rows:(replica + 1) * rows]),
                                        Tensor(y.data[replica * rows:(replica + 1) * rows])).data)
                  for x, y in data]
        plan = StagePlan(net, stages)
        mine = {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()
                if plan.stage_of_parameter[id(p)] == rank // replicas}
        return losses, mine

    out = mp.run_threads(stages * replicas, body, timeout=240)
    for rank, (losses, mine) in enumerate(out):
        if rank % replicas == 0:  # replica 0 trained on block 0, whose losses the reference reports
            assert all(np.array_equal(a, b) for a, b in zip(losses, ref_losses)), (rank, losses, ref_losses)
        for name, value in mine.items():  # every replica of a stage holds the same parameters
            np.testing.assert_array_equal(value, ref[name], err_msg=f"{kind}: {name} on rank {rank}")


@pytest.mark.parametrize("stages, scheduler", [(2, "1f1b"), (4, "gpipe")])
def test_a_head_tied_to_the_embedding_shares_it_between_the_first_and_last_stage(stages, scheduler):
    """The table's gradient is summed over the two stages after the micro-batches (one device adds the
    two uses within each micro-batch): the same sums in another order, so float64 within 1e-10."""
    data = models.batches("gpt", 2, 8)
    ref_losses, ref = models.reference(models.gpt_tied, data, 4)
    table = lambda net: backend.to_numpy(net._backbone.wte.embedding_table.data)  # noqa: E731
    out = run_pipeline("gpt", stages, 4, scheduler, data, build=models.gpt_tied, also=table)
    name = "_backbone.wte.embedding_table"
    np.testing.assert_array_equal(out[-1][2], out[0][2])  # the last stage's copy stays the first's, bit for bit
    for rank, (losses, mine, _) in enumerate(out):
        np.testing.assert_allclose(np.array(losses), np.array(ref_losses), rtol=1e-10, atol=0)
        for key, value in mine.items():
            np.testing.assert_allclose(value, ref[key], rtol=1e-10, atol=1e-14, err_msg=f"{key} on rank {rank}")
    first, last = out[0][1], out[-1][1]
    assert name in first and name not in last  # (listed with its first stage)


def _with_seeded_dropout(stages):
    """The MLP with a Dropout after each hidden layer, each drawing from its own seeded stream."""
    from minidl import ops
    net = models.mlp(stages)
    layers = list(net._backbone)
    cells = []
    for k, layer in enumerate(layers):
        cells.append(layer)
        if k < len(layers) - 1:
            drop = nn.Dropout(keep_prob=0.7)
            drop.dropout = ops.Dropout(0.7, seed0=5, seed1=k + 1)  # (MindSpore's per-op seeds)
            drop.pipeline_stage = layer.pipeline_stage
            cells.append(drop)
    body = nn.SequentialCell(cells)
    body.set_train(True)
    return nn.WithLossCell(body, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))


def test_dropout_with_its_own_seeds_draws_one_devices_masks_in_a_pipeline():
    """A seeded Dropout op advances its own stream call by call, and each op sees the micro-batches in the
    same order on its stage as on one device: the same masks, so the same training, bit for bit. (An
    unseeded Dropout draws from the global stream, which each stage's rank advances by its own ops.)"""
    check_equal("mlp", 2, 4, "1f1b", build=_with_seeded_dropout)
