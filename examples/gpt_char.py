"""A character-level GPT on a few Shakespeare sonnets (public domain, examples/data/sonnets.txt).

    python examples/gpt_char.py                  # about 2 minutes on a 2-core laptop CPU, then a sample
    python examples/gpt_char.py --steps 50       # a quick look
    python examples/gpt_char.py --recompute --loss-scale dynamic
    python examples/gpt_char.py --amp O2 --loss-scale dynamic --steps 50          # float16 (slow in NumPy)
    mpirun --oversubscribe -n 4 python examples/gpt_char.py --batch 8 --zero level2   # optimizer parallel
    mpirun --oversubscribe -n 4 python examples/gpt_char.py --batch 8               # data parallel, 4 processes
    python -m minidl_parallel.run -n 4 examples/gpt_char.py --batch 8               # the same, without mpirun
    mpirun --oversubscribe -n 2 python examples/gpt_char.py --batch 8 --pipeline 2  # 2 pipeline stages
    mpirun --oversubscribe -n 4 python examples/gpt_char.py --batch 8 --pipeline 2 --micro-batches 4  # x 2 replicas

A small decoder-only Transformer (minidl.models.gpt: token + position embeddings, pre-LayerNorm
blocks of causal self-attention and a GELU MLP, the head tied to the embedding) learns to predict
the next character. AdamWeightDecay, one ``nn.TrainOneStepCell(nn.WithLossCell(...))`` call per
step; the training and held-out losses are printed as they fall from ln(vocabulary) (about 4.1),
and text is sampled at the end.

Launched by mpirun or ``python -m minidl_parallel.run`` (``--parallel auto``, the default), or
inside an already initialised world (``minidl_parallel.run_threads``), it trains data parallel:
DATA_PARALLEL with ``gradients_mean=True`` and ``parameter_broadcast=True``, so the step cell
averages the gradients over the ranks by itself. ``--batch`` is per rank: every rank draws the
same ``batch x ranks`` random windows (the same seed) and keeps its own ``batch`` rows, so the
global batch, and the training, are those of one process run with ``--batch batch x ranks``
(equal up to float32 rounding: the ranks' means are averaged where one process averages at
once). The losses printed are the global batch's (the ranks' losses averaged, one 8-byte
all-reduce per printed line), once, by rank 0; the held-out windows are sharded the same way.
``--save PATH`` writes the network's parameters at the end (rank 0; every rank holds the same).
``--ckpt-dir DIR`` saves the training state every ``--ckpt-steps`` steps (every rank its own file,
``save_train_state``, with the loop's data generator and losses in ``append_dict``); under
``python -m minidl_parallel.run --max-restarts K`` a restarted job continues from the newest one
every rank wrote (``minidl.train.resume_after_restart``, one call before the first step) and ends
with the parameters of a run that never failed, bit for bit (data parallel, with --zero, whose
checkpoints gather each weight and its state whole, and with --pipeline; docs/reliability.md).

``--recompute`` makes every Transformer block recompute itself in backward (``cell.recompute()``):
less activation memory for one more forward of each block, and the same losses and parameters
bit for bit. ``--loss-scale fixed|dynamic`` trains through ``nn.TrainOneStepWithLossScaleCell``
with ``minidl.amp``'s ``FixedLossScaleManager()`` / ``DynamicLossScaleManager()`` (MindSpore's
defaults); in float32 with no overflow (powers of 2) that equals ``none`` bit for bit, and the
last line says the scale and how many steps were skipped. ``--amp O1|O2|O3|auto`` casts the
network with ``minidl.amp.auto_mixed_precision`` (float16 compute, float32 master weights; on the
CPU NumPy's float16 is slow: the point there is the numbers, the GPU makes it fast).

``--zero level1|level2|level3`` (with several ranks) turns on optimizer parallelism
(``enable_parallel_optimizer``, MindSpore's ``parallel_optimizer_config``): each rank keeps its
rows of the weights and of AdamWeightDecay's state between steps (and at level2/3 receives only
its rows of the gradients), with the same losses as plain data parallelism (bit for bit with
threads). The end (sampling and ``--save`` on rank 0) runs inside
``minidl_parallel.summon_full_params(net)``, which every rank enters.

``--pipeline P`` (with P x D ranks) cuts the GPT by depth into P stages (MindSpore's
``pipeline_stages``, ``cell.pipeline_stage`` and ``nn.PipelineCell``, under SEMI_AUTO_PARALLEL):
the embeddings on stage 0, the blocks split in order over the stages, ``ln_f`` and the head on the
last; the head is tied to the embedding table, a parameter stages 0 and P - 1 share (their
gradients summed, as MindSpore's shared pipeline parameters). The other D ranks of the world are data
parallel: stage s runs on ranks [s*D, (s+1)*D), replica ``rank % D`` reads its own ``--batch``
windows, and each stage's gradients are averaged over its replicas. Each batch is cut into
``--micro-batches M`` (default P, at least P) that flow through the stages as ``--schedule 1f1b``
(the default) or ``gpipe`` orders them; rank 0 prints the schedule, bubble included. PipelineCell
returns the sum of the micro-batch losses (MindSpore's); the example trains on the sum divided by
M, so the losses, and the training, are those of one process on the same batch (equal up to float32
rounding; ``--pipeline 1 --micro-batches M`` runs the same micro-batches one after the other, and
``--pipeline P`` equals it). The held-out loss runs through the pipeline too. Each rank trains only
its stage's parameters, so at the end every parameter is broadcast from its stage's first rank
(one broadcast per parameter), and rank 0 samples and saves the whole model as without a pipeline.
``--recompute`` works inside the stages (bit for bit); --zero, --amp and --loss-scale do not
combine with --pipeline or --micro-batches here (refused when parsed).
"""
import contextlib
import argparse
import json
import os
import time

