"""Nothing of a training step outlives it: after ``loss, grads = grad_fn(x, y)``, the optimizer's
update and ``del loss, grads``, the memory NumPy still holds (NumPy reports its allocations to
tracemalloc) is far below one activation's size, on the kernels as on the reference bodies.

Whatever a kernel needs between forward and backward lives on the autograd node and goes with
the graph; a module-level cache, a kept work buffer, or a thread still holding the closure of its
last task (minidl/kernels/cpu/threads.py's pool did) would keep a step's arrays. The kernels'
pool of reused blocks (buffers.py) keeps its blocks, made in the first step; every one of them
must be free after the steps. The options send every
size down the routes the large models take: the intra-op threads (map_rows, parallel_map), the
BatchNorm kernels and the conv routes' chunks.
"""
import contextlib
import gc
import tracemalloc

import numpy as np
import pytest

import minidl
from minidl import kernels, nn
from minidl.kernels.cpu import buffers, threads as intra_op

pytestmark = pytest.mark.cpu_only

BATCH, FEATURES, HIDDEN = 64, 512, 1024  # the MLP's hidden activation: 256 KiB in float32
SMALL = {"parallel_min_bytes": 0, "batchnorm_min_bytes": 0, "batchnorm_parallel_bytes": 0,
         "images_per_chunk": 2}


@contextlib.contextmanager
def settings(threads=2, mode=minidl.PYNATIVE_MODE, **options):
    """Intra-op threads, execution mode and kernel options for the block, restored after it."""
    before = intra_op.get_num_threads(), minidl.get_context("mode"), {k: kernels.get_option(k) for k in options}
    intra_op.set_num_threads(threads)
    minidl.set_context(mode=mode)
    for k, v in options.items():
        kernels.set_option(k, v)
    try:
        yield
    finally:
        intra_op.set_num_threads(before[0])
        minidl.set_context(mode=before[1])
        for k, v in before[2].items():
            kernels.set_option(k, v)


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        self.l1, self.relu, self.l2 = nn.Dense(FEATURES, HIDDEN), nn.ReLU(), nn.Dense(HIDDEN, 10)

    def construct(self, x):
        return self.l2(self.relu(self.l1(x)))


class ConvNet(nn.Cell):
    """An RGB stem (im2col), a 16-channel conv (taps), a strided conv (phases), BatchNorms."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, pad_mode="pad", padding=1)
        self.b1, self.relu = nn.BatchNorm2d(16), nn.ReLU()
        self.c2 = nn.Conv2d(16, 16, 3, pad_mode="pad", padding=1)
        self.b2 = nn.BatchNorm2d(16)
        self.c3 = nn.Conv2d(16, 16, 3, stride=2, pad_mode="pad", padding=1)
        self.flatten, self.fc = nn.Flatten(), nn.Dense(16 * 8 * 8, 10)

    def construct(self, x):
        x = self.relu(self.b1(self.c1(x)))
        x = self.relu(self.b2(self.c2(x)))
        return self.fc(self.flatten(self.relu(self.c3(x))))


def left_after_steps(net, x, steps=2):
    """(bytes still traced after ``steps`` training steps, less those before; the kernels that ran)."""
    net.set_train()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    grad_fn = minidl.value_and_grad(lambda a, b: loss_fn(net(a), b), None, opt.parameters)
    x = minidl.Tensor(x)
    y = minidl.Tensor(np.random.default_rng(1).integers(0, 10, x.shape[0]).astype(np.int32))

    def step():
        loss, grads = grad_fn(x, y)
        opt(grads)
        del loss, grads

    step()  # first calls: compiled loops, the pool's threads, oneDNN's plans, the optimizer's state
    gc.collect()
    tracemalloc.start()
    try:
        with kernels.tracking() as used:
            for _ in range(steps):
                step()
        gc.collect()
        held, free = buffers.held_bytes()
        assert free == held, f"{held - free} bytes of the kernels' pool still in use after the steps"
        # What the steps allocated and is still alive, in blocks of SMALLEST_COUNTED bytes or more.
        alive = tracemalloc.take_snapshot().traces
        return sum(trace.size for trace in alive if trace.size >= SMALLEST_COUNTED), {k.name for k in used}
    finally:
        tracemalloc.stop()


def mlp_input():
    return np.random.default_rng(0).standard_normal((BATCH, FEATURES)).astype(np.float32)


def images():
    return np.random.default_rng(0).standard_normal((8, 3, 16, 16)).astype(np.float32)


# A step's arrays (activations, gradients, kernel scratch) are far larger than this. Smaller blocks are
# the interpreter's: freed tuples and lists kept on its free lists, caches filled as threads meet
# oneDNN's run slots; together 7 to 17 KB, varying with the threads' timing, so not counted.
SMALLEST_COUNTED = 1024
ACTIVATION = BATCH * HIDDEN * 4
IMAGE_ACTIVATION = 8 * 16 * 16 * 16 * 4  # 128 KiB


@pytest.mark.usefixtures("kernels_on")
@pytest.mark.parametrize("mode", [minidl.PYNATIVE_MODE, minidl.GRAPH_MODE], ids=["pynative", "graph"])
def test_an_mlp_step_on_the_kernels_keeps_nothing(mode):
    with settings(mode=mode, **SMALL):
        left, used = left_after_steps(MLP(), mlp_input())
    # PyNative: ReLURows' backward on the intra-op threads (map_rows); graph mode fuses the ReLU
    # into DenseReLU, whose sweeps run compiled where Numba is installed.
    assert used & {"ReLURows", "DenseReLUBLAS"}, sorted(used)
    assert left < ACTIVATION // 8, f"{left} bytes outlived the steps (kernels {sorted(used)})"


def test_an_mlp_step_on_the_reference_keeps_nothing():
    with settings(**SMALL), kernels.reference_only():
        left, used = left_after_steps(MLP(), mlp_input())
    assert not used
    assert left < ACTIVATION // 8, f"{left} bytes outlived the steps"


@pytest.mark.usefixtures("kernels_on")
@pytest.mark.parametrize("mode", [minidl.PYNATIVE_MODE, minidl.GRAPH_MODE], ids=["pynative", "graph"])
@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "routes"])
def test_a_conv_batchnorm_step_on_the_kernels_keeps_nothing(mode, onednn):
    with settings(mode=mode, onednn=onednn, **SMALL):
        left, used = left_after_steps(ConvNet(), images())
    assert used & {"BatchNormBlocked", "BatchNormReLUBlocked"}, sorted(used)
    assert used & {"Conv2DOneDNN", "Conv2DRoutes"}, sorted(used)
    assert left < IMAGE_ACTIVATION // 8, f"{left} bytes outlived the steps (kernels {sorted(used)})"


@pytest.mark.parametrize("mode", [minidl.PYNATIVE_MODE, minidl.GRAPH_MODE], ids=["pynative", "graph"])
def test_a_conv_batchnorm_step_on_the_reference_keeps_nothing(mode):
    with settings(mode=mode, **SMALL), kernels.reference_only():
        left, used = left_after_steps(ConvNet(), images())
    assert not used
    assert left < IMAGE_ACTIVATION // 8, f"{left} bytes outlived the steps"
