"""Details of the fifth session's pipeline modules that the main tests leave open (found by mutation runs):
a partial loss made whole and 0-d / 1-d activations between stages cut by shard() (stage_cut.py), the
stage and pipeline groups of an explicit stage count (pipeline_groups.py); PipelineEvalCell's arguments,
outputs and messages (evaluation.py); which files load_segmented_checkpoints reads and every refusal
(checkpoint.py)."""
import re

import numpy as np
import pytest

import minidl_parallel as mp
from minidl import Tensor, backend, nn, ops
from minidl.io.checkpoint import load_checkpoint, load_checkpoint_metadata, save_checkpoint
from minidl.train.checkpoint import save_train_state
from minidl_parallel import context, pipeline_groups
from minidl_parallel.nn import PipelineCell
from minidl_parallel.pipeline.evaluation import PipelineEvalCell
from minidl_parallel.pipeline.stage_forward import PipelineError
from minidl_parallel.pipeline.stages import StagePlan
from minidl_parallel.tensor_parallel.dispatch import gather_like

from . import pipeline_models as models
from .test_pipeline_tensor_parallel import COLUMN, ROW, local_batch

BATCH_ONLY = ((2, 1), (1, 1))  # a Dense's batch cut over the stage's 2 ranks


def _train_cut(build, stages, ranks, micro, data):
    """Trains ``build(stages)`` in ``stages`` stages of ``ranks`` ranks (dataset_strategy "data_parallel":
    rank k of a stage is fed block k of each micro-batch); per rank (the losses, its stage's parameters)."""
    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                     dataset_strategy="data_parallel", pipeline_config={"pipeline_scheduler": "1f1b"})
        k = mp.get_rank() % ranks
        net = build(stages)
        step = nn.TrainOneStepCell(PipelineCell(net, micro), models.optimizer(net))
        losses = [float(backend.to_numpy(step(*(Tensor(local_batch(t.data, micro, ranks, k)) for t in (x, y))).data))
                  for x, y in data]
        plan, stage = StagePlan(net, stages), mp.get_rank() // ranks
        return losses, {name: backend.to_numpy(gather_like(p.data, p) if p.placement is not None else p.data)
                        for name, p in net.parameters_and_names() if plan.stage_of_parameter[id(p)] == stage}

    return mp.run_threads(stages * ranks, body, timeout=120)


def _assert_as_one_device(build, stages, ranks, micro, data):
    ref_losses, ref = models.reference(build, data, micro)
    seen = set()
    for rank, (losses, mine) in enumerate(_train_cut(build, stages, ranks, micro, data)):
        np.testing.assert_allclose(losses, np.array(ref_losses, dtype=np.float64), rtol=1e-10, err_msg=f"rank {rank}")
        for name, value in mine.items():
            seen.add(name)
            np.testing.assert_allclose(value, ref[name], rtol=1e-10, atol=1e-13, err_msg=f"{name} on rank {rank}")
    assert seen == set(ref)


# ---- stage_cut.py -------------------------------------------------------------------------------

class _SumOfSquares(nn.Cell):
    """The sum over the batch of the squared logits, by an op of the network's own construct (no cell runs it,
    so the dispatcher does not complete it): with the batch cut, each rank holds a partial sum."""

    def __init__(self, backbone):
        super().__init__()
        self.backbone = backbone
        self.square = ops.Mul()
        self.sum = ops.ReduceSum().shard(((2, 1),))

    def construct(self, x, y):
        logits = self.backbone(x)
        return self.sum(self.square(logits, logits))


def test_a_loss_left_partial_by_the_last_op_is_made_whole_on_every_rank_of_the_last_stage():
    """The loss is the stage's partial sums reduced (StageCut.whole): left as they are, each rank would
    report and differentiate its own block's sum."""
    def build(stages):
        return _SumOfSquares(models.mlp_cut(stages, (COLUMN, ROW, COLUMN, ROW))._backbone)

    _assert_as_one_device(build, 2, 2, 2, models.batches("mlp_cut", 2, 16))


