"""Pipeline parallelism: per stage, the schedule's bubble, the messages and bytes of a step, the micro-batches
held and the traced peak memory, against the formulas; the step time against one rank accumulating.

    python3 benchmarks/bench_pipeline.py                          # mpirun, p = 2 and 4, GPT and MLP
    python3 benchmarks/bench_pipeline.py --launch threads         # threads world: no memory figures
    python3 benchmarks/bench_pipeline.py --ranks 2 --models mlp --steps 4

For each model (a GPT of minidl.models.gpt with its own head, tie_weights=False; an MLP of Dense +
ReLU layers), each --ranks p (one stage per rank), m in (p, 2p, 4p) micro-batches (of --rows rows for
the MLP, --sequences sequences for the GPT) and both schedulers, nn.PipelineCell in nn.TrainOneStepCell
(Momentum) trains --steps steps. Per stage:

  bubble   the idle fraction of the schedule, Schedule.bubble_fraction(): (p - 1) / (m + p - 1);
  sent     activations and gradients this stage sent in one step (PipelineCell.last_step, a StepLog),
           and their bytes, next to the formula: m of each per boundary ((p - 1) m per direction over
           the stages), each the size of a micro-batch's activation at that boundary (rows x width x 4
           for the MLP, sequences x block x n_embd x 4 for the GPT); headers (80 B each) left out;
  held     StepLog.peak_held next to Schedule.peak_activations(stage): m (GPipe), min(p - s, m) (1F1B);
  traced   the peak bytes tracemalloc traced during one step over those before it (after the timed
           steps, the optimizer's state made), with the kernels' buffer pool off so that every array
           is NumPy's (NumPy reports its allocations to tracemalloc). Only under mpirun: tracemalloc is
           per process, and thread ranks would share it;
  ms/step  the median wall time of steps 2..--steps (untraced), rank 0's, next to the same model on
           one rank (this process) accumulating the gradients of the same m micro-batches.

On a machine with fewer cores than ranks (4 ranks on 2 cores) the ranks take turns: the wall time
cannot show the bubble, and a pipeline is slower than one rank; the schedule and the memory are the
figures. The script exits 1 when a count, a byte total or a held count differs from its formula.
"""
import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # minidl from this checkout

import minidl_parallel as mp  # noqa: E402
from minidl import Tensor, kernels, nn  # noqa: E402
from minidl.autograd import value_and_grad  # noqa: E402
from minidl.models.gpt import GPT  # noqa: E402
from minidl.optim import Momentum  # noqa: E402
from minidl_parallel.nn import PipelineCell  # noqa: E402

MODELS = ("gpt", "mlp")
SCHEDULERS = ("gpipe", "1f1b")
MLP_WIDTH, MLP_LAYERS = 256, 8
GPT_SIZES = dict(vocab_size=65, block_size=32, n_layer=4, n_head=4, n_embd=64)
HEADER_BYTES = 80  # 10 int64 before each activation: dtype, ndim, shape


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--schedulers", nargs="+", choices=SCHEDULERS, default=list(SCHEDULERS))
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per run (>= 2)")
    # The MLP's micro-batch: as many rows as its width, so an activation (256 KiB) weighs as a weight.
    parser.add_argument("--rows", type=int, default=256, help="MLP rows per micro-batch")
    parser.add_argument("--sequences", type=int, default=8, help="GPT sequences per micro-batch")
    parser.add_argument("--launch", choices=["mpirun", "threads"], default="mpirun")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank under mpirun
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first step is a warm-up), got {args.steps}")
    if any(p < 2 for p in args.ranks):
        parser.error(f"--ranks must be >= 2 (a pipeline of one stage has no messages), got {args.ranks}")
    return args


# ---- the models ----------------------------------------------------------------------------------

class _TokenLoss(nn.Cell):
    """Cross-entropy of (batch, time, vocab) logits against (batch, time) ids."""

    def __init__(self):
        super().__init__()
        self.ce = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def construct(self, logits, labels):
        n, t, v = logits.shape
        return self.ce(logits.reshape(n * t, v), labels.reshape(n * t))


def stage_of(k, n, stages):
    return k * stages // n


