"""minidl/train/checkpoint.py in detail, on one device: the messages of a refused resume in full, the
metadata of a ``saved_network`` save, the names a save gets when the loop does not say the step within
the epoch, and what a resume restores (the tests the mutation run of issues 32 and 33 asked for)."""
import json
import os
import re
import time
import warnings

import numpy as np
import pytest

import minidl
from minidl import Parameter, Tensor, nn
from minidl.io.checkpoint import load_checkpoint, load_checkpoint_metadata, save_checkpoint
from minidl.train import (Callback, CallbackParam, CheckpointConfig, Model, ModelCheckpoint, RunContext,
                          restore_train_state, save_train_state)
from minidl.train.checkpoint import TrainPosition

from .helpers import blobs, ce_loss, mlp, momentum, slices

BATCH = 4


def _dataset(steps):
    x, y = blobs(n=steps * BATCH, seed=2)
    return slices((x, y), ["x", "y"], BATCH)


def _values(net):
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


def _denses(count, last_bias=True):
    """``count`` Dense(2, 2) layers: parameters '0.weight', '0.bias', '1.weight', ... (the last one's
    bias only with ``last_bias``)."""
    return nn.SequentialCell([nn.Dense(2, 2, has_bias=last_bias or k < count - 1) for k in range(count)])


def _train_state_metadata(**changes):
    """The metadata save_train_state writes (position 1/1 of 2 steps per epoch), with ``changes``."""
    meta = {"epoch_num": 1, "step_num": 1, "step_in_epoch": 1, "batch_num": 2, "seed": "3",
            "rng_state": json.dumps(np.random.default_rng(7).bit_generator.state)}
    meta.update(changes)
    return meta


# ---- the messages of a refused resume, in full -------------------------------------------------------------

def test_a_missing_resume_file_is_named_by_model_train_and_by_restore_train_state_alone(tmp_path):
    missing = str(tmp_path / "net-1_1.ckpt")
    net = mlp()
    want = f"Model.train: resume_from checkpoint {missing!r} does not exist"
    with pytest.raises(FileNotFoundError) as err:
        Model(net, ce_loss(), momentum(net)).train(1, _dataset(2), resume_from=missing)
    assert str(err.value) == want
    with pytest.raises(FileNotFoundError) as err:  # (its default caller is Model.train, which calls it so)
        restore_train_state(missing, net, None)
    assert str(err.value) == want


@pytest.mark.parametrize("layers, last_bias, shown_tail", [
    (5, True, ""),          # 8 parameters absent: all listed
    (6, False, " ..."),     # 9 absent: the first 8, then " ..."
])
def test_a_checkpoint_lacking_parameters_lists_the_first_eight_and_loads_nothing(tmp_path, layers, last_bias,
                                                                                    shown_tail):
    path = str(tmp_path / "small.ckpt")
    save_train_state(path, _denses(1), None, 1, 1, 1, 2)
    net = _denses(layers, last_bias)
    before = _values(net)
    absent = [name for name, _ in net.parameters_and_names()][2:]
    with pytest.raises(ValueError) as err:
        restore_train_state(path, net, None)
    assert str(err.value) == (f"Model.train: checkpoint {path!r} lacks {len(absent)} parameter(s) or optimizer "
                              f"state(s) of this model, nothing was loaded: {absent[:8]}{shown_tail}")
    assert all(np.array_equal(value, before[name]) for name, value in _values(net).items())


def test_a_corrupt_training_state_is_named_with_the_parse_error(tmp_path):
    path = str(tmp_path / "corrupt.ckpt")
    net = _denses(1)
    save_checkpoint(net, path, append_dict=_train_state_metadata(epoch_num="one"))
    with pytest.raises(ValueError) as err:
        restore_train_state(path, _denses(1), None)
    assert str(err.value) == (f"Model.train: checkpoint {path!r} has a corrupt training state in its metadata: "
                              f"invalid literal for int() with base 10: 'one'")


