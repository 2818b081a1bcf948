"""Run under mpirun -n 2: a long data-parallel Model.train (STEPS steps of a small MLP, the
default timeout and stall warning on) must neither leak threads nor grow its memory, and
must keep every rank's parameters bit-identical.

Each rank prints "rank r: threads A -> B, rss_growth_mb M, identical True|False".
"""
import hashlib
import resource
import sys
import threading

import numpy as np

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback, Model
import minidl_parallel as mp

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 6000
PER_EPOCH = 50


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


class Sample(Callback):
    """Threads and peak memory after the first epoch (warm: caches, the watchdog, buffers)."""

    def on_train_epoch_end(self, run_context):
        if run_context.original_args().cur_epoch_num == 1:
            self.threads, self.rss = threading.active_count(), rss_mb()


mp.init("mpi")
mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
rank, size = mp.get_rank(), mp.get_group_size()
minidl.set_seed(3)
net = nn.SequentialCell(nn.Dense(16, 32), nn.ReLU(), nn.Dense(32, 4))
rng = np.random.default_rng(0)
x = rng.standard_normal((PER_EPOCH * 8 * size, 16)).astype(np.float32)
y = rng.integers(0, 4, len(x)).astype(np.int32)
ds = NumpySlicesDataset({"x": x, "y": y}, shuffle=True, num_shards=size, shard_id=rank).batch(8)
model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
              nn.Momentum(net.trainable_params(), 0.01, 0.9))
sample = Sample()
model.train(STEPS // PER_EPOCH, ds, callbacks=[sample], progress=False)
digest = hashlib.sha256(b"".join(np.ascontiguousarray(p.asnumpy()).tobytes() for p in net.trainable_params()))
digests = mp.get_communicator().allgather_object(digest.hexdigest())
print(f"rank {rank}: threads {sample.threads} -> {threading.active_count()}, "
      f"rss_growth_mb {rss_mb() - sample.rss:.1f}, identical {all(d == digests[0] for d in digests)}", flush=True)