class _Head(nn.Cell):
    """Stage 0: a (rows,) vector, or with ``total`` a 0-d sum over the micro-batch, sent to stage 1."""

    def __init__(self, total, cut):
        super().__init__()
        self.dense = nn.Dense(6, 1, dtype=np.float64)
        if cut:
            self.dense.shard(BATCH_ONLY)
        self.total = total
        self.reshape, self.sum = ops.Reshape(), ops.ReduceSum()

    def construct(self, x):
        h = self.reshape(self.dense(x), (-1,))
        return self.sum(h) if self.total else h


class _Tail(nn.Cell):
    """Stage 1: logits from the vector received (one column), or the data scaled by the 0-d value received."""

    def __init__(self, total, cut):
        super().__init__()
        self.dense = nn.Dense(6 if total else 1, 4, dtype=np.float64)
        if cut:
            self.dense.shard(BATCH_ONLY)
        self.total = total
        self.reshape, self.mul = ops.Reshape(), ops.Mul()

    def construct(self, h, x):
        if self.total:
            return self.dense(self.mul(x, h))
        return self.dense(self.reshape(h, (-1, 1)))


class _SmallActivations(nn.Cell):
    """Stage 0's _Head, stage 1's _Tail (their Dense layers' batch cut over the stage's ranks with ``cut``)."""

    def __init__(self, stages, total, cut=True):
        super().__init__()
        self.head, self.tail = _Head(total, cut), _Tail(total, cut)
        rng = np.random.default_rng(5)
        for p in self.trainable_params():
            p.set_data(Tensor((0.5 * rng.standard_normal(p.shape)).astype(p.dtype)))
        self.head.pipeline_stage, self.tail.pipeline_stage = 0, stages - 1
        self.loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def construct(self, x, y):
        return self.loss(self.tail(self.head(x), x), y)


def test_a_one_dimensional_activation_crosses_cut_along_the_batch():
    """A (rows,) activation is the batch's too: rank k sends its block of rows to rank k of the next stage
    (replicated, it would arrive as the whole micro-batch's)."""
    _assert_as_one_device(lambda stages: _SmallActivations(stages, total=False), 2, 2, 2,
                          models.batches("mlp_cut", 2, 16))


def test_a_zero_dimensional_activation_crosses_whole():
    """A 0-d activation (a sum over the micro-batch) has no batch axis to cut: it crosses replicated."""
    _assert_as_one_device(lambda stages: _SmallActivations(stages, total=True), 2, 2, 2,
                          models.batches("mlp_cut", 2, 16))


def test_a_zero_dimensional_activation_crosses_a_plain_pipeline():
    data = models.batches("mlp_cut", 2, 8)
    build = lambda stages: _SmallActivations(stages, total=True, cut=False)  # noqa: E731
    ref_losses, ref = models.reference(build, data, 2)

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)
        net = build(2)
        step = nn.TrainOneStepCell(PipelineCell(net, 2), models.optimizer(net))
        losses = [float(backend.to_numpy(step(x, y).data)) for x, y in data]
        plan = StagePlan(net, 2)
        return losses, {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()
                        if plan.stage_of_parameter[id(p)] == mp.get_rank()}

    for rank, (losses, mine) in enumerate(mp.run_threads(2, body, timeout=60)):
        np.testing.assert_allclose(losses, np.array(ref_losses, dtype=np.float64), rtol=1e-12, err_msg=f"rank {rank}")
        for name, value in mine.items():
            np.testing.assert_allclose(value, ref[name], rtol=1e-12, atol=1e-15, err_msg=f"{name} on rank {rank}")


# ---- pipeline_groups.py -------------------------------------------------------------------------

