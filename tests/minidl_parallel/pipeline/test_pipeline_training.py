"""A pipeline in Model.train, and what a step does on each stage: its messages (counted from the
executed step), the micro-batches it holds, its stalls and failures."""
import time

import numpy as np
import pytest

import minidl_parallel as mp
from minidl import backend, nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Model
from minidl.train.callbacks import Callback
from minidl_parallel.comm.base import CollectiveTimeout
from minidl_parallel.nn import PipelineCell, PipelineGradReducer
from minidl_parallel.pipeline.stages import StagePlan
from minidl.autograd import value_and_grad

from . import pipeline_models as models


class _Losses(Callback):
    def __init__(self):
        self.seen = []

    def on_train_step_end(self, run_context):
        self.seen.append(backend.to_numpy(run_context.original_args().net_outputs.data).copy())


def _pipeline_context(stages, scheduler="1f1b"):
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                 pipeline_config={"pipeline_scheduler": scheduler})


def test_model_train_runs_a_pipeline_and_every_rank_sees_the_last_stages_loss():
    data = models.batches("mlp", 3, 8)
    xs = np.concatenate([x.asnumpy() for x, _ in data])
    ys = np.concatenate([y.asnumpy() for _, y in data])
    ref_losses, ref = models.reference(models.mlp, data, 4)

    def body():
        _pipeline_context(2)
        net = models.mlp(2)
        model = Model(PipelineCell(net, 4), optimizer=models.optimizer(net))
        losses = _Losses()
        dataset = NumpySlicesDataset((xs, ys), column_names=["x", "y"], shuffle=False).batch(8)
        model.train(1, dataset, callbacks=[losses])
        mine = net._backbone[mp.get_rank() * 2]  # stage r holds Dense layer 2r (and 2r + 1)
        return losses.seen, backend.to_numpy(mine.weight.data)

    for rank, (seen, weight) in enumerate(mp.run_threads(2, body, timeout=120)):
        assert len(seen) == 3 and all(np.array_equal(a, b) for a, b in zip(seen, ref_losses)), (seen, ref_losses)
        np.testing.assert_array_equal(weight, ref[f"_backbone.{2 * rank}.weight"])


def test_mindsporess_functional_loop_with_the_grad_reducer_trains_as_train_one_step():
    data = models.batches("mlp", 2, 8)
    _, ref = models.reference(models.mlp, data, 2)

    def body():
        _pipeline_context(2)
        net = models.mlp(2)
        pipe = PipelineCell(net, 2)
        optimizer = models.optimizer(net)
        grad_fn = value_and_grad(lambda x, y: pipe(x, y), None, pipe.trainable_params())
        reducer = PipelineGradReducer(optimizer.parameters)
        for x, y in data:
            _, grads = grad_fn(x, y)
            optimizer(reducer(grads))
        return {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()}

    for rank, params in enumerate(mp.run_threads(2, body, timeout=120)):
        for k in (2 * rank, 2 * rank + 1):
            np.testing.assert_array_equal(params[f"_backbone.{k}.weight"], ref[f"_backbone.{k}.weight"])


@pytest.mark.parametrize("stages, micro_batches, scheduler", [(2, 4, "gpipe"), (4, 4, "1f1b"), (4, 6, "gpipe"),
                                                              (3, 5, "1f1b")])
