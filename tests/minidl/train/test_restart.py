"""Restarts (minidl/train/restart.py): with MINIDL_RESTART_COUNT set, Model.train with a
ModelCheckpoint, and a custom loop through resume_after_restart, continue from the newest
checkpoint that reads back whole, and end bit-identical to the run that never failed; a damaged
newest file is skipped with a warning naming it. The launcher's side, and several ranks, are
tested in tests/minidl_parallel/test_restarts.py."""
import json
import os

import numpy as np
import pytest

import minidl
from minidl import nn
from minidl.train import Callback, CheckpointConfig, Model, ModelCheckpoint, resume_after_restart, restart_count, \
    save_train_state
from minidl.train.checkpoint import rank_checkpoint_path
from minidl.train.restart import newest_complete_checkpoint

from .helpers import ce_loss, slices
from .test_resume import EPOCHS, X, Y, _build  # the same model, data and schedule as the resume tests


def _params(net):
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


class Crash(Callback):
    """The process dies after global step ``step`` (no end-of-training save, as after kill -9)."""

    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == self.step:
            raise KeyboardInterrupt(f"crash after step {self.step}")


class Steps(Callback):
    """The global steps an attempt ran."""

    def __init__(self):
        self.done = []

    def on_train_step_end(self, run_context):
        self.done.append(run_context.original_args().cur_step_num)


def _train(directory, crash_after=None, log=None, steps=None):
    """One attempt of the script: the same code every time, as a launcher reruns it."""
    net, opt, ds = _build()
    callbacks = [ModelCheckpoint("mlp", str(directory), CheckpointConfig(save_checkpoint_steps=3))]
    if steps is not None:
        callbacks.append(steps)
    if crash_after is not None:
        callbacks.append(Crash(crash_after))
    try:
        Model(net, ce_loss(), opt).train(EPOCHS, ds, callbacks=callbacks, log_file=log)
    except KeyboardInterrupt:
        return None, None
    return net, opt


@pytest.fixture
def restart(monkeypatch):
    def set_count(count, log=None):
        monkeypatch.setenv("MINIDL_RESTART_COUNT", str(count))
        if log is not None:
            monkeypatch.setenv("MINIDL_RESTART_LOG", str(log))
    monkeypatch.delenv("MINIDL_RESTART_COUNT", raising=False)
    monkeypatch.delenv("MINIDL_RESTART_LOG", raising=False)
    return set_count


def test_restart_count_reads_the_launchers_variable(restart):
    assert restart_count() == 0
    restart(2)
    assert restart_count() == 2
    restart(-1)
    with pytest.raises(ValueError, match=r"MINIDL_RESTART_COUNT must be an int >= 0 \(the launcher sets it\), "
                                         r"got '-1'"):
        restart_count()
    restart("two")
    with pytest.raises(ValueError, match="got 'two'"):
        restart_count()


def test_each_restart_resumes_from_the_newest_checkpoint_and_ends_bit_identical(tmp_path, restart, capsys):
    reference, ref_opt = _train(tmp_path / "reference")
    directory = tmp_path / "ckpt"
    log = tmp_path / "restarts.jsonl"
    _train(directory, crash_after=7)  # attempt 0 fails after step 7: saved after steps 3 and 6
    restart(1, log)
    first, last = Steps(), Steps()
    _train(directory, crash_after=11, steps=first)  # restart 1 resumes after step 6, fails after 11 (saved at 9)
    restart(2, log)
    net, opt = _train(directory, steps=last)
    assert (first.done, last.done) == ([7, 8, 9, 10, 11], [10, 11, 12, 13, 14, 15])
    for name, value in _params(net).items():
        assert np.array_equal(value, _params(reference)[name]), name
    for name, value in opt.state_dict().items():
        assert np.array_equal(value.asnumpy(), ref_opt.state_dict()[name].asnumpy()), name
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert lines == [{"restart": 1, "checkpoint": str(directory / "mlp-2_1.ckpt"), "step": 6},
                     {"restart": 2, "checkpoint": str(directory / "mlp_1-2_4.ckpt"), "step": 9}]
    out = capsys.readouterr().out
    assert f"Model.train: restart 2: resuming from {directory / 'mlp_1-2_4.ckpt'} (after step 9)" in out


def test_a_first_attempt_does_not_resume(tmp_path, restart):
    _train(tmp_path, crash_after=7)
    _train(tmp_path, crash_after=4)  # MINIDL_RESTART_COUNT unset: a new run, from step 1
    assert sorted(os.listdir(tmp_path)) == ["mlp-1_3.ckpt", "mlp-2_1.ckpt", "mlp_1-1_3.ckpt"]