import numpy as np

import minidl
from minidl import amp, nn, Tensor
from minidl.models.gpt import GPT
from minidl.runtime import get_runtime
from minidl.train import resume_after_restart, save_train_state
from minidl.train.checkpoint import rank_checkpoint_path

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "sonnets.txt")
LOSS_SCALES = {"none": None, "fixed": amp.FixedLossScaleManager, "dynamic": amp.DynamicLossScaleManager}


class CharData:
    """The text as integer ids, split 90/10 into training and held-out parts."""

    def __init__(self, text):
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        ids = np.array([self.index[c] for c in text], dtype=np.int32)
        cut = int(0.9 * len(ids))
        self.train, self.val = ids[:cut], ids[cut:]

    def batch(self, part, size, block, rng, rank=0, ranks=1):
        """This rank's ``size`` of ``size x ranks`` random windows of ``block`` characters and, shifted
        by one, their next characters. Every rank draws all the starts (the same generator state on
        every rank), so the global batch does not depend on how many ranks share it."""
        ids = self.train if part == "train" else self.val
        starts = rng.integers(0, len(ids) - block - 1, size * ranks)[rank * size:(rank + 1) * size]
        x = np.stack([ids[s:s + block] for s in starts])
        y = np.stack([ids[s + 1:s + block + 1] for s in starts])
        return Tensor(x), Tensor(y)

    def decode(self, ids):
        return "".join(self.chars[i] for i in ids)


