"""Optimizer parallelism (ZeRO): per-rank memory between steps and communication per step, against the formulas.

    python3 benchmarks/bench_optimizer_parallel.py                          # threads world, n = 2 and 4
    python3 benchmarks/bench_optimizer_parallel.py --launch mpirun          # the same under mpirun (mpi backend)
    python3 benchmarks/bench_optimizer_parallel.py --ranks 4 --levels level2 --steps 8 --threshold 0

The GPT of examples/gpt_char.py (its model, loss and AdamWeightDecay, its default sizes) trains
--steps steps with nn.TrainOneStepCell under DATA_PARALLEL with gradients_mean, at each --ranks
size, for plain data parallel ("plain": enable_parallel_optimizer=False) and each --levels
optimizer level (parallel_optimizer_config with --threshold KB, shard size -1: every rank).

Memory, per rank, between two steps (after a step returned), each next to its formula:
  weights    the bytes of p.data over the network's parameters;
  state      the bytes of the optimizer's per-parameter buffers (adam_m, adam_v); global_step and
             any beta powers are left out (a few bytes, never sliced);
  gradients  the bytes of the gradients the reducer handed the optimizer (TrainOneStepCell's
             return_grad=True).
  The formula: a parameter of >= threshold KB is sliced over the n ranks, rank r holding
  rows_r = min((r+1)c, d0) - min(rc, d0) of its d0 = shape[0] rows, c = ceil(d0 / n), that is
  rows_r * prod(shape[1:]) * itemsize bytes; any other parameter (and every one under plain)
  its whole bytes; the optimizer state is 2 such buffers per parameter. The formula is computed
  here from the config alone, not from the slices' placements, and every rank's figures must
  equal it.

Communication, per rank and step, from the CommCounter (minidl_parallel.tensor_parallel.counter)
over steps 2..--steps (step 1 starts from whole weights: no all-gather), next to the analytical
ring volumes (plan.comm_bytes), with S the sliced parameters' bytes (padded to n * c rows on the
wire, which equals S when n divides every d0) and R the bytes of the parameters kept whole:
  plain   all-reduce 2(n-1)/n (S + R)
  level1  all-reduce 2(n-1)/n (S + R) + weights all-gather (n-1)/n S  ->  S's part 1.5x an all-reduce
  level2  all-reduce 2(n-1)/n R + reduce-scatter (n-1)/n S + all-gather (n-1)/n S  ->  S's part 1x
  level3  level2 + a second all-gather (backward) (n-1)/n S  ->  S's part 1.5x (plus, for a sliced tied
          embedding, one more all-gather of it for the head, which reads it outside its cell)
The "x" column is S's part over 2(n-1)/n S. The script exits 1 when any figure differs from
its formula (all-reduces are rounded down per bucket: a difference of at most one byte per
collective is accepted).

Also, for information: each level's losses against plain's (max relative difference, rank 0's
losses; the threads world sums in the same order, so they are equal bit for bit), and the step
time (median over steps 2..--steps, rank 0's; the ranks share this machine's cores).
"""
import argparse
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # minidl from this checkout
sys.path.insert(0, str(ROOT / "examples"))  # the GPT example's model, data and loss

import gpt_char  # noqa: E402
import minidl  # noqa: E402
from minidl import nn  # noqa: E402
import minidl_parallel as mp  # noqa: E402
from minidl_parallel.tensor_parallel.counter import CommCounter  # noqa: E402

LEVELS = ("plain", "level1", "level2", "level3")
STATE_PER_PARAMETER = 2  # AdamWeightDecay's adam_m and adam_v


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--levels", nargs="+", choices=LEVELS, default=list(LEVELS))
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (>= 2)")
    parser.add_argument("--threshold", type=int, default=64,
                        help="parallel_optimizer_threshold in KB (MindSpore's default 64)")
    parser.add_argument("--batch", type=int, default=8, help="windows per step and rank")
    parser.add_argument("--launch", choices=["threads", "mpirun"], default="threads")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank under mpirun
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (step 1 has no weights all-gather), got {args.steps}")
    if any(n < 1 for n in args.ranks):
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    return args


