"""What a pipeline refuses, each with a message naming what was wrong and what was expected."""
import re

import numpy as np
import pytest

import minidl_parallel as mp
from minidl import Tensor, nn
from minidl_parallel.comm.threads import CollectiveAborted
from minidl_parallel.nn import PipelineCell, PipelineGradReducer
from minidl_parallel.pipeline import PipelineError
from minidl_parallel.pipeline.stages import StagePlan

from . import pipeline_models as models

X = Tensor(np.ones((4, 6), np.float32))
Y = Tensor(np.zeros(4, np.int32))


def dense_chain(stages_of_layers, widths=(6, 5, 4, 3)):
    layers = [nn.Dense(a, b) for a, b in zip(widths[:-1], widths[1:])]
    for layer, stage in zip(layers, stages_of_layers):
        if stage is not None:
            layer.pipeline_stage = stage
    return layers


def loss_of(body):
    return nn.WithLossCell(body, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"))


@pytest.mark.parametrize("stages_of_layers, stages, message", [
    ((0, 1, None), 2, "parameter '2.weight' belongs to no cell with a pipeline_stage: set pipeline_stage on the cell "
                      "that holds it (stages 0..1)"),
    ((0, 0, 0), 2, "pipeline stage(s) [1] have no cell: pipeline_stages is 2, so set pipeline_stage to each of 0..1 "
                   "on some cell of the network"),
    ((0, 1, 2), 2, "cell '2' has pipeline_stage 2, but pipeline_stages is 2: stages are 0..1"),
])
def test_the_plan_names_a_parameter_without_stage_a_stage_without_cell_and_a_stage_out_of_range(
        stages_of_layers, stages, message):
    with pytest.raises(PipelineError, match=re.escape(message)):
        StagePlan(nn.SequentialCell(dense_chain(stages_of_layers)), stages)


def test_a_cell_inside_a_staged_cell_takes_its_stage_and_a_parameter_of_two_stages_is_shared():
    inner = dense_chain((1,))
    outer = nn.SequentialCell(inner)
    outer.pipeline_stage = 0
    with pytest.raises(PipelineError, match=re.escape(
            "cell '0.0' has pipeline_stage 1 inside cell '0' of stage 0: a cell runs whole on its stage, so the "
            "cells inside it take its stage")):
        StagePlan(nn.SequentialCell([outer, *dense_chain((1,), widths=(5, 3))]), 2)
    a, b = dense_chain((0, 1), widths=(4, 4, 4))
    b.weight = a.weight  # one Parameter in two stages' cells (a tied embedding and head)
    plan = StagePlan(nn.SequentialCell([a, b]), 2)
    assert plan.shared == {id(a.weight): (a.weight, [0, 1])}
    assert a.weight in plan.parameters[0] and a.weight in plan.parameters[1] and plan.stage_of_parameter[
        id(a.weight)] == 0
    norm_a, norm_b = nn.BatchNorm1d(4), nn.BatchNorm1d(4)
    norm_a.pipeline_stage, norm_b.pipeline_stage = 0, 1
    norm_b.moving_mean = norm_a.moving_mean
    with pytest.raises(PipelineError, match=re.escape(
            "is held by '0' (stage 0) and by '1' (stage 1): only trainable parameters can be shared by stages")):
        StagePlan(nn.SequentialCell([norm_a, norm_b]), 2)


def test_copies_of_a_shared_parameter_that_differ_between_stages_are_refused_naming_them():
    data = models.batches("gpt", 1, 4)

    def build():
        net = models.gpt_tied(2)
        if mp.get_rank() == 1:  # this rank's copy of the tied table was made with other weights
            table = net._backbone.wte.embedding_table
            table.set_data(Tensor(table.asnumpy() + 1.0))
        return net

    def call(pipe):
        with pytest.raises(PipelineError) as info:
            pipe(*data[0])
        return str(info.value)

    messages = run(2, in_pipeline(2, build, call, micro=2))
    assert messages[0] == ("parameter 'wte.embedding_table' is used by stages [0, 1], but its copy on stage 0 differs "
                           "from the copy on stage(s) [1]: build the network with the same seed and weights on every "
                           "rank")
    assert messages[1].startswith("parameter 'wte.embedding_table' is used by stages [0, 1], but its copy on stage 1")


def test_the_stages_of_a_network_hold_every_parameter_and_statistic_once():
    net = models.resnet(2)
    plan = StagePlan(net, 2)
    names = {id(p): name for name, p in net.parameters_and_names()}
    assert sum(len(ps) for ps in plan.parameters) == len(net.trainable_params())
    assert set(plan.stage_of_parameter) == set(names)  # BatchNorm's moving statistics too
    assert [names[id(p)] for p in plan.parameters[0]][:3] == ["_backbone.conv1.weight", "_backbone.bn1.gamma",
                                                              "_backbone.bn1.beta"]
    assert "_backbone.fc.weight" in [names[id(p)] for p in plan.parameters[1]]


def run(n, body):
    return mp.run_threads(n, body, timeout=60)


def in_pipeline(stages, build, call, scheduler="1f1b", micro=None, mode="semi_auto_parallel"):
    def body():
        mp.set_auto_parallel_context(parallel_mode=mode, pipeline_stages=stages,
                                     pipeline_config={"pipeline_scheduler": scheduler})
        return call(PipelineCell(build(), micro or stages))
    return body


class Backwards(nn.Cell):
    """Stage 1's output goes into a stage-0 cell: the forward runs against the stage order."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = dense_chain((1, 0, 1), widths=(6, 6, 6, 3))

    def construct(self, x):
        return self.c(self.b(self.a(x)))


class Skips(nn.Cell):
    """Stage 0's output goes to stage 1 and also straight to stage 2."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = dense_chain((0, 1, 2), widths=(6, 6, 6, 3))
        self.d = nn.Dense(6, 3)
        self.d.pipeline_stage = 2

    def construct(self, x):
        h = self.a(x)
        return self.c(self.b(h)) + self.d(h)


class ReadsShape(nn.Cell):
    def __init__(self):
        super().__init__()
        self.a, self.b = dense_chain((0, 1), widths=(6, 4, 3))

    def construct(self, x):
        h = self.a(x)
        return self.b(h.reshape(h.shape[0], -1))


@pytest.mark.parametrize("net, n, message", [
    (Backwards, 2, "cell '_backbone.b' (Dense) (pipeline stage 0) takes an output of stage 1, but stage 0 takes only "
                   "the data: set pipeline_stage so that the stages follow the order of the forward"),
    (Skips, 3, "cell '_backbone.d' (Dense) (pipeline stage 2) takes an output of stage 0, but stage 2 takes the data "
               "and the outputs of stage 1 only: set pipeline_stage so that the stages follow the order of the forward"),
    (ReadsShape, 2, "the construct reads 'reshape' of the output of cell '_backbone.a' (Dense), which lives on "
                    "pipeline stage 0 (another rank): move this code into a cell of that stage"),
])
def test_a_network_whose_stages_do_not_follow_its_forward_is_refused_naming_the_cell(net, n, message):
    # (Both ranks of an out-of-order message see it, with the same words; the first to raise is reported.)
    with pytest.raises((PipelineError, CollectiveAborted)) as info:
        run(n, in_pipeline(n, lambda: loss_of(net()), lambda pipe: pipe(X, Y), micro=4))
    assert message in str(info.value)


def test_a_network_that_does_not_return_its_loss_on_the_last_stage_is_refused():
    with pytest.raises(PipelineError, match=re.escape(
            "the network's output on the last stage (1) must be the loss, a one-element Tensor computed on it; got a "
            "Tensor of shape (2, 3): wrap the network and its loss in nn.WithLossCell")):
        run(2, in_pipeline(2, lambda: nn.SequentialCell(dense_chain((0, 1, 1))), lambda pipe: pipe(X)))


def test_a_batch_that_the_micro_batches_do_not_divide_is_refused_naming_both():
    with pytest.raises(ValueError, match=re.escape(
            "PipelineCell: input 0 of shape (4, 6) cannot be cut into micro_size=3 micro-batches along axis 0 (its "
            "length must be a multiple of 3)")):
        run(2, in_pipeline(2, lambda: loss_of(nn.SequentialCell(dense_chain((0, 1, 1)))), lambda pipe: pipe(X, Y),
                           micro=3))


@pytest.mark.parametrize("n, stages, mode, error, message", [
    (2, 2, "data_parallel", RuntimeError, "pipeline_stages is 2, which needs parallel_mode one of "
                                          "('semi_auto_parallel', 'auto_parallel')"),
    (3, 2, "semi_auto_parallel", ValueError, "pipeline_stages is 2, which does not divide the world size 3"),
])
def test_a_world_or_mode_that_cannot_run_the_pipeline_is_refused_on_every_rank(n, stages, mode, error, message):
    def call(pipe):
        with pytest.raises(error) as info:
            pipe(X, Y)
        return str(info.value)

    messages = run(n, in_pipeline(stages, lambda: loss_of(nn.SequentialCell(dense_chain((0, 1, 1)))), call,
                                  mode=mode))
    assert all(message in m for m in messages), messages


def test_fewer_micro_batches_than_stages_is_refused_as_mindspore_requires():
    with pytest.raises(ValueError, match=re.escape("pipeline_schedule: micro_batches (1) must be >= stages (2)")):
        run(2, in_pipeline(2, lambda: loss_of(nn.SequentialCell(dense_chain((0, 1, 1)))), lambda pipe: pipe(X, Y),
                           micro=1))


def test_pipeline_cell_checks_its_arguments_as_mindspore_does():
    body = loss_of(nn.SequentialCell(dense_chain((None, None, None))))
    with pytest.raises(TypeError, match="PipelineCell: network must be a Cell, got function"):
        PipelineCell(lambda x: x, 2)
    for bad, error in ((True, TypeError), (2.0, TypeError), (0, ValueError)):
        with pytest.raises(error, match="PipelineCell: micro_size must be an int"):
            PipelineCell(body, bad)
    with pytest.raises(KeyError, match=re.escape("PipelineCell: stage_config names ['_backbone.9'], which the network "
                                                 "does not have; its cells are")):
        PipelineCell(body, 2, stage_config={"_backbone.9": 1})
    PipelineCell(body, 2, stage_config={"_backbone.0": 0, "_backbone.1": 1, "_backbone.2": 1})
    assert [cell.pipeline_stage for cell in body._backbone] == [0, 1, 1]


def test_one_stage_accumulates_the_micro_batches_on_this_rank():
    net = models.mlp(1)
    data = models.batches("mlp", 1, 8)
    ref_losses, _ = models.reference(models.mlp, data, 4)
    loss = PipelineCell(net, 4)(*data[0])
    np.testing.assert_allclose(loss.asnumpy(), ref_losses[0], rtol=1e-6)  # one backward, not summed per micro-batch
    assert PipelineCell(net, 4).schedule().stages == 1


def test_the_grad_reducer_divides_by_the_loss_scale_and_checks_its_arguments():
    params = models.mlp(1).trainable_params()
    grads = tuple(Tensor(np.full(p.shape, 8.0, np.float32)) for p in params)
    assert PipelineGradReducer(params)(grads) == grads  # scale 1: the same gradients
    halved = PipelineGradReducer(params, scale_sense=Tensor(np.float32(2.0)))(grads)
    assert all(np.array_equal(g.asnumpy(), np.full(p.shape, 4.0)) for g, p in zip(halved, params))
    with pytest.raises(ValueError, match=re.escape(f"PipelineGradReducer: got 1 gradients for its {len(params)} "
                                                   f"parameters")):
        PipelineGradReducer(params)(grads[:1])
    for bad in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="PipelineGradReducer: scale_sense must be a finite number > 0"):
            PipelineGradReducer(params, scale_sense=bad)
    with pytest.raises(NotImplementedError, match="opt_shard=True"):
        PipelineGradReducer(params, opt_shard=True)
    with pytest.raises(TypeError, match=re.escape("PipelineGradReducer: parameters must be Parameters "
                                                  "(optimizer.parameters), got ['Tensor']")):
        PipelineGradReducer([grads[0]])


