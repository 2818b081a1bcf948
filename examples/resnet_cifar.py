"""Train a CIFAR ResNet with minidl.

    python examples/resnet_cifar.py                                   # synthetic data, ~1 minute on a laptop CPU
    python examples/resnet_cifar.py --data-path ~/data/cifar-10-batches-bin --epochs 30 --batch-size 128
    python examples/resnet_cifar.py --arch resnet18 --device GPU --ckpt-dir ckpt --resume-from ckpt/resnet-3_390.ckpt
    mpirun -n 8 python examples/resnet_cifar.py --log-file log.jsonl  # data parallel: 8 processes (MPI or NCCL)
    mpirun -n 4 python examples/resnet_cifar.py --pipeline 2          # 2 pipeline stages x 2 data-parallel replicas
    python -m minidl_parallel.run -n 8 --max-restarts 3 examples/resnet_cifar.py --ckpt-dir ckpt --ckpt-steps 10
                                               # survives 3 lost ranks: resumes from ckpt, ends bit-identical

With --data-path it reads the official CIFAR-10 binary release (the unpacked
`cifar-10-batches-bin/` folder), trains with random crops and flips, and evaluates on the
test batch after every epoch. Without it, it trains on a synthetic, learnable CIFAR-shaped
dataset (each class a fixed random image plus noise), so the loss visibly falls at once.

Launched by mpirun (``--parallel auto``, the default), it calls ``minidl_parallel.init()``
(NCCL on GPUs, MPI on CPUs) and trains data-parallel: gradients averaged over ranks
(``gradients_mean=True``), every rank starting from rank 0's parameters
(``parameter_broadcast=True``), each rank reading its own shard of every epoch (the datasets
are built with ``num_shards=get_group_size(), shard_id=get_rank()``), so ``--batch-size`` is
per rank and the global batch is ``batch-size x ranks``. Everything is printed once, by
rank 0: this script's own messages, rank 0's local loss and epoch times (``LossMonitor`` and
``TimeMonitor`` with ``rank0_only=True``; without it every rank prints its own, each line
prefixed ``[rank r]``), and the evaluation, which covers the whole test set (every rank
computes the same values).
The metrics log (``--log-file``) is written by rank 0; put ``{rank}`` in its name for one
file per rank. The ResNets keep plain BatchNorm2d, whose statistics stay local to each rank
(as in MindSpore and PyTorch); for exactly the single-process result on the global batch,
use ``minidl_parallel.nn.SyncBatchNorm``.

``--pipeline P`` (with P x D ranks) cuts the ResNet by depth into P stages (MindSpore's
``pipeline_stages``, ``cell.pipeline_stage`` and ``nn.PipelineCell``, under SEMI_AUTO_PARALLEL):
the stem (conv1, bn1) on stage 0, the residual blocks split in order over the stages, the
classifier on the last. The other D ranks are data parallel: stage s runs on ranks
[s*D, (s+1)*D), and replica ``rank % D`` reads shard ``rank % D`` of D (so ``--batch-size`` is per
replica). Each batch is cut into ``--micro-batches M`` (default P, at least P; BatchNorm normalises
each micro-batch) that flow as ``--schedule 1f1b`` or ``gpipe`` orders them; rank 0 prints the
schedule. PipelineCell returns the sum of the micro-batch losses (MindSpore's); the example trains
on the sum divided by M, the mean loss of the batch, so the learning rate means what it means
without a pipeline (``--pipeline 1 --micro-batches M`` runs the same micro-batches on one
process, and ``--pipeline P`` equals it). Each rank trains only its stage's cells, so after
training every parameter (BatchNorm statistics included) is broadcast from its stage's first rank,
and every rank then evaluates the whole evaluation set with the whole network (the same numbers on
every rank; no per-epoch evaluation under a pipeline). With --ckpt-dir each rank saves its stage's
part (``resnet20-E_S.ckpt`` and ``_rank{r}`` beside it); --resume-from continues at the same stage
count, and ``minidl_parallel.load_segmented_checkpoints`` loads the files into any other.

Under ``python -m minidl_parallel.run --max-restarts K`` with ``--ckpt-dir``, a job that loses a rank
restarts and ``Model.train`` resumes by itself from the newest checkpoint every rank wrote
(``--ckpt-steps`` sets how often: a restart repeats at most the steps since the last one); the
final parameters equal the uninterrupted run's, bit for bit (docs/reliability.md#restarts). An
elastic restart on fewer ranks (``--min-np``, ``--max-np``, ``--host-discovery-script``) keeps the
global batch, each rank taking more rows; ``--keep-batch per_rank`` keeps ``--batch-size`` instead.
"""
import argparse

