"""A resume on another number of data shards (minidl/train/resize.py): the global batch kept by resizing
the dataset's last .batch, or the per-rank batch kept with the epoch continued at the same share; the
refusals name what cannot be kept and the other choice. On one process: the shards are the dataset's."""
import numpy as np
import pytest

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback, CheckpointConfig, Model, ModelCheckpoint
from minidl.train.checkpoint import TrainPosition, restore_train_state
from minidl.train import resize
from minidl.train.resize import resume_on_these_shards

ROWS = np.arange(96, dtype=np.float32).reshape(48, 2)


def dataset(num_shards, batch):
    return NumpySlicesDataset({"x": ROWS}, shuffle=False, num_shards=num_shards, shard_id=0).batch(batch)


def position(batch_num=3, skip=1, group_size=4, batch_size=4, num_shards=4):
    return TrainPosition(1, skip, 4, batch_num, group_size, batch_size, num_shards)


def test_keeping_the_global_batch_resizes_the_last_batch_and_keeps_the_steps(capsys):
    ds = dataset(2, 4)  # 24 rows per shard: 6 steps of 4, or 3 of 8
    assert resume_on_these_shards("c.ckpt", position(), ds, 6, 2) == (3, 1)
    assert ds.get_batch_size() == 8 and ds.get_dataset_size() == 3
    assert capsys.readouterr().out == ("Model.train: keeping the global batch of 16 that checkpoint 'c.ckpt' was "
                                       "trained with: 8 rows per rank on 2 shard(s), 3 steps per epoch "
                                       "(keep_batch='global')\n")


def test_keeping_the_per_rank_batch_continues_the_epoch_at_the_same_share(capsys):
    ds = dataset(2, 4)
    assert resume_on_these_shards("c.ckpt", position(skip=2), ds, 6, 2, keep_batch="per_rank") == (6, 4)
    assert ds.get_batch_size() == 4
    assert capsys.readouterr().out == ""


def test_a_global_batch_already_kept_by_the_script_is_left_as_it_is(capsys):
    ds = dataset(2, 8)
    assert resume_on_these_shards("c.ckpt", position(), ds, 3, 2) == (3, 1)
    assert ds.get_batch_size() == 8 and capsys.readouterr().out == ""


def test_a_checkpoint_that_does_not_record_its_batch_continues_as_per_rank():
    ds = dataset(2, 4)
    assert resume_on_these_shards("c.ckpt", position(skip=2, batch_size=None), ds, 6, 2) == (6, 4)
    assert resume_on_these_shards("c.ckpt", position(skip=2, num_shards=None), ds, 6, 2) == (6, 4)
    assert ds.get_batch_size() == 4


def test_a_global_batch_the_shards_cannot_split_is_refused_naming_both_and_the_other_choice():
    ds = dataset(3, 4)
    with pytest.raises(ValueError) as e:
        resume_on_these_shards("c.ckpt", position(), ds, 4, 3)
    assert str(e.value) == ("Model.train: checkpoint 'c.ckpt' was trained with a global batch of 16 (4 shards of 4), "
                            "which 3 shards cannot split evenly; resume on a number of shards that divides 16, or "
                            "pass keep_batch='per_rank' to train 4 rows per rank")
    assert ds.get_batch_size() == 4


def test_keeping_the_global_batch_of_a_dataset_without_batch_is_refused():
    ds = NumpySlicesDataset({"x": ROWS}, shuffle=False, num_shards=2, shard_id=0)
    with pytest.raises(ValueError) as e:
        resume_on_these_shards("c.ckpt", position(), ds, 24, 2, who="resume")
    assert str(e.value) == ("resume: checkpoint 'c.ckpt' was trained with a global batch of 16 (4 shards of 4); "
                            "keeping it on 2 shards needs a .batch() in train_dataset to resize; add one, or pass "
                            "keep_batch='per_rank'")


