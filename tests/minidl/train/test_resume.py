"""Resume: a run stopped after k steps and resumed from its checkpoint ends bit-identical to
an uninterrupted run (MLP with Dropout, shuffled data, Momentum with an lr schedule)."""
import json
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl
from minidl import nn
from minidl.train import CheckpointConfig, Model, ModelCheckpoint, latest_checkpoint, save_train_state

from .helpers import StopAt, blobs, ce_loss, mlp, slices

X, Y = blobs(n=30, seed=1)
EPOCHS, BATCH = 3, 7  # 5 steps per epoch, the last batch short


def _build(seed=11):
    """Everything a training script makes, from the seed: net, optimizer, dataset."""
    minidl.set_seed(seed)
    net = mlp(dropout=0.3)
    opt = nn.Momentum(net.trainable_params(), learning_rate=[0.1] * 4 + [0.05] * 100, momentum=0.9)
    ds = slices((X, Y), ["x", "y"], BATCH, shuffle=True)
    return net, opt, ds


def _params(net):
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


def _uninterrupted():
    net, opt, ds = _build()
    Model(net, ce_loss(), opt).train(EPOCHS, ds)
    return _params(net), opt


REFERENCE = {}


def _reference():
    if not REFERENCE:
        params, opt = _uninterrupted()
        REFERENCE.update(params=params, moments={k: v.asnumpy().copy() for k, v in opt.state_dict().items()})
    return REFERENCE


def _interrupted_then_resumed(tmp_path, stop_step, log=None):
    net, opt, ds = _build()
    ckpt = ModelCheckpoint("mlp", str(tmp_path), CheckpointConfig(save_checkpoint_steps=100, keep_checkpoint_max=2))
    Model(net, ce_loss(), opt).train(EPOCHS, ds, callbacks=[ckpt, StopAt(stop_step)], log_file=log)
    path = latest_checkpoint(str(tmp_path), "mlp")
    # a new process: fresh objects, the random stream elsewhere (the script drew from it)
    net, opt, ds = _build()
    minidl.backend.rng().random(17)
    Model(net, ce_loss(), opt).train(EPOCHS, ds, resume_from=path, log_file=log)
    return net, opt, path


@settings(max_examples=5, deadline=None)
@given(stop_step=st.integers(1, 14))
def test_resumed_run_is_bit_identical(tmp_path_factory, stop_step):
    ref = _reference()
    net, opt, _ = _interrupted_then_resumed(tmp_path_factory.mktemp("ckpt"), stop_step)
    got = _params(net)
    assert got.keys() == ref["params"].keys()
    for name in got:
        assert np.array_equal(got[name], ref["params"][name]), (stop_step, name)
    for name, v in opt.state_dict().items():
        assert np.array_equal(v.asnumpy(), ref["moments"][name]), name
    assert opt.global_step == EPOCHS * 5


@pytest.mark.parametrize("stop_step", [5, 10])  # at an epoch's end: the next epoch starts afresh
def test_resume_at_epoch_boundary(tmp_path, stop_step):
    net, _, path = _interrupted_then_resumed(tmp_path, stop_step)
    assert os.path.basename(path) == f"mlp-{stop_step // 5}_5.ckpt"
    ref = _reference()["params"]
    assert all(np.array_equal(p, ref[k]) for k, p in _params(net).items())


def test_resume_restores_seed_and_random_state(tmp_path):
    net, opt, ds = _build(seed=11)
    Model(net, ce_loss(), opt).train(1, ds, callbacks=[ModelCheckpoint("s", str(tmp_path)), StopAt(2)])
    state = minidl.backend.rng().bit_generator.state
    minidl.set_seed(99)
    net2, opt2, ds2 = _build(seed=5)
    Model(net2, ce_loss(), opt2).train(1, ds2, resume_from=latest_checkpoint(str(tmp_path), "s"),
                                       callbacks=StopAt(0))  # stop after the first resumed step
    assert minidl.get_seed() == 11
    assert opt2.global_step == 3
    assert minidl.backend.rng().bit_generator.state != state  # the resumed step drew dropout masks


def test_resumed_log_continues_the_same_file(tmp_path):
    log = str(tmp_path / "log.jsonl")
    _interrupted_then_resumed(tmp_path, 7, log=log)
    steps = [json.loads(line)["step"] for line in open(log) if '"loss"' in line]
    assert steps == list(range(1, 8)) + list(range(8, 16))


def test_finished_run_resumes_to_nothing(tmp_path):
    net, opt, ds = _build()
    Model(net, ce_loss(), opt).train(1, ds, callbacks=ModelCheckpoint("f", str(tmp_path)))
    before = _params(net)
    Model(net, ce_loss(), opt).train(1, ds, resume_from=latest_checkpoint(str(tmp_path), "f"))
    assert all(np.array_equal(p, before[k]) for k, p in _params(net).items())


# ---- bad input ---------------------------------------------------------------------------------


def test_missing_resume_file(tmp_path):
    net, opt, ds = _build()
    with pytest.raises(FileNotFoundError, match=r"resume_from checkpoint '.*nope.ckpt' does not exist"):
        Model(net, ce_loss(), opt).train(1, ds, resume_from=str(tmp_path / "nope.ckpt"))


def test_plain_checkpoint_is_not_a_training_state(tmp_path):
    net, opt, ds = _build()
    path = str(tmp_path / "plain.ckpt")
    minidl.save_checkpoint(net, path)
    with pytest.raises(ValueError, match=r"is not a training checkpoint: its metadata lacks \['epoch_num'"):
        Model(net, ce_loss(), opt).train(1, ds, resume_from=path)


def test_checkpoint_from_another_model_or_dataset(tmp_path):
    net, opt, ds = _build()
    path = str(tmp_path / "other.ckpt")
    other = mlp(hidden=8)
    save_train_state(path, other, None, 1, 2, 2, 5)
    before = _params(net)
    with pytest.raises(ValueError, match=r"lacks \d+ parameter\(s\) or optimizer state\(s\).*moments\."):
        Model(net, ce_loss(), opt).train(1, ds, resume_from=path)
    assert all(np.array_equal(p, before[k]) for k, p in _params(net).items())  # nothing loaded
    save_train_state(path, net, opt, 1, 2, 2, 4)
    with pytest.raises(ValueError, match="trained with 4 steps per epoch, but train_dataset has 5"):
        Model(net, ce_loss(), opt).train(1, ds, resume_from=path)
