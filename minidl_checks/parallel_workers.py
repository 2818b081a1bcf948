"""The GPU check's stages that need minidl_parallel: NCCL on one rank, thread-ranks sharing a
GPU, and the mpirun stages. ``python -m minidl.gpu_check`` (gpu.py) runs each as
``python -m minidl_checks.parallel_workers --worker NAME ...`` in its own process, so that the
report's own process never imports minidl_parallel; each prints one result line (stages.py).
"""
import sys

import numpy

import minidl_parallel as mp

from .gpu import parse_args
from .stages import emit_result
from .training import float64_mlp, train_mlp


def dp_equivalence(comm, per_rank=3, steps=3):
    """Data-parallel Model.train on GPU (parameter broadcast, averaged gradients) vs one process.

    As tests/mpi/train_equivalence.py, on the device and through ``comm`` (nccl or threads):
    each rank first trains rank 0's initial float64 MLP alone on the whole global batches, then
    trains data parallel from its own seed (the broadcast must replace it with rank 0's) on its
    shard. Losses (averaged over ranks) and parameters must equal the reference to 1e-10
    relative (float64; only the summation order of the gradient average differs). Returns a
    list of mismatches (empty when it holds).
    """
    import cupy
    n, r = comm.size, comm.rank
    rng = numpy.random.default_rng(11)
    data = rng.standard_normal((n * per_rank * steps, 4))
    label = rng.standard_normal((n * per_rank * steps, 2))
    want_losses, want = train_mlp(float64_mlp(0), data, label, n * per_rank)
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 parameter_broadcast=True)
    try:
        local, got = train_mlp(float64_mlp(0 if r == 0 else 100 + r), data, label, per_rank, num_shards=n, shard_id=r)
    finally:
        mp.reset_auto_parallel_context()
    got_losses = [float(cupy.asnumpy(comm.allreduce(cupy.asarray([v]), "mean"))[0]) for v in local]
    failures = []
    if len(got_losses) != steps or not numpy.allclose(got_losses, want_losses, rtol=1e-10, atol=1e-12):
        failures.append(f"losses {got_losses} != {want_losses}")
    failures += [f"parameter {k}" for k, v in want.items() if not numpy.allclose(got[k], v, rtol=1e-10, atol=1e-12)]
    return failures


def collectives_check(comm):
    """Every collective of ``comm`` on CuPy arrays against NumPy (each rank builds every input)."""
    import cupy
    r, n = comm.rank, comm.size
    failures = []

    def check(name, got, want, rtol=1e-12):
        # float64 sums in another order (NCCL's ring) differ from NumPy's in the last bits only.
        if not isinstance(got, cupy.ndarray):
            failures.append(f"{name}: returned {type(got).__name__}, not a CuPy array")
            return
        got = cupy.asnumpy(got)
        if got.shape != want.shape or got.dtype != want.dtype or not numpy.allclose(got, want, rtol=rtol, atol=rtol):
            failures.append(f"{name}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}"
                            + ("" if got.shape != want.shape else f", max diff {numpy.max(numpy.abs(got - want)):.3g}"))

    xs = [numpy.random.default_rng([0, q]).standard_normal((2 * n, 3)) for q in range(n)]
    ops = {"sum": lambda v: numpy.sum(v, 0), "max": lambda v: numpy.max(v, 0), "min": lambda v: numpy.min(v, 0),
           "prod": lambda v: numpy.prod(v, 0)}
    mine = cupy.asarray(xs[r])
    for op, ref in ops.items():
        check(f"allreduce {op}", comm.allreduce(mine, op), ref(xs))
        y = mine.copy()
        comm.allreduce_(y, op)
        check(f"allreduce_ {op}", y, ref(xs))
        y = mine.copy()
        comm.iallreduce_(y, op).wait()
        check(f"iallreduce_ {op}", y, ref(xs))
        check(f"reduce_scatter {op}", comm.reduce_scatter(mine, op), numpy.split(ref(xs), n)[r])
    check("allreduce mean", comm.allreduce(mine, "mean"), numpy.mean(xs, 0))
    check("allgather axis 0", comm.allgather(mine), numpy.concatenate(xs, 0))
    check("allgather axis 1", comm.allgather(mine, axis=1), numpy.concatenate(xs, 1))
    check("broadcast", comm.broadcast(mine, root=n - 1), xs[n - 1])
    check("alltoall", comm.alltoall(mine, 0, 1),
          numpy.concatenate([numpy.split(xs[q], n, 0)[r] for q in range(n)], 1))
    f32 = [x.astype(numpy.float32) for x in xs]  # the dtype training sends: float32 rounding, 1e-6
    check("allreduce float32", comm.allreduce(cupy.asarray(f32[r])), numpy.sum(f32, 0, dtype=numpy.float32), 1e-5)
    ints = [numpy.arange(6, dtype=numpy.int64) * (q + 1) for q in range(n)]
    check("allreduce int64", comm.allreduce(cupy.asarray(ints[r])), numpy.sum(ints, 0))
    comm.barrier()
    if n > 1:
        half = list(range(0, n, 2)) if r % 2 == 0 else list(range(1, n, 2))
        sub = comm.new_group(half)
        check("sub-group allreduce", sub.allreduce(mine), numpy.sum([xs[q] for q in half], 0))
        check("sub-group allgather", sub.allgather(mine), numpy.concatenate([xs[q] for q in half], 0))
    return failures