# ---- the formulas ------------------------------------------------------------------------------

def is_sliced(shape, itemsize, n, threshold_kb):
    return n > 1 and len(shape) >= 1 and math.prod(shape) * itemsize >= threshold_kb * 1024


def rows_of(d0, n, r):
    c = math.ceil(d0 / n)
    return min((r + 1) * c, d0) - min(r * c, d0)


def held_bytes(shape, itemsize, n, r, sliced):
    """What rank r holds of a parameter of ``shape``: its rows if sliced, else the whole tensor."""
    if not sliced:
        return math.prod(shape) * itemsize
    return rows_of(shape[0], n, r) * math.prod(shape[1:]) * itemsize


def analytical_comm(shapes, itemsize, n, level, threshold_kb, read_outside=()):
    """({(phase, kind): bytes per rank per step}, S, R, S's part over an all-reduce of S).

    S and R are those the level's threshold gives (under plain too, where both are all-reduced).
    ``read_outside``: the indices of weights an op reads outside their cell (GPT's tied head),
    which level3 gathers once more for that op when they are sliced.
    """
    sliced = [s for s in shapes if is_sliced(s, itemsize, n, threshold_kb)]
    tied_wire = sum(math.ceil(shapes[i][0] / n) * n * math.prod(shapes[i][1:]) * itemsize
                    for i in read_outside if is_sliced(shapes[i], itemsize, n, threshold_kb))
    S = sum(math.prod(s) * itemsize for s in sliced)
    wire = sum(math.ceil(s[0] / n) * n * math.prod(s[1:]) * itemsize for s in sliced)  # padded rows
    R = sum(math.prod(s) * itemsize for s in shapes) - S
    allreduce = 2 * (n - 1) / n
    gather_or_scatter = (n - 1) / n * wire
    scatters = level in ("level2", "level3")
    out = {("gradients", "allreduce"): allreduce * (R if scatters else R + S)}
    if scatters:
        out[("gradients", "reduce_scatter")] = gather_or_scatter
    if level != "plain":
        # level3 gathers each cell's weights for its forward and again for its backward
        out[("weights", "allgather")] = gather_or_scatter * (2 if level == "level3" else 1) + (
            (n - 1) / n * tied_wire if level == "level3" else 0)
    sliced_part = {"plain": allreduce * S, "level1": allreduce * S + gather_or_scatter,
                   "level2": 2 * gather_or_scatter, "level3": 3 * gather_or_scatter + (n - 1) / n * tied_wire}[level]
    out = {key: value for key, value in out.items() if value}
    return out, S, R, (sliced_part / (allreduce * S) if S else float("nan"))


# ---- one rank ----------------------------------------------------------------------------------

def set_level(level, threshold_kb):
    settings = dict(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                    enable_parallel_optimizer=level != "plain")
    if level != "plain":
        settings["parallel_optimizer_config"] = {"optimizer_level": level,
                                                 "parallel_optimizer_threshold": threshold_kb,
                                                 # level2 turns it on; MindSpore refuses level3 while it is
                                                 "gradient_accumulation_shard": level == "level2"}
    mp.set_auto_parallel_context(**settings)


