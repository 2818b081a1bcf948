"""Run under mpirun: rank 1 raises while the others wait in a collective; the job must abort."""
import numpy as np

import minidl_parallel as mp

comm = mp.init("mpi")
if comm.rank == 1:
    raise ValueError("rank 1 fails on purpose")
comm.allreduce(np.ones(3))
print(f"rank {comm.rank}: the collective returned, which it must not", flush=True)
