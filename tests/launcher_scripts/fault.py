"""A worker script that fails on purpose, the way argv[1] names, while the other ranks wait in
an all-reduce for it (so only the launcher or the MPI runtime can end them):

raise: rank 1 raises ValueError.   exit3: rank 2 calls sys.exit(3).
kill9: rank 1 kills itself with SIGKILL.   stall: rank 1 sleeps for 600 s (for --timeout).
Each rank prints "rank r: ready" first.
"""
import os
import signal
import sys
import time

import numpy as np

import minidl_parallel as mp

mode = sys.argv[1]
comm = mp.init()
comm.allreduce(np.ones(1))  # every rank is up
print(f"rank {comm.rank}: ready", flush=True)
if mode == "raise" and comm.rank == 1:
    raise ValueError("rank 1 fails on purpose")
if mode == "exit3" and comm.rank == 2:
    sys.exit(3)
if mode == "kill9" and comm.rank == 1:
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "stall" and comm.rank == 1:
    time.sleep(600)
comm.allreduce(np.ones(1))
print(f"rank {comm.rank}: the all-reduce returned, which it must not", flush=True)