def test_the_groups_follow_the_stage_count_given_not_the_setting():
    """stage_group / pipeline_group cut the world by the count they are given (here 2, while the
    context's pipeline_stages is 1), each made once per world and shared; all the ranks: the world."""
    def body():
        world = context.get_communicator()
        stage, group = pipeline_groups.stage_group(world, 2)
        same_stage, pipe = pipeline_groups.pipeline_group(world, 2)
        again = pipeline_groups.stage_group(world, 2)[1], pipeline_groups.pipeline_group(world, 2)[1]
        whole = pipeline_groups.group_of(world, range(world.size))
        return (stage, same_stage, group.size, group.rank, pipe.size, pipe.rank,
                again[0] is group, again[1] is pipe, whole is world)

    got = mp.run_threads(4, body, timeout=60)
    # ranks 0, 1: stage 0; 2, 3: stage 1; a stage group holds its stage's ranks, a pipeline one rank per stage
    assert got == [(r // 2, r // 2, 2, r % 2, 2, r // 2, True, True, True) for r in range(4)]


# ---- evaluation.py ------------------------------------------------------------------------------

class _Outputs(nn.Cell):
    """An evaluation network over ``mlp``'s backbone returning ``what(logits, x, y, *rest)``."""

    def __init__(self, backbone, what):
        super().__init__()
        self.backbone, self.what = backbone, what
        self.loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        self.mul = ops.Mul()

    def construct(self, x, y, *rest):
        return self.what(self, self.backbone(x), x, y, *rest)


def _evaluate(what, micro, *inputs, stages=2, scheduler="1f1b"):
    """Per rank (the PipelineEvalCell's result, None off the last stage; the call's messages as (action, direction,
    payload)) of ``_Outputs(mlp(stages)'s backbone, what)`` on ``inputs`` through ``stages`` stages."""
    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                     pipeline_config={"pipeline_scheduler": scheduler})
        cell = PipelineEvalCell(_Outputs(models.mlp(stages)._backbone, what), micro)
        out = cell(*inputs)
        log = [(str(m.action), m.direction, m.payload) for m in cell.last_step.messages]
        return out, log

    return mp.run_threads(stages, body, timeout=60)


def _rows(n):
    rng = np.random.default_rng(9)
    return Tensor(rng.standard_normal((n, 6)).astype(np.float32)), Tensor(rng.integers(0, 3, n).astype(np.int32))


def test_the_eval_cell_keeps_the_networks_parameter_names_and_checks_micro_size():
    """It wraps the training network's cells without renaming them (checkpoints key parameters by name)."""
    net = models.mlp(2)._backbone
    names = [p.name for p in net.trainable_params()]
    cell = PipelineEvalCell(net, 1)  # (one micro-batch is allowed)
    assert [p.name for p in net.trainable_params()] == names and cell.last_step is None
    for bad in (0, True, 2.0, "2"):
        with pytest.raises(ValueError, match=re.escape(f"PipelineEvalCell: micro_size must be an int >= 1, "
                                                       f"got {bad!r}")):
            PipelineEvalCell(net, bad)


# PipelineEvalCell accepts micro_size >= 1 and cuts a batch of fewer rows into fewer micro-batches, but
@pytest.mark.parametrize("micro", [1, 2])
def test_a_single_tensor_output_comes_back_whole_on_the_last_stage(micro):
    """A single Tensor is returned as it is (the micro-batches' joined); micro_size 1: the batch in one forward."""
    x, y = _rows(5)
    want = models.mlp(1)._backbone(x).asnumpy()
    for stage, (out, log) in enumerate(_evaluate(lambda self, logits, x, y: logits, micro, x, y)):
        assert log == [(f"F{k}", "send" if stage == 0 else "recv", p) for k in range(micro)
                       for p in ("header", "activation")]
        if stage == 0:
            assert out is None
        else:
            assert isinstance(out, Tensor)
            np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6, atol=1e-7)


def test_a_last_batch_of_one_row_evaluates_through_two_stages():
    """Model.eval over 17 rows in batches of 8: the last batch has one row, one micro-batch."""
    from minidl.dataset import NumpySlicesDataset
    from minidl.train import Accuracy, Loss, Model
    x, y = _rows(17)

    def dataset():
        return NumpySlicesDataset({"x": x.asnumpy(), "y": y.asnumpy()}, shuffle=False).batch(8)

    net = models.mlp(1)
    want = Model(net._backbone, net._loss_fn, metrics={"acc": Accuracy(), "loss": Loss()}).eval(dataset())

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)
        net = models.mlp(2)
        eval_net = _Outputs(net._backbone, lambda self, logits, x, y: (self.loss(logits, y), logits, y))
        model = Model(PipelineCell(net, 2), optimizer=models.optimizer(net),
                      metrics={"acc": Accuracy(), "loss": Loss()}, eval_network=PipelineEvalCell(eval_net, 2),
                      eval_indexes=[0, 1, 2])
        return model.eval(dataset())

    for got in mp.run_threads(2, body, timeout=60):
        assert got["acc"] == want["acc"] and got["loss"] == pytest.approx(want["loss"], rel=1e-6), (got, want)


