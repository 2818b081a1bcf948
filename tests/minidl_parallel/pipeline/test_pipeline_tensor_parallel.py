"""Tensor parallelism inside pipeline stages equals one device accumulating the same micro-batches.

A world of stages x k ranks: each stage's cells are cut by their shard() strategies over the stage's k
ranks (the dispatcher's world is the stage group), activations cross between rank j of one stage and
rank j of the next in the layout dataset_strategy gives, and the dispatcher's layouts reduce the
gradients. The sums run in another order than one device's (all-reduced per micro-batch), so float64
within 1e-10 relative.
"""
import numpy as np
import pytest

import minidl_parallel as mp
from minidl import Tensor, backend, nn
from minidl_parallel.nn import PipelineCell
from minidl_parallel.pipeline.stages import StagePlan
from minidl_parallel.tensor_parallel.dispatch import gather_like

from . import pipeline_models as models

COLUMN, ROW = ((1, 1), (2, 1)), ((1, 2), (1, 2))  # Megatron's pair over 2 ranks
BATCH = ((2, 1), (1, 1))  # the batch cut over 2 ranks (data parallel inside the stage)


def local_batch(x, micro, ranks, rank):
    """Rank ``rank``'s block of each of the ``micro`` micro-batches of ``x``, one after the other: its
    micro-batch i is block ``rank`` of the one-device micro-batch i (dataset_strategy "data_parallel")."""
    rows = x.shape[0] // (micro * ranks)
    return np.concatenate([x[(i * ranks + rank) * rows:(i * ranks + rank + 1) * rows] for i in range(micro)])


def run(strategies, stages, ranks, micro, scheduler, data, dataset_strategy="data_parallel"):
    build = lambda s: models.mlp_cut(s, strategies)  # noqa: E731

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                     dataset_strategy=dataset_strategy,
                                     pipeline_config={"pipeline_scheduler": scheduler})
        k = mp.get_rank() % ranks
        net = build(stages)
        step = nn.TrainOneStepCell(PipelineCell(net, micro), models.optimizer(net))
        losses = []
        for x, y in data:
            if dataset_strategy == "data_parallel":
                x, y = (Tensor(local_batch(t.data, micro, ranks, k)) for t in (x, y))
            losses.append(float(backend.to_numpy(step(x, y).data)))
        plan = StagePlan(net, stages)
        stage = mp.get_rank() // ranks
        mine = {name: backend.to_numpy(gather_like(p.data, p) if p.placement is not None else p.data)
                for name, p in net.parameters_and_names() if plan.stage_of_parameter[id(p)] == stage}
        log = step.network.last_step
        return losses, mine, (log.count("send", "activation"), log.count("send", "gradient"))

    return mp.run_threads(stages * ranks, body, timeout=240), build


def check(strategies, stages, ranks, micro, scheduler, dataset_strategy="data_parallel"):
    data = models.batches("mlp_cut", 2, 16)
    out, build = run(strategies, stages, ranks, micro, scheduler, data, dataset_strategy)
    ref_losses, ref = models.reference(build, data, micro)
    seen = set()
    widths = (8, 8, 4, 4)  # each Dense layer's output features
    for rank, (losses, mine, (activations, gradients)) in enumerate(out):
        np.testing.assert_allclose(losses, np.array(ref_losses, dtype=np.float64), rtol=1e-10, err_msg=f"rank {rank}")
        # One message per micro-batch and direction, holding this rank's block of the edge's layout: its
        # rows of the micro-batch (all of them with "full_batch"), every feature, float64.
        stage = rank // ranks
        rows = 16 // micro // (ranks if dataset_strategy == "data_parallel" else 1)
        width = widths[max(k for k in range(4) if models.stage_of(k, 4, stages) == stage)]
        assert activations == ((micro, micro * rows * width * 8) if stage < stages - 1 else (0, 0)), rank
        assert gradients[0] == (micro if stage > 0 else 0), rank
        for name, value in mine.items():
            seen.add(name)
            np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-13, err_msg=f"{name} on rank {rank}")
    assert seen == set(ref)


@pytest.mark.parametrize("strategies, micro, scheduler", [
    ((COLUMN, ROW, COLUMN, ROW), 2, "1f1b"),
    ((COLUMN, None, BATCH, ROW), 4, "gpipe"),
])
def test_two_stages_of_two_tensor_parallel_ranks_train_as_one_device(strategies, micro, scheduler):
    check(strategies, 2, 2, micro, scheduler)