def build(kind, stages):
    """The model with its loss, ``pipeline_stage`` set on its cells for ``stages`` stages (1: all on 0);
    the same weights whatever the stage count (seeded)."""
    rng = np.random.default_rng(7)
    if kind == "mlp":
        layers = [nn.Dense(MLP_WIDTH, MLP_WIDTH, activation="relu") for _ in range(MLP_LAYERS - 1)]
        layers.append(nn.Dense(MLP_WIDTH, 10))
        body = nn.SequentialCell(layers)
        for k, layer in enumerate(layers):
            layer.pipeline_stage = stage_of(k, len(layers), stages)
        loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    else:
        body = GPT(**GPT_SIZES, tie_weights=False)
        body.wte.pipeline_stage = body.wpe.pipeline_stage = 0
        for k, block in enumerate(body.blocks):
            block.pipeline_stage = stage_of(k, len(body.blocks), stages)
        body.ln_f.pipeline_stage = body.lm_head.pipeline_stage = stages - 1
        loss = _TokenLoss()
    for p in body.trainable_params():  # matrices: standard deviation 1/sqrt(fan-in); vectors as initialised
        if len(p.shape) > 1:
            p.set_data(Tensor((rng.standard_normal(p.shape) / np.sqrt(p.shape[-1])).astype(np.float32)))
    return nn.WithLossCell(body, loss)


def batch(kind, micro_batches, rows, seed=3):
    rng = np.random.default_rng(seed)
    n = micro_batches * rows
    if kind == "mlp":
        return (Tensor(rng.standard_normal((n, MLP_WIDTH)).astype(np.float32)),
                Tensor(rng.integers(0, 10, n).astype(np.int32)))
    shape = (n, GPT_SIZES["block_size"])
    return (Tensor(rng.integers(0, GPT_SIZES["vocab_size"], shape).astype(np.int32)),
            Tensor(rng.integers(0, GPT_SIZES["vocab_size"], shape).astype(np.int32)))


def rows_of(kind, args):
    return args.rows if kind == "mlp" else args.sequences


def activation_bytes(kind, rows):
    """One micro-batch's activation at any stage boundary (float32)."""
    return rows * (MLP_WIDTH if kind == "mlp" else GPT_SIZES["block_size"] * GPT_SIZES["n_embd"]) * 4


def optimizer(net):
    return Momentum(net.trainable_params(), 0.01, 0.9)


# ---- one rank of a pipeline, and one rank alone ----------------------------------------------------

def traced_peak(step):
    """The peak traced bytes of ``step()`` over those before it, every array NumPy's."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        step()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def run_stage(kind, micro_batches, scheduler, steps, rows, trace):
    """Trains the pipeline on this rank's stage; returns its figures (a JSON-able dict)."""
    stages, stage = mp.get_group_size(), mp.get_rank()
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", pipeline_stages=stages,
                                 pipeline_config={"pipeline_scheduler": scheduler})
    net = build(kind, stages)
    pipe = PipelineCell(net, micro_batches)
    train = nn.TrainOneStepCell(pipe, optimizer(net))
    x, y = batch(kind, micro_batches, rows)
    times = []
    with kernels.option("buffer_pool", not trace):  # the same allocations timed and traced
        for _ in range(steps):
            start = time.perf_counter()
            train(x, y)
            times.append(time.perf_counter() - start)
        traced = traced_peak(lambda: train(x, y)) if trace else None
    log = pipe.last_step
    sent = {payload: log.count("send", payload) for payload in ("activation", "gradient")}
    mp.set_auto_parallel_context(parallel_mode="stand_alone", pipeline_stages=1)
    return {"stage": stage, "sent": sent, "held": log.peak_held, "traced": traced,
            "ms": 1000 * statistics.median(times[1:])}


def run_alone(kind, micro_batches, steps, rows, trace):
    """One rank, gradient accumulation: value_and_grad per micro-batch, the sums, one Momentum step."""
    net = build(kind, 1)
    params = net.trainable_params()
    opt = optimizer(net)
    grad_fn = value_and_grad(net, None, params)
    x, y = batch(kind, micro_batches, rows)

    def step():
        total = None
        for k in range(micro_batches):
            part = slice(k * rows, (k + 1) * rows)
            _, grads = grad_fn(Tensor(x.data[part]), Tensor(y.data[part]))
            total = list(grads) if total is None else [a + g for a, g in zip(total, grads)]
        opt(tuple(total))

    times = []
    with kernels.option("buffer_pool", not trace):
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        traced = traced_peak(step) if trace else None
    return {"ms": 1000 * statistics.median(times[1:]), "traced": traced}


def configurations(p, args):
    return [(kind, m, scheduler) for kind in args.models for m in (p, 2 * p, 4 * p) for scheduler in args.schedulers]


def run_pipelines(p, args):
    """{"kind m scheduler": [per-stage figures]} for this p, in the threads world or (worker) this MPI job."""
    out = {}
    for kind, m, scheduler in configurations(p, args):
        key = f"{kind} {m} {scheduler}"
        if args.launch == "threads":
            out[key] = mp.run_threads(p, run_stage, kind, m, scheduler, args.steps, rows_of(kind, args), False,
                                      timeout=600)
        else:
            mine = run_stage(kind, m, scheduler, args.steps, rows_of(kind, args), True)
            gc.collect()  # this configuration's cells gone before the next one's
            out[key] = mp.get_communicator().allgather_object(mine)
    return out