def test_a_parameter_of_another_shape_is_named_by_model_train(tmp_path):
    path = str(tmp_path / "wide.ckpt")
    save_train_state(path, nn.SequentialCell([nn.Dense(2, 3)]), None, 1, 1, 1, 2)
    with pytest.raises(ValueError) as err:
        restore_train_state(path, nn.SequentialCell([nn.Dense(2, 2)]), None)
    assert str(err.value) == ("Model.train: 2 parameter(s) have a different shape in the checkpoint, nothing was "
                              "loaded: '0.weight': net (2, 2) vs checkpoint (3, 2); '0.bias': net (2,) vs "
                              "checkpoint (3,)")


def test_an_entry_two_parameters_claim_is_named_by_model_train(tmp_path):
    path = str(tmp_path / "net.ckpt")
    save_train_state(path, _denses(1), None, 1, 1, 1, 2)
    net = _denses(1)
    net.extra = Parameter(Tensor(np.zeros((2, 2), np.float32)), name="0.weight")  # named as the path of another
    with pytest.raises(ValueError) as err:
        restore_train_state(path, net, None)
    assert str(err.value) == ("Model.train: 1 checkpoint entry matches more than one parameter, nothing was loaded: "
                              "'0.weight' matches the parameters at 'extra' (named '0.weight') and '0.weight'; give "
                              "the parameters names that tell them apart, or pass a dict keyed by the names wanted")


def test_a_pipeline_stages_file_on_one_device_is_named_by_model_train_with_its_path(tmp_path):
    path = str(tmp_path / "pp-1_1.ckpt")
    net = mlp()
    save_train_state(path, net, None, 1, 1, 1, 2,
                     append_dict={"pipeline_stages": 2, "pipeline_stage": 1, "pipeline_network": ""})
    with pytest.raises(ValueError) as err:
        Model(net, ce_loss(), momentum(net)).train(1, _dataset(2), resume_from=path)
    assert str(err.value) == (f"Model.train: {path!r} holds pipeline stage 1 of a 2-stage pipeline, but this rank "
                              f"trains the whole model (no pipeline): load the stages' files with "
                              f"minidl_parallel.load_segmented_checkpoints(path, net, optimizer), which merges them "
                              f"for any stage count, then train")


def test_a_network_parameter_named_global_step_is_refused_by_model_checkpoint(tmp_path):
    net = mlp()
    net[0].bias.name = "global_step"  # the optimizer's step count has that name too
    ckpt = ModelCheckpoint("net", str(tmp_path))
    with pytest.raises(ValueError) as err:
        Model(net, ce_loss(), momentum(net)).train(1, _dataset(2), callbacks=[ckpt], progress=False)
    assert str(err.value) == ("ModelCheckpoint: the network and the optimizer both have a parameter named "
                              "'global_step'; a checkpoint needs unique names")
    assert os.listdir(tmp_path) == []


def test_an_optimizer_state_of_another_shape_loads_nothing(tmp_path):
    path, bad = str(tmp_path / "net.ckpt"), str(tmp_path / "bad.ckpt")
    net = _denses(1)
    save_train_state(path, net, momentum(net), 1, 1, 1, 2)
    tensors = {name: value.asnumpy() + 1 for name, value in load_checkpoint(path).items()}
    tensors["moments.0.weight"] = np.zeros((4, 4), np.float32)
    save_checkpoint(tensors, bad, append_dict=load_checkpoint_metadata(path))
    before = _values(net)
    with pytest.raises(ValueError, match=r"'moments\.0\.weight': net \(2, 2\) vs checkpoint \(4, 4\)"):
        restore_train_state(bad, net, momentum(net))
    assert all(np.array_equal(value, before[name]) for name, value in _values(net).items())


# ---- what a resume restores --------------------------------------------------------------------------------