def run_rank(level, steps, threshold_kb, batch):
    """Trains the example's GPT on this rank; returns its measurements (a JSON-able dict)."""
    set_level(level, threshold_kb)
    r, n = mp.get_rank(), mp.get_group_size()
    with open(gpt_char.TEXT, encoding="utf-8") as f:
        data = gpt_char.CharData(f.read())
    defaults = gpt_char.parse_args([])
    minidl.set_seed(defaults.seed)
    vocab = len(data.chars)
    net = gpt_char.GPT(vocab, block_size=defaults.block, n_layer=defaults.layers, n_head=defaults.heads,
                       n_embd=defaults.embd)
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=defaults.lr, weight_decay=0.01)
    train_step = nn.TrainOneStepCell(nn.WithLossCell(net, gpt_char.NextCharLoss(vocab)), opt, return_grad=True)
    train_step.set_train(True)
    rng = np.random.default_rng(defaults.seed)
    params = list(net.trainable_params())
    itemsize = np.dtype(params[0].dtype).itemsize
    formula = {p.name: held_bytes(tuple(p.shape), itemsize, n, r,
                                  level != "plain" and is_sliced(tuple(p.shape), itemsize, n, threshold_kb))
               for p in params}
    state = [(name, b) for name, b in opt.parameters_and_names() if name.split(".", 1)[-1] in formula]
    left_out = sorted(name for name, _ in opt.parameters_and_names() if name.split(".", 1)[-1] not in formula)
    if len(state) != STATE_PER_PARAMETER * len(params):
        raise RuntimeError(f"expected {STATE_PER_PARAMETER} state buffers per parameter, got {len(state)} for "
                           f"{len(params)} parameters")
    losses, times, comm, memory = [], [], [], []
    for step in range(1, steps + 1):
        x, y = data.batch("train", batch, defaults.block, rng, r, n)
        with CommCounter() as counter:
            start = time.perf_counter()
            loss, grads = train_step(x, y)
            seconds = time.perf_counter() - start
        losses.append(float(loss.asnumpy()))
        memory.append({  # between this step and the next: [measured, formula]
            "weights": [sum(p.data.nbytes for p in params), sum(formula.values())],
            "state": [sum(b.data.nbytes for _, b in state), STATE_PER_PARAMETER * sum(formula.values())],
            "gradients": [sum(g.data.nbytes for g in grads.values()), sum(formula[name] for name in grads)],
        })
        if step > 1:
            times.append(seconds)
            per_kind = {}  # "phase/kind" -> [collectives, bytes]
            for e in counter.events:
                count, nbytes = per_kind.get(f"{e.phase}/{e.kind}", [0, 0])
                per_kind[f"{e.phase}/{e.kind}"] = [count + 1, nbytes + e.bytes_per_rank]
            comm.append(per_kind)
    return {"rank": r, "memory": memory, "comm": comm, "losses": losses, "times": times,
            "left_out": left_out, "shapes": [list(p.shape) for p in params], "itemsize": itemsize,
            "read_outside": [i for i, p in enumerate(params) if net.tie_weights and p is net.wte.embedding_table]}


def run_level(n, level, args):
    """Every rank's measurements for one (n, level), in the threads world or (worker) this MPI job."""
    if args.launch == "threads":
        return mp.run_threads(n, run_rank, level, args.steps, args.threshold, args.batch)
    mine = run_rank(level, args.steps, args.threshold, args.batch)
    # This level's step cell, and with it its reducer, must be gone before the next level, or the
    # next level's Cell calls would gather this level's weights too (the runtime holds reducers weakly).
    gc.collect()
    return mp.get_communicator().allgather_object(mine)