import numpy as np

import minidl
from minidl import nn
from minidl.dataset import Cifar10Dataset, NumpySlicesDataset, vision, transforms
from minidl.models import resnet20, resnet18, resnet50
from minidl.train import Model, LossMonitor, TimeMonitor, ModelCheckpoint, CheckpointConfig

ARCHS = {"resnet20": resnet20, "resnet18": resnet18, "resnet50": resnet50}
CIFAR_MEAN = [0.4914, 0.4822, 0.4465]
CIFAR_STD = [0.2470, 0.2435, 0.2616]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a CIFAR ResNet with minidl.")
    p.add_argument("--data-path", help="the cifar-10-batches-bin folder; default: synthetic data")
    p.add_argument("--arch", choices=sorted(ARCHS), default="resnet20")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank (per replica with --pipeline)")
    p.add_argument("--global-batch-size", type=int,
                   help="the batch of all replicas together, cut evenly among them (instead of --batch-size)")
    p.add_argument("--keep-batch", choices=["global", "per_rank"], default="global",
                   help="what a resume on another number of ranks (an elastic restart) keeps: the global batch "
                        "(each rank's batch resized) or each rank's batch (Model.train's keep_batch)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--num-samples", type=int, default=640, help="size of the synthetic training set")
    p.add_argument("--device", choices=["CPU", "GPU"], default=None, help="default: GPU when CuPy sees one")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ckpt-dir", help="save a checkpoint every epoch (or --ckpt-steps) into this folder")
    p.add_argument("--ckpt-steps", type=int, help="save every this many steps (default: every epoch)")
    p.add_argument("--resume-from", help="a checkpoint written by --ckpt-dir to continue from")
    p.add_argument("--log-file", help="write one JSON line per step (plot with python -m minidl.plot); rank 0 "
                                      "writes it, or every rank its own when the name holds {rank}")
    p.add_argument("--parallel", choices=["auto", "none"], default="auto",
                   help="auto: data parallel when launched by mpirun (needs minidl_parallel); none: never")
    p.add_argument("--pipeline", type=int, default=1,
                   help="pipeline stages P (the world a multiple of P; the rest is data parallel); 1: none")
    p.add_argument("--micro-batches", type=int,
                   help="micro-batches per step (default P, at least P); --batch-size is cut into them")
    p.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b", help="the pipeline's schedule")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "num_samples", "pipeline", "ckpt_steps", "global_batch_size"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.micro_batches is None:
        args.micro_batches = args.pipeline
    if args.micro_batches < args.pipeline:
        p.error(f"--micro-batches must be >= --pipeline ({args.pipeline}), as MindSpore's PipelineCell requires, "
                f"got {args.micro_batches}")
    if args.batch_size % args.micro_batches:
        p.error(f"--batch-size {args.batch_size} must be a multiple of --micro-batches {args.micro_batches} (each "
                f"batch is cut into equal micro-batches)")
    if args.pipeline > 1:
        if args.parallel == "none":
            p.error(f"--pipeline {args.pipeline} does not combine with --parallel none (its stages are ranks): "
                    f"drop it, or use --pipeline 1")
    return args


def shards(rank, size):
    """The sharding arguments of this rank's datasets: its own shard when data parallel, else none."""
    return dict(num_shards=size, shard_id=rank) if size > 1 else {}


def cifar_datasets(path, batch_size, rank=0, size=1):
    """Training pipeline with augmentation, test pipeline without; both batched, vectorised.

    Under data parallelism each rank reads its shard: training pads the shards to one length
    (every rank runs as many steps), the test set is split exactly, every image once.
    """
    train = Cifar10Dataset(path, usage="train", shuffle=True, **shards(rank, size))
    train = train.batch(batch_size, drop_remainder=True)
    train = train.map([vision.RandomCrop(32, padding=4), vision.RandomHorizontalFlip(),
                       vision.Rescale(1 / 255, 0), vision.Normalize(CIFAR_MEAN, CIFAR_STD), vision.HWC2CHW()],
                      input_columns="image")
    test = Cifar10Dataset(path, usage="test", shuffle=False, shard_mode="exact", **shards(rank, size))
    test = test.batch(batch_size)
    test = test.map([vision.Rescale(1 / 255, 0), vision.Normalize(CIFAR_MEAN, CIFAR_STD), vision.HWC2CHW()],
                    input_columns="image")
    train, test = (ds.map(transforms.TypeCast(np.int32), input_columns="label") for ds in (train, test))
    return train, test