@pytest.mark.parametrize("micro", [1, 4])
def test_a_single_0d_output_is_the_row_weighted_mean_in_its_own_dtype(micro):
    """5 rows in 4 micro-batches are cut 1, 1, 1, 2: the batch's mean weighs each micro-batch's by its rows."""
    x, y = _rows(5)
    net = models.mlp(1)
    want = net(x, y).asnumpy()
    out, _ = _evaluate(lambda self, logits, x, y: self.loss(logits, y), micro, x, y)[1]
    assert out.dtype == want.dtype == np.float32 and out.shape == ()
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6)


def test_the_evaluation_sends_each_micro_batchs_activation_in_forward_order_and_nothing_back():
    x, y = _rows(6)
    for stage, (_, log) in enumerate(_evaluate(lambda self, logits, x, y: (logits, y), 3, x, y)):
        direction = "send" if stage == 0 else "recv"
        assert log == [(f"F{k}", direction, p) for k in range(3) for p in ("header", "activation")], stage


def test_arguments_other_than_tensors_go_to_every_micro_batch():
    x, y = _rows(4)
    want = 2.5 * models.mlp(1)._backbone(x).asnumpy()
    out, _ = _evaluate(lambda self, logits, x, y, scale, tag: self.mul(logits, scale), 2, x, y, 2.5, "every part")[1]
    np.testing.assert_allclose(out.asnumpy(), want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("inputs, shapes", [
    (lambda x, y: (x, Tensor(y.data[:3])), "[(4, 6), (3,)]"),
    (lambda x, y: (x, y, Tensor(np.float32(1.0))), "[(4, 6), (4,), ()]"),
])
def test_inputs_without_one_batch_axis_are_refused_naming_their_shapes(inputs, shapes):
    with pytest.raises(ValueError, match=re.escape(
            "PipelineEvalCell: the inputs' Tensors must share their first axis (the batch), which is cut into "
            f"micro-batches; got shapes {shapes}")):
        _evaluate(lambda self, logits, x, y, *rest: logits, 2, *inputs(*_rows(4)))


def test_an_output_that_is_not_a_tensor_is_refused_naming_its_type():
    with pytest.raises(PipelineError, match=re.escape(
            "output 0 of the evaluation network is a float; it must return Tensors (a Tensor, or a tuple of them) "
            "for the metrics")):
        _evaluate(lambda self, logits, x, y: 1.5, 2, *_rows(4))


class _Argmax(nn.Cell):
    """The class each row's logits pick (a 1-d output): the metrics' predictions, alone."""

    def __init__(self, with_loss):
        super().__init__()
        self.backbone, self.argmax = with_loss._backbone, ops.Argmax(axis=-1)

    def construct(self, x, y):
        return self.argmax(self.backbone(x))


def test_a_one_dimensional_output_of_stages_cut_by_shard_comes_back_with_every_row_fed():
    """full_batch, the last layer's batch cut over the stage's 2 ranks: the predictions leave cut along the
    batch, and each last-stage rank returns all the rows it was fed (the edge's layout), as one device."""
    data = models.batches("mlp_cut", 1, 8)
    x, y = data[0]
    want = _Argmax(models.mlp_cut(1, (None,) * 4))(x, y).asnumpy()

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2,
                                     dataset_strategy="full_batch")
        out = PipelineEvalCell(_Argmax(models.mlp_cut(2, (COLUMN, ROW, BATCH_ONLY, BATCH_ONLY))), 2)(x, y)
        return None if out is None else out.asnumpy()

    got = mp.run_threads(4, body, timeout=60)
    assert got[:2] == [None, None]
    for rank in (2, 3):
        np.testing.assert_array_equal(got[rank], want, err_msg=f"rank {rank}")


def test_a_refused_strategy_in_an_evaluation_names_the_operator_by_its_path_in_the_network():
    """Two ranks in two stages: a cut in two is refused, naming the operator from the evaluated network down."""
    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)
        x, y = models.batches("mlp_cut", 1, 4)[0]
        PipelineEvalCell(models.mlp_cut(2, (COLUMN, None, None, None)), 2)(x, y)

    with pytest.raises(Exception, match=r"MatMul \(_backbone\.0\.matmul\): inputs of shapes \(2, 6\), \(8, 6\), "
                                        r"strategy \(\(1, 1\), \(2, 1\)\) \(shard\), device_num 1: "):
        mp.run_threads(2, body, timeout=60)


