"""Tensor parallelism: communication per step vs the analytical minimum, and step time vs data parallel.

    python benchmarks/bench_tensor_parallel.py                     # counts (8 thread-ranks) + timing (mpirun -n 4)
    python benchmarks/bench_tensor_parallel.py --ranks 8 --steps 20

Part 1 (no timing, exact): one training step (forward + backward) of MindSpore's quickstart
network (dense1.matmul.shard(((dp, mp), (mp, 1))), AUTO_PARALLEL propagation, 8 ranks as
2 x 4) and of a Megatron MLP block (column- then row-parallel MatMul) runs on the threads
backend under a CommCounter. Every collective and the bytes each rank sends are compared
with the analytical minimum derived below from the layouts alone; the script exits 1 if they
differ.

Part 0 (in this process): the dispatcher's overhead per operator call, a ReLU on an 8x8
tensor inside a Cell: plain (the local runtime), dispatched in a world of one (SEMI_AUTO),
and with the parallel runtime still installed but the mode back to STAND_ALONE (what every
op pays while a world is initialised and tensor parallelism is off).

Part 2 (timing): the same two networks trained for --steps steps under
``mpirun --oversubscribe -n N`` (mpi backend), tensor parallel against pure data parallel
(ParallelMode.DATA_PARALLEL + DistributedGradReducer) on the same N ranks and the same
global batch. It prints ms per step (the slowest rank's, best of --repeats rounds) and the
ratio. On a machine with fewer cores than ranks the ratio says more than the absolute times.
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import minidl  # noqa: E402
from minidl import nn, ops, Parameter, Tensor  # noqa: E402

F32 = 4  # bytes per float32 element


def ring_allreduce(nbytes, g):
    return int(2 * (g - 1) / g * nbytes)


def ring_reduce_scatter(nbytes, g):
    return int((g - 1) / g * nbytes)


def ring_allgather(nbytes_in, g):
    return (g - 1) * nbytes_in


# ---- the analytical minima --------------------------------------------------------------------

def quickstart_minimum(batch, dp, mp, d_in=32, hidden=16, out=16):
    """(phase, kind, bytes/rank) of one step of the quickstart, from its layouts.

    Forward: x arrives cut over all dp*mp ranks by rows and must be (rows / dp, K / mp): one
    all-to-all in groups of mp. Each MatMul's K cut leaves partial sums that the following
    Add (propagated to (dp, mp)) takes as blocks: one reduce-scatter each. The labels move
    like x; the mean loss is a partial scalar: one all-reduce over all ranks. Backward: each
    reduce-scatter's adjoint is an all-gather; each weight and bias is whole along dp, so its
    gradient is a partial sum over the dp ranks: one all-reduce each; x needs no gradient.
    """
    n = dp * mp
    rows, rows_dp = batch // n, batch // dp
    a2a = lambda nbytes: ring_reduce_scatter(nbytes, mp)  # noqa: E731  ((g-1)/g of the block, like reduce-scatter)
    return [
        ("forward", "alltoall", a2a(rows * d_in * F32)),
        ("forward", "reduce_scatter", ring_reduce_scatter(rows_dp * hidden * F32, mp)),
        ("forward", "reduce_scatter", ring_reduce_scatter(rows_dp * out * F32, mp)),
        ("forward", "alltoall", a2a(rows * out * F32)),
        ("forward", "allreduce", ring_allreduce(F32, n)),
        ("backward", "allreduce", ring_allreduce(out // mp * F32, dp)),
        ("backward", "allgather", ring_allgather(rows_dp * out // mp * F32, mp)),
        ("backward", "allreduce", ring_allreduce(hidden // mp * out * F32, dp)),
        ("backward", "allreduce", ring_allreduce(hidden // mp * F32, dp)),
        ("backward", "allgather", ring_allgather(rows_dp * hidden // mp * F32, mp)),
        ("backward", "allreduce", ring_allreduce(d_in // mp * hidden * F32, dp)),
    ]


def megatron_minimum(batch, d, n):
    """One all-reduce of the block's (batch, d) output in forward, one of the input gradient in backward."""
    return [("forward", "allreduce", ring_allreduce(batch * d * F32, n)),
            ("backward", "allreduce", ring_allreduce(batch * d * F32, n))]