def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning_naming_it(tmp_path, restart):
    reference, _ = _train(tmp_path / "reference")
    directory = tmp_path / "ckpt"
    _train(directory, crash_after=7)
    newest = directory / "mlp-2_1.ckpt"
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the last tensor's bytes
    newest.write_bytes(bytes(data))
    restart(1)
    steps = Steps()
    with pytest.warns(RuntimeWarning, match=rf"Model.train: skipped the damaged checkpoint {newest}: .*checksum "
                                            rf"mismatch"):
        net, _ = _train(directory, steps=steps)
    assert steps.done[0] == 4
    for name, value in _params(net).items():  # from step 3's checkpoint: still the same end
        assert np.array_equal(value, _params(reference)[name]), name


def test_no_checkpoint_trains_from_the_start(tmp_path, restart, capsys):
    reference, _ = _train(tmp_path / "reference")
    restart(1, tmp_path / "log.jsonl")
    net, _ = _train(tmp_path / "empty")
    for name, value in _params(net).items():
        assert np.array_equal(value, _params(reference)[name]), name
    assert "restart 1: no checkpoint in" in capsys.readouterr().out
    assert json.loads((tmp_path / "log.jsonl").read_text()) == {"restart": 1, "checkpoint": None, "step": 0}


def test_a_file_of_another_rank_or_job_is_not_this_ranks(tmp_path, restart, monkeypatch):
    net, opt, _ = _build()
    save_train_state(tmp_path / "mlp-1_4.ckpt", net, opt, 1, 4, 4, 5, append_dict={"rank": 1, "group_size": 2})
    save_train_state(tmp_path / "mlp-1_2.ckpt", net, opt, 1, 2, 2, 5)  # by hand: no writer recorded, anyone's
    assert newest_complete_checkpoint(tmp_path, "mlp") == str(tmp_path / "mlp-1_2.ckpt")
    # rank 0's file of a 2-rank world: what this rank of a 1-rank world (an elastic restart) resumes from
    save_train_state(tmp_path / "mlp-1_3.ckpt", net, opt, 1, 3, 3, 5, append_dict={"rank": 0, "group_size": 2})
    assert newest_complete_checkpoint(tmp_path, "mlp") == str(tmp_path / "mlp-1_3.ckpt")
    monkeypatch.setenv("MINIDL_RUN_ID", "job-b")  # a restarting launcher's job: its own files only
    assert newest_complete_checkpoint(tmp_path, "mlp") is None
    save_train_state(tmp_path / "mlp-1_1.ckpt", net, opt, 1, 1, 1, 5)
    assert minidl.load_checkpoint_metadata(tmp_path / "mlp-1_1.ckpt")["run_id"] == "job-b"
    assert newest_complete_checkpoint(tmp_path, "mlp") == str(tmp_path / "mlp-1_1.ckpt")
    assert newest_complete_checkpoint(tmp_path / "absent", "mlp") is None
    assert rank_checkpoint_path(tmp_path / "mlp-1_2.ckpt", 1) == str(tmp_path / "mlp-1_2_rank1.ckpt")


def _custom_loop(directory, stop_step=None, steps=None):
    """A hand-written loop that checkpoints every 2 steps and keeps its own data order's state."""
    net, opt, _ = _build()
    step_cell = nn.TrainOneStepCell(nn.WithLossCell(net, ce_loss()), opt)
    data_rng = np.random.default_rng(5)
    start = 0
    resumed = resume_after_restart(directory, net, opt, prefix="loop")
    if resumed is not None:
        path, position = resumed
        start = position.global_step
        data_rng.bit_generator.state = json.loads(minidl.load_checkpoint_metadata(path)["data_rng"])
    for step in range(start + 1, 9):
        if steps is not None:
            steps.append(step)
        rows = data_rng.choice(len(X), 6, replace=False)
        step_cell(minidl.Tensor(X[rows]), minidl.Tensor(Y[rows]))
        if step % 2 == 0:
            save_train_state(directory / f"loop-1_{step}.ckpt", net, opt, 1, step, step, 8,
                             append_dict={"data_rng": json.dumps(data_rng.bit_generator.state)})
        if step == stop_step:
            return None
    return _params(net)


def test_a_custom_loop_resumes_through_one_call(tmp_path, restart):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    reference = _custom_loop(tmp_path / "a")
    assert _custom_loop(tmp_path / "b", stop_step=5) is None
    assert resume_after_restart(tmp_path / "b", None, None, prefix="loop") is None  # a first attempt
    restart(1)
    steps = []
    got = _custom_loop(tmp_path / "b", steps=steps)
    assert steps == [5, 6, 7, 8]  # from the checkpoint of step 4
    for name, value in got.items():
        assert np.array_equal(value, reference[name]), name