# ---- checkpoint.py ------------------------------------------------------------------------------
# Stage files made by hand (save_checkpoint with the metadata a stage's save records): load_segmented_checkpoints
# reads files only, so these need no pipeline run.

def _staged(stages=2):
    """Two Dense layers, layer k on stage k * stages // 2 (names "0.weight", ..., "1.bias")."""
    net = nn.SequentialCell([nn.Dense(2, 3), nn.Dense(3, 2)])
    for k, layer in enumerate(net):
        layer.pipeline_stage = k * stages // 2
    return net


def _save_stage(path, stage, value, layers=None, stages=2, **meta):
    """Stage ``stage``'s file: the parameters of layers ``layers`` (default: layer ``stage``) all equal to ``value``."""
    shapes = {"weight": (3, 2), "bias": (3,)} if stage == 0 else {"weight": (2, 3), "bias": (2,)}
    entries = {f"{layer}.{name}": np.full(shape, value, np.float32)
               for layer in (layers if layers is not None else [stage]) for name, shape in shapes.items()}
    save_checkpoint(entries, str(path), append_dict={"pipeline_stages": stages, "pipeline_stage": stage,
                                                     "pipeline_network": "", **meta})
    return str(path)


def _loaded_values(net):
    return {name: float(backend.to_numpy(p.data).flat[0]) for name, p in net.parameters_and_names()}


def test_a_staged_network_saved_without_a_pipeline_cell_holds_its_stage_and_says_so(tmp_path):
    """save_train_state of the staged network itself (no nn.PipelineCell around it): each rank's file holds its
    stage's parameters (the network path ""), and the files load into one device."""
    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=2)
        rank = mp.get_rank()
        net = _staged()
        for p in net.trainable_params():
            p.set_data(Tensor(np.full(p.shape, rank + 1.0, np.float32)))  # (the other stage's copy: stale)
        save_train_state(str(tmp_path / ("net.ckpt" if rank == 0 else f"net_rank{rank}.ckpt")), net, None, 1, 1, 1, 1)

    mp.run_threads(2, body, timeout=60)
    for stage, name in enumerate(["net.ckpt", "net_rank1.ckpt"]):
        meta = load_checkpoint_metadata(str(tmp_path / name))
        assert (meta["pipeline_stages"], meta["pipeline_stage"], meta["pipeline_network"]) == ("2", str(stage), "")
        assert {k for k in load_checkpoint(str(tmp_path / name)) if "." in k} == {f"{stage}.weight", f"{stage}.bias"}
    net = _staged(1)
    mp.load_segmented_checkpoints(str(tmp_path / "net.ckpt"), net)
    assert _loaded_values(net) == {"0.weight": 1.0, "0.bias": 1.0, "1.weight": 2.0, "1.bias": 2.0}


def test_of_a_stages_files_the_lowest_ranks_is_read(tmp_path):
    """A file without a rank (save_train_state writes none) counts as rank 0; listed order does not matter."""
    files = [_save_stage(tmp_path / "a.ckpt", 0, 5.0, rank=1, step_num=2),
             _save_stage(tmp_path / "b.ckpt", 0, 1.0, rank=0, step_num=2),
             _save_stage(tmp_path / "c.ckpt", 1, 7.0, rank=1, step_num=2),
             _save_stage(tmp_path / "d.ckpt", 1, 2.0, step_num=2)]
    net = _staged(1)
    mp.load_segmented_checkpoints(files, net)
    assert _loaded_values(net) == {"0.weight": 1.0, "0.bias": 1.0, "1.weight": 2.0, "1.bias": 2.0}


