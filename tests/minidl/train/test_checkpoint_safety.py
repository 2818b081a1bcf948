"""ModelCheckpoint never writes a non-finite checkpoint: a diverged run keeps its last finite files."""
import os
import warnings

import numpy as np
import pytest

import minidl
from minidl import nn
from minidl.train import Callback, CheckpointConfig, Model, ModelCheckpoint, latest_checkpoint
from minidl.train.checkpoint import rank_checkpoint_path

from .helpers import blobs, ce_loss, mlp, slices

BATCH, N = 4, 24  # 6 steps per epoch


def _data(nan_batch=None):
    x, y = blobs(n=N, seed=3)
    if nan_batch is not None:
        x = x.copy()
        x[nan_batch * BATCH] = np.nan  # one row of that batch: the step's gradients, then the weights, turn NaN
    return x, y


def _train(tmp_path, x, y, epochs=1, keep=2, callbacks=(), saved_network=None):
    minidl.set_seed(5)
    net = mlp()
    opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
    ckpt = ModelCheckpoint("net", str(tmp_path), CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=keep,
                                                                  saved_network=saved_network))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Model(net, ce_loss(), opt).train(epochs, slices((x, y), ["x", "y"], BATCH), callbacks=[*callbacks, ckpt],
                                         progress=False)
    skipped = [str(w.message) for w in caught if "ModelCheckpoint: skipped" in str(w.message)]
    return net, ckpt, skipped


def _all_finite(path):
    return all(np.isfinite(p.asnumpy()).all() for p in minidl.load_checkpoint(path).values()
               if p.asnumpy().dtype.kind == "f")


def test_loss_going_nan_at_step_k_keeps_the_last_finite_checkpoints_and_warns(tmp_path):
    k = 4  # the 4th step (batch index 3) holds a NaN: its update makes every weight NaN
    net, ckpt, skipped = _train(tmp_path, *_data(nan_batch=k - 1))
    assert not np.isfinite(net[0].weight.asnumpy()).all()  # the run did diverge
    # steps 1..3 were finite (keep 2: steps 2 and 3 stay); steps 4..6 are skipped and prune nothing
    assert sorted(os.listdir(tmp_path)) == ["net-1_2.ckpt", "net-1_3.ckpt"]
    assert all(_all_finite(tmp_path / name) for name in os.listdir(tmp_path))
    assert ckpt.latest_ckpt_file_name == str(tmp_path / "net-1_3.ckpt")
    assert latest_checkpoint(str(tmp_path), "net") == str(tmp_path / "net-1_3.ckpt")
    assert len(skipped) == 3  # steps 4, 5, 6 (the end-of-training save was the step-6 one)
    first = skipped[0]
    assert "net-1_4.ckpt" in first and "step 4" in first
    # the names of the non-finite tensors (a few) and how many there are: 4 weights/biases + their 4 moments
    assert "8 parameter(s) or optimizer state(s) hold NaN or inf" in first
    assert "'0.weight'" in first and "and 5 more" in first
    assert "latest: " + str(tmp_path / "net-1_3.ckpt") in first


def test_a_finite_run_saves_as_before(tmp_path):
    _, ckpt, skipped = _train(tmp_path, *_data())
    assert skipped == []
    assert sorted(os.listdir(tmp_path)) == ["net-1_5.ckpt", "net-1_6.ckpt"]


class _PoisonMoment(Callback):
    """Sets one optimizer state (not a parameter) to inf after step ``step``."""

    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        if cb.cur_step_num == self.step:
            moment = next(p for name, p in cb.optimizer.parameters_and_names() if name.startswith("moments."))
            moment.data[...] = np.inf


def test_a_non_finite_optimizer_state_alone_also_skips_the_save(tmp_path):
    _, _, skipped = _train(tmp_path, *_data(), callbacks=[_PoisonMoment(5)])
    # step 5 makes one moment inf; step 6's update spreads it to its weight and on
    assert "net-1_5.ckpt" not in os.listdir(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["net-1_3.ckpt", "net-1_4.ckpt"]
    assert "1 parameter(s) or optimizer state(s) hold NaN or inf: 'moments.0.weight';" in skipped[0]
    assert "2 parameter(s) or optimizer state(s) hold NaN or inf: '0.weight', 'moments.0.weight';" in skipped[1]


def test_saved_network_is_checked_too(tmp_path):
    x, y = _data(nan_batch=2)
    minidl.set_seed(5)
    other = mlp()  # saved_network: the one whose values are written; it is finite here
    _, _, skipped = _train(tmp_path, x, y, saved_network=other)
    assert skipped == [] and len(os.listdir(tmp_path)) == 2
    for p in other.get_parameters():
        p.data[...] = np.nan
    _, _, skipped = _train(tmp_path / "again", x, y, saved_network=other)
    assert len(skipped) == 6 and not os.path.exists(tmp_path / "again" / "net-1_1.ckpt")


def test_rank_checkpoint_path_names():
    assert rank_checkpoint_path("ckpt/net-2_5.ckpt", 0) == "ckpt/net-2_5.ckpt"
    assert rank_checkpoint_path("ckpt/net-2_5.ckpt", 3) == "ckpt/net-2_5_rank3.ckpt"
    assert rank_checkpoint_path("ckpt/net-2_5_rank3.ckpt", 3) == "ckpt/net-2_5_rank3.ckpt"


@pytest.mark.parametrize("key", ["rank", "group_size", "batch_size", "num_shards"])
def test_rank_keys_are_reserved_in_append_info(key):
    with pytest.raises(ValueError, match="reserved"):
        CheckpointConfig(append_info=[{key: 1}])


def test_a_new_model_checkpoint_removes_temporary_files_of_dead_writers_only(tmp_path):
    """kill -9 during a save leaves a temporary file; the next ModelCheckpoint in the directory
    removes it, but never the temporary file of a writer still running."""
    import subprocess
    import sys
    from minidl.io import safetensors
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    host = safetensors._host_token()
    dead, live = f".net-1_1.ckpt.{host}.{child.pid}.abcdefgh.tmp", f".net-1_2.ckpt.{host}.{os.getpid()}.abcdefgh.tmp"
    for name in (dead, live):
        (tmp_path / name).write_bytes(b"partial")
    ModelCheckpoint("net", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [live]


def test_save_train_state_names_a_name_two_of_its_tensors_would_share(tmp_path):
    from minidl.train import save_train_state
    net = mlp()
    params = list(net.trainable_params())
    opt = nn.Momentum(params, 0.05, 0.9)
    params[0].name = "global_step"  # the optimizer's step counter has that name
    with pytest.raises(ValueError) as err:
        save_train_state(tmp_path / "a.ckpt", net, opt, 1, 1, 1, 6)
    assert str(err.value) == ("save_train_state: the network and the optimizer both have a parameter named "
                              "'global_step'; a checkpoint needs unique names")
    params[0].name = "2.weight"  # two parameters of the network (the other keeps its path)
    with pytest.raises(ValueError, match=r"^save_train_state: parameters '.*' and '.*' would both be saved as "
                                         r"'2\.weight'"):
        save_train_state(tmp_path / "a.ckpt", net, opt, 1, 1, 1, 6)
    assert not os.listdir(tmp_path)