def synthetic_dataset(num_samples, batch_size, seed, num_classes=10, rank=0, size=1):
    """A learnable CIFAR-shaped problem: NCHW float32 images (class template + noise), this rank's shard."""
    rng = np.random.default_rng(seed)  # the same images on every rank: each then reads its shard
    templates = rng.standard_normal((num_classes, 3, 32, 32)).astype(np.float32)
    labels = rng.integers(0, num_classes, num_samples).astype(np.int32)
    images = templates[labels] + 1.5 * rng.standard_normal((num_samples, 3, 32, 32)).astype(np.float32)
    data = {"image": images, "label": labels}
    ds = NumpySlicesDataset(data, column_names=["image", "label"], shuffle=True, **shards(rank, size))
    return ds.batch(batch_size, drop_remainder=True)


def setup_parallel(mode, pipeline=1, schedule="1f1b"):
    """Under mpirun (mode auto): joins the world and turns on data parallelism, or with ``pipeline`` > 1
    a pipeline of that many stages (x data parallelism over the rest); returns (rank, size)."""
    if mode == "none":
        return 0, 1
    try:
        import minidl_parallel as mp
        from minidl_parallel.context import launched_under_mpi
    except ImportError:
        if pipeline > 1:
            raise SystemExit(f"--pipeline {pipeline} needs minidl_parallel (pip install -e '.[mpi]')")
        return 0, 1
    if not launched_under_mpi():
        if pipeline > 1:
            raise SystemExit(f"--pipeline {pipeline} needs {pipeline} x D processes, one per stage and replica: "
                             f"launch with mpirun -n {pipeline} or python -m minidl_parallel.run -n {pipeline}")
        return 0, 1
    mp.init()
    if pipeline > 1:
        size = mp.get_group_size()
        if size % pipeline:
            raise SystemExit(f"--pipeline {pipeline}: the world has {size} ranks, which is not a multiple of "
                             f"{pipeline} (P stages x D data-parallel replicas)")
        # The stages' gradients are averaged over their replicas inside the PipelineCell (gradients_mean).
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.SEMI_AUTO_PARALLEL, gradients_mean=True,
                                     pipeline_stages=pipeline, pipeline_config={"pipeline_scheduler": schedule})
        return mp.get_rank(), size
    # Model.train asks for the gradient reducer this mode gives when training starts; the
    # datasets are sharded explicitly, with the rank and size returned here.
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 parameter_broadcast=True)
    return mp.get_rank(), mp.get_group_size()


def cut_into_stages(net, stages):
    """Sets ``pipeline_stage`` on the ResNet's cells: the stem (conv1, bn1) and the residual blocks, in
    order, split into runs of nearly equal length, the stem on stage 0 and the classifier on the last."""
    units = [net.conv1, net.bn1] + [block for stage in net.layers for block in stage] + [net.fc]
    for k, unit in enumerate(units):
        unit.pipeline_stage = k * stages // len(units)


class MicroBatchMean(nn.Cell):
    """The PipelineCell's loss (the sum of its micro-batch losses, MindSpore's) divided by their number:
    the batch's mean loss, so that the learning rate means what it means without a pipeline."""

    def __init__(self, pipeline):
        super().__init__(auto_prefix=False)
        self.pipeline = pipeline
        self.scale = 1.0 / pipeline.micro_size

    def construct(self, *inputs):
        return self.pipeline(*inputs) * self.scale