def mpirun_results(n, args):
    """Runs this script's --worker under mpirun -n n; {level: [per-rank results]}."""
    beside = Path(sys.executable).parent / "mpirun"
    mpirun = str(beside) if beside.exists() else "mpirun"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    cmd = [mpirun, "--oversubscribe", "-n", str(n), sys.executable, __file__, "--worker", "--ranks", str(n),
           "--levels", *args.levels, "--steps", str(args.steps), "--threshold", str(args.threshold),
           "--batch", str(args.batch), "--launch", "mpirun"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"mpirun -n {n} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def worker(args):
    mp.init("mpi")
    results = {level: run_level(mp.get_group_size(), level, args) for level in args.levels}
    if mp.get_rank() == 0:
        print("RESULTS " + json.dumps(results), flush=True)
    mp.release()


# ---- the report --------------------------------------------------------------------------------

def cpu_name():
    """lscpu's "Model name" (read from /proc/cpuinfo), else what platform knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def kib(nbytes):
    return f"{nbytes / 1024:.1f}"


def check_rank(n, level, result, args, failures):
    """Checks every figure of one rank against its formula (appends to ``failures``); returns
    analytical_comm's answer."""
    r = result["rank"]
    for step, memory in enumerate(result["memory"], start=1):
        for what, (got, want) in memory.items():
            if got != want:
                failures.append(f"n={n} {level} rank {r} after step {step}: {what} {got} B, formula {want} B")
    shapes = [tuple(s) for s in result["shapes"]]
    expected, S, R, ratio = analytical_comm(shapes, result["itemsize"], n, level, args.threshold,
                                            result["read_outside"])
    for i, per_kind in enumerate(result["comm"], start=2):
        for key in set(per_kind) | {f"{p}/{k}" for p, k in expected}:
            count, got = per_kind.get(key, [0, 0])
            want = expected.get(tuple(key.split("/")), 0)
            if abs(got - want) > count:  # all-reduces round down, at most a byte per collective
                failures.append(f"n={n} {level} rank {r} step {i}: {key} {got} B/rank, analytical {want:.0f}")
    return expected, S, R, ratio


def report(n, results_by_level, args, failures):
    rows = []
    plain_losses = results_by_level.get("plain", [{}])[0].get("losses")
    for level, results in results_by_level.items():
        for result in results:
            expected, S, R, ratio = check_rank(n, level, result, args, failures)
        rank0 = results[0]
        mem = rank0["memory"][-1]
        measured = sum(sum(b for _, b in step.values()) for step in rank0["comm"]) / len(rank0["comm"])
        analytic = sum(expected.values())
        # S's part: the step's bytes less R's all-reduce (analytical: level1 and plain all-reduce R
        # and S in the same buckets), over an all-reduce of S.
        allreduce_of_r, allreduce_of_s = 2 * (n - 1) / n * R, 2 * (n - 1) / n * S
        part = (f"{(measured - allreduce_of_r) / allreduce_of_s:.2f}x ({ratio:.2f}x)" if S and n > 1 else "-")
        diff = (max(abs(a - b) / abs(b) for a, b in zip(rank0["losses"], plain_losses))
                if plain_losses and level != "plain" else 0.0)
        rows.append([str(n), level, f"{kib(mem['weights'][0])} ({kib(mem['weights'][1])})",
                     f"{kib(mem['state'][0])} ({kib(mem['state'][1])})",
                     f"{kib(mem['gradients'][0])} ({kib(mem['gradients'][1])})",
                     f"{kib(measured)} ({kib(analytic)})", part,
                     f"{diff:.1e}" if level != "plain" and plain_losses else "-",
                     f"{1000 * float(np.median(rank0['times'])):.0f}"])
    return rows, S, R, results_by_level[next(iter(results_by_level))][0]["left_out"]


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    header = ["n", "level", "weights KiB", "opt. state KiB", "gradients KiB", "comm KiB/step", "S's part",
              "loss vs plain", "step ms"]
    failures, table = [], []
    started = time.perf_counter()
    for n in args.ranks:
        if args.launch == "threads":
            by_level = {level: run_level(n, level, args) for level in args.levels}
        else:
            by_level = mpirun_results(n, args)
        rows, S, R, left_out = report(n, by_level, args, failures)
        table += rows
        if n > 1:
            print(f"n = {n}: S (sliced, >= {args.threshold} KB) = {kib(S)} KiB, R (whole) = {kib(R)} KiB")
    print(f"GPT of examples/gpt_char.py (default sizes), AdamWeightDecay, batch {args.batch} per rank, "
          f"{args.launch}, {args.steps} steps; {cpu_name()}, {os.cpu_count()} cores")
    print(f"optimizer state: adam_m + adam_v; left out: {', '.join(left_out)}")
    print("per rank (rank 0 shown; every rank checked): measured (formula)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in table:
        print("| " + " | ".join(row) + " |")
    print(f"({time.perf_counter() - started:.0f} s)")
    if failures:
        print(f"{len(failures)} figure(s) differ from the formula:\n  " + "\n  ".join(failures[:20]))
        sys.exit(1)
    print("every figure equals its formula")


if __name__ == "__main__":
    main()
