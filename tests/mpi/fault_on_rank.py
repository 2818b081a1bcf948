"""Run under mpirun -n 2: rank 1 misbehaves in the way argv[1] names; the job must end, not hang.

exit3:   rank 1 calls sys.exit(3) while rank 0 waits in an all-reduce.
exit0:   rank 1 calls sys.exit(0) while rank 0 waits in an all-reduce.
stall:   rank 1 sleeps (far past the timeout) before its all-reduce.
extra:   rank 0 calls one all-reduce more than rank 1, which then finishes normally.
reorder: both ranks all-reduce two same-shape arrays, in a different order (run with
         MINIDL_DIST_DEBUG=2: both ranks must raise, naming both calls).
Each rank prints "rank r: t0=<time.time()>" just before the fault, for the time-to-end figure.
"""
import sys
import time

import numpy as np

import minidl_parallel as mp

mode = sys.argv[1]
comm = mp.init("mpi")
comm.allreduce(np.ones(2))  # both ranks are up before the clock starts
print(f"rank {comm.rank}: t0={time.time():.3f}", flush=True)
if mode == "exit3" and comm.rank == 1:
    sys.exit(3)
if mode == "exit0" and comm.rank == 1:
    sys.exit(0)
if mode == "stall" and comm.rank == 1:
    time.sleep(60)
if mode == "reorder":
    weights, biases = np.full((4, 3), comm.rank + 1.0), np.full((4, 3), 10.0 * (comm.rank + 1))
    try:
        if comm.rank == 0:
            comm.allreduce(weights)
            comm.allreduce(biases)
        else:
            comm.allreduce(biases)
            comm.allreduce(weights)
    except RuntimeError as exc:
        print(f"rank {comm.rank}: raised: {exc}", flush=True)
        sys.exit(0)
    print(f"rank {comm.rank}: no error raised", flush=True)
    sys.exit(1)
comm.allreduce(np.ones((3, 5), dtype=np.float32))
if mode == "extra" and comm.rank == 0:
    comm.allreduce(np.ones((7,), dtype=np.int64))
print(f"rank {comm.rank}: returned", flush=True)