def test_a_checkpoint_of_another_world_size_resumes_at_the_same_share_of_its_epoch(tmp_path):
    """Saved by rank 0 of 2 after 2 of its 5 steps per epoch; one process reading the whole dataset has 10 steps
    per epoch (batches of 3): it skips 4, as far into the epoch."""
    net, opt, _ = _build()
    path = tmp_path / "mlp-2_2.ckpt"
    save_train_state(path, net, opt, 2, 7, 2, 5, append_dict={"rank": 0, "group_size": 2})
    steps = Steps()
    net, opt, _ = _build()
    Model(net, ce_loss(), opt).train(2, slices((X, Y), ["x", "y"], 3), callbacks=[steps], resume_from=str(path))
    assert steps.done == list(range(8, 14))  # global steps go on from 7; the epoch's steps 5..10
    save_train_state(path, net, opt, 2, 7, 2, 5, append_dict={"rank": 0, "group_size": 1})
    with pytest.raises(ValueError, match=rf"^Model.train: checkpoint '{path}' was trained with 5 steps per epoch, but "
                                         rf"train_dataset has 10; resume with the same dataset, batch size and sharding$"):
        Model(net, ce_loss(), opt).train(2, slices((X, Y), ["x", "y"], 3), resume_from=str(path))


def test_of_two_runs_at_one_step_the_later_run_wins(tmp_path):
    """A restart that resumed before step 3 saves step 3 again, under the next run's prefix: that file is the newer."""
    from minidl.train.restart import _candidates
    net, opt, _ = _build()
    save_train_state(tmp_path / "mlp-1_3.ckpt", net, opt, 1, 3, 3, 5)
    save_train_state(tmp_path / "mlp_1-1_3.ckpt", net, opt, 1, 3, 3, 5)
    assert _candidates(str(tmp_path), "mlp") == {(1, 3, 0): "mlp-1_3.ckpt", (1, 3, 1): "mlp_1-1_3.ckpt"}
    assert newest_complete_checkpoint(tmp_path, "mlp") == str(tmp_path / "mlp_1-1_3.ckpt")


def test_a_file_of_a_named_job_is_anyones_when_no_job_is_named(tmp_path, monkeypatch):
    net, opt, _ = _build()
    monkeypatch.setenv("MINIDL_RUN_ID", "job-a")
    save_train_state(tmp_path / "mlp-1_3.ckpt", net, opt, 1, 3, 3, 5)
    monkeypatch.delenv("MINIDL_RUN_ID")  # (MINIDL_RESTART_COUNT set by hand, without the launcher)
    assert newest_complete_checkpoint(tmp_path, "mlp") == str(tmp_path / "mlp-1_3.ckpt")


def test_the_defaults_are_modelcheckpoints_prefix_and_each_functions_own_name(tmp_path, restart, capsys):
    net, opt, _ = _build()
    save_train_state(tmp_path / "CKP-1_2.ckpt", net, opt, 1, 2, 2, 5)
    (tmp_path / "CKP-1_3.ckpt").write_bytes(b"not a checkpoint")
    with pytest.warns(RuntimeWarning, match=r"^newest_complete_checkpoint: skipped the damaged checkpoint"):
        assert newest_complete_checkpoint(tmp_path) == str(tmp_path / "CKP-1_2.ckpt")
    restart(1)
    with pytest.warns(RuntimeWarning, match=r"^resume_after_restart: skipped the damaged checkpoint"):
        path, position = resume_after_restart(tmp_path, net, opt)
    assert (path, position.global_step) == (str(tmp_path / "CKP-1_2.ckpt"), 2)
    assert f"resume_after_restart: restart 1: resuming from {path} (after step 2)" in capsys.readouterr().out
    from minidl.train.restart import restart_checkpoint
    with pytest.warns(RuntimeWarning, match=r"^restart_checkpoint: skipped"):
        assert restart_checkpoint(tmp_path) == path
    assert capsys.readouterr().out.startswith("restart_checkpoint: restart 1: resuming from")


def test_a_restart_names_itself_in_a_refused_resume(tmp_path, restart):
    net, opt, _ = _build()
    save_train_state(tmp_path / "mlp-1_2.ckpt", net, opt, 1, 2, 2, 5)
    restart(1)
    bigger, bigger_opt, _ = _build()
    bigger.extra = nn.Dense(2, 2)
    with pytest.raises(ValueError, match=r"^resume_after_restart: checkpoint .* lacks 2 parameter\(s\)"):
        resume_after_restart(tmp_path, bigger, None, prefix="mlp")


def test_a_restart_removes_what_a_writer_killed_while_saving_left(tmp_path, restart):
    import subprocess
    from minidl.io.safetensors import _host_token
    from minidl.train.restart import restart_checkpoint
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process id no process has now
    torn = tmp_path / f".mlp-1_4.ckpt.{_host_token()}.{gone.pid}.abcd1234.tmp"
    torn.write_bytes(b"half a checkpoint")
    restart(1)
    assert restart_checkpoint(tmp_path, "mlp") is None
    assert not torn.exists()
