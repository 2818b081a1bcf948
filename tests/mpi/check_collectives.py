"""Run under mpirun: every collective of the mpi backend against NumPy; exits 1 on a mismatch.

Every rank can build every rank's input (seeded by rank), so each computes the expected
result of each collective itself.
"""
import sys

import numpy as np

import minidl_parallel as mp

OPS = {"sum": lambda xs: np.sum(xs, axis=0), "mean": lambda xs: np.mean(xs, axis=0),
       "max": lambda xs: np.max(xs, axis=0), "min": lambda xs: np.min(xs, axis=0),
       "prod": lambda xs: np.prod(xs, axis=0)}


def inputs(n, shape, seed):
    return [np.random.default_rng([seed, r]).standard_normal(shape) for r in range(n)]


def main():
    comm = mp.init("mpi")
    r, n = comm.rank, comm.size
    failures = []

    def check(name, got, want):
        if got.shape != want.shape or not np.allclose(got, want, rtol=1e-12, atol=1e-12):
            failures.append(name)

    xs = inputs(n, (2 * n, 3), 0)
    for op, ref in OPS.items():
        check(f"allreduce {op}", comm.allreduce(xs[r], op), ref(xs))
        y = xs[r].copy()
        check(f"allreduce_ {op}", comm.allreduce_(y, op), ref(xs))
        y = xs[r].copy()
        comm.iallreduce_(y, op).wait()
        check(f"iallreduce_ {op}", y, ref(xs))
        check(f"reduce_scatter {op}", comm.reduce_scatter(xs[r], op), np.split(ref(xs), n)[r])
    check("allreduce_ strided", comm.allreduce_(xs[r].T.copy().T, "sum"), OPS["sum"](xs))
    check("allgather axis 0", comm.allgather(xs[r]), np.concatenate(xs, 0))
    check("allgather axis 1", comm.allgather(xs[r], axis=1), np.concatenate(xs, 1))
    check("reduce_scatter axis 1", comm.reduce_scatter(xs[r].T.copy(), "sum", axis=1),
          np.split(np.sum(xs, 0).T, n, axis=1)[r])
    check("broadcast", comm.broadcast(xs[r], root=n - 1), xs[n - 1])
    check("alltoall", comm.alltoall(xs[r], 0, 1),
          np.concatenate([np.split(xs[q], n, 0)[r] for q in range(n)], 1))
    ints = [np.arange(6, dtype=np.int64) * (q + 1) for q in range(n)]
    check("allreduce int64", comm.allreduce(ints[r]), np.sum(ints, 0))
    comm.barrier()
    half = list(range(0, n, 2)) if r % 2 == 0 else list(range(1, n, 2))
    sub = comm.new_group(half)
    check("sub-group allreduce", sub.allreduce(xs[r]), np.sum([xs[q] for q in half], 0))
    check("sub-group allgather", sub.allgather(xs[r]), np.concatenate([xs[q] for q in half], 0))
    if sub.rank != half.index(r) or sub.size != len(half):
        failures.append("sub-group rank/size")
    if comm.collective_count != 4 * len(OPS) + 8:
        failures.append(f"collective_count {comm.collective_count}")
    if failures:
        print(f"rank {r}: mismatches: {failures}", flush=True)
        sys.exit(1)
    print(f"rank {r}: ok", flush=True)
    mp.release()


if __name__ == "__main__":
    main()