class NextCharLoss(nn.Cell):
    """Cross-entropy of the (N, T, vocabulary) logits against the (N, T) next characters."""

    def __init__(self, vocab):
        super().__init__()
        self.vocab = vocab
        self.cross_entropy = nn.CrossEntropyLoss()

    def construct(self, logits, labels):
        return self.cross_entropy(logits.reshape(-1, self.vocab), labels.reshape(-1))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=32, help="windows per step and rank")
    parser.add_argument("--block", type=int, default=32, help="context length (characters)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--sample", type=int, default=300, help="characters to sample at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--recompute", action="store_true", help="recompute each Transformer block in backward")
    parser.add_argument("--loss-scale", choices=sorted(LOSS_SCALES), default="none",
                        help="train through nn.TrainOneStepWithLossScaleCell with this minidl.amp manager")
    parser.add_argument("--amp", choices=["O0", "O1", "O2", "O3", "auto"], default="O0",
                        help="minidl.amp.auto_mixed_precision level (float16)")
    parser.add_argument("--zero", choices=["level1", "level2", "level3"],
                        help="optimizer parallelism at this level (data parallel runs only)")
    parser.add_argument("--zero-threshold", type=int, default=64,
                        help="with --zero: parameters under this many KB stay whole (parallel_optimizer_threshold)")
    parser.add_argument("--save", help="write the network's parameters here at the end (rank 0)")
    parser.add_argument("--ckpt-dir", help="save the training state here every --ckpt-steps steps (every rank its "
                                           "own file); a restarted job continues from the newest one")
    parser.add_argument("--ckpt-steps", type=int, default=100, help="steps between checkpoints (default 100)")
    parser.add_argument("--parallel", choices=["auto", "none"], default="auto",
                        help="auto: data parallel when launched by mpirun / minidl_parallel.run or inside an "
                             "initialised world (needs minidl_parallel); none: never")
    parser.add_argument("--pipeline", type=int, default=1,
                        help="pipeline stages P (the world a multiple of P; the rest is data parallel); 1: none")
    parser.add_argument("--micro-batches", type=int,
                        help="micro-batches per step (default P, at least P); each rank's --batch is cut into them")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="the pipeline's schedule")
    args = parser.parse_args(argv)
    if args.zero_threshold < 0:
        parser.error(f"--zero-threshold must be >= 0, got {args.zero_threshold}")
    for name in ("steps", "batch", "block", "layers", "heads", "embd", "eval_every", "pipeline", "ckpt_steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    check_pipeline_args(parser, args)
    return args


def check_pipeline_args(parser, args):
    """Fills in --micro-batches and refuses what a pipeline here cannot do, naming the flag."""
    if args.micro_batches is None:
        args.micro_batches = args.pipeline
    if args.micro_batches < args.pipeline:
        parser.error(f"--micro-batches must be >= --pipeline ({args.pipeline}), as MindSpore's PipelineCell "
                     f"requires, got {args.micro_batches}")
    if args.batch % args.micro_batches:
        parser.error(f"--batch {args.batch} must be a multiple of --micro-batches {args.micro_batches} "
                     f"(each batch is cut into equal micro-batches)")
    if args.pipeline == 1 and args.micro_batches == 1:
        return
    refused = [flag for flag, on in (("--zero", args.zero is not None),
                                     ("--parallel none", args.parallel == "none" and args.pipeline > 1)) if on]
    if refused:
        parser.error(f"--pipeline {args.pipeline} --micro-batches {args.micro_batches} does not combine with "
                     f"{', '.join(refused)} (optimizer parallelism inside a pipeline is not built; a pipeline needs "
                     f"minidl_parallel): drop {'it' if len(refused) == 1 else 'them'}, or use --pipeline 1 "
                     f"--micro-batches 1")
    if args.layers < args.pipeline:
        parser.error(f"--pipeline {args.pipeline} needs at least as many --layers (blocks to cut), got {args.layers}")


def setup_parallel(mode, zero=None, threshold_kb=64, pipeline=1, schedule="1f1b"):
    """Joins the world when launched by mpirun (mode auto) and turns on data parallelism in it, or in
    the world already joined (run_threads), with optimizer parallelism at level ``zero``, or, with
    ``pipeline`` > 1, a pipeline of that many stages; returns (rank, ranks)."""
    if mode == "none":
        return 0, 1
    try:
        import minidl_parallel as mp
        from minidl_parallel.context import launched_under_mpi
    except ImportError:
        if pipeline > 1:
            raise SystemExit(f"--pipeline {pipeline} needs minidl_parallel (pip install -e '.[mpi]')")
        return 0, 1
    if not mp.is_initialized():
        if not launched_under_mpi():
            if pipeline > 1:
                raise SystemExit(f"--pipeline {pipeline} needs {pipeline} x D processes, one per stage and replica: "
                                 f"launch with mpirun -n {pipeline} or python -m minidl_parallel.run -n {pipeline}")
            return 0, 1
        mp.init()
    if pipeline > 1:
        ranks = mp.get_group_size()
        if ranks % pipeline:
            raise SystemExit(f"--pipeline {pipeline}: the world has {ranks} ranks, which is not a multiple of "
                             f"{pipeline} (P stages x D data-parallel replicas)")
        # The stages' gradients are averaged over their replicas inside the PipelineCell (gradients_mean).
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.SEMI_AUTO_PARALLEL, gradients_mean=True,
                                     pipeline_stages=pipeline, pipeline_config={"pipeline_scheduler": schedule})
        return mp.get_rank(), ranks
    # The step cell asks the runtime for this mode's gradient reducer at its first step.
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 parameter_broadcast=True, enable_parallel_optimizer=zero is not None)
    if zero is not None:
        # gradient_accumulation_shard goes with level2 (MindSpore's rule)
        mp.set_auto_parallel_context(parallel_optimizer_config={"gradient_accumulation_shard": zero == "level2",
                                                                "optimizer_level": zero,
                                                                "parallel_optimizer_threshold": threshold_kb})
    return mp.get_rank(), mp.get_group_size()


