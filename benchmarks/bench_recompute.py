"""Peak traced memory and time of one training step, with and without Cell.recompute().

    python3 benchmarks/bench_recompute.py            # the 20-layer MLP and ResNet-20, both modes

Peak: the most NumPy memory (NumPy reports its allocations to tracemalloc) above what was held
before the step, with the kernels' pool of reused blocks off (every array NumPy's, allocated when
made). Time: the fastest of 7 steps after 2 untimed ones, pool on (the default).
"""
import os
import sys
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # minidl from this checkout
import minidl  # noqa: E402
from minidl import Tensor, kernels, nn  # noqa: E402
from minidl.models import resnet20  # noqa: E402


class DenseBlock(nn.Cell):
    def __init__(self, width):
        super().__init__()
        self.fc, self.relu = nn.Dense(width, width), nn.ReLU()

    def construct(self, x):
        return self.relu(self.fc(x))


class Segment(nn.Cell):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.CellList(blocks)

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class DeepMLP(nn.Cell):
    """20 Dense + ReLU layers of width 256, in 4 segments of 5 (each recomputed as one), and a head."""

    def __init__(self, width=256, depth=20, segments=4):
        super().__init__()
        per = depth // segments
        self.segments = nn.CellList([Segment([DenseBlock(width) for _ in range(per)]) for _ in range(segments)])
        self.head = nn.Dense(width, 10)

    def construct(self, x):
        for segment in self.segments:
            x = segment(x)
        return self.head(x)

    def recompute_parts(self):
        for segment in self.segments:
            segment.recompute()


def resnet20_recomputed_blocks(net):
    for stage in net.layers:
        for block in stage:
            block.recompute()


CASES = {
    "20-layer MLP (batch 256, width 256)": (DeepMLP, DeepMLP.recompute_parts, (256, 256)),
    "ResNet-20 (batch 32, 32x32)": (resnet20, resnet20_recomputed_blocks, (32, 3, 32, 32)),
}


def measure(build, mark, shape, recompute):
    minidl.set_seed(0)
    net = build()
    if recompute:
        mark(net)
    net.set_train()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    x = Tensor(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    y = Tensor(np.zeros(shape[0], np.int32))

    def step():
        _, grads = grad_fn(x, y)
        opt(grads)

    with kernels.option("buffer_pool", False):
        step()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        step()
        peak = tracemalloc.get_traced_memory()[1] - before
        tracemalloc.stop()
    step()
    step()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return peak, min(times)


def main():
    for mode_name, mode in (("PYNATIVE_MODE", minidl.PYNATIVE_MODE), ("GRAPH_MODE", minidl.GRAPH_MODE)):
        minidl.set_context(mode=mode)
        for name, (build, mark, shape) in CASES.items():
            plain_peak, plain_time = measure(build, mark, shape, False)
            peak, step_time = measure(build, mark, shape, True)
            print(f"{mode_name:13s} {name:36s} peak {plain_peak / 2**20:6.2f} -> {peak / 2**20:6.2f} MiB "
                  f"({100 * (1 - peak / plain_peak):4.1f}% less); step {1e3 * plain_time:7.1f} -> "
                  f"{1e3 * step_time:7.1f} ms ({100 * (step_time / plain_time - 1):+5.1f}%)")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