def test_a_checkpoint_of_a_run_without_a_seed_restores_its_random_state_and_sets_no_seed(tmp_path):
    # What save_train_state writes when minidl.get_seed() is None (a process that never called set_seed).
    path = str(tmp_path / "seedless.ckpt")
    net = _denses(1)
    meta = _train_state_metadata(seed="None")
    save_checkpoint(net, path, append_dict=meta)
    minidl.set_seed(5)
    minidl.backend.rng().random(3)
    position = restore_train_state(path, _denses(1), None)
    assert position == TrainPosition(0, 1, 1, 2) and position.group_size is None
    assert minidl.get_seed() == 5
    assert minidl.backend.rng().bit_generator.state == json.loads(meta["rng_state"])


# ---- the step within the epoch, when cb_params does not hold it --------------------------------------------

def test_a_custom_loop_without_cur_step_in_epoch_names_files_by_the_step_within_the_epoch(tmp_path):
    net = mlp()
    optimizer = momentum(net)
    ckpt = ModelCheckpoint("loop", str(tmp_path), CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=10))
    cb_params = CallbackParam(train_network=net, optimizer=optimizer, batch_num=3, cur_epoch_num=1, cur_step_num=0)
    run_context = RunContext(cb_params)
    ckpt.on_train_begin(run_context)
    for step in range(1, 8):  # 3 steps per epoch: epochs 1 and 2, and the first step of epoch 3
        cb_params.cur_epoch_num, cb_params.cur_step_num = (step - 1) // 3 + 1, step
        ckpt.on_train_step_end(run_context)
    ckpt.on_train_end(run_context)
    names = ["loop-1_1.ckpt", "loop-1_2.ckpt", "loop-1_3.ckpt", "loop-2_1.ckpt", "loop-2_2.ckpt", "loop-2_3.ckpt",
             "loop-3_1.ckpt"]
    assert sorted(os.listdir(tmp_path)) == names
    for step, name in enumerate(names, 1):
        meta = load_checkpoint_metadata(str(tmp_path / name))
        assert (meta["step_num"], meta["step_in_epoch"], meta["batch_num"]) == (str(step), name[7], "3"), name
    fresh = mlp()
    position = restore_train_state(str(tmp_path / "loop-3_1.ckpt"), fresh, momentum(fresh))
    assert position == TrainPosition(2, 1, 7, 3) and position.group_size == 1  # (epoch 3 of 1-based files is epoch 2 of 0-based positions)


def test_a_resume_on_another_number_of_ranks_names_files_by_the_share_of_the_epoch_done(tmp_path):
    """A 2-rank run's checkpoint (2 steps per epoch, 1 done) resumed on one process (4 steps per epoch):
    the epoch continues at step 3 of 4 while the global step is 2, and the files are named by the former."""
    path = str(tmp_path / "two_ranks.ckpt")
    net = mlp()
    optimizer = momentum(net)
    save_train_state(path, net, optimizer, 1, 1, 1, 2, append_dict={"rank": 0, "group_size": 2})
    saving = tmp_path / "resumed"
    ckpt = ModelCheckpoint("net", str(saving), CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=10))
    Model(net, ce_loss(), optimizer).train(2, _dataset(4), callbacks=[ckpt], resume_from=path, progress=False)
    names = ["net-1_3.ckpt", "net-1_4.ckpt", "net-2_1.ckpt", "net-2_2.ckpt", "net-2_3.ckpt", "net-2_4.ckpt"]
    assert sorted(os.listdir(saving)) == names
    for step, name in enumerate(names, 2):
        meta = load_checkpoint_metadata(str(saving / name))
        assert (meta["step_num"], meta["step_in_epoch"]) == (str(step), name[6]), name