def cut_into_stages(net, stages):
    """Sets ``pipeline_stage`` on the GPT's cells: the embeddings on stage 0, the blocks split in order
    into runs of nearly equal length, the final LayerNorm on the last stage. The tied head (an op that
    reads the embedding table) runs where its input lives, the last stage: the table is shared by
    stages 0 and ``stages - 1``."""
    net.wte.pipeline_stage = net.wpe.pipeline_stage = 0
    for k, block in enumerate(net.blocks):
        block.pipeline_stage = k * stages // len(net.blocks)
    net.ln_f.pipeline_stage = stages - 1
    if not net.tie_weights:
        net.lm_head.pipeline_stage = stages - 1


class MicroBatchMean(nn.Cell):
    """The PipelineCell's loss (the sum of its micro-batch losses, MindSpore's) divided by their number:
    the mean loss of the batch, so that the gradients, and the learning rate, are those of one step on
    the whole batch."""

    def __init__(self, pipeline):
        super().__init__(auto_prefix=False)
        self.pipeline = pipeline
        self.scale = 1.0 / pipeline.micro_size

    def construct(self, *inputs):
        return self.pipeline(*inputs) * self.scale


def whole_network(net, ranks):
    """The block in which rank 0 may use the whole network alone (every rank enters it)."""
    if ranks == 1:
        return contextlib.nullcontext()
    import minidl_parallel as mp
    return mp.summon_full_params(net)


def mean_over_ranks(value, ranks):
    """The mean of a float over the ranks (every rank must call): the global batch's loss."""
    return float(get_runtime().sum_over_ranks(np.array([value], dtype=np.float64))[0]) / ranks


def save_state(args, step, train_step, opt, rng, losses, skipped, rank, ranks):
    """This rank's training state after ``step`` (``gpt-1_{step}.ckpt``, ``_rank{r}`` on rank r > 0): the
    parameters and optimizer state (and the loss scale), minidl's random state, and what this loop keeps
    itself: its data generator's state, the losses so far and the skipped steps. Keeps the last two."""
    state = {"data_rng": json.dumps(rng.bit_generator.state), "losses": json.dumps(losses), "skipped": skipped,
             "rank": rank, "group_size": ranks}
    path = rank_checkpoint_path(os.path.join(args.ckpt_dir, f"gpt-1_{step}.ckpt"), rank)
    # (under --zero each weight and its state gathered whole, a collective: the restart slices them anew)
    save_train_state(path, train_step, opt, 1, step, step, args.steps, append_dict=state,
                     integrated_save=args.zero is not None)
    old = rank_checkpoint_path(os.path.join(args.ckpt_dir, f"gpt-1_{step - 2 * args.ckpt_steps}.ckpt"), rank)
    if os.path.exists(old):
        os.remove(old)


def resume_state(args, train_step, opt, rng, say):
    """After a launcher's restart, the newest state every rank saved, loaded: (steps done, losses,
    skipped); (0, {}, 0) on a first attempt or when there is none."""
    resumed = resume_after_restart(args.ckpt_dir, train_step, opt, prefix="gpt", who="gpt_char.py")
    if resumed is None:
        return 0, {}, 0
    path, position = resumed
    state = minidl.load_checkpoint_metadata(path)
    rng.bit_generator.state = json.loads(state["data_rng"])
    losses = {int(step): tuple(pair) for step, pair in json.loads(state["losses"]).items()}
    return position.global_step, losses, int(state["skipped"])


