"""Saving under parallelism is explicit and agreed: no hidden collective, no per-rank clock decisions."""
import os
import threading

import numpy as np
import pytest

import minidl
import minidl_parallel as mp
from minidl import Tensor, nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import CheckpointConfig, Model, ModelCheckpoint
from minidl.train import checkpoint as train_checkpoint
from minidl_parallel import run_threads


def _net():
    minidl.set_seed(3)
    net = nn.SequentialCell(nn.Dense(8, 6, dtype=minidl.float64), nn.ReLU(), nn.Dense(6, 2, dtype=minidl.float64))
    net[0].matmul.shard(((1, 2), (1, 2)))  # the first weight (6, 8) is cut in 2 along K
    return net


def _semi_auto(fn, n=2):
    def body():
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.SEMI_AUTO_PARALLEL, dataset_strategy="full_batch")
        try:
            return fn()
        except Exception as e:  # every rank must raise, none may hang
            return e
    return run_threads(n, body, timeout=60)


X = np.random.default_rng(0).standard_normal((4, 8))


def test_saving_sharded_parameters_needs_an_explicit_integrated_save(tmp_path):
    def fn():
        net = _net()
        net(Tensor(X))  # the weight becomes this rank's block
        minidl.save_checkpoint(net, str(tmp_path / f"r{mp.get_rank()}.ckpt"))
    errors = _semi_auto(fn)
    for e in errors:
        assert isinstance(e, ValueError), errors
        assert "'0.weight'" in str(e) and "integrated_save=True on every rank" in str(e)
    assert os.listdir(tmp_path) == []


def test_integrated_save_false_writes_each_ranks_blocks_and_loads_them_back(tmp_path):
    def fn():
        net = _net()
        want = minidl.backend.to_numpy(mp.full_value(net(Tensor(X))))
        path = str(tmp_path / f"r{mp.get_rank()}.ckpt")
        minidl.save_checkpoint(net, path, integrated_save=False)
        saved = minidl.load_checkpoint(path)
        meta = minidl.load_checkpoint_metadata(path)
        other = _net()
        for p in other.get_parameters():
            p.set_data(np.zeros(p.data.shape))
        other(Tensor(X))  # placed like net: the blocks fit
        minidl.load_param_into_net(other, saved)
        got = minidl.backend.to_numpy(mp.full_value(other(Tensor(X))))
        return saved["0.weight"].shape, meta["block.0.weight"], got, want
    for shape, block, got, want in _semi_auto(fn):
        assert shape == (6, 4) and block == "(6, 4)"
        np.testing.assert_allclose(got, want, rtol=1e-12)


class _RankClocks:
    """time.time() as ranks with different clocks see it: rank 0's runs 10 s per call, the others' stand still."""

    def __init__(self):
        self._calls = threading.local()

    def time(self):
        n = getattr(self._calls, "n", 0)
        self._calls.n = n + 1
        return 1000.0 + (10.0 * n if mp.get_rank() == 0 else 0.0)


def test_time_based_saves_are_rank_0s_decision_on_every_rank(tmp_path, monkeypatch):
    """A save of sharded parameters gathers them (a collective); ranks deciding by their own clocks
    would deadlock or pair different collectives. Every rank must save at the same steps."""
    monkeypatch.setattr(train_checkpoint, "time", _RankClocks())
    ds_x = np.random.default_rng(1).standard_normal((12, 8))
    ds_y = np.random.default_rng(2).standard_normal((12, 2))

    def fn():
        net = _net()
        ds = NumpySlicesDataset({"x": ds_x, "y": ds_y}, shuffle=False).batch(4)
        cfg = CheckpointConfig(save_checkpoint_steps=0, save_checkpoint_seconds=5, keep_checkpoint_max=10)
        ckpt = ModelCheckpoint("net", str(tmp_path / f"rank{mp.get_rank()}"), cfg)
        Model(net, nn.MSELoss(), nn.Momentum(net.trainable_params(), 0.1, 0.9)).train(1, ds, callbacks=[ckpt],
                                                                                     progress=False)
        return sorted(os.listdir(ckpt.directory))
    saved = _semi_auto(fn)
    assert not any(isinstance(s, Exception) for s in saved), saved
    assert saved[0] == saved[1] == ["net-1_1.ckpt", "net-1_2.ckpt", "net-1_3.ckpt"]
