"""Run under mpirun with MINIDL_DIST_DEBUG=1: ranks pass different shapes; all must raise, not hang."""
import sys

import numpy as np

import minidl_parallel as mp

comm = mp.init("mpi")
try:
    comm.allreduce(np.ones(comm.rank + 1))
except RuntimeError as exc:
    msg = str(exc)
    ok = "collective #0" in msg and "allreduce" in msg and all(f"shape=({r + 1},)" in msg for r in range(comm.size))
    print(f"rank {comm.rank}: {'ok' if ok else 'bad message: ' + msg}", flush=True)
    sys.exit(0 if ok else 1)
print(f"rank {comm.rank}: no error raised", flush=True)
sys.exit(1)
