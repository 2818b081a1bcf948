"""Model's step agreement on the threads world, with callbacks that share plans across ranks."""
import os

import numpy as np

import minidl
import minidl_parallel as mp
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import CheckpointConfig, Model, ModelCheckpoint
from minidl_parallel import run_threads


def test_checkpoints_under_uneven_inputs_are_saved_by_each_rank_at_its_own_steps(tmp_path):
    """The ranks run different numbers of steps, so their ModelCheckpoints must decide alone:
    a save decided together would wait for a rank that never saves at that step."""
    counts = [3, 2]

    def fn():
        rank = mp.get_rank()
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        minidl.set_seed(3)
        net = nn.Dense(3, 2, dtype=minidl.float64)
        rng = np.random.default_rng(rank)
        ds = NumpySlicesDataset({"x": rng.standard_normal((2 * counts[rank], 3)),
                                 "y": rng.standard_normal((2 * counts[rank], 2))}, shuffle=False).batch(2)
        ckpt = ModelCheckpoint("net", str(tmp_path / f"rank{rank}"),
                               CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=10))
        Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), learning_rate=0.1)).train(
            1, ds, callbacks=[ckpt], progress=False, uneven_inputs=True)
        return sorted(os.listdir(ckpt.directory))

    assert run_threads(2, fn, timeout=30) == [["net-1_1.ckpt", "net-1_2.ckpt", "net-1_3.ckpt"],
                                              ["net-1_1.ckpt", "net-1_2.ckpt"]]
