"""Run under mpirun: ranks that disagree raise on every rank, naming the difference, instead of crashing or hanging.

Three phases, in one job (each ends with every rank past the same collectives):

1. rank 0 builds Dense(8, 4), the others Dense(8, 3): Model.train must raise a ValueError
   naming '0.weight' and every rank's shape (today: MPI_ERR_TRUNCATE, a crash, or a hang);
2. rank 0 has 3 batches, the others 2: Model.train must raise, naming each rank's count
   (today: rank 1 finishes and rank 0 waits forever);
3. the same uneven data with uneven_inputs=True: training ends on every rank with the same
   parameters.

Prints ``rank r: <phase>: <outcome>`` lines, then ``rank r: ok``.
"""
import sys

import numpy as np

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
import minidl_parallel as mp


def train(out, batches, uneven_inputs=False):
    minidl.set_seed(0)
    net = nn.SequentialCell(nn.Dense(8, out, dtype=minidl.float64), nn.ReLU(), nn.Dense(out, 2, dtype=minidl.float64))
    model = minidl.Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), learning_rate=0.1))
    rng = np.random.default_rng(mp.get_rank())
    ds = NumpySlicesDataset({"x": rng.standard_normal((2 * batches, 8)), "y": rng.standard_normal((2 * batches, 2))},
                            shuffle=False).batch(2)
    # The keyword only when set: phases 1 and 2 run unchanged on code without it (to see them fail there).
    model.train(1, ds, progress=False, **({"uneven_inputs": True} if uneven_inputs else {}))
    return np.concatenate([p.data.ravel() for _, p in net.parameters_and_names()])


def expect_error(phase, fn, *parts):
    rank = mp.get_rank()
    try:
        fn()
    except ValueError as e:
        missing = [p for p in parts if p not in str(e)]
        print(f"rank {rank}: {phase}: {'raised' if not missing else 'wrong message'}: {e}", flush=True)
        return not missing
    print(f"rank {rank}: {phase}: did not raise", flush=True)
    return False


def main():
    comm = mp.init("mpi")
    rank, n = comm.rank, comm.size
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    ok = expect_error("models", lambda: train(4 if rank == 0 else 3, 2), "'0.weight'",
                      "rank 0: '0.weight' of shape (4, 8) float64", "rank 1: '0.weight' of shape (3, 8) float64")
    counts = ", ".join(f"rank {r}: {3 if r == 0 else 2}" for r in range(n))
    ok &= expect_error("uneven", lambda: train(4, 3 if rank == 0 else 2), counts)
    params = train(4, 3 if rank == 0 else 2, uneven_inputs=True)
    every = comm.allgather(params[None])
    same = all(np.array_equal(every[r], every[0]) for r in range(n))
    print(f"rank {rank}: join: {'same parameters' if same else 'parameters differ'}", flush=True)
    ok &= same
    if not ok:
        sys.exit(1)
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()
