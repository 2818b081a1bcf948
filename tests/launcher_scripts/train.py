"""A worker script that runs unchanged under `mpirun -n N python train.py` and
`python -m minidl_parallel.run -n N train.py`: every rank all-reduces its rank + 1 and prints
what it sees (rank, size, backend, the sum, its arguments); rank 0 also writes to stderr."""
import sys

import numpy as np

import minidl_parallel as mp

under_mpi = mp.launched_under_mpi()
comm = mp.init()
total = comm.allreduce(np.array([comm.rank + 1.0]))
print(f"rank {mp.get_rank()} of {mp.get_group_size()}: backend {comm.backend}, launched_under_mpi {under_mpi}, "
      f"local {mp.get_local_rank()}/{mp.get_local_rank_size()}, sum {total[0]:g}, argv {sys.argv[1:]}", flush=True)
if comm.rank == 0:
    print("rank 0 writes to stderr too", file=sys.stderr, flush=True)
