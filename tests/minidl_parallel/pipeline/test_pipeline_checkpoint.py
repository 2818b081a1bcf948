"""Pipeline checkpoints: each stage's file holds its stage's part and records it;
``load_segmented_checkpoints`` merges one save's files into a network of any stage count, or one
device's, and training continues as the uninterrupted single-device run (bit for bit: the
micro-batches' gradients are added in the same order)."""
import warnings

import numpy as np
import pytest

import minidl_parallel as mp
from minidl import Tensor, backend, nn
from minidl.autograd import value_and_grad
from minidl.dataset import NumpySlicesDataset
from minidl.io.checkpoint import load_checkpoint, load_checkpoint_metadata, save_checkpoint
from minidl.train import CheckpointConfig, Model, ModelCheckpoint
from minidl.train.checkpoint import save_train_state
from minidl_parallel.nn import PipelineCell
from minidl_parallel.pipeline import PipelineError
from minidl_parallel.pipeline.stages import StagePlan

from . import pipeline_models as models

MICRO, STEPS, SAVED_AT, BATCH = 4, 4, 2, 8


def _pipeline_context(stages, **settings):
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                 pipeline_config={"pipeline_scheduler": "1f1b"}, **settings)


def _dataset(data, rows=slice(None)):
    xs = np.concatenate([x.asnumpy()[rows] for x, _ in data])
    ys = np.concatenate([y.asnumpy()[rows] for _, y in data])
    return NumpySlicesDataset((xs, ys), column_names=["x", "y"], shuffle=False).batch(len(xs) // len(data))


def _train_one_device(net, optimizer, data, micro_batches):
    """pipeline_models.reference's step, in training mode (as Model.train runs): each micro-batch's
    gradients added in order, one optimizer step."""
    net.set_train(True)
    fn = value_and_grad(net, None, optimizer.parameters)
    for x, y in data:
        n, acc = x.shape[0] // micro_batches, None
        for k in range(micro_batches):
            _, grads = fn(Tensor(x.data[k * n:(k + 1) * n]), Tensor(y.data[k * n:(k + 1) * n]))
            acc = [g.data.copy() for g in grads] if acc is None else [a + g.data for a, g in zip(acc, grads)]
        optimizer(tuple(Tensor(a) for a in acc))


def _values(net):
    return {name: backend.to_numpy(p.data).copy() for name, p in net.parameters_and_names()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 2-stage ResNet (BatchNorm) trained with Model.train, saved by ModelCheckpoint after step 2
    (``pp-1_2.ckpt`` and ``pp-1_2_rank1.ckpt``); and the single device's parameters after every step."""
    directory = tmp_path_factory.mktemp("pipeline_ckpt")
    data = models.batches("resnet", STEPS, BATCH)

    def body():
        _pipeline_context(2)
        net = models.resnet(2)
        model = Model(PipelineCell(net, MICRO), optimizer=models.optimizer(net))
        saving = ModelCheckpoint("pp", str(directory), CheckpointConfig(save_checkpoint_steps=SAVED_AT))
        model.train(1, _dataset(data), callbacks=[saving])

    mp.run_threads(2, body, timeout=120)
    reference = models.resnet(1)
    _train_one_device(reference, models.optimizer(reference), data, MICRO)
    return directory, data, _values(reference)


def _assert_trained_as_one_device(got, want, where):
    assert sorted(got) == sorted(want)
    for name, value in want.items():  # BatchNorm's moving statistics too
        np.testing.assert_array_equal(got[name], value, err_msg=f"{name} ({where})")


def test_each_stage_saves_its_own_parameters_their_momenta_and_its_layout(saved):
    directory, _, _ = saved
    net = models.resnet(2)
    plan = StagePlan(net, 2)
    momenta = {name for name, _ in models.optimizer(net).parameters_and_names() if name.startswith("moments.")}
    seen_momenta = set()
    for stage, name in enumerate(["pp-1_2.ckpt", "pp-1_2_rank1.ckpt"]):
        meta = load_checkpoint_metadata(str(directory / name))
        assert (meta["pipeline_stages"], meta["pipeline_stage"], meta["rank"]) == ("2", str(stage), str(stage))
        prefix = meta["pipeline_network"] + "."
        entries = set(load_checkpoint(str(directory / name)))
        mine = {path for path, p in net.parameters_and_names() if plan.stage_of_parameter[id(p)] == stage}
        assert {e[len(prefix):] for e in entries if e.startswith(prefix)} == mine  # no stale copy of the other stage
        stage_momenta = {e for e in entries if e.startswith("moments.")}
        assert len(stage_momenta) == len(plan.parameters[stage]) and not stage_momenta & seen_momenta
        seen_momenta |= stage_momenta
        assert "global_step" in entries
    assert seen_momenta == momenta


def test_a_save_of_two_stages_loads_into_one_device_and_trains_on_as_the_uninterrupted_run(saved):
    directory, data, want = saved
    net = models.resnet(1)
    optimizer = models.optimizer(net)
    params = mp.load_segmented_checkpoints(str(directory / "pp-1_2.ckpt"), net, optimizer)
    assert optimizer.global_step == SAVED_AT and sorted(_values(net)) == sorted(k for k in params if k in want)
    _train_one_device(net, optimizer, data[SAVED_AT:], MICRO)  # the momenta carried: else the steps differ
    _assert_trained_as_one_device(_values(net), want, "one device")


@pytest.mark.parametrize("stages", [2, 4])
def test_a_save_of_two_stages_loads_into_any_stage_count_and_trains_on_as_the_uninterrupted_run(saved, stages):
    directory, data, want = saved

    def body():
        _pipeline_context(stages)
        net = models.resnet(stages)
        optimizer = models.optimizer(net)
        pipe = PipelineCell(net, MICRO)
        step = nn.TrainOneStepCell(pipe, optimizer)
        # (the whole list of files, or the Cell around the PipelineCell, load as well as rank 0's file into the network)
        mp.load_segmented_checkpoints([str(directory / "pp-1_2_rank1.ckpt"), str(directory / "pp-1_2.ckpt")], step,
                                      optimizer)
        step.set_train(True)
        for x, y in data[SAVED_AT:]:
            step(x, y)
        pipe.gather_parameters()
        return _values(net)

    for rank, got in enumerate(mp.run_threads(stages, body, timeout=120)):
        _assert_trained_as_one_device(got, want, f"rank {rank} of {stages} stages")


def test_a_save_of_pipeline_times_data_parallel_loads_from_its_directory_into_one_device(tmp_path):
    """2 stages x 2 replicas: replica j trains on block j of each batch; loading the save (four files,
    one stage's replicas equal: the lowest rank's is read) into one device gives the reference over
    the replicas' shards."""
    stages, replicas, micro = 2, 2, 2
    data = models.batches("mlp", SAVED_AT, BATCH)
    _, want = models.reference(models.mlp, data, micro, replicas=replicas)

    def body():
        _pipeline_context(stages)
        replica, rows = mp.get_rank() % replicas, BATCH // replicas
        net = models.mlp(stages)
        model = Model(PipelineCell(net, micro), optimizer=models.optimizer(net))
        saving = ModelCheckpoint("pp", str(tmp_path), CheckpointConfig(save_checkpoint_steps=SAVED_AT))
        model.train(1, _dataset(data, slice(replica * rows, (replica + 1) * rows)), callbacks=[saving])

    mp.run_threads(stages * replicas, body, timeout=120)
    net = models.mlp(1)
    mp.load_segmented_checkpoints(str(tmp_path), net)  # (a directory of one save's files)
    _assert_trained_as_one_device(_values(net), want, "one device")


def test_a_pipeline_resumes_at_its_stage_count_from_its_stages_files_alone(saved):
    """Model.train(resume_from=...) at the saved stage count: each rank loads its stage's part (the
    other stages' parameters are not in its file, and not used by its stage)."""
    directory, data, want = saved

    def body():
        _pipeline_context(2)
        net = models.resnet(2)
        pipe = PipelineCell(net, MICRO)
        model = Model(pipe, optimizer=models.optimizer(net))
        model.train(1, _dataset(data), resume_from=str(directory / "pp-1_2.ckpt"))
        pipe.gather_parameters()
        return _values(net)

    for rank, got in enumerate(mp.run_threads(2, body, timeout=120)):
        _assert_trained_as_one_device(got, want, f"rank {rank}")


def test_a_missing_stage_file_or_parameter_is_named(saved, tmp_path):
    directory, _, _ = saved
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "pp-1_2.ckpt").write_bytes((directory / "pp-1_2.ckpt").read_bytes())
    with pytest.raises(FileNotFoundError, match=r"the file\(s\) of stage 1 \('.*pp-1_2_rank1\.ckpt'\) do not exist"):
        mp.load_segmented_checkpoints(str(alone / "pp-1_2.ckpt"), models.resnet(1))
    with pytest.raises(FileNotFoundError, match=r"no file of stage\(s\) \[1\]"):
        mp.load_segmented_checkpoints(str(alone), models.resnet(1))
    bigger = models.resnet(1)
    bigger._backbone.extra = nn.Dense(2, 2)
    before = _values(bigger)
    with pytest.raises(ValueError, match=r"2 parameter\(s\) or optimizer state\(s\) are in none of the files .*"
                                         r"'_backbone\.extra\.weight', '_backbone\.extra\.bias'"):
        mp.load_segmented_checkpoints(str(directory / "pp-1_2.ckpt"), bigger)
    assert all(np.array_equal(v, before[k]) for k, v in _values(bigger).items())  # nothing was loaded


def test_a_stage_file_is_refused_where_it_would_load_stale_or_missing_values(saved, tmp_path):
    directory, data, _ = saved
    plain = tmp_path / "plain.ckpt"
    save_checkpoint(models.mlp(1), str(plain))
    with pytest.raises(ValueError, match=r"record no pipeline layout"):
        mp.load_segmented_checkpoints([str(plain)], models.mlp(1))
    net = models.resnet(1)  # one device resuming from stage 0's file: the other stage's part is not there
    with pytest.raises(ValueError, match=r"holds pipeline stage 0 of a 2-stage pipeline, but this rank trains the "
                                         r"whole model .*load_segmented_checkpoints"):
        Model(net, optimizer=models.optimizer(net)).train(1, _dataset(data),
                                                          resume_from=str(directory / "pp-1_2.ckpt"))

    def body():  # a 4-stage pipeline given stage 0's file of a 2-stage save: rank r trains stage r
        _pipeline_context(4)
        net = models.resnet(4)
        try:
            with warnings.catch_warnings():  # (ranks 2 and 3 read rank 0's file: warned, then refused)
                warnings.simplefilter("ignore", RuntimeWarning)
                Model(PipelineCell(net, MICRO), optimizer=models.optimizer(net)).train(
                    1, _dataset(data), resume_from=str(directory / "pp-1_2.ckpt"))
        except ValueError as err:
            return str(err)
    said = mp.run_threads(4, body, timeout=120)
    assert "holds pipeline stage 0 of a 2-stage pipeline, but this rank trains stage 0 of a 4-stage pipeline" \
        in said[0]
    assert "holds pipeline stage 1 of a 2-stage pipeline, but this rank trains stage 1 of a 4-stage pipeline" \
        in said[1]


def test_a_pipeline_save_needs_the_network_to_say_its_stages(tmp_path):
    def body():
        _pipeline_context(2)
        net = nn.Dense(2, 2)  # no PipelineCell, no cell with a pipeline_stage
        save_train_state(str(tmp_path / f"net_{mp.get_rank()}.ckpt"), net, None, 1, 1, 1, 1)

    with pytest.raises(PipelineError, match=r"checkpoint: pipeline_stages is 2, but the saved network \(Dense\) "
                                            r"holds no nn\.PipelineCell and no cell with a pipeline_stage"):
        mp.run_threads(2, body, timeout=60)
    assert not list(tmp_path.iterdir())


def test_stages_cut_by_tensor_parallelism_save_whole_tensors_that_load_into_one_device(tmp_path):
    """2 stages x 2 tensor-parallel ranks (Megatron's column / row pairs): integrated_save gathers each
    stage's blocks over its ranks; the merged save, momenta included, trains on as one device (float64,
    within 1e-10: the tensor-parallel sums run in another order)."""
    from .test_pipeline_tensor_parallel import COLUMN, ROW, local_batch
    strategies, micro = (COLUMN, ROW, COLUMN, ROW), 2
    data = models.batches("mlp_cut", SAVED_AT + 1, 16)

    def body():
        _pipeline_context(2, dataset_strategy="data_parallel")
        rank = mp.get_rank()
        net = models.mlp_cut(2, strategies)
        optimizer = models.optimizer(net)
        step = nn.TrainOneStepCell(PipelineCell(net, micro), optimizer)
        for x, y in data[:SAVED_AT]:
            step(*(Tensor(local_batch(t.data, micro, 2, rank % 2)) for t in (x, y)))
        path = tmp_path / ("tp.ckpt" if rank == 0 else f"tp_rank{rank}.ckpt")
        save_train_state(str(path), step, optimizer, 1, SAVED_AT, SAVED_AT, SAVED_AT,
                         append_dict={"rank": rank, "group_size": 4}, integrated_save=True)

    mp.run_threads(4, body, timeout=120)
    _, want = models.reference(lambda stages: models.mlp_cut(stages, strategies), data, micro)
    net = models.mlp_cut(1, (None,) * 4)
    optimizer = models.optimizer(net)
    mp.load_segmented_checkpoints(str(tmp_path / "tp.ckpt"), net, optimizer)
    _train_one_device(net, optimizer, data[SAVED_AT:], micro)
    got = _values(net)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-13, err_msg=name)


