"""Run under mpirun -n N (N >= 2): point-to-point messages of the mpi backend; argv[1] is the case.

exchange: every pattern a pipeline uses, checked against the values each rank knows its peers
          sent; every rank prints "rank r: ok" or what was wrong.
mismatch: rank 1 receives rank 0's message into a buffer of another shape; with
          MINIDL_DIST_DEBUG=1 the fingerprint names both, without it the byte count does. Rank 1
          prints "rank 1: raised: <message>"; rank 0 prints "rank 0: sent".
silent:   rank 1 receives from rank 0, which never sends (it sleeps past the timeout): the job
          must end, naming rank 0.
"""
import sys
import time

import numpy as np

import minidl_parallel as mp
from minidl_parallel.comm.p2p import P2POp

case = sys.argv[1]
comm = mp.init("mpi")
rank, size = comm.rank, comm.size


def message(sender, receiver, k, shape=(3, 4), dtype=np.float64):
    """What ``sender`` sends ``receiver`` as its k-th message: a value each side can compute."""
    return np.asarray(np.arange(int(np.prod(shape))).reshape(shape) + 1000 * sender + 100 * receiver + k, dtype=dtype)


def check(got, want, what, problems):
    if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
        problems.append(f"{what}: got {got.ravel()[:4]} {got.dtype}, want {want.ravel()[:4]} {want.dtype}")


if case == "exchange":
    problems = []
    nxt, prev = (rank + 1) % size, (rank - 1) % size
    # 1. a ring in one batch: everyone sends forward and receives from behind at once
    buf = np.empty((3, 4))
    comm.batch_isend_irecv([P2POp("send", message(rank, nxt, 0), nxt), P2POp("recv", buf, prev)])[1].wait()
    check(buf, message(prev, rank, 0), "ring", problems)
    # 2. both directions of a pair at once, 2 MiB each (past MPI's eager limit: blocking sends
    #    first on both sides would wait for each other), with the isend / irecv spelling
    if rank < 2:
        peer = 1 - rank
        big = message(rank, peer, 1, shape=(512, 512))
        into = np.empty((512, 512))
        requests = comm.batch_isend_irecv([P2POp(comm.isend, big, peer), P2POp(comm.irecv, into, peer)])
        for r in requests:
            r.wait()
        check(into, message(peer, rank, 1, shape=(512, 512)), "pair of 2 MiB", problems)
    # 3. tags: rank 0 sends tag 5 then tag 2; rank 1 receives tag 2 first; float32, int64, 0-d
    if rank == 0:
        comm.send(message(0, 1, 2, dtype=np.float32), 1, tag=5)
        comm.send(message(0, 1, 3, shape=(), dtype=np.int64), 1, tag=2)
        comm.send(message(0, 1, 4)[:, ::2], 1)  # not contiguous: sent as its copy
    elif rank == 1:
        scalar, first = np.empty((), np.int64), np.empty((3, 4), np.float32)
        comm.recv(scalar, 0, tag=2)
        comm.recv(first, 0, tag=5)
        strided = np.zeros((3, 4))
        comm.recv(strided[:, 1::2], 0)  # received into a view: written through
        check(scalar, message(0, 1, 3, shape=(), dtype=np.int64), "tag 2", problems)
        check(first, message(0, 1, 2, dtype=np.float32), "tag 5", problems)
        check(strided[:, 1::2], message(0, 1, 4)[:, ::2], "strided", problems)
        check(strided[:, ::2], np.zeros((3, 2)), "strided, untouched columns", problems)
    counts = (comm.sent_messages, comm.received_messages)
    want = {0: (2 + 3, 2), 1: (2, 2 + 3)}.get(rank, (1, 1))
    if counts != want:
        problems.append(f"sent/received messages {counts}, want {want}")
    print(f"rank {rank}: " + ("ok" if not problems else "; ".join(problems)), flush=True)
    mp.release()
    sys.exit(0)

if case == "mismatch":
    if rank == 0:
        comm.send(np.ones((2, 3)), 1)
        print("rank 0: sent", flush=True)
    elif rank == 1:
        try:
            comm.recv(np.empty((3, 3)), 0)
            print("rank 1: no error raised", flush=True)
        except RuntimeError as exc:
            print(f"rank 1: raised: {exc}", flush=True)
    mp.release()
    sys.exit(0)

if case == "silent":
    comm.barrier()
    print(f"rank {rank}: t0={time.time():.3f}", flush=True)
    if rank == 0:
        time.sleep(60)
    elif rank == 1:
        comm.recv(np.empty(4), 0, tag=7)
    sys.exit(0)
raise SystemExit(f"unknown case {case!r}")