@pytest.mark.parametrize("group_size, num_shards", [(2, 2), (None, None), (2, None), (None, 2)])
def test_other_steps_per_epoch_on_the_same_shards_are_another_dataset(group_size, num_shards):
    ds = dataset(2, 4)
    with pytest.raises(ValueError) as e:
        resume_on_these_shards("c.ckpt", position(group_size=group_size, batch_size=4, num_shards=num_shards), ds,
                               6, 2, keep_batch="per_rank")
    assert str(e.value) == ("Model.train: checkpoint 'c.ckpt' was trained with 3 steps per epoch, but train_dataset "
                            "has 6; resume with the same dataset, batch size and sharding")


def test_other_shards_on_the_same_number_of_ranks_continue_at_the_same_share():
    """Tensor parallelism may give a world of 4 ranks 2 data shards: the shards, not the ranks, decide."""
    ds = dataset(2, 4)
    assert resume_on_these_shards("c.ckpt", position(skip=2, group_size=2), ds, 6, 2, keep_batch="per_rank") == (6, 4)


def test_keep_batch_must_be_one_of_its_two_values():
    with pytest.raises(ValueError, match=r"^Model.train: keep_batch must be one of \('global', 'per_rank'\), "
                                         r"got 'rank'$"):
        resume_on_these_shards("c.ckpt", position(), dataset(2, 4), 6, 2, keep_batch="rank")


def test_model_train_checks_keep_batch_before_training():
    net = nn.Dense(2, 1)
    model = Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.1))
    ds = NumpySlicesDataset({"x": ROWS, "y": ROWS[:, :1]}, shuffle=False).batch(4)
    before = net.weight.asnumpy().copy()
    with pytest.raises(ValueError, match=r"^Model.train: keep_batch must be one of \('global', 'per_rank'\), "
                                         r"got 'all'$"):
        model.train(1, ds, keep_batch="all")
    assert np.array_equal(net.weight.asnumpy(), before)


@pytest.mark.parametrize("keep_batch, batch, steps_seen", [("global", 8, [3, 1, 2, 3]),
                                                          ("per_rank", 4, [5, 6, 1, 2, 3, 4, 5, 6])])
def test_model_checkpoint_records_the_batch_and_shards_and_a_resume_on_other_shards_keeps_them(tmp_path, keep_batch,
                                                                                               batch, steps_seen):
    """Written by a run on 4 shards of 4 rows (one of them: shard 0) after step 2 of 3, resumed on 2 shards with a
    script batch of 4: keeping the global batch, the dataset trains 8 rows a step and the resume skips the same
    2 steps of 3; keeping the per-rank batch, 4 rows a step, 6 steps per epoch, 2 * 6 // 3 = 4 skipped."""
    minidl.set_seed(1)
    net = nn.Dense(2, 1)
    data = {"x": ROWS, "y": ROWS[:, :1] / 100}

    def shard(n, batch):
        return NumpySlicesDataset(data, shuffle=True, num_shards=n, shard_id=0).batch(batch)
    model = Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), 0.001))
    model.train(1, shard(4, 4), callbacks=[ModelCheckpoint("m", str(tmp_path), CheckpointConfig(
        save_checkpoint_steps=2))])
    path = str(tmp_path / "m-1_2.ckpt")
    saved = restore_train_state(path, net, None)
    assert (saved.batch_size, saved.num_shards, saved.batch_num, saved.skip_batches) == (4, 4, 3, 2)
    resumed = shard(2, 4)
    steps = StepsInEpoch()
    model.train(2, resumed, resume_from=path, callbacks=[steps], keep_batch=keep_batch)
    assert resumed.get_batch_size() == batch and steps.seen == steps_seen


class StepsInEpoch(Callback):
    def __init__(self):
        self.seen = []

    def on_train_step_end(self, run_context):
        self.seen.append(run_context.original_args().cur_step_in_epoch)


@pytest.mark.parametrize("rank, says", [(0, True), (1, False), (2, False)])
def test_only_rank_0_says_that_it_keeps_the_global_batch(monkeypatch, capsys, rank, says):
    class World:
        def group_size(self):
            return 3

        def rank(self):
            return rank
    monkeypatch.setattr(resize, "get_runtime", World)
    ds = dataset(2, 4)
    assert resume_on_these_shards("c.ckpt", position(), ds, 6, 2) == (3, 1)
    assert ds.get_batch_size() == 8
    assert ("keeping the global batch of 16" in capsys.readouterr().out) is says