# ---- the networks -------------------------------------------------------------------------------

class Megatron(nn.Cell):
    """x -> ReLU(x @ w1) @ w2, w1 cut by columns and w2 by rows over t ranks (t = 1: not sharded)."""

    def __init__(self, d, h, t, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.w1 = Parameter((rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32), name="w1")
        self.w2 = Parameter((rng.standard_normal((h, d)) / np.sqrt(h)).astype(np.float32), name="w2")
        self.column = ops.MatMul().shard(((1, 1), (1, t)))
        self.relu = ops.ReLU().shard(((1, t),))
        self.row = ops.MatMul().shard(((1, t), (t, 1)))

    def construct(self, x):
        return self.row(self.relu(self.column(x, self.w1)), self.w2)


def _quickstart(dp, mp):
    from parallel_quickstart import FFN
    net = FFN()
    net.dense1.matmul.shard(((dp, mp), (mp, 1)))
    return net


def _step_fn(net, loss_fn, reducer=None, opt=None):
    params = net.trainable_params()
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, params)

    def step(x, y):
        loss, grads = grad_fn(x, y)
        if reducer is not None:
            grads = reducer(grads)
        if opt is not None:
            opt(grads)
        return loss
    return step


# ---- part 0: dispatch overhead -------------------------------------------------------------------

def part0():
    import minidl_parallel as mp

    class OneOp(nn.Cell):
        def __init__(self):
            super().__init__()
            self.relu = ops.ReLU()

        def construct(self, x):
            return self.relu(x)
    cell, x = OneOp(), Tensor(np.ones((8, 8), np.float32))

    def us_per_call(reps=5000):
        for _ in range(200):
            cell(x)
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps):
                cell(x)
            best = min(best, (time.perf_counter() - t) / reps * 1e6)
        return best
    plain = us_per_call()
    mp.init("local")
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.SEMI_AUTO_PARALLEL)
    dispatched = us_per_call()
    mp.reset_auto_parallel_context()
    inactive = us_per_call()
    mp.release()
    print("part 0: one ReLU (8x8) in a Cell, us per call")
    print(f"  plain {plain:.1f}   dispatched (SEMI_AUTO, world of one) {dispatched:.1f}   "
          f"parallel runtime, STAND_ALONE {inactive:.1f}\n")


# ---- part 1: counts -----------------------------------------------------------------------------

def count_rank(model, n, batch, d, h):
    import minidl_parallel as mp
    from minidl_parallel.tensor_parallel import CommCounter
    minidl.set_seed(0)
    if model == "quickstart":
        mp.set_auto_parallel_context(parallel_mode="auto_parallel")
        dp_, mp_ = n // min(4, n), min(4, n)
        net = _quickstart(dp_, mp_)
        rows = batch // n
        x, y = np.ones((rows, 32), np.float32), np.ones((rows, 16), np.float32)
        step = _step_fn(net, nn.MSELoss())
        xt = Tensor(x)
    else:
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
        net = Megatron(d, h, n)
        x, y = np.ones((batch, d), np.float32), np.ones((batch, d), np.float32)
        step = _step_fn(net, lambda out, target: out)  # the block alone: its output is the "loss"
        xt = Tensor(x, requires_grad=True)
    if model == "quickstart":
        step(xt, Tensor(y))  # places the parameters; the counted step is a steady one
        with CommCounter() as c:
            step(Tensor(x), Tensor(y))
    else:
        with CommCounter() as c:
            out = net(xt)
            out.backward(Tensor(np.ones(out.shape, np.float32)))
    mp.reset_auto_parallel_context()
    return [(e.phase, e.kind, e.bytes_per_rank) for e in c.events]