def test_a_tied_head_resumes_at_its_stage_count_with_the_table_in_both_stages_files(tmp_path):
    """GPT's head reads the embedding table (stage 0) on the last stage: the step's plan shares it, so both
    stages' files hold it, and a resume continues as the uninterrupted pipeline, bit for bit."""
    data = models.batches("gpt", STEPS, BATCH)

    def body(resume):
        _pipeline_context(2)
        net = models.gpt_tied(2)
        pipe = PipelineCell(net, MICRO)
        model = Model(pipe, optimizer=models.optimizer(net))
        if resume:
            model.train(1, _dataset(data), resume_from=str(tmp_path / "gpt-1_2.ckpt"))
        else:
            saving = ModelCheckpoint("gpt", str(tmp_path), CheckpointConfig(save_checkpoint_steps=SAVED_AT))
            model.train(1, _dataset(data), callbacks=[saving])
        pipe.gather_parameters()
        return _values(net)

    whole = mp.run_threads(2, body, False, timeout=120)
    table = "network._backbone.wte.embedding_table"  # (its path in the Model's train network)
    for path in ("gpt-1_2.ckpt", "gpt-1_2_rank1.ckpt"):
        assert table in load_checkpoint(str(tmp_path / path)), path
    for rank, got in enumerate(mp.run_threads(2, body, True, timeout=120)):
        _assert_trained_as_one_device(got, whole[rank], f"rank {rank}")


