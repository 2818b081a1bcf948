"""Data-parallel checkpoints in one shared directory: each rank its own file, one prefix, and a
resume that equals the uninterrupted run on every rank, BatchNorm moving statistics included.

The scenario (a net with a plain BatchNorm, whose moving statistics differ per rank under data
parallelism) lives in tests/mpi/dp_resume.py; here it runs in the threads world and under mpirun.
"""
import json
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import minidl
import minidl_parallel as mp
from minidl.dataset import NumpySlicesDataset
from minidl.runtime import get_runtime
from minidl.train import Callback, CheckpointConfig, ModelCheckpoint, save_train_state
from minidl.train import checkpoint as train_checkpoint
from minidl_parallel import run_threads

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi"))
import dp_resume  # noqa: E402

from test_mpirun_training import _mpirun_path, mpirun  # noqa: E402

RANKS = 2


def _assert_resumed_equals_uninterrupted(references, results):
    # The test means something only if the ranks' BatchNorm statistics differ (no SyncBatchNorm).
    assert not np.array_equal(references[0]["1.moving_mean"], references[1]["1.moving_mean"])
    for rank, (want, got) in enumerate(zip(references, results)):
        assert got.keys() == want.keys()
        for name in want:
            assert np.array_equal(got[name], want[name]), f"rank {rank}: {name}"


def _assert_each_path_written_by_one_rank(writes):
    writers = {}
    for rank, path in writes:
        writers.setdefault(path, set()).add(rank)
    shared = {path: ranks for path, ranks in writers.items() if len(ranks) > 1}
    assert not shared, f"written by several ranks: {shared}"
    assert {rank for rank, _ in writes} == set(range(RANKS))


@pytest.fixture(scope="module")
def references():
    return run_threads(RANKS, dp_resume.uninterrupted)


@pytest.mark.parametrize("how", ["rank0", "latest"])
def test_threads_resume_in_a_shared_directory_equals_the_uninterrupted_run_on_every_rank(tmp_path, monkeypatch,
                                                                                          references, how):
    writes = []
    save = train_checkpoint.save_checkpoint

    def recording(save_obj, path, *args, **kwargs):
        writes.append((mp.get_rank(), os.path.abspath(os.fspath(path))))
        return save(save_obj, path, *args, **kwargs)
    monkeypatch.setattr(train_checkpoint, "save_checkpoint", recording)

    latest = run_threads(RANKS, dp_resume.interrupted, tmp_path)
    _assert_each_path_written_by_one_rank(writes)
    # saves at steps 2 and 4 (epoch 1 step 2, epoch 2 step 1); rank 0 keeps MindSpore's names
    assert sorted(os.listdir(tmp_path)) == ["net-1_2.ckpt", "net-1_2_rank1.ckpt", "net-2_1.ckpt",
                                            "net-2_1_rank1.ckpt"]
    assert latest == [str(tmp_path / "net-2_1.ckpt"), str(tmp_path / "net-2_1_rank1.ckpt")]

    results = run_threads(RANKS, lambda: dp_resume.resumed(dp_resume.resume_path(tmp_path, how)))
    _assert_resumed_equals_uninterrupted(references, results)


def test_latest_checkpoint_is_each_ranks_own_file(tmp_path):
    run_threads(RANKS, dp_resume.interrupted, tmp_path)
    found = run_threads(RANKS, lambda: train_checkpoint.latest_checkpoint(str(tmp_path), "net"))
    assert found == [str(tmp_path / "net-2_1.ckpt"), str(tmp_path / "net-2_1_rank1.ckpt")]
    assert train_checkpoint.latest_checkpoint(str(tmp_path), "net") == str(tmp_path / "net-2_1.ckpt")  # one process