def test_a_step_sends_one_activation_and_one_gradient_per_micro_batch_per_boundary(stages, micro_batches,
                                                                                    scheduler):
    batch = 2 * micro_batches

    def body():
        _pipeline_context(stages, scheduler)
        net = models.mlp(stages, widths=(6,) + (8,) * stages)  # every boundary: 8 features
        pipe = PipelineCell(net, micro_batches)
        x, y = models.batches("mlp", 1, batch)[0]
        pipe(x, y)
        log = pipe.last_step
        return (log.count("send", "activation"), log.count("send", "gradient"), log.count("recv", "activation"),
                log.count("recv", "gradient"), log.count("send", "header"), log.peak_held,
                [(str(m.action), m.direction, m.peer, m.payload) for m in log.messages][:3])

    out = mp.run_threads(stages, body, timeout=120)
    schedule = mp.pipeline_schedule(stages, micro_batches, scheduler)
    width = 8 * 2 * 4  # a micro-batch of 2 rows of 8 float32 features crosses every boundary
    sent_activations = sum(o[0][0] for o in out)
    sent_gradients = sum(o[1][0] for o in out)
    assert sent_activations == sent_gradients == (stages - 1) * micro_batches
    for stage, (act, grad, got_act, got_grad, headers, held, first) in enumerate(out):
        last = stage == stages - 1
        each = (micro_batches, micro_batches * width)
        assert act == ((0, 0) if last else each) and got_grad == ((0, 0) if last else each)
        assert grad == ((0, 0) if stage == 0 else each) and got_act == ((0, 0) if stage == 0 else each)
        assert headers == ((0, 0) if last else (micro_batches, micro_batches * 80))  # 10 int64 each
        assert held == schedule.peak_activations(stage)  # m for GPipe, min(p - s, m) for 1F1B
    if stages > 1:  # stage 1's first action: F0, which receives its input's header, then the activation
        assert out[1][6][:2] == [("F0", "recv", 0, "header"), ("F0", "recv", 0, "activation")]


def test_a_stalled_stage_is_named_with_the_action_and_message_its_neighbour_waits_for():
    data = models.batches("mlp", 1, 8)

    def body():
        _pipeline_context(2)
        mp.get_communicator().timeout = 0.5 if mp.get_rank() == 1 else 30.0
        net = models.mlp(2)
        if mp.get_rank() == 0:
            time.sleep(2.0)
        return PipelineCell(net, 4)(*data[0])

    start = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        mp.run_threads(2, body, timeout=60)
    assert time.monotonic() - start < 10
    assert ("rank 1 of 2: threads backend: rank 1 of 2: recv #0 from rank 0 (tag 2, shape=(10,), dtype=int64) "
            "(pipeline stage 1, F0: the header from stage 0) timed out after 0.5 s; ranks that have not arrived: "
            "[0] (the sender has not sent it)") in str(info.value)


def test_a_stage_that_raises_is_named_with_its_action():
    data = models.batches("mlp", 1, 8)

    def body():
        _pipeline_context(2, "gpipe")
        net = models.mlp(2)
        if mp.get_rank() == 0:
            layer = net._backbone[1]
            original = layer.construct
            calls = {"n": 0}

            def failing(x):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise ValueError("stage 0 fails on purpose")
                return original(x)
            layer.construct = failing
        return PipelineCell(net, 4)(*data[0])

    with pytest.raises(ValueError, match="rank 0 of 2: stage 0 fails on purpose") as info:
        mp.run_threads(2, body, timeout=60)
    assert info.value.__notes__ == ["(in pipeline stage 0, F2: the forward of micro-batch 2)"]


@pytest.mark.parametrize("kind, stages", [("resnet", 2), ("gpt", 4)])
def test_gather_parameters_makes_every_ranks_network_the_trained_one(kind, stages):
    build = {"resnet": models.resnet, "gpt": models.gpt}[kind]
    data = models.batches(kind, 2, 8)
    _, ref = models.reference(build, data, stages)

    def body():
        _pipeline_context(stages)
        net = build(stages)
        pipe = PipelineCell(net, stages)
        step = nn.TrainOneStepCell(pipe, models.optimizer(net))
        for x, y in data:
            step(x, y)
        stale = sum(not np.array_equal(backend.to_numpy(p.data), ref[name]) for name, p in net.parameters_and_names())
        pipe.gather_parameters()
        return stale, {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()}

    for rank, (stale, params) in enumerate(mp.run_threads(stages, body, timeout=120)):
        assert stale > 0  # before: the other stages' parameters were this rank's old copies
        assert sorted(params) == sorted(ref)
        for name, value in params.items():
            np.testing.assert_array_equal(value, ref[name], err_msg=f"{name} on rank {rank}")