def part1(args):
    from minidl_parallel import run_threads
    ok = True
    n = 8
    cases = [("quickstart", n, 16, 0, 0, quickstart_minimum(16, n // 4, 4)),
             ("megatron", 4, args.mlp_batch, args.mlp_d, args.mlp_h,
              megatron_minimum(args.mlp_batch, args.mlp_d, 4))]
    print("part 1: collectives per training step vs the analytical minimum (threads backend)")
    print(f"{'network':12s} {'ranks':>5s} {'collectives':>11s} {'minimum':>7s} {'B/rank':>9s} {'minimum':>9s}  equal")
    for model, ranks, batch, d, h, minimum in cases:
        events = run_threads(ranks, count_rank, model, ranks, batch, d, h)
        same = all(sorted(e) == sorted(events[0]) for e in events)
        got = events[0]
        equal = same and sorted(got) == sorted(minimum)
        ok &= equal
        print(f"{model:12s} {ranks:5d} {len(got):11d} {len(minimum):7d} {sum(e[2] for e in got):9d} "
              f"{sum(e[2] for e in minimum):9d}  {'yes' if equal else 'NO'}")
        if not equal:
            print("  measured:", got)
            print("  minimum: ", minimum)
    return ok


# ---- part 2: timing -----------------------------------------------------------------------------

def worker(args):
    import minidl_parallel as mp
    mp.init("mpi")
    n, rank = mp.get_group_size(), mp.get_rank()
    minidl.set_seed(0)
    rng = np.random.default_rng(0)
    if args.model == "quickstart":
        batch_global, d_in, d_out = 16 * n, 32, 16
    else:
        batch_global, d_in, d_out = args.mlp_batch, args.mlp_d, args.mlp_d
    x_all = rng.standard_normal((batch_global, d_in)).astype(np.float32)
    y_all = rng.standard_normal((batch_global, d_out)).astype(np.float32)
    rows = batch_global // n
    if args.worker == "dp":
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        net = _quickstart(1, 1) if args.model == "quickstart" else Megatron(args.mlp_d, args.mlp_h, 1)
        reducer = mp.DistributedGradReducer(net.trainable_params(), mean=True)
        x, y = x_all[rank * rows:(rank + 1) * rows], y_all[rank * rows:(rank + 1) * rows]
    else:
        if args.model == "quickstart":
            mp.set_auto_parallel_context(parallel_mode="auto_parallel")
            net = _quickstart(n // min(4, n), min(4, n))
            x, y = x_all[rank * rows:(rank + 1) * rows], y_all[rank * rows:(rank + 1) * rows]
        else:
            mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
            net = Megatron(args.mlp_d, args.mlp_h, n)
            x, y = x_all, y_all
        reducer = None
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    step = _step_fn(net, nn.MSELoss(), reducer, opt)
    comm = mp.get_communicator()
    for _ in range(args.warmup):
        step(Tensor(x), Tensor(y))
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step(Tensor(x), Tensor(y))
    comm.barrier()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    slowest = max(comm._allgather_object(ms))
    if rank == 0:
        print("RESULT " + json.dumps({"ms": slowest}), flush=True)
    mp.release()


def launch(args, mode, model):
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    mpirun = Path(sys.executable).parent / "mpirun"
    cmd = [str(mpirun) if mpirun.exists() else "mpirun", "--oversubscribe", "-n", str(args.ranks), sys.executable,
           __file__, "--worker", mode, "--model", model, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--mlp-batch", str(args.mlp_batch), "--mlp-d", str(args.mlp_d), "--mlp-h", str(args.mlp_h)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])["ms"]
    raise RuntimeError(f"worker failed:\n{proc.stdout}\n{proc.stderr}")


def part2(args):
    print(f"\npart 2: ms per step under mpirun -n {args.ranks} (mpi backend, 1 BLAS thread per rank), "
          f"best of {args.repeats}")
    print(f"{'network':12s} {'tensor parallel':>15s} {'data parallel':>13s} {'TP / DP':>8s}")
    for model in ("quickstart", "megatron"):
        best = {"tp": float("inf"), "dp": float("inf")}
        for _ in range(args.repeats):
            for mode in ("tp", "dp"):
                best[mode] = min(best[mode], launch(args, mode, model))
        print(f"{model:12s} {best['tp']:15.2f} {best['dp']:13.2f} {best['tp'] / best['dp']:8.2f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="ranks for the timing runs")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--mlp-batch", type=int, default=32)
    p.add_argument("--mlp-d", type=int, default=256)
    p.add_argument("--mlp-h", type=int, default=1024)
    p.add_argument("--no-timing", dest="timing", action="store_false")
    p.add_argument("--worker", choices=["tp", "dp"], help=argparse.SUPPRESS)
    p.add_argument("--model", choices=["quickstart", "megatron"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    part0()
    ok = part1(args)
    if args.timing:
        part2(args)
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