def test_a_rank_resuming_from_another_ranks_file_is_warned(tmp_path):
    run_threads(RANKS, dp_resume.interrupted, tmp_path)
    os.remove(tmp_path / "net-2_1_rank1.ckpt")

    def body():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dp_resume.resumed(str(tmp_path / "net-2_1.ckpt"))
        return [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    on_rank0, on_rank1 = run_threads(RANKS, body, timeout=60)
    assert not any("resumes from" in m for m in on_rank0)
    assert any(re.search(r"rank 1 of 2 resumes from .*net-2_1.ckpt', rank 0's state of a 2-rank run, since its "
                         r"own file .*net-2_1_rank1.ckpt' does not exist.*BatchNorm", m) for m in on_rank1), on_rank1


def test_a_model_checkpoint_on_rank_0_alone_neither_waits_nor_renames(tmp_path, references):
    """The PyTorch habit (save on rank 0 only): no rank waits for a ModelCheckpoint the others lack,
    rank 0 keeps MindSpore's names, and every rank resumes from rank 0's file (with a warning)."""
    def first():
        dp_resume.data_parallel()
        model, _, _, ds = dp_resume.build()
        callbacks = [dp_resume.StopAt(dp_resume.STOP)]
        if mp.get_rank() == 0:
            cfg = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=2, save_checkpoint_seconds=0)
            callbacks.append(ModelCheckpoint("net", str(tmp_path), cfg))
        model.train(dp_resume.EPOCHS, ds, callbacks=callbacks, progress=False)
    run_threads(RANKS, first, timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["net-1_2.ckpt", "net-2_1.ckpt"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        results = run_threads(RANKS, lambda: dp_resume.resumed(str(tmp_path / "net-2_1.ckpt")), timeout=60)
    # rank 0 resumed its own state exactly; rank 1 has rank 0's parameters (identical under data
    # parallelism) but not its own BatchNorm statistics: what the warning says
    for name, value in references[0].items():
        assert np.array_equal(results[0][name], value), name
    assert np.array_equal(results[1]["0.weight"], references[1]["0.weight"])
    assert not np.array_equal(results[1]["1.moving_mean"], references[1]["1.moving_mean"])


@pytest.mark.parametrize("how", ["rank0", "latest"])
def test_resume_with_parameter_broadcast_keeps_each_ranks_own_state(tmp_path, how):
    """parameter_broadcast makes the ranks start alike; a resumed run restores each rank's own state
    instead of broadcasting rank 0's over it."""
    broadcast = {"parameter_broadcast": True}
    references = run_threads(RANKS, lambda: dp_resume.uninterrupted(**broadcast))
    run_threads(RANKS, lambda: dp_resume.interrupted(tmp_path, **broadcast))
    results = run_threads(RANKS, lambda: dp_resume.resumed(dp_resume.resume_path(tmp_path, how), **broadcast))
    _assert_resumed_equals_uninterrupted(references, results)


def test_the_prefix_is_decided_by_rank_0_even_when_the_ranks_list_the_directory_at_different_moments(tmp_path):
    def body():
        dp_resume.data_parallel()
        model, _, _, ds = dp_resume.build()
        cfg = CheckpointConfig(save_checkpoint_steps=3, keep_checkpoint_max=5)
        if mp.get_rank() == 0:
            ckpt = ModelCheckpoint("net", str(tmp_path), cfg)  # an empty directory: "net"
            (tmp_path / "net-9_9.ckpt").write_bytes(b"")  # an earlier run's file shows up late (a slow listing)
        get_runtime().gather(None)  # rank 1 lists the directory only now
        if mp.get_rank() == 1:
            ckpt = ModelCheckpoint("net", str(tmp_path), cfg)  # alone, it would pick "net_1"
        model.train(1, ds, callbacks=[ckpt], progress=False)
        return ckpt.prefix
    assert run_threads(RANKS, body) == ["net", "net"]
    assert sorted(os.listdir(tmp_path)) == ["net-1_3.ckpt", "net-1_3_rank1.ckpt", "net-9_9.ckpt"]


class _PoisonMovingMean(Callback):
    """Rank ``rank`` alone gets a NaN in its BatchNorm moving mean after step ``step``."""

    def __init__(self, rank, step):
        self.rank, self.step = rank, step

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        if mp.get_rank() == self.rank and cb.cur_step_num == self.step:
            cb.train_network[1].moving_mean.data[0] = np.nan


def test_a_non_finite_state_on_one_rank_makes_every_rank_skip_the_save(tmp_path):
    def body():
        dp_resume.data_parallel()
        model, _, _, ds = dp_resume.build()
        ckpt = ModelCheckpoint("net", str(tmp_path), CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=2))
        model.train(1, ds, callbacks=[_PoisonMovingMean(1, 2), ckpt], progress=False)
        return ckpt.latest_ckpt_file_name
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        latest = run_threads(RANKS, body)
    # step 1 saved on both ranks; steps 2 and 3 skipped on both (rank 1's moving mean stays NaN)
    assert sorted(os.listdir(tmp_path)) == ["net-1_1.ckpt", "net-1_1_rank1.ckpt"]
    assert latest == [str(tmp_path / "net-1_1.ckpt"), str(tmp_path / "net-1_1_rank1.ckpt")]
    skipped = sorted({str(w.message) for w in caught if "ModelCheckpoint: skipped" in str(w.message)})
    assert len(skipped) == 4  # steps 2 and 3, each rank its own file name
    assert all("on 1 rank(s): rank 1: 1 ('1.moving_mean')" in message for message in skipped)


@pytest.mark.cpu_only  # mpirun starts fresh processes: they import the machine's own CuPy, not the device double
@pytest.mark.parametrize("how", ["rank0", "latest"])
def test_mpirun_resume_in_a_shared_directory_equals_the_uninterrupted_run_on_every_rank(tmp_path, how):
    if _mpirun_path() is None:
        pytest.skip("mpirun is not on PATH")
    directory, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    script = Path(dp_resume.__file__)
    first = mpirun(RANKS, script, "first", directory, out, timeout=180)
    assert first.returncode == 0, first.stdout + first.stderr
    writes = [tuple(w) for r in range(RANKS) for w in json.loads((out / f"writes_rank{r}.json").read_text())]
    _assert_each_path_written_by_one_rank(writes)
    assert sorted(os.listdir(directory)) == ["net-1_2.ckpt", "net-1_2_rank1.ckpt", "net-2_1.ckpt",
                                             "net-2_1_rank1.ckpt"]
    second = mpirun(RANKS, script, "resume", directory, out, how, timeout=180)  # fresh processes
    assert second.returncode == 0, second.stdout + second.stderr

    def load(kind, rank):
        with np.load(out / f"{kind}_rank{rank}.npz") as f:
            return {name: f[name] for name in f.files}
    _assert_resumed_equals_uninterrupted([load("reference", r) for r in range(RANKS)],
                                         [load("resumed", r) for r in range(RANKS)])


def test_uneven_inputs_save_on_each_rank_alone_without_waiting_for_the_others(tmp_path):
    """With uneven inputs the ranks run different steps (a join block): their saves cannot meet."""
    def body():
        dp_resume.data_parallel()
        model, _, _, _ = dp_resume.build()
        rows = 8 + 4 * mp.get_rank()  # rank 0: 2 steps per epoch, rank 1: 3
        ds = NumpySlicesDataset({"x": np.ones((rows, 5)), "y": np.zeros((rows, 2))}, shuffle=False).batch(4)
        ckpt = ModelCheckpoint("net", str(tmp_path), CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=9))
        model.train(1, ds, callbacks=[ckpt], uneven_inputs=True, progress=False)
    run_threads(RANKS, body, timeout=60)
    assert sorted(os.listdir(tmp_path)) == ["net-1_1.ckpt", "net-1_1_rank1.ckpt", "net-1_2.ckpt",
                                            "net-1_2_rank1.ckpt", "net-1_3_rank1.ckpt"]


def test_a_file_saved_by_hand_without_rank_keys_is_every_ranks_starting_point(tmp_path, references):
    """save_train_state called directly records no rank: every rank may resume from it (as before)."""
    path = str(tmp_path / "by_hand.ckpt")

    def save_on_rank_0():
        dp_resume.data_parallel()
        model, net, opt, ds = dp_resume.build()
        if mp.get_rank() == 0:
            save_train_state(path, net, opt, epoch_num=1, step_num=3, step_in_epoch=3, batch_num=3)
    run_threads(RANKS, save_on_rank_0)
    assert "rank" not in minidl.load_checkpoint_metadata(path)
    results = run_threads(RANKS, lambda: dp_resume.resumed(path))
    assert all(result.keys() == references[0].keys() for result in results)
    for name in ("0.weight", "3.weight"):  # data parallelism keeps the trained parameters identical
        assert np.array_equal(results[0][name], results[1][name])
