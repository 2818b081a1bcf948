"""A data-parallel run with BatchNorm, checkpointed into ONE shared directory and resumed.

The scenario is shared by tests/minidl_parallel/test_dp_checkpoint_resume.py (threads world)
and by mpirun (this file run as a script, one process per rank):

    python dp_resume.py first  DIR OUT    # the uninterrupted run, then STOP steps with ModelCheckpoint in DIR
    python dp_resume.py resume DIR OUT HOW  # fresh processes resume from DIR (HOW: "rank0" passes rank 0's
                                            # file name to every rank, "latest" asks latest_checkpoint)

Each rank writes its results to OUT: ``reference_rank{r}.npz`` (the uninterrupted run),
``writes_rank{r}.json`` (every path its ModelCheckpoint wrote), ``resumed_rank{r}.npz``.
Under data parallelism without SyncBatchNorm every rank's BatchNorm moving statistics are its
own (computed on its shard), so a resume is exact only if each rank gets its own state back.
"""
import json
import os
import sys

import numpy as np

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback, CheckpointConfig, Model, ModelCheckpoint, latest_checkpoint
from minidl.train import checkpoint as train_checkpoint
import minidl_parallel as mp

F64 = minidl.float64
EPOCHS, BATCH, ROWS_PER_RANK = 2, 4, 12  # 3 steps per epoch, 6 in all
STOP = 4  # the interrupted run stops after epoch 2 step 1
PREFIX = "net"


def data(size):
    rng = np.random.default_rng(0)
    rows = size * ROWS_PER_RANK
    return rng.standard_normal((rows, 5)) * 2 + 1, rng.standard_normal((rows, 2))


def data_parallel(**context):
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True, **context)


def build():
    """What a training script makes, from the seed: its Model, net, optimizer and shard of the data."""
    rank, size = mp.get_rank(), mp.get_group_size()
    minidl.set_seed(7)
    net = nn.SequentialCell(nn.Dense(5, 6, dtype=F64), nn.BatchNorm1d(6, momentum=0.8, dtype=F64), nn.ReLU(),
                            nn.Dense(6, 2, dtype=F64))  # a plain BatchNorm: each rank's statistics are its own
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    x, y = data(size)
    ds = NumpySlicesDataset({"x": x, "y": y}, shuffle=True, num_shards=size, shard_id=rank).batch(BATCH)
    return Model(net, nn.MSELoss(), opt), net, opt, ds


def state(net, opt):
    """Every parameter (moving statistics included) and optimizer state, by name."""
    out = {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}
    out.update({f"optimizer.{name}": np.array(v.asnumpy()) for name, v in opt.state_dict().items()})
    return out


class StopAt(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num >= self.step:
            run_context.request_stop()


def uninterrupted(**context):
    data_parallel(**context)
    model, net, opt, ds = build()
    model.train(EPOCHS, ds, progress=False)
    return state(net, opt)


def interrupted(directory, stop=STOP, **context):
    data_parallel(**context)
    model, net, opt, ds = build()
    ckpt = ModelCheckpoint(PREFIX, str(directory), CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=2))
    model.train(EPOCHS, ds, callbacks=[ckpt, StopAt(stop)], progress=False)
    return ckpt.latest_ckpt_file_name


def resumed(path, **context):
    data_parallel(**context)
    model, net, opt, ds = build()
    minidl.backend.rng().random(5)  # a new process: the random stream is elsewhere
    model.train(EPOCHS, ds, resume_from=path, progress=False)
    return state(net, opt)


def resume_path(directory, how):
    """rank0: the file name rank 0 wrote (what a user copies from a log), on every rank; latest: latest_checkpoint."""
    if how == "rank0":
        return os.path.join(str(directory), f"{PREFIX}-{(STOP - 1) // 3 + 1}_{(STOP - 1) % 3 + 1}.ckpt")
    return latest_checkpoint(str(directory), PREFIX)


def record_writes(log):
    """Wraps the save that ModelCheckpoint calls so that every (rank, path) written is appended to log."""
    save = train_checkpoint.save_checkpoint

    def recording(save_obj, path, *args, **kwargs):
        log.append((mp.get_rank(), os.path.abspath(os.fspath(path))))
        return save(save_obj, path, *args, **kwargs)
    train_checkpoint.save_checkpoint = recording
    return save


def main():
    phase, directory, out = sys.argv[1], sys.argv[2], sys.argv[3]
    mp.init("mpi")
    rank = mp.get_rank()
    if phase == "first":
        np.savez(os.path.join(out, f"reference_rank{rank}.npz"), **uninterrupted())
        writes = []
        record_writes(writes)
        interrupted(directory)
        with open(os.path.join(out, f"writes_rank{rank}.json"), "w") as f:
            json.dump(writes, f)
    else:
        np.savez(os.path.join(out, f"resumed_rank{rank}.npz"), **resumed(resume_path(directory, sys.argv[4])))
    print(f"rank {rank}: ok", flush=True)
    mp.release()


if __name__ == "__main__":
    main()
