"""A restart's resume across ranks (minidl/train/restart.py on the threads world): the ranks agree on
the newest checkpoint every one of them has whole, only rank 0 says and logs where it resumed, and a
rank beyond the world that wrote a checkpoint starts from rank 0's file."""
import json
import os
import warnings

import numpy as np
import pytest

import minidl
import minidl_parallel as mp
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback, CheckpointConfig, Model, ModelCheckpoint, save_train_state
from minidl.train import restart as restart_module
from minidl.train.restart import newest_complete_checkpoint

X = np.random.default_rng(5).standard_normal((24, 4)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)


class _Steps(Callback):
    def __init__(self):
        self.done = []

    def on_train_step_end(self, run_context):
        self.done.append(run_context.original_args().cur_step_num)


def _train(directory, crash_after=None, saving_ranks=None):
    """Data-parallel MLP with BatchNorm on every rank, a checkpoint per step (on ``saving_ranks``, default
    all); returns the steps it ran."""
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    minidl.set_seed(7)
    net = nn.SequentialCell(nn.Dense(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Dense(6, 2))
    ds = NumpySlicesDataset((X, Y), column_names=["x", "y"], shuffle=True, num_shards=mp.get_group_size(),
                            shard_id=mp.get_rank()).batch(3)
    steps = _Steps()
    callbacks = [steps]
    if saving_ranks is None or mp.get_rank() in saving_ranks:
        callbacks.insert(0, ModelCheckpoint("m", str(directory), CheckpointConfig(save_checkpoint_steps=1)))

    class Crash(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == crash_after:
                raise KeyboardInterrupt
    if crash_after is not None:
        callbacks.append(Crash())
    try:
        Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
              nn.Momentum(net.trainable_params(), 0.05, 0.9)).train(2, ds, callbacks=callbacks)
    except KeyboardInterrupt:
        pass
    return steps.done


@pytest.fixture
def job(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIDL_RUN_ID", "job-r")
    monkeypatch.setenv("MINIDL_RESTART_COUNT", "0")
    monkeypatch.setenv("MINIDL_RESTART_LOG", str(tmp_path / "restarts.jsonl"))
    said = []
    # (the threads share stdout: each rank's words are recorded with its rank)
    monkeypatch.setattr(restart_module, "print", lambda *a, **k: said.append((mp.get_rank(), a[0])), raising=False)

    def restart(count):
        monkeypatch.setenv("MINIDL_RESTART_COUNT", str(count))
    return restart, said


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_ranks_agree_on_the_newest_checkpoint_all_of_them_have(tmp_path, job, ranks):
    """The last rank's file of step 3 is missing (it died writing it): every rank resumes after step 2, the
    newest step all of them saved, and only rank 0 says so (and logs it for the launcher)."""
    restart, said = job
    mp.run_threads(ranks, lambda: _train(tmp_path, crash_after=3), timeout=120)
    os.remove(tmp_path / f"m-1_3_rank{ranks - 1}.ckpt")
    restart(1)
    done = mp.run_threads(ranks, lambda: _train(tmp_path), timeout=120)
    per_epoch = -(-(24 // ranks) // 3)  # batches of 3 of each rank's 24 // ranks rows
    assert all(steps == list(range(3, 2 * per_epoch + 1)) for steps in done), done
    assert said == [(0, f"Model.train: restart 1: resuming from {tmp_path / 'm-1_2.ckpt'} (after step 2)")]
    logged = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert logged == [{"restart": 1, "checkpoint": str(tmp_path / "m-1_2.ckpt"), "step": 2}]


def test_a_rank_beyond_the_world_that_wrote_a_checkpoint_reads_rank_0s_file(tmp_path, job):
    """A custom loop's file records its rank but not the world's size: for rank 1 of 2 it is the file of a
    one-rank world, and so its starting point, as it is rank 0's."""
    net = nn.Dense(2, 2)
    save_train_state(tmp_path / "c-1_1.ckpt", net, None, 1, 1, 1, 4, append_dict={"rank": 0})

    def body():
        return newest_complete_checkpoint(tmp_path, "c")
    assert mp.run_threads(2, body, timeout=60) == [str(tmp_path / "c-1_1.ckpt")] * 2


def test_when_rank_0_alone_saves_every_rank_resumes_from_its_file(tmp_path, job):
    """The PyTorch habit (a ModelCheckpoint on rank 0 only): the other ranks take part in the choice without
    a view of their own, and resume from rank 0's file, warned that its per-rank state is rank 0's."""
    restart, said = job
    mp.run_threads(2, lambda: _train(tmp_path, crash_after=3, saving_ranks={0}), timeout=120)
    assert sorted(os.listdir(tmp_path)) == ["m-1_1.ckpt", "m-1_2.ckpt", "m-1_3.ckpt"]
    restart(1)

    with warnings.catch_warnings(record=True) as seen:  # (the threads' warnings, recorded here)
        warnings.simplefilter("always")
        done = mp.run_threads(2, lambda: _train(tmp_path, saving_ranks={0}), timeout=120)
    assert done == [list(range(4, 9))] * 2
    assert [str(w.message).split(",")[0] for w in seen if "rank 0's state" in str(w.message)] == [
        f"Model.train: rank 1 of 2 resumes from '{tmp_path / 'm-1_3.ckpt'}'"]
    assert said == [(0, f"Model.train: restart 1: resuming from {tmp_path / 'm-1_3.ckpt'} (after step 3)")]
    mp.run_threads(2, lambda: _train(tmp_path / "none", saving_ranks=set()), timeout=120)  # nobody saves: no hang
    assert said[-1] == (0, "Model.train: restart 1: no checkpoint that every rank has whole; training from the start")



def test_ranks_that_train_alone_each_choose_their_own_newest_checkpoint(tmp_path):
    """Without data or tensor parallelism (STAND_ALONE) the ranks do not train in lockstep: each resumes
    from the newest file in its own directory, with no exchange (rank 1 saved one step fewer)."""
    net = nn.Dense(2, 2)
    for rank, steps in ((0, 3), (1, 2)):
        (tmp_path / str(rank)).mkdir()
        for step in range(1, steps + 1):
            save_train_state(tmp_path / str(rank) / f"s-1_{step}.ckpt", net, None, 1, step, step, 4,
                             append_dict={"rank": rank, "group_size": 2})

    def body():
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.STAND_ALONE)
        return newest_complete_checkpoint(tmp_path / str(mp.get_rank()), "s")
    assert mp.run_threads(2, body, timeout=60) == [str(tmp_path / "0" / "s-1_3.ckpt"), str(tmp_path / "1" / "s-1_2.ckpt")]
