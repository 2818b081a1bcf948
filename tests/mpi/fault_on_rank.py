"""Run under mpirun -n 2: rank 1 misbehaves in the way argv[1] names; the job must end, not hang.

exit3:   rank 1 calls sys.exit(3) while rank 0 waits in an all-reduce.
exit0:   rank 1 calls sys.exit(0) while rank 0 waits in an all-reduce.
stall:   rank 1 sleeps (far past the timeout) before its all-reduce.
extra:   rank 0 calls one all-reduce more than rank 1, which then finishes normally.
raise:   rank 1 raises ValueError while rank 0 waits in an all-reduce.
kill9:   rank 1 kills itself with SIGKILL while rank 0 waits in an all-reduce.
normal:  no fault: both ranks finish (after release()) and the job must end at once.
slow_finish: no fault: rank 1 ends at once, rank 0 works on alone (SLOW_FINISH_S, default
         10 s, past the timeout) outside any collective; the job must end normally.
reorder: both ranks all-reduce two same-shape arrays, in a different order. Each rank prints
         "raised: <message>" (MINIDL_DIST_DEBUG=2 must make both raise, naming both call
         sites) or "no error raised" with the sums it got (what happens below level 2).
Each rank prints "rank r: t0=<time.time()>" just before the fault, for the time-to-end figure.
"""
import os
import signal
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
if mode == "raise" and comm.rank == 1:
    raise ValueError("rank 1 fails on purpose")
if mode == "kill9" and comm.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "slow_finish":  # rank 1 ends normally; rank 0 works on, alone, far past the timeout
    if comm.rank == 0:
        time.sleep(float(os.environ.get("SLOW_FINISH_S", "10")))
        print("rank 0: finished its work", flush=True)
    sys.exit(0)
if mode == "normal":
    mp.release()
    print(f"rank {comm.rank}: released", flush=True)
    sys.exit(0)
if mode == "reorder":
    weights, biases = np.full((4, 3), comm.rank + 1.0), np.full((4, 3), 10.0 * (comm.rank + 1))
    try:
        if comm.rank == 0:
            first = comm.allreduce(weights)  # rank 0's first call
            comm.allreduce(biases)
        else:
            first = comm.allreduce(biases)  # rank 1's first call
            comm.allreduce(weights)
    except RuntimeError as exc:
        print(f"rank {comm.rank}: raised: {exc}", flush=True)
        sys.exit(0)
    # Without the check the two calls match each other: rank 0's weights are summed with
    # rank 1's biases (1 + 20 = 21 where the weights' sum is 3).
    print(f"rank {comm.rank}: no error raised; the first all-reduce returned {first[0, 0]:g}", flush=True)
    sys.exit(0)
comm.allreduce(np.ones((3, 5), dtype=np.float32))
if mode == "extra" and comm.rank == 0:
    comm.allreduce(np.ones((7,), dtype=np.int64))
print(f"rank {comm.rank}: returned", flush=True)