def main(argv=None):
    """Trains and samples; returns ``{"losses": {step: (train, held-out)}, "params": {name: array}}``."""
    args = parse_args(argv)
    rank, ranks = setup_parallel(args.parallel, args.zero, args.zero_threshold, args.pipeline, args.schedule)
    if args.zero and ranks == 1:
        print(f"--zero {args.zero}: one process, nothing to slice over; training without it", flush=True)
    # Data parallel replicas: every rank without a pipeline; with one, the ranks of a stage (all the
    # stages of replica r, ranks r, r + D, ..., read the same batches).
    replicas = ranks // args.pipeline
    replica = rank % replicas

    def say(message):
        """This script's messages: once per job, from rank 0."""
        if rank == 0:
            print(message, flush=True)

    minidl.set_seed(args.seed)
    with open(args.text, encoding="utf-8") as f:
        data = CharData(f.read())
    rng = np.random.default_rng(args.seed)  # the same on every rank: each keeps its rows of every batch
    vocab = len(data.chars)
    net = GPT(vocab, block_size=args.block, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    if args.recompute:
        for block in net.blocks:
            block.recompute()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=args.lr, weight_decay=0.01)
    # (the cast network shares net's parameters: the optimizer updates float32 master weights)
    cast = net if args.amp == "O0" else amp.auto_mixed_precision(net, args.amp)
    with_loss = evaluate = nn.WithLossCell(cast, NextCharLoss(vocab))
    pipeline = None
    if args.pipeline > 1 or args.micro_batches > 1:
        from minidl_parallel.nn import PipelineCell
        if args.pipeline > 1:
            cut_into_stages(net, args.pipeline)
        pipeline = PipelineCell(with_loss, args.micro_batches)
        with_loss = MicroBatchMean(pipeline)
        if args.pipeline > 1:  # (one process holds every parameter: it evaluates without the pipeline)
            evaluate = with_loss
    manager = LOSS_SCALES[args.loss_scale]
    if manager is None:
        train_step = nn.TrainOneStepCell(with_loss, opt)
    else:
        manager = manager()
        train_step = nn.TrainOneStepWithLossScaleCell(with_loss, opt, scale_sense=manager.get_update_cell())
    say(f"{len(data.train) + len(data.val)} characters, vocabulary {vocab}; "
        f"{sum(p.size for p in net.trainable_params())} parameters; ln(vocabulary) = {np.log(vocab):.2f}")
    if args.pipeline > 1:
        say(f"pipeline of {args.pipeline} stages x {replicas} data-parallel replicas on {ranks} ranks: batch "
            f"{args.batch} per replica, global batch {args.batch * replicas}, {args.micro_batches} micro-batches "
            f"of {args.batch // args.micro_batches}")
        say(str(pipeline.schedule()))
    elif ranks > 1:
        say(f"data parallel on {ranks} ranks: batch {args.batch} per rank, global batch {args.batch * ranks}")
    train_step.set_train(True)
    losses, skipped, done = {}, 0, 0
    if args.ckpt_dir:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        done, losses, skipped = resume_state(args, train_step, opt, rng, say)
    start = time.perf_counter()
    for step in range(done + 1, args.steps + 1):
        out = train_step(*data.batch("train", args.batch, args.block, rng, replica, replicas))
        loss = out if manager is None else out[0]
        skipped += manager is not None and bool(out[1])
        if step % args.eval_every == 0 or step == 1 or step == args.steps:
            net.set_train(False)
            with minidl.no_grad():
                val = np.mean([float(evaluate(*data.batch("val", args.batch, args.block, rng, replica, replicas))
                                     .asnumpy()) for _ in range(4)])
            net.set_train(True)
            # (with a pipeline every rank holds its replica's loss: the mean over the ranks is the replicas')
            train, val = mean_over_ranks(float(loss.asnumpy()), ranks), mean_over_ranks(val, ranks)
            losses[step] = (train, val)
            say(f"step {step:4d}  train loss {train:.3f}  held-out loss {val:.3f}  "
                f"({time.perf_counter() - start:.0f} s)")
        if args.ckpt_dir and step % args.ckpt_steps == 0:
            save_state(args, step, train_step, opt, rng, losses, skipped, rank, ranks)
    if manager is not None:
        say(f"loss scale {float(train_step.scale_sense.asnumpy().reshape(-1)[0]):g}, "
            f"{skipped} of {args.steps} steps skipped (overflow)")
    if args.pipeline > 1:  # each rank trained its stage: the whole network on every rank, for the end
        pipeline.gather_parameters()
    with whole_network(net, ranks):  # optimizer parallelism: every weight whole in here, on every rank
        if args.save and rank == 0:
            minidl.save_checkpoint(net, args.save)
        if args.sample and rank == 0:
            prompt = data.train[:args.block // 2][None]
            out = net.generate(Tensor(prompt), args.sample, temperature=0.8, top_k=10)
            print("--- sample ---")
            print(data.decode(out[0]), flush=True)
        params = {p.name: p.asnumpy() for p in net.trainable_params()}
    return {"losses": losses, "params": params}


if __name__ == "__main__":
    main()
