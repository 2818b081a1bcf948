"""MindSpore's operator-level parallel quickstart, on minidl.

    mpirun -n 8 python examples/parallel_quickstart.py              # 8 ranks, MatMul.shard(((2, 4), (4, 1)))
    mpirun -n 8 python examples/parallel_quickstart.py --explain    # also print the plan, operator by operator
    python examples/parallel_quickstart.py --single                 # the single-device reference run

A feed-forward network (in 32, hidden 16, out 16) whose first MatMul is sharded: the batch
cut in 2 and the inner dimension K in 4, the weight's K in 4. Under AUTO_PARALLEL with
sharding propagation the ReLU and the second MatMul follow that layout by themselves; the
framework slices the weights, runs each operator on its blocks, and moves data between
layouts (all-to-all, reduce-scatter, all-reduce) as the plan printed by --explain shows.
MSELoss, Momentum (lr 0.2, momentum 0.1), 5 epochs of 4 steps, a global batch of 16 (2 per
rank on 8 ranks, data_parallel dataset strategy: each rank reads its shard of the rows,
``num_shards=get_group_size(), shard_id=get_rank()``). Every rank prints the same losses,
equal to those of --single (up to float32 rounding).

On fewer ranks the strategy shrinks to ((n / mp, mp), (mp, 1)) with mp = min(4, n).
"""
import argparse

import numpy as np

import minidl
from minidl import nn, ops, Parameter
from minidl.common.initializer import initializer
from minidl.dataset import NumpySlicesDataset
from minidl.train import Model, LossMonitor
import minidl_parallel as mp

GLOBAL_BATCH = 16


class Dense(nn.Cell):
    """x @ weight + bias with a MatMul that can be sharded."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.weight = Parameter(initializer("normal", [in_channels, out_channels], minidl.float32))
        self.bias = Parameter(initializer("normal", [out_channels], minidl.float32))
        self.matmul = ops.MatMul()
        self.add = ops.Add()

    def construct(self, x):
        return self.add(self.matmul(x, self.weight), self.bias)


class FFN(nn.Cell):
    def __init__(self):
        super().__init__()
        self.dense1 = Dense(32, 16)
        self.relu = ops.ReLU()
        self.dense2 = Dense(16, 16)

    def construct(self, x):
        return self.dense2(self.relu(self.dense1(x)))


def make_data(steps):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((steps * GLOBAL_BATCH, 32)).astype(np.float32)
    y = rng.standard_normal((steps * GLOBAL_BATCH, 16)).astype(np.float32)
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--single", action="store_true", help="run the single-device reference")
    parser.add_argument("--explain", action="store_true", help="print the parallel plan before training")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="steps per epoch")
    args = parser.parse_args()

    minidl.set_seed(1)
    if args.single:
        world, batch = 1, GLOBAL_BATCH
    else:
        mp.init()
        world = mp.get_group_size()
        if GLOBAL_BATCH % world:
            raise SystemExit(f"parallel_quickstart: the global batch {GLOBAL_BATCH} must divide by the number of "
                             f"ranks, got {world}")
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.AUTO_PARALLEL,
                                     search_mode="sharding_propagation", dataset_strategy="data_parallel")
        batch = GLOBAL_BATCH // world
    net = FFN()
    if not args.single:
        cut = min(4, world)
        net.dense1.matmul.shard(((world // cut, cut), (cut, 1)))
        if mp.get_rank() == 0:
            print(f"parallel_quickstart: {world} rank(s), dense1.matmul.shard({net.dense1.matmul.in_strategy}), "
                  f"batch {batch} per rank")

    x, y = make_data(args.steps)
    # dataset_strategy "data_parallel": each rank reads its own rows, asked for explicitly (datasets are
    # never sharded implicitly); batch s of the ranks together is rows [16 s, 16 (s + 1)), as in --single.
    shards = {} if args.single else dict(num_shards=world, shard_id=mp.get_rank())
    dataset = NumpySlicesDataset({"data": x, "label": y}, shuffle=False, **shards).batch(batch)
    if args.explain and not args.single:
        mp.explain(net, minidl.Tensor(x[:batch]))
    model = Model(net, loss_fn=nn.MSELoss(), optimizer=nn.Momentum(net.trainable_params(), 0.2, 0.1))
    model.train(args.epochs, dataset, callbacks=[LossMonitor()])


if __name__ == "__main__":
    main()