def test_a_pipeline_resumes_from_its_ranks_checkpoints_bit_for_bit(tmp_path):
    """ModelCheckpoint on every rank writes the rank's own file (its stage's parameters and optimizer
    state are the true ones); resuming at the same stage count continues exactly."""
    from minidl.train import CheckpointConfig, ModelCheckpoint
    data = models.batches("resnet", 4, 8)
    xs = np.concatenate([x.asnumpy() for x, _ in data])
    ys = np.concatenate([y.asnumpy() for _, y in data])

    def body(how):
        _pipeline_context(2, "gpipe")
        net = models.resnet(2)
        model = Model(PipelineCell(net, 2), optimizer=models.optimizer(net))
        dataset = NumpySlicesDataset((xs, ys), column_names=["x", "y"], shuffle=False).batch(8)
        if how == "resume":
            model.train(1, dataset, resume_from=str(tmp_path / "pp-1_2.ckpt"))
        else:
            saving = [ModelCheckpoint(prefix="pp", directory=str(tmp_path),
                                      config=CheckpointConfig(save_checkpoint_steps=2))] if how == "save" else []
            model.train(1, dataset, callbacks=saving)
        plan = StagePlan(net, 2)
        return {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()
                if plan.stage_of_parameter[id(p)] == mp.get_rank()}

    whole = mp.run_threads(2, lambda: body("straight"), timeout=120)
    mp.run_threads(2, lambda: body("save"), timeout=120)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pp-1_2.ckpt", "pp-1_2_rank1.ckpt", "pp-1_4.ckpt",
                                                          "pp-1_4_rank1.ckpt"]
    resumed = mp.run_threads(2, lambda: body("resume"), timeout=120)
    for rank in range(2):
        assert sorted(resumed[rank]) == sorted(whole[rank])
        for name, value in whole[rank].items():  # BatchNorm's moving statistics too
            np.testing.assert_array_equal(resumed[rank][name], value, err_msg=f"{name} on rank {rank}")


def test_a_loss_scaled_step_around_a_pipeline_trains_as_one_device():
    """TrainOneStepWithLossScaleCell scales the pipeline's loss: the step's gradients are the sums
    times the scale (a power of two: exact), unscaled before the optimizer; the overflow flag is summed
    over every rank, so all stages skip or step together."""
    from minidl import Tensor
    data = models.batches("mlp", 3, 8)
    ref_losses, ref = models.reference(models.mlp, data, 4)

    def body():
        _pipeline_context(2)
        net = models.mlp(2)
        step = nn.TrainOneStepWithLossScaleCell(PipelineCell(net, 4), models.optimizer(net),
                                                scale_sense=Tensor(np.float32(1024.0)))
        outs = [step(x, y) for x, y in data]
        plan = StagePlan(net, 2)
        return ([(backend.to_numpy(o[0].data), bool(o[1].asnumpy())) for o in outs],
                {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()
                 if plan.stage_of_parameter[id(p)] == mp.get_rank()})

    for rank, (outs, mine) in enumerate(mp.run_threads(2, body, timeout=120)):
        assert [overflow for _, overflow in outs] == [False] * 3
        assert all(np.array_equal(loss, want) for (loss, _), want in zip(outs, ref_losses))
        for name, value in mine.items():
            np.testing.assert_array_equal(value, ref[name], err_msg=f"{name} on rank {rank}")


def test_under_no_grad_a_step_runs_the_forwards_only_and_returns_the_same_loss():
    from minidl import no_grad
    data = models.batches("mlp", 1, 8)
    ref_losses, _ = models.reference(models.mlp, data, 4)

    def body():
        _pipeline_context(2)
        pipe = PipelineCell(models.mlp(2), 4)
        with no_grad():
            loss = pipe(*data[0])
        log = pipe.last_step
        return (backend.to_numpy(loss.data), log.count("send", "gradient")[0] + log.count("recv", "gradient")[0],
                log.count("send", "activation")[0] + log.count("recv", "activation")[0], log.peak_held)

    for loss, gradients, activations, held in mp.run_threads(2, body, timeout=60):
        assert np.array_equal(loss, ref_losses[0]) and (gradients, activations, held) == (0, 4, 0)