def test_per_parameter_flags_without_an_owning_buffer_go_with_their_stage(tmp_path):
    # SGD's "stat.<name>" flags are registered by key, not as buffers of a parameter: each stage's file holds
    # its parameters' flags and accumulators, and no stale copy of the other stage's.
    data = models.batches("mlp", 1, BATCH)

    def body():
        _pipeline_context(2)
        net = models.mlp(2)
        optimizer = nn.SGD(net.trainable_params(), learning_rate=0.1, momentum=0.9)
        Model(PipelineCell(net, MICRO), optimizer=optimizer).train(
            1, _dataset(data), callbacks=[ModelCheckpoint("sgd", str(tmp_path))])
        return sorted(p.name for p in optimizer.parameters
                      if StagePlan(net, 2).stage_of_parameter[id(p)] == mp.get_rank())

    mine = mp.run_threads(2, body, timeout=60)
    for stage, name in enumerate(["sgd-1_1.ckpt", "sgd-1_1_rank1.ckpt"]):
        entries = set(load_checkpoint(str(tmp_path / name)))
        assert {e for e in entries if e.startswith("stat.")} == {f"stat.{p}" for p in mine[stage]}
        assert {e for e in entries if e.startswith("accum.")} == {f"accum.{p}" for p in mine[stage]}
        assert "global_step" in entries