def main(argv=None):
    args = parse_args(argv)
    if args.device:
        minidl.set_context(device_target=args.device)  # before init: it picks nccl on GPU
    rank, size = setup_parallel(args.parallel, args.pipeline, args.schedule)
    # Data parallel replicas: every rank without a pipeline; with one, the ranks of a stage (all the
    # stages of replica r read its shard).
    replicas = size // args.pipeline
    replica = rank % replicas
    if args.global_batch_size:
        if args.global_batch_size % replicas:
            raise SystemExit(f"--global-batch-size {args.global_batch_size} must be a multiple of the {replicas} "
                             f"data-parallel replica(s)")
        args.batch_size = args.global_batch_size // replicas
        if args.batch_size % args.micro_batches:
            raise SystemExit(f"--global-batch-size {args.global_batch_size} gives {args.batch_size} per replica, not a "
                             f"multiple of --micro-batches {args.micro_batches}")

    def say(message):
        """This script's messages: once per job, from rank 0 (as the monitors below print)."""
        if rank == 0:
            print(message, flush=True)

    if args.data_path:
        say(f"minidl ResNet example: training {args.arch} on CIFAR-10 from {args.data_path}")
    else:
        say(f"minidl ResNet example: no --data-path given, training {args.arch} on a synthetic, learnable "
            f"CIFAR-shaped dataset ({args.num_samples} images of 3x32x32, 10 classes)")
    if args.pipeline > 1:
        say(f"pipeline of {args.pipeline} stages x {replicas} data-parallel replicas on {size} ranks: batch "
            f"{args.batch_size} per replica, global batch {args.batch_size * replicas}, {args.micro_batches} "
            f"micro-batches of {args.batch_size // args.micro_batches}")
    elif size > 1:
        say(f"data parallel on {size} ranks: batch {args.batch_size} per rank, global batch {args.batch_size * size}")
    minidl.set_seed(args.seed)  # before the datasets: their shuffles and augmentations follow it
    if args.data_path:
        train_ds, test_ds = cifar_datasets(args.data_path, args.batch_size, replica, replicas)
    else:
        train_ds, test_ds = synthetic_dataset(args.num_samples, args.batch_size, args.seed, rank=replica,
                                              size=replicas), None

    net = ARCHS[args.arch]()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    steps = train_ds.get_dataset_size()
    lr = nn.cosine_decay_lr(0.0, args.lr, steps * args.epochs, steps, args.epochs)
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=lr, momentum=0.9, weight_decay=1e-4)
    if args.pipeline > 1 or args.micro_batches > 1:
        from minidl_parallel.nn import PipelineCell
        if args.pipeline > 1:
            cut_into_stages(net, args.pipeline)
        pipeline = PipelineCell(nn.WithLossCell(net, loss_fn), args.micro_batches)
        model = Model(MicroBatchMean(pipeline), optimizer=optimizer)
    else:
        model = Model(net, loss_fn, optimizer, metrics={"accuracy"})
    say(f"device {minidl.get_context('device_target')}, {steps} steps per epoch, batch {args.batch_size}")
    if args.pipeline > 1:
        say(str(pipeline.schedule()))
    # Rank 0's lines only: the ranks' losses differ (each its own shard) but tell the same story.
    callbacks = [LossMonitor(per_print_times=max(1, steps // 4), rank0_only=True), TimeMonitor(rank0_only=True)]
    if args.ckpt_dir:
        callbacks.append(ModelCheckpoint(prefix=args.arch, directory=args.ckpt_dir,
                                         config=CheckpointConfig(save_checkpoint_steps=args.ckpt_steps or steps,
                                                                 keep_checkpoint_max=3)))
    if args.pipeline > 1:
        train_pipeline(args, model, pipeline, net, loss_fn, train_ds, callbacks, say)
    elif test_ds is not None:
        model.fit(args.epochs, train_ds, test_ds, callbacks=callbacks, resume_from=args.resume_from,
                  log_file=args.log_file, keep_batch=args.keep_batch)
    else:
        model.train(args.epochs, train_ds, callbacks=callbacks, resume_from=args.resume_from, log_file=args.log_file,
                    keep_batch=args.keep_batch)
        if args.micro_batches > 1:  # (the PipelineCell's Model has no metrics: evaluate the network itself)
            model = Model(net, loss_fn, metrics={"accuracy"})
        accuracy = model.eval(train_ds)["accuracy"]  # every rank takes part: the shards' counts are added up
        say(f"train accuracy: {accuracy:.3f}")


def train_pipeline(args, model, pipeline, net, loss_fn, train_ds, callbacks, say):
    """Trains the stages, gathers the whole network on every rank, and evaluates it there."""
    model.train(args.epochs, train_ds, callbacks=callbacks, resume_from=args.resume_from, log_file=args.log_file,
                keep_batch=args.keep_batch)
    pipeline.gather_parameters()  # each rank trained its stage: the whole network on every rank
    # Every rank evaluates the whole set alone (a dataset no rank shards): the same numbers on each.
    if args.data_path:
        whole, what = cifar_datasets(args.data_path, args.batch_size)[1], "test"
    else:
        whole, what = synthetic_dataset(args.num_samples, args.batch_size, args.seed), "train"
    accuracy = Model(net, loss_fn, metrics={"accuracy"}).eval(whole)["accuracy"]
    say(f"{what} accuracy: {accuracy:.3f}")


if __name__ == "__main__":
    main()