def test_an_activation_left_cut_by_columns_crosses_in_the_batch_layout():
    """Stage 0 ends column-parallel (each rank holds half the features of every row): the activation is
    redistributed to the batch layout before it leaves, else stage 1 would take half-rows for rows."""
    check((ROW, COLUMN, ROW, COLUMN), 2, 2, 4, "1f1b")


def test_four_stages_of_two_ranks_train_as_one_device():
    check((COLUMN, ROW, BATCH, COLUMN), 4, 2, 4, "gpipe")


def test_a_full_batch_pipeline_cut_inside_its_stages_trains_as_one_device():
    check((COLUMN, ROW, COLUMN, ROW), 2, 2, 2, "1f1b", dataset_strategy="full_batch")


def run_gpt(stages, ranks, micro, data, tie):
    build = lambda s: (models.gpt_tied if tie else models.gpt64)(s, vocab=12)  # noqa: E731 (cut in 2)

    def body():
        mp.set_auto_parallel_context(parallel_mode="auto_parallel", pipeline_stages=stages,
                                     dataset_strategy="full_batch")
        net = build(stages)
        net._backbone.shard(ranks)
        step = nn.TrainOneStepCell(PipelineCell(net, micro), models.optimizer(net))
        losses = [float(backend.to_numpy(step(x, y).data)) for x, y in data]
        plan = StagePlan(net, stages)
        stage = mp.get_rank() // ranks
        mine = {name: backend.to_numpy(gather_like(p.data, p) if p.placement is not None else p.data)
                for name, p in net.parameters_and_names() if stage in plan.stages_of(p)}
        return losses, mine

    return mp.run_threads(stages * ranks, body, timeout=240), build


@pytest.mark.parametrize("tie", [False, True])
def test_a_megatron_gpt_in_two_stages_of_two_ranks_trains_as_one_device(tie):
    """GPT.shard(2) inside each stage (vocabulary-parallel embedding and head, heads and MLP cut); with
    the head tied to the embedding, the table's two copies (stage 0 and 1) are cut alike and their
    gradients summed block by block."""
    data = models.batches("gpt", 2, 4)
    out, build = run_gpt(2, 2, 2, data, tie)
    ref_losses, ref = models.reference(build, data, 2)
    for rank, (losses, mine) in enumerate(out):
        np.testing.assert_allclose(losses, np.array(ref_losses, dtype=np.float64), rtol=1e-10, err_msg=f"rank {rank}")
        for name, value in mine.items():
            np.testing.assert_allclose(value, ref[name], rtol=1e-9, atol=1e-12, err_msg=f"{name} on rank {rank}")


def test_a_strategy_for_more_ranks_than_the_stage_has_raises_naming_the_stage_device_count():
    """Two ranks in two stages: each stage has one rank, so a cut in two is refused (before it runs)."""
    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)
        net = models.mlp_cut(2, (COLUMN, None, None, None))
        x, y = models.batches("mlp_cut", 1, 4)[0]
        PipelineCell(net, 2)(x, y)

    with pytest.raises(Exception, match=r"MatMul \(_backbone\.0\.matmul\): inputs of shapes \(2, 6\), \(8, 6\), strategy "
                                        r"\(\(1, 1\), \(2, 1\)\) \(shard\), device_num 1: "):
        mp.run_threads(2, body, timeout=60)


@pytest.mark.parametrize("setting, message", [
    ({"enable_parallel_optimizer": True}, "PipelineCell: enable_parallel_optimizer=True (optimizer parallelism inside "
                                          "a pipeline) is not built in minidl; set it to False with pipeline_stages > 1"),
    ({"strategy_ckpt_config": {"save_file": "/tmp/plan.json"}},
     "PipelineCell: strategy_ckpt_config save_file='/tmp/plan.json' (a strategy file of a pipeline) is not built in "
     "minidl; set it to \"\" with pipeline_stages > 1"),
    ({"strategy_ckpt_load_file": "/tmp/plan.json"},
     "PipelineCell: strategy_ckpt_config load_file='/tmp/plan.json' (a strategy file of a pipeline) is not built in "
     "minidl; set it to \"\" with pipeline_stages > 1"),
])
def test_settings_a_pipeline_would_ignore_raise_on_every_rank(setting, message):
    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2, **setting)
        x, y = models.batches("mlp_cut", 1, 4)[0]
        try:
            PipelineCell(models.mlp_cut(2, (None,) * 4), 2)(x, y)
        except NotImplementedError as e:
            return str(e)

    assert mp.run_threads(2, body, timeout=60) == [message, message]
