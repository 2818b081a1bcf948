"""Train a CIFAR ResNet with minidl.

    python examples/resnet_cifar.py                      # synthetic CIFAR-shaped data, ~1 minute on a laptop CPU
    python examples/resnet_cifar.py --arch resnet18 --epochs 3 --batch-size 64 --device GPU

Without a dataset the script trains on a synthetic, learnable CIFAR-shaped problem (each
class is a fixed random image plus noise), so the loss visibly falls within a minute.
"""
import argparse
import time

import numpy as np

import minidl
from minidl import nn, Tensor
from minidl.models import resnet20, resnet18, resnet50

ARCHS = {"resnet20": resnet20, "resnet18": resnet18, "resnet50": resnet50}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train a CIFAR ResNet with minidl.")
    p.add_argument("--arch", choices=sorted(ARCHS), default="resnet20")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--num-samples", type=int, default=640, help="size of the synthetic training set")
    p.add_argument("--device", choices=["CPU", "GPU"], default=None, help="default: GPU when CuPy sees one")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    for name in ("epochs", "batch_size", "num_samples"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    return args


def synthetic_cifar(num_samples, seed, num_classes=10):
    """Images (N, 3, 32, 32) float32 and int64 labels: class template + noise."""
    rng = np.random.default_rng(seed)
    templates = rng.standard_normal((num_classes, 3, 32, 32)).astype(np.float32)
    labels = rng.integers(0, num_classes, num_samples)
    images = templates[labels] + 1.5 * rng.standard_normal((num_samples, 3, 32, 32)).astype(np.float32)
    return images, labels.astype(np.int64)


def main(argv=None):
    args = parse_args(argv)
    print(f"minidl ResNet example: no --data-path given, training {args.arch} on a synthetic, learnable "
          f"CIFAR-shaped dataset ({args.num_samples} images of 3x32x32, 10 classes)", flush=True)
    if args.device:
        minidl.set_context(device_target=args.device)
    minidl.set_seed(args.seed)
    images, labels = synthetic_cifar(args.num_samples, args.seed)

    net = ARCHS[args.arch]()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    optimizer = nn.Momentum(net.trainable_params(), learning_rate=args.lr, momentum=0.9, weight_decay=1e-4)

    def forward_fn(x, y):
        logits = net(x)
        return loss_fn(logits, y), logits

    grad_fn = minidl.value_and_grad(forward_fn, None, optimizer.parameters, has_aux=True)
    steps = args.num_samples // args.batch_size
    print(f"device {minidl.get_context('device_target')}, {steps} steps per epoch, batch {args.batch_size}", flush=True)
    rng = np.random.default_rng(args.seed)
    net.set_train(True)
    for epoch in range(1, args.epochs + 1):
        order = rng.permutation(args.num_samples)
        t0, correct = time.perf_counter(), 0
        for step in range(1, steps + 1):
            idx = order[(step - 1) * args.batch_size: step * args.batch_size]
            x, y = Tensor(images[idx]), Tensor(labels[idx])
            (loss, logits), grads = grad_fn(x, y)
            optimizer(grads)
            correct += int((logits.asnumpy().argmax(1) == labels[idx]).sum())
            if step % 5 == 0 or step == steps:
                print(f"epoch: {epoch} step: {step}, loss is {loss.item():.7f}", flush=True)
        seen = steps * args.batch_size
        print(f"epoch {epoch} done: train accuracy {correct / seen:.3f}, "
              f"{seen / (time.perf_counter() - t0):.1f} images/s", flush=True)


if __name__ == "__main__":
    main()
