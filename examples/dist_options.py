"""SINGA's distributed CNN example in minidl: one training loop, five ways to communicate.

    python examples/dist_options.py                                   # one process
    mpirun -n 2 python examples/dist_options.py --dist-option fp16
    mpirun -n 2 python examples/dist_options.py --dist-option sparseTopK --spars 0.01
    python -m minidl_parallel.run -n 2 examples/dist_options.py --dist-option partialUpdate

The model is SINGA's MNIST CNN (conv 5x5 x20, pool, conv 5x5 x50, pool, dense 500, dense 10),
the optimizer SGD with momentum 0.9 and weight decay 1e-5 wrapped in ``DistOpt``, and
``--dist-option`` picks SINGA's update: fp32 (``backward_and_update``), fp16
(``backward_and_update_half``), partialUpdate (``backward_and_partial_update``), sparseTopK
and sparseThreshold (``backward_and_sparse_update`` with ``topK`` True/False, ``--spars``,
error feedback on). minidl adds Horovod's bf16 compression, accumulate4 (4 backward passes
per reduction, the loss scaled by 1/4) and adasum, through ``DistributedOptimizer``;
``--model mlp`` swaps the CNN for SINGA's MLP. The data is a learnable MNIST-shaped problem (each class a fixed random
image plus noise; every rank reads its own shard), so it runs anywhere in seconds.

Each epoch rank 0 prints the mean training loss, the accuracy on held-out data and the time;
``--summary FILE`` writes a JSON line with those and the bytes each rank sent per step
(benchmarks/bench_dist_options.py reads it).
"""
import argparse
import json
import time

import numpy as np

import minidl
import minidl_parallel as mp
from minidl import Tensor, nn

SINGA_OPTIONS = ("fp32", "fp16", "partialUpdate", "sparseTopK", "sparseThreshold")
# Horovod's options, through mp.DistributedOptimizer in the same loop (not in SINGA's example)
HOROVOD_OPTIONS = ("bf16", "accumulate4", "adasum")
OPTIONS = SINGA_OPTIONS + HOROVOD_OPTIONS


class CNN(nn.Cell):
    """SINGA's examples/cnn/model/cnn.py."""

    def __init__(self, num_classes=10, channels=1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, 20, 5, pad_mode="valid", has_bias=True)
        self.conv2 = nn.Conv2d(20, 50, 5, pad_mode="valid", has_bias=True)
        self.pool = nn.MaxPool2d(2, 2)
        self.relu = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Dense(50 * 4 * 4, 500)
        self.fc2 = nn.Dense(500, num_classes)

    def construct(self, x):
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        return self.fc2(self.relu(self.fc1(self.flatten(x))))


def mlp(num_classes=10):
    """SINGA's examples/mlp: 784 -> 500 -> 10 on flattened images."""
    return nn.SequentialCell(nn.Flatten(), nn.Dense(28 * 28, 500), nn.ReLU(), nn.Dense(500, num_classes))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="SINGA's distributed CNN example, in minidl.")
    p.add_argument("--dist-option", choices=OPTIONS, default="fp32")
    p.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    p.add_argument("--spars", type=float, default=None,
                   help="sparseTopK: fraction of entries sent (default 0.05); sparseThreshold: |g| >= spars "
                        "(default 0.05)")
    p.add_argument("--threshold", type=int, default=2097152,
                   help="SINGA's threshold: elements per fused buffer, and per chunk of partialUpdate (with the "
                        "default the whole CNN is one chunk, averaged every step)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--num-samples", type=int, default=1024, help="training images (all ranks together)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--summary", help="write a JSON line of results here (rank 0)")
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "num_samples", "threshold"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.spars is None:
        args.spars = 0.05
    return args