def test_loading_without_a_net_returns_the_entries_and_a_network_without_stages_loads_them(tmp_path):
    path = _save_stage(tmp_path / "m.ckpt", 0, 1.0)
    _save_stage(tmp_path / "m_rank1.ckpt", 1, 2.0, rank=1, group_size=2)
    merged = mp.load_segmented_checkpoints(path)
    assert {name: float(np.asarray(backend.to_numpy(v.data if isinstance(v, Tensor) else v)).flat[0])
            for name, v in merged.items()} == {"0.weight": 1.0, "0.bias": 1.0, "1.weight": 2.0, "1.bias": 2.0}
    plain = nn.SequentialCell([nn.Dense(2, 3), nn.Dense(3, 2)])  # (no cell with a pipeline_stage)
    mp.load_segmented_checkpoints(path, plain)
    assert _loaded_values(plain) == {"0.weight": 1.0, "0.bias": 1.0, "1.weight": 2.0, "1.bias": 2.0}


@pytest.mark.parametrize("given", ["m_rank0.ckpt", "m_rank0_rank1.ckpt"])
def test_any_stages_file_finds_the_others_beside_it(tmp_path, given):
    """ModelCheckpoint's names: rank r > 0's file is rank 0's with ``_rank{r}`` (here rank 0's own name ends in
    "_rank0", which is not a rank suffix); a file without rank and group_size is rank 0's of one rank per stage."""
    _save_stage(tmp_path / "m_rank0.ckpt", 0, 1.0)
    _save_stage(tmp_path / "m_rank0_rank1.ckpt", 1, 2.0, rank=1, group_size=2)
    net = _staged(1)
    mp.load_segmented_checkpoints(str(tmp_path / given), net)
    assert _loaded_values(net) == {"0.weight": 1.0, "0.bias": 1.0, "1.weight": 2.0, "1.bias": 2.0}


def test_the_other_stages_missing_files_are_each_named(tmp_path):
    path = _save_stage(tmp_path / "m.ckpt", 0, 1.0, stages=3, rank=0, group_size=3)
    with pytest.raises(FileNotFoundError, match="^" + re.escape(
            f"load_segmented_checkpoints: {path!r} is stage 0's file of a 3-stage pipeline save; the file(s) of "
            f"stage 1 ({str(tmp_path / 'm_rank1.ckpt')!r}), stage 2 ({str(tmp_path / 'm_rank2.ckpt')!r}) do not "
            f"exist: every stage's file is needed to load the whole model") + "$"):
        mp.load_segmented_checkpoints(path, _staged(1))


# (the steps are the files' metadata, strings)
@pytest.mark.parametrize("steps, stages, shown", [((2, 4), (2, 2), "pipeline_stages [2], steps [2, 4]"),
                                                  ((2, 2), (2, 3), "pipeline_stages [2, 3], steps [2]")])
def test_files_of_several_saves_are_refused_naming_their_stage_counts_and_steps(tmp_path, steps, stages, shown):
    files = [_save_stage(tmp_path / f"s{k}.ckpt", k, 1.0, stages=stages[k], step_num=steps[k]) for k in range(2)]
    with pytest.raises(ValueError, match="^" + re.escape(
            f"load_segmented_checkpoints: the files {files} come from several saves ({shown}): pass the files of one "
            f"save (rank 0's file of it finds the others)") + "$"):
        mp.load_segmented_checkpoints(files, _staged(1))


def test_what_is_not_one_saves_files_is_named(tmp_path):
    who = "load_segmented_checkpoints"
    empty = tmp_path / "empty"
    empty.mkdir()
    absent = str(tmp_path / "absent.ckpt")
    given = _save_stage(tmp_path / "m.ckpt", 0, 1.0)
    refusals = [
        (str(empty), FileNotFoundError, f"{who}: directory {str(empty)!r} holds no .ckpt file"),
        (absent, FileNotFoundError, f"{who}: checkpoint {absent!r} does not exist"),
        ([given, absent], FileNotFoundError, f"{who}: checkpoint file(s) [{absent!r}] do not exist"),
    ] + [(bad, TypeError, f"{who}: ckpt_files must be a path (rank 0's file of a save, or a directory of one save's "
                          f"files) or a non-empty list of paths, got {bad!r}") for bad in ([], [3], 5)]
    for files, error, message in refusals:
        with pytest.raises(error, match="^" + re.escape(message) + "$"):
            mp.load_segmented_checkpoints(files, _staged(1))
    _save_stage(tmp_path / "m_rank1.ckpt", 1, 2.0, rank=1)
    with pytest.raises(TypeError, match="^" + re.escape(f"{who}: net must be a Cell, got int") + "$"):
        mp.load_segmented_checkpoints(given, 3)


