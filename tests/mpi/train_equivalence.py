"""Run under mpirun: k data-parallel Model.train steps equal one process on the global batch.

Each rank first trains, alone, rank 0's initial MLP on the whole global batches (the
reference, no collectives), then turns on DATA_PARALLEL (gradients_mean, parameter_broadcast)
and trains a net initialised from ITS OWN seed: the parameter broadcast must replace it
with rank 0's, each rank reads the shard it asks for (num_shards, shard_id), the reducer
averages the gradients. Losses
(averaged over ranks) and parameters must match the reference in float64 to 1e-10
relative; prints ``rank r: ok`` or exits 1.
"""
import sys

import numpy as np

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback, Model
import minidl_parallel as mp

F64 = minidl.float64
PER_RANK, STEPS = 3, 3


class Losses(Callback):
    def __init__(self):
        self.values = []

    def on_train_step_end(self, run_context):
        self.values.append(float(run_context.original_args().net_outputs.asnumpy()))


def net_seeded(seed):
    minidl.set_seed(seed)
    return nn.SequentialCell(nn.Dense(4, 6, dtype=F64), nn.Tanh(), nn.Dense(6, 5, dtype=F64), nn.ReLU(),
                             nn.Dense(5, 2, dtype=F64))


def train(net, data, label, batch, **shards):
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    model = Model(net, nn.MSELoss(reduction="mean"), opt)
    ds = NumpySlicesDataset({"data": data, "label": label}, shuffle=False, **shards).batch(batch)
    losses = Losses()
    model.train(1, ds, callbacks=[losses], progress=False)
    return losses.values, {name: p.data.copy() for name, p in net.parameters_and_names()}


def main():
    comm = mp.init("mpi")
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(11)
    data = rng.standard_normal((n * PER_RANK * STEPS, 4))
    label = rng.standard_normal((n * PER_RANK * STEPS, 2))

    want_losses, want = train(net_seeded(0), data, label, n * PER_RANK)

    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 parameter_broadcast=True)
    # Sharding interleaves rows (rank r reads r, r + n, ...), so rank r's batch i is its share
    # of rows [i * n * PER_RANK, (i + 1) * n * PER_RANK): exactly the reference's batch i.
    local_losses, got = train(net_seeded(0 if r == 0 else 100 + r), data, label, PER_RANK,
                              num_shards=mp.get_group_size(), shard_id=mp.get_rank())
    got_losses = [float(comm.allreduce(np.asarray(v), "mean")) for v in local_losses]

    failures = []
    if len(got_losses) != STEPS or not np.allclose(got_losses, want_losses, rtol=1e-10, atol=1e-12):
        failures.append(f"losses {got_losses} != {want_losses}")
    for name, value in want.items():
        if not np.allclose(got[name], value, rtol=1e-10, atol=1e-12):
            failures.append(f"parameter {name}")
    if failures:
        print(f"rank {r}: mismatches: {failures}", flush=True)
        sys.exit(1)
    print(f"rank {r}: ok", flush=True)
    mp.release()


if __name__ == "__main__":
    main()