def synthetic_mnist(n, seed, split, num_classes=10):
    """MNIST-shaped (N, 1, 28, 28) float32 images: a fixed random template per class (from seed)
    plus noise (from seed and split, so the training and test images differ)."""
    templates = np.random.default_rng(seed).standard_normal((num_classes, 1, 28, 28)).astype(np.float32)
    rng = np.random.default_rng([seed, split])
    labels = rng.integers(0, num_classes, n).astype(np.int32)
    return templates[labels] + 1.0 * rng.standard_normal((n, 1, 28, 28)).astype(np.float32), labels


def horovod_optimizer(inner, option):
    if option == "bf16":
        return mp.DistributedOptimizer(inner, compression=mp.Compression.bf16)
    if option == "accumulate4":
        return mp.DistributedOptimizer(inner, backward_passes_per_step=4)
    return mp.DistributedOptimizer(inner, op=mp.Adasum)


def update(sgd, loss, option, spars, threshold):
    if option in HOROVOD_OPTIONS:  # Horovod's way: backward, then step on the parameters' .grad
        if option == "accumulate4":
            loss = loss / 4  # the mean over the 4 micro-batches, as Horovod's examples scale it
        loss.backward()
        sgd.step()
        sgd.zero_grad()
    elif option == "fp32":
        sgd.backward_and_update(loss, threshold)
    elif option == "fp16":
        sgd.backward_and_update_half(loss, threshold)
    elif option == "partialUpdate":
        sgd.backward_and_partial_update(loss, threshold)
    else:
        sgd.backward_and_sparse_update(loss, threshold, topK=option == "sparseTopK", spars=spars, corr=True)


def main(argv=None):
    args = parse_args(argv)
    minidl.set_seed(args.seed)
    net = CNN() if args.model == "cnn" else mlp()
    inner = nn.SGD(net.trainable_params(), args.lr, momentum=0.9, weight_decay=1e-5)
    dist = mp.DistOpt(inner)  # joins the world (mpirun: mpi; alone: a world of one)
    sgd = horovod_optimizer(inner, args.dist_option) if args.dist_option in HOROVOD_OPTIONS else dist
    rank, size = dist.global_rank, dist.world_size
    mp.broadcast_parameters(net.parameters_dict(), root_rank=0)  # every rank starts from rank 0's model
    x, y = synthetic_mnist(args.num_samples, args.seed, 0)
    test_x, test_y = synthetic_mnist(512, args.seed, 1)
    mine = np.arange(rank, args.num_samples, size)  # this rank's shard
    steps = len(mine) // args.batch_size
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"minidl dist_options: {args.dist_option} on {size} rank(s), {steps} steps per epoch, batch "
        f"{args.batch_size} per rank")
    result = {}
    for epoch in range(args.epochs):
        net.set_train(True)
        order = np.random.default_rng([args.seed, epoch]).permutation(mine)
        losses, start = [], time.perf_counter()
        with mp.CommCounter() as counter:
            for s in range(steps):
                rows = order[s * args.batch_size:(s + 1) * args.batch_size]
                loss = loss_fn(net(Tensor(x[rows])), Tensor(y[rows]))
                update(sgd, loss, args.dist_option, args.spars, args.threshold)
                losses.append(float(loss.asnumpy()))
        seconds = time.perf_counter() - start
        net.set_train(False)
        with minidl.no_grad():
            predicted = np.argmax(net(Tensor(test_x)).asnumpy(), axis=1)
        accuracy = float(np.mean(predicted == test_y))
        train_loss = float(dist.communicator.allreduce(np.array([np.mean(losses)]), "mean")[0])
        say(f"epoch {epoch + 1}: loss {train_loss:.4f}, test accuracy {accuracy:.3f}, {seconds:.2f} s "
            f"({1000 * seconds / steps:.1f} ms/step), {counter.bytes(phase='gradients') / steps:.0f} B/step sent")
        result = {"option": args.dist_option, "model": args.model, "spars": args.spars, "ranks": size, "epochs": epoch + 1,
                  "loss": train_loss, "accuracy": accuracy, "ms_per_step": 1000 * seconds / steps,
                  "bytes_per_step": counter.bytes(phase="gradients") / steps}
    if args.summary and rank == 0:
        with open(args.summary, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
