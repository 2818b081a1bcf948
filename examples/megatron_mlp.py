"""Megatron-style tensor-parallel MLP blocks, on minidl.

    mpirun --oversubscribe -n 4 python examples/megatron_mlp.py      # 4-way tensor parallel
    python examples/megatron_mlp.py                                  # one process: the reference

Each block is x + W2 ReLU(W1 x): W1 is cut by columns (each rank computes its slice of the
hidden units, no communication) and W2 by rows (each rank a partial sum of the output), so
the block needs exactly one all-reduce in forward, and one in backward (the gradient of the
block's input; the first block's input, the data, needs none). Every rank feeds the whole
batch (dataset_strategy="full_batch"), prints the same loss, and the loss equals the
one-process run. The last line counts the collectives of one training step with
minidl_parallel.CommCounter: with 2 blocks, 2 all-reduces in forward and 1 in backward.
"""
import argparse

import numpy as np

import minidl
from minidl import nn, ops, Parameter, Tensor
import minidl_parallel as mp


class Block(nn.Cell):
    """x + ReLU(x @ w1) @ w2, column- then row-parallel over t ranks."""

    def __init__(self, d, h, t, rng):
        super().__init__()
        self.w1 = Parameter((rng.standard_normal((d, h)) / np.sqrt(d)).astype(np.float32))
        self.w2 = Parameter((rng.standard_normal((h, d)) / np.sqrt(h)).astype(np.float32))
        self.column = ops.MatMul().shard(((1, 1), (1, t)))
        self.relu = ops.ReLU().shard(((1, t),))
        self.row = ops.MatMul().shard(((1, t), (t, 1)))
        self.add = ops.Add().shard(((1, 1), (1, 1)))  # the residual needs the whole sum: the all-reduce

    def construct(self, x):
        return self.add(x, self.row(self.relu(self.column(x, self.w1)), self.w2))


class MLP(nn.Cell):
    def __init__(self, d, h, blocks, t, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.blocks = nn.SequentialCell(*[Block(d, h, t, rng) for _ in range(blocks)])

    def construct(self, x):
        return self.blocks(x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    parallel = mp.launched_under_mpi()
    t = 1
    if parallel:
        mp.init()
        t = mp.get_group_size()
        # AUTO: the loss's operators follow the replicated block output, with no communication.
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.AUTO_PARALLEL, dataset_strategy="full_batch")
    rank = mp.get_rank()
    net = MLP(args.dim, args.hidden, args.blocks, t)
    loss_fn = nn.MSELoss()
    opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, net.trainable_params())
    rng = np.random.default_rng(1)
    x = Tensor(rng.standard_normal((args.batch, args.dim)).astype(np.float32))
    y = Tensor(rng.standard_normal((args.batch, args.dim)).astype(np.float32))
    for step in range(args.steps):
        with mp.CommCounter() as comm:
            loss, grads = grad_fn(x, y)
            opt(grads)
        print(f"rank {rank}: step {step + 1}, loss is {float(loss.asnumpy()):.6f}", flush=True)
    if rank == 0:
        print(f"collectives per step: {comm.count('allreduce', 'forward')} all-reduce(s) in forward, "
              f"{comm.count('allreduce', 'backward')} in backward, {comm.count()} in all "
              f"({args.blocks} blocks, {t}-way tensor parallel)")


if __name__ == "__main__":
    main()
