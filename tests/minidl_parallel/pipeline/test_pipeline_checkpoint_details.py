"""minidl/train/checkpoint.py under a pipeline, in detail (the tests its mutation run asked for): a
``saved_network`` save holds the stage's part, records it and gathers tensor-parallel blocks; a resume
from a stage's file refuses what the file lacks and loads the stale copy of a shared parameter it holds."""
import numpy as np

import minidl_parallel as mp
from minidl import Parameter, Tensor, backend, nn
from minidl.dataset import NumpySlicesDataset
from minidl.io.checkpoint import load_checkpoint, load_checkpoint_metadata, save_checkpoint
from minidl.train import (CallbackParam, CheckpointConfig, Model, ModelCheckpoint, RunContext, restore_train_state,
                          save_train_state)
from minidl.train.checkpoint import rank_checkpoint_path
from minidl_parallel.nn import PipelineCell
from minidl_parallel.pipeline.stages import StagePlan

from . import pipeline_models as models
from .test_pipeline_tensor_parallel import COLUMN, ROW, local_batch

MICRO, BATCH = 2, 8


def _pipeline_context(stages, **settings):
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                 pipeline_config={"pipeline_scheduler": "1f1b"}, **settings)


def _dataset(data):
    xs = np.concatenate([x.asnumpy() for x, _ in data])
    ys = np.concatenate([y.asnumpy() for _, y in data])
    return NumpySlicesDataset((xs, ys), column_names=["x", "y"], shuffle=False).batch(len(xs) // len(data))


def _errors(*attempts):
    """The message each attempt raised (None: it did not raise)."""
    said = []
    for attempt in attempts:
        try:
            attempt()
            said.append(None)
        except ValueError as err:
            said.append(str(err))
    return said


def test_a_saved_network_save_of_pipeline_stages_cut_by_tensor_parallelism_holds_its_stage_whole(tmp_path):
    """2 stages x 2 tensor-parallel ranks, ModelCheckpoint(saved_network=the staged network) in a custom
    loop: each rank's file holds its stage's parameters as whole tensors (integrated_save gathers the
    blocks), none of the other stage's and no optimizer state, and records its layout and writer."""
    strategies, steps = (COLUMN, ROW, COLUMN, ROW), 2
    data = models.batches("mlp_cut", steps, 16)

    def body():
        _pipeline_context(2, dataset_strategy="data_parallel")
        rank = mp.get_rank()
        net = models.mlp_cut(2, strategies)
        optimizer = models.optimizer(net)
        step = nn.TrainOneStepCell(PipelineCell(net, MICRO), optimizer)
        for x, y in data:
            step(*(Tensor(local_batch(t.data, MICRO, 2, rank % 2)) for t in (x, y)))
        config = CheckpointConfig(saved_network=net, append_info=[{"run": "tp"}])
        saving = ModelCheckpoint("tp", str(tmp_path / f"rank{rank}"), config)  # (a directory each: no shared prefix)
        cb_params = CallbackParam(train_network=step, optimizer=optimizer, batch_num=steps, cur_epoch_num=1,
                                  cur_step_num=steps, cur_step_in_epoch=steps)
        saving.on_train_end(RunContext(cb_params))
        plan = StagePlan(net, 2)
        return {name: tuple(p.shape) for name, p in net.parameters_and_names()
                if plan.stage_of_parameter[id(p)] == rank // 2}

    stage_shapes = mp.run_threads(4, body, timeout=120)
    for rank, shapes in enumerate(stage_shapes):
        path = rank_checkpoint_path(str(tmp_path / f"rank{rank}" / "tp-1_2.ckpt"), rank)
        meta = load_checkpoint_metadata(path)
        layouts = {key for key in meta if key.startswith("layout.")}  # (how the gathered tensors were cut)
        assert {key: value for key, value in meta.items() if key not in layouts} == {
            "run": "tp", "rank": str(rank), "group_size": "4", "epoch_num": "1", "step_num": "2",
            "pipeline_stages": "2", "pipeline_stage": str(rank // 2), "pipeline_network": ""}, rank
        assert layouts and {key[len("layout."):] for key in layouts} <= set(shapes), rank
        saved = load_checkpoint(path)
        assert {name: tuple(value.shape) for name, value in saved.items()} == shapes, rank  # whole, this stage's
    # the two ranks of a stage gathered the same whole tensors
    for first in (0, 2):
        a = load_checkpoint(rank_checkpoint_path(str(tmp_path / f"rank{first}" / "tp-1_2.ckpt"), first))
        b = load_checkpoint(rank_checkpoint_path(str(tmp_path / f"rank{first + 1}" / "tp-1_2.ckpt"), first + 1))
        assert all(np.array_equal(a[name].asnumpy(), b[name].asnumpy()) for name in a)


def test_a_resume_from_a_stages_file_refuses_what_the_stage_needs_and_the_file_lacks(tmp_path):
    """Each rank's file (save_train_state without the optimizer): a resume with an optimizer names this
    stage's optimizer state alone; a parameter added to stage 0 is named on stage 0 (on stage 1 it is a
    stale copy, not needed); two parameters of one name are refused by name."""
    def body():
        _pipeline_context(2)
        rank = mp.get_rank()
        path = str(tmp_path / f"net_rank{rank}.ckpt")
        net = models.mlp(2)
        save_train_state(path, PipelineCell(net, MICRO), None, 1, 1, 1, 1)

        def with_optimizer():
            fresh = models.mlp(2)
            restore_train_state(path, PipelineCell(fresh, MICRO), models.optimizer(fresh))

        def with_a_parameter_more():
            bigger = models.mlp(2)
            bigger._backbone[0].extra = Parameter(Tensor(np.zeros(3, np.float32)))
            restore_train_state(path, PipelineCell(bigger, MICRO), None)

        def with_two_of_one_name():
            named = models.mlp(2)
            named._backbone[0].bias.name = named._backbone[1].bias.name = "bias"
            restore_train_state(path, PipelineCell(named, MICRO), None, who="resume")

        plan = StagePlan(net, 2)
        momenta = [f"moments.{p.name}" for p in models.optimizer(net).parameters
                   if plan.stage_of_parameter[id(p)] == rank]
        return path, momenta, _errors(with_optimizer, with_a_parameter_more, with_two_of_one_name)

    (path0, momenta0, said0), (path1, momenta1, said1) = mp.run_threads(2, body, timeout=60)
    for path, momenta, said in ((path0, momenta0, said0), (path1, momenta1, said1)):
        absent = ["global_step"] + momenta
        assert len(momenta) == 4 and said[0] == (
            f"Model.train: checkpoint {path!r} lacks {len(absent)} parameter(s) or optimizer state(s) of this model, "
            f"nothing was loaded: {absent}")
        assert said[2] == ("resume: parameters 'network._backbone.0.bias' and 'network._backbone.1.bias' would both "
                           "be saved as 'bias'; a checkpoint needs unique names: give one of them another name")
    assert said0[1] == (f"Model.train: checkpoint {path0!r} lacks 1 parameter(s) or optimizer state(s) of this model, "
                        f"nothing was loaded: ['network._backbone.0.extra']")
    assert said1[1] is None


def test_an_optimizer_state_of_another_shape_in_a_stages_file_is_named(tmp_path):
    def body():
        _pipeline_context(2)
        rank = mp.get_rank()
        path, bad = str(tmp_path / f"net_rank{rank}.ckpt"), str(tmp_path / f"bad_rank{rank}.ckpt")
        net = models.mlp(2)
        pipe = PipelineCell(net, MICRO)
        optimizer = models.optimizer(net)
        save_train_state(path, pipe, optimizer, 1, 1, 1, 1)
        tensors = {name: value.asnumpy() for name, value in load_checkpoint(path).items()}
        moment = sorted(name for name in tensors if name.startswith("moments."))[0]
        tensors[moment] = np.zeros((1, 1), np.float32)
        save_checkpoint(tensors, bad, append_dict=load_checkpoint_metadata(path))
        return bad, moment, tuple(dict(optimizer.parameters_and_names())[moment].shape), _errors(
            lambda: restore_train_state(bad, pipe, models.optimizer(net)))[0]

    for bad, moment, shape, said in mp.run_threads(2, body, timeout=60):
        assert said == (f"Model.train: 1 parameter(s) have a different shape in the checkpoint, nothing was loaded: "
                        f"{moment!r}: net {shape} vs checkpoint (1, 1)")


def test_a_named_tied_table_resumes_from_both_stages_files(tmp_path):
    """GPT's tied table under a name of its own: both stages' files hold it under that name, and the last
    stage's resume loads its copy (which a fresh network's stage plan calls stale) from its file, so
    training continues as the uninterrupted pipeline, bit for bit."""
    data = models.batches("gpt", 4, BATCH)

    def body(resume):
        _pipeline_context(2)
        net = models.gpt_tied(2)
        net._backbone.wte.embedding_table.name = "token_table"
        pipe = PipelineCell(net, 4)
        model = Model(pipe, optimizer=models.optimizer(net))
        if resume:
            model.train(1, _dataset(data), resume_from=str(tmp_path / "gpt-1_2.ckpt"))
        else:
            model.train(1, _dataset(data), callbacks=[ModelCheckpoint("gpt", str(tmp_path),
                                                                      CheckpointConfig(save_checkpoint_steps=2))])
        pipe.gather_parameters()
        return {name: backend.to_numpy(p.data).copy() for name, p in net.parameters_and_names()}

    whole = mp.run_threads(2, body, False, timeout=120)
    for path in ("gpt-1_2.ckpt", "gpt-1_2_rank1.ckpt"):
        assert "token_table" in load_checkpoint(str(tmp_path / path)), path
    for rank, got in enumerate(mp.run_threads(2, body, True, timeout=120)):
        assert sorted(got) == sorted(whole[rank])
        for name, value in whole[rank].items():
            np.testing.assert_array_equal(got[name], value, err_msg=f"{name} (rank {rank})")
