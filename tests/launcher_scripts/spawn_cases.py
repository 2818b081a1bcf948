"""Calls minidl_parallel.spawn the ways tests/minidl_parallel/test_launcher.py checks, all in this
one process (one MPI singleton), in the order argv names them; each case prints one line,
``<case>: ok <json>`` or ``<case>: SpawnError <json>``:

values: 2 workers run allreduce_rank, defined in this script (so in the workers' __mp_main__),
        with nprocs given as a keyword; the values come back in rank order.
raise, exit3, kill9: rank 1 of 2 raises ValueError, calls sys.exit(3) or kills itself with
        SIGKILL while rank 0 waits for it in an all-reduce.
startfail: values with start_timeout=3, for a test whose workers end before MPI_Init.
path: 2 workers return their PATH; the value is {"workers": [their PATHs], "before": this
        process's PATH before the spawn, "after": after it}.
restarts: spawn(max_restarts=2): rank 1 calls sys.exit(3) on the first two attempts; the third
        returns each rank's MINIDL_RESTART_COUNT.
exhausted: spawn(max_restarts=1): rank 1 calls sys.exit(3) on every attempt.
"""
import json
import os
import signal
import sys
import time

from minidl_parallel.spawning import SpawnError, spawn


def allreduce_rank(rank, offset):
    import numpy as np

    import minidl_parallel as mp
    comm = mp.init()
    total = comm.allreduce(np.array([rank + 1.0]))
    return {"rank": rank, "get_rank": mp.get_rank(), "size": mp.get_group_size(), "backend": comm.backend,
            "sum": float(total[0]) + offset, "module": __name__}


def fail_on_rank_1(rank, how):
    import numpy as np

    import minidl_parallel as mp
    comm = mp.init()
    if rank == 1:
        if how == "raise":
            raise ValueError("rank 1 fails on purpose")
        if how == "exit3":
            sys.exit(3)
        if how == "kill9":
            os.kill(os.getpid(), signal.SIGKILL)
    comm.allreduce(np.ones(1))  # rank 0 waits here for rank 1
    return "the all-reduce returned, which it must not"


def fail_until(rank, attempts):
    """Rank 1 exits with status 3 while MINIDL_RESTART_COUNT < attempts; returns the count."""
    import numpy as np

    import minidl_parallel as mp
    comm = mp.init()
    count = int(os.environ["MINIDL_RESTART_COUNT"])
    if rank == 1 and count < attempts:
        sys.exit(3)
    comm.allreduce(np.ones(1))
    return {"restart": count, "run_id": os.environ["MINIDL_RUN_ID"]}


def worker_path(rank):
    return os.environ.get("PATH")


def run_case(name):
    start = time.monotonic()
    try:
        if name == "values":
            value = spawn(allreduce_rank, nprocs=2, args=(100,))
        elif name == "path":
            before = os.environ.get("PATH")
            value = {"workers": spawn(worker_path, 2), "before": before, "after": os.environ.get("PATH")}
        elif name == "restarts":
            value = spawn(fail_until, 2, args=(2,), max_restarts=2, restart_delay=0)
        elif name == "exhausted":
            value = spawn(fail_until, 2, args=(99,), max_restarts=1, restart_delay=0)
        elif name == "startfail":
            value = spawn(allreduce_rank, 2, args=(0,), start_timeout=3)
        else:
            value = spawn(fail_on_rank_1, 2, args=(name,))
    except SpawnError as exc:
        print(f"{name}: SpawnError " + json.dumps({"rank": exc.rank, "status": exc.status, "message": str(exc),
                                                   "traceback": exc.traceback,
                                                   "seconds": time.monotonic() - start}), flush=True)
    else:
        print(f"{name}: ok " + json.dumps({"value": value, "seconds": time.monotonic() - start}), flush=True)


if __name__ == "__main__":
    for case in sys.argv[1:]:
        run_case(case)