def worker_nccl_one(args):
    import minidl
    minidl.set_context(device_target="GPU")
    comm = mp.init("nccl")
    try:
        assert comm.backend == "nccl" and comm.size == 1 and comm.rank == 0, \
            f"init('nccl') gave backend {comm.backend!r}, rank {comm.rank} of {comm.size}"
        failures = collectives_check(comm)
        failures += dp_equivalence(comm)
    finally:
        mp.release()
    if failures:
        emit_result("failed", f"one-rank nccl: mismatches: {failures}")
    else:
        emit_result("passed", "one-rank nccl communicator: every collective on CuPy arrays equals NumPy; "
                              "data-parallel Model.train (parameter_broadcast) equals training alone")


def worker_threads_gpu(args):
    import minidl
    minidl.set_context(device_target="GPU")

    def rank():
        comm = mp.get_communicator()
        return collectives_check(comm) + dp_equivalence(comm)
    results = mp.run_threads(2, rank)
    failures = [f"rank {i}: {f}" for i, fs in enumerate(results) for f in fs]
    if failures:
        emit_result("failed", f"2 thread-ranks on one GPU: mismatches: {failures}")
    else:
        emit_result("passed", "2 thread-ranks sharing the GPU (threads backend): collectives on CuPy arrays "
                              "equal NumPy; data-parallel Model.train equals one process on the global batch")


def worker_mpi(args):
    """Under mpirun: nccl-collectives or nccl-dp; every rank prints its own result line."""
    import minidl
    minidl.set_context(device_target="GPU")
    comm = mp.init("nccl")
    try:
        failures = collectives_check(comm) if args.worker == "nccl-collectives" else dp_equivalence(comm)
    finally:
        mp.release()
    what = "every collective equals NumPy" if args.worker == "nccl-collectives" else \
        "data-parallel Model.train equals one process on the global batch"
    if failures:
        emit_result("failed", f"rank {comm.rank} of {comm.size}: mismatches: {failures}")
    else:
        emit_result("passed", f"{comm.size} ranks over NCCL: {what}")


WORKERS = {"nccl-1": worker_nccl_one, "threads-gpu": worker_threads_gpu, "nccl-collectives": worker_mpi,
           "nccl-dp": worker_mpi}


def main(argv=None):
    args = parse_args(argv)
    if args.worker not in WORKERS:
        sys.exit(f"minidl_checks.parallel_workers: --worker must be one of {sorted(WORKERS)}, got {args.worker!r}")
    WORKERS[args.worker](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