def mpirun_results(p, args):
    """Runs this script's --worker under mpirun -n p."""
    beside = Path(sys.executable).parent / "mpirun"
    mpirun = str(beside) if beside.exists() else "mpirun"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    cmd = [mpirun, "--oversubscribe", "-n", str(p), sys.executable, __file__, "--worker", "--ranks", str(p),
           "--models", *args.models, "--schedulers", *args.schedulers, "--steps", str(args.steps),
           "--rows", str(args.rows), "--sequences", str(args.sequences), "--launch", "mpirun"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"mpirun -n {p} failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


def worker(args):
    mp.init("mpi")
    results = run_pipelines(mp.get_group_size(), args)
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
    return "-" if nbytes is None else f"{nbytes / 1024:.0f}"


def report(p, results, args, failures):
    rows = []
    alone = {}
    for key, stages in results.items():
        kind, m, scheduler = key.split()
        m = int(m)
        schedule = mp.pipeline_schedule(p, m, scheduler)
        if (kind, m) not in alone:
            alone[(kind, m)] = run_alone(kind, m, args.steps, rows_of(kind, args), args.launch == "mpirun")
        each = activation_bytes(kind, rows_of(kind, args))
        total = {"activation": 0, "gradient": 0}
        for figures in sorted(stages, key=lambda f: f["stage"]):
            s = figures["stage"]
            want = {"activation": (m, m * each) if s < p - 1 else (0, 0),
                    "gradient": (m, m * each) if s > 0 else (0, 0)}
            for payload, (count, nbytes) in figures["sent"].items():
                total[payload] += count
                if [count, nbytes] != list(want[payload]):
                    failures.append(f"{key} p={p} stage {s}: sent {count} {payload}s, {nbytes} B; formula "
                                    f"{want[payload][0]}, {want[payload][1]} B")
            held = schedule.peak_activations(s)
            if figures["held"] != held:
                failures.append(f"{key} p={p} stage {s}: held {figures['held']} micro-batches, schedule {held}")
            act, grad = figures["sent"]["activation"], figures["sent"]["gradient"]
            rows.append([kind, str(p), str(m), scheduler, str(s), f"{schedule.bubble_fraction()}",
                         f"{act[0]} / {kib(act[1])} ({want['activation'][0]} / {kib(want['activation'][1])})",
                         f"{grad[0]} / {kib(grad[1])} ({want['gradient'][0]} / {kib(want['gradient'][1])})",
                         f"{figures['held']} ({held})", kib(figures["traced"]),
                         f"{figures['ms']:.0f}" if s == 0 else "", f"{alone[(kind, m)]['ms']:.0f}" if s == 0 else "",
                         kib(alone[(kind, m)]["traced"]) if s == 0 else ""])
        for payload, count in total.items():
            if count != (p - 1) * m:
                failures.append(f"{key} p={p}: {count} {payload}s sent over the stages, formula (p-1) m = "
                                f"{(p - 1) * m}")
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    header = ["model", "p", "m", "scheduler", "stage", "bubble", "sent act. n / KiB (formula)",
              "sent grad. n / KiB (formula)", "held (schedule)", "traced peak KiB", "ms/step", "1 rank ms/step",
              "1 rank traced KiB"]
    failures, table = [], []
    started = time.perf_counter()
    for p in args.ranks:
        results = mpirun_results(p, args) if args.launch == "mpirun" else run_pipelines(p, args)
        table += report(p, results, args, failures)
    print(f"pipeline, {args.launch}: MLP {MLP_LAYERS} x Dense({MLP_WIDTH}), GPT {GPT_SIZES} (tie_weights=False); "
          f"micro-batches of {args.rows} rows (MLP) / {args.sequences} sequences (GPT), Momentum, {args.steps} steps; "
          f"{cpu_name()}, "
          f"{os.cpu_count()} cores")
    print("per stage: measured (formula); ms/step is rank 0's median; '1 rank': gradient accumulation over the same "
          "micro-batches in one process")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in table:
        print("| " + " | ".join(row) + " |")
    print(f"({time.perf_counter() - started:.0f} s)")
    if failures:
        print(f"{len(failures)} figure(s) differ from the formula:\n  " + "\n  ".join(failures[:20]))
        sys.exit(1)
    print("every count, byte total and held count equals its formula")


if __name__ == "__main__":
    main()