def test_a_resume_on_another_number_of_ranks_from_an_epochs_end_starts_the_next_epoch(tmp_path):
    """The 2-rank run's checkpoint at the end of its first epoch: the position keeps the number of ranks,
    so one process with 4 steps per epoch starts epoch 2 (rather than refusing another dataset)."""
    path = str(tmp_path / "two_ranks.ckpt")
    net = mlp()
    optimizer = momentum(net)
    save_train_state(path, net, optimizer, 1, 2, 2, 2, append_dict={"rank": 0, "group_size": 2})
    fresh = mlp()
    position = restore_train_state(path, fresh, momentum(fresh))
    assert position == TrainPosition(1, 0, 2, 2) and position.group_size == 2
    saving = tmp_path / "resumed"
    ckpt = ModelCheckpoint("net", str(saving), CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=10))
    Model(net, ce_loss(), optimizer).train(2, _dataset(4), callbacks=[ckpt], resume_from=path, progress=False)
    names = ["net-2_1.ckpt", "net-2_2.ckpt", "net-2_3.ckpt", "net-2_4.ckpt"]
    assert sorted(os.listdir(saving)) == names
    assert [load_checkpoint_metadata(str(saving / name))["step_num"] for name in names] == ["3", "4", "5", "6"]


# ---- saved_network: another Cell, without the optimizer ----------------------------------------------------

def test_a_saved_network_file_records_its_writer_position_and_user_metadata(tmp_path):
    net, other = mlp(), mlp(hidden=5)
    config = CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=10, saved_network=other,
                              append_info=["epoch_num", {"run": "a", "lr": 0.5}])
    Model(net, ce_loss(), momentum(net)).train(1, _dataset(4), callbacks=[ModelCheckpoint("other", str(tmp_path),
                                                                                             config)], progress=False)
    assert sorted(os.listdir(tmp_path)) == ["other-1_2.ckpt", "other-1_4.ckpt"]
    for step in (2, 4):
        path = str(tmp_path / f"other-1_{step}.ckpt")
        assert load_checkpoint_metadata(path) == {"run": "a", "lr": "0.5", "rank": "0", "group_size": "1",
                                                  "batch_size": str(BATCH), "num_shards": "1",
                                                  "epoch_num": "1", "step_num": str(step)}
        saved = load_checkpoint(path)  # the other network alone: no optimizer state
        want = _values(other)
        assert sorted(saved) == sorted(want)
        assert all(np.array_equal(saved[name].asnumpy(), value) for name, value in want.items())


# ---- a skipped save --------------------------------------------------------------------------------------

class _Poison(Callback):
    """Sets the first layer's bias to NaN after step ``step``, then waits ``wait`` seconds."""

    def __init__(self, step, wait=0.0):
        self.step, self.wait = step, wait

    def on_train_step_end(self, run_context):
        cb_params = run_context.original_args()
        if cb_params.cur_step_num == self.step:
            cb_params.network[0].bias.data[...] = np.nan
            time.sleep(self.wait)


def _skipped(caught):
    return [(w.category, str(w.message)) for w in caught if "ModelCheckpoint: skipped" in str(w.message)]


def test_a_save_skipped_before_any_was_written_says_none_was(tmp_path):
    net = mlp()
    ckpt = ModelCheckpoint("net", str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Model(net, ce_loss(), momentum(net)).train(1, _dataset(1), callbacks=[_Poison(1), ckpt], progress=False)
    path = tmp_path / "net-1_1.ckpt"
    assert _skipped(caught) == [(RuntimeWarning, f"ModelCheckpoint: skipped the checkpoint {path} (epoch 1, step 1): "
                                                 f"1 parameter(s) or optimizer state(s) hold NaN or inf: '0.bias'; the "
                                                 f"earlier checkpoints are kept (latest: none written yet)")]
    assert os.listdir(tmp_path) == []


def test_a_skipped_time_based_save_restarts_the_interval(tmp_path):
    # save_checkpoint_seconds=1: step 2 comes after 1 s and is skipped (NaN); step 3 comes at once, so is not
    # due; the end of training saves again (skipped too).
    net = mlp()
    ckpt = ModelCheckpoint("net", str(tmp_path), CheckpointConfig(save_checkpoint_steps=0, save_checkpoint_seconds=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Model(net, ce_loss(), momentum(net)).train(1, _dataset(3), callbacks=[_Poison(2, wait=1.1), ckpt],
                                                   progress=False)
    said = [message for _, message in _skipped(caught)]
    assert [re.search(r"\(epoch 1, step (\d+)\)", message).group(1) for message in said] == ["2", "3"], said
    assert os.listdir(tmp_path) == []