@pytest.mark.parametrize("extra", [[True] * 4, [True] * 4 + [False]])
def test_missing_parameters_are_listed_eight_at_most(tmp_path, extra):
    """Layers 2 on have no entry (the last without bias): 8 names, all shown; 9, the first eight shown."""
    files = [_save_stage(tmp_path / "m.ckpt", 0, 1.0), _save_stage(tmp_path / "m_rank1.ckpt", 1, 2.0, rank=1)]
    net = nn.SequentialCell([nn.Dense(2, 3), nn.Dense(3, 2)] + [nn.Dense(2, 2, has_bias=bias) for bias in extra])
    absent = [f"{k}.{name}" for k, bias in enumerate(extra, 2) for name in ("weight", "bias")[:1 + bias]]
    more = " ..." if len(absent) > 8 else ""
    with pytest.raises(ValueError, match="^" + re.escape(
            f"load_segmented_checkpoints: {len(absent)} parameter(s) or optimizer state(s) are in none of the files "
            f"{files}, nothing was loaded: {absent[:8]}{more}") + "$"):
        mp.load_segmented_checkpoints(files, net)


def test_a_shape_that_differs_anywhere_is_refused_before_anything_is_loaded(tmp_path):
    """The optimizer's momenta were saved for other shapes: the network is not loaded either."""
    net, other = _staged(1), nn.SequentialCell([nn.Dense(2, 3), nn.Dense(3, 4)])
    optimizer = models.optimizer(other)
    entries = {name: np.ones(p.shape, np.float32) for name, p in net.parameters_and_names()}
    entries.update({name: np.ones(p.shape, np.float32) for name, p in models.optimizer(net).parameters_and_names()})
    path = str(tmp_path / "m.ckpt")
    save_checkpoint(entries, path, append_dict={"pipeline_stages": 1, "pipeline_stage": 0, "pipeline_network": ""})
    before = _loaded_values(net)
    with pytest.raises(ValueError, match="^" + re.escape(
            "load_segmented_checkpoints: 2 parameter(s) have a different shape in the checkpoint, nothing was loaded: "
            "'moments.1.weight': (4, 3) vs checkpoint (2, 3); 'moments.1.bias': (4,) vs checkpoint (2,)") + "$"):
        mp.load_segmented_checkpoints(path, net, optimizer)
    assert _loaded_values(net) == before


def test_an_entry_two_parameters_claim_is_refused_by_its_name(tmp_path):
    files = [_save_stage(tmp_path / "m.ckpt", 0, 1.0), _save_stage(tmp_path / "m_rank1.ckpt", 1, 2.0, rank=1)]
    net = _staged(1)
    net[1].bias.name = "0.bias"  # (an explicit name: the entry "0.bias" is claimed at two paths)
    with pytest.raises(ValueError, match="^" + re.escape("load_segmented_checkpoints: 1 checkpoint entry matches more "
                                                         "than one parameter")):
        mp.load_segmented_checkpoints(files, net)


def test_a_sharded_parameters_shape_that_differs_is_refused_by_its_name(tmp_path):
    """A tensor-parallel network (its first layer cut in two) loading a save whose first weight has another shape:
    the blocks are checked where they are cut, with the same refusal."""
    net = models.mlp_cut(1, (None,) * 4)
    entries = {name: backend.to_numpy(p.data) for name, p in net.parameters_and_names()}
    entries["_backbone.0.weight"] = np.zeros((10, 6))
    path = str(tmp_path / "m.ckpt")
    save_checkpoint(entries, path, append_dict={"pipeline_stages": 1, "pipeline_stage": 0, "pipeline_network": ""})

    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
        net = models.mlp_cut(1, (COLUMN, None, None, None))
        net(*models.batches("mlp_cut", 1, 4)[0])  # (the first call places the parameters: the weight cut in two)
        try:
            mp.load_segmented_checkpoints(path, net)
        except ValueError as e:
            return str(e)

    message = ("load_segmented_checkpoints: 1 parameter(s) have a different shape in the checkpoint, nothing was "
               "loaded: '_backbone.0.weight': net (8, 6) (block (4, 6)) vs checkpoint (10, 6)")
    assert mp.run_threads(2, body, timeout=60) == [message, message]
