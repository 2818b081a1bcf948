"""The bench stages' workers: ResNet-20 training steps per second on the GPU, in minidl and in
PyTorch (its own ResNet-20, the same network) on the same GPU."""
import time

import numpy

from .stages import emit_result
from .training import resnet_data


def _time_steps(step, sync, warmup, steps, rounds):
    """Steps per second: the best of ``rounds`` rounds, each timed between device synchronisations."""
    for _ in range(warmup):
        step()
    sync()
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        sync()  # kernels run asynchronously: the clock stops when the GPU has finished them
        rates.append(steps / (time.perf_counter() - t0))
    return max(rates), rates


def worker_bench(args):
    import cupy
    import minidl
    from minidl import nn, Tensor
    from minidl.models import resnet20
    minidl.set_context(device_target="GPU")
    minidl.set_seed(0)
    net = resnet20()
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    images, labels = resnet_data(1, args.bench_batch)
    x, y = Tensor(images), Tensor(labels)  # uploaded once: the timing is of the step, not the copy

    def step():
        _, grads = grad_fn(x, y)
        opt(grads)
    best, rates = _time_steps(step, cupy.cuda.Device().synchronize, 3, args.bench_steps, 3)  # every stream
    peak = cupy.get_default_memory_pool().total_bytes() / 2 ** 20
    summary = (f"minidl ResNet-20 batch {args.bench_batch}: {best:.2f} steps/s ({best * args.bench_batch:.0f} "
               f"images/s), best of {len(rates)} rounds of {args.bench_steps} steps; pool {peak:.0f} MiB")
    print(summary, flush=True)
    emit_result("passed", summary, steps_per_s=best, rounds=rates, pool_mib=peak)


def worker_bench_torch(args):
    try:
        import torch
    except Exception as exc:
        emit_result("skipped", f"PyTorch does not import: {type(exc).__name__}: {exc}")
        return
    if not torch.cuda.is_available():
        emit_result("skipped", f"PyTorch {torch.__version__} is installed without a usable CUDA "
                               f"(torch.version.cuda={torch.version.cuda})")
        return
    # Like for like: CuPy computes float32 in float32 (no TF32 unless CUPY_TF32=1).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    dev = torch.device("cuda")
    net = _torch_resnet20(torch).to(dev).train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    images, labels = resnet_data(1, args.bench_batch)
    x, y = torch.from_numpy(images).to(dev), torch.from_numpy(labels.astype(numpy.int64)).to(dev)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(net(x), y).backward()
        opt.step()
    best, rates = _time_steps(step, torch.cuda.synchronize, 3, args.bench_steps, 3)
    summary = (f"PyTorch {torch.__version__} ResNet-20 batch {args.bench_batch}: {best:.2f} steps/s "
               f"({best * args.bench_batch:.0f} images/s), TF32 off, cuDNN {torch.backends.cudnn.version()}")
    print(summary, flush=True)
    emit_result("passed", summary, steps_per_s=best, rounds=rates)


def _torch_resnet20(torch):
    """minidl.models.resnet20 in PyTorch: 3x3 stem, 3 stages of 3 BasicBlocks, 1x1 option-B shortcuts."""
    tnn = torch.nn

    class Block(tnn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = tnn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = tnn.BatchNorm2d(cout)
            self.conv2 = tnn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = tnn.BatchNorm2d(cout)
            self.down = None if stride == 1 and cin == cout else tnn.Sequential(
                tnn.Conv2d(cin, cout, 1, stride, bias=False), tnn.BatchNorm2d(cout))

        def forward(self, x):
            identity = x if self.down is None else self.down(x)
            out = torch.relu(self.bn1(self.conv1(x)))
            return torch.relu(self.bn2(self.conv2(out)) + identity)

    layers, cin = [tnn.Conv2d(3, 16, 3, 1, 1, bias=False), tnn.BatchNorm2d(16), tnn.ReLU()], 16
    for i, width in enumerate((16, 32, 64)):
        for j in range(3):
            layers.append(Block(cin, width, 2 if i > 0 and j == 0 else 1))
            cin = width
    layers += [tnn.AdaptiveAvgPool2d(1), tnn.Flatten(), tnn.Linear(64, 10)]
    return tnn.Sequential(*layers)
