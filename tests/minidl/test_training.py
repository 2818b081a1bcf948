"""End to end: an MLP and a small CNN learn a fixed, learnable problem to low loss."""
import numpy as np

import minidl
from minidl import nn, ops, Tensor


def _train(net, x, y, steps, lr, momentum=0.9):
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=lr, momentum=momentum)
    grad_fn = minidl.value_and_grad(lambda a, b: loss_fn(net(a), b), None, opt.parameters)
    net.set_train(True)
    losses = []
    for _ in range(steps):
        loss, grads = grad_fn(x, y)
        opt(grads)
        losses.append(loss.item())
    return losses


def _accuracy(net, x, y):
    net.set_train(False)
    with minidl.no_grad():
        return float((net(x).asnumpy().argmax(1) == y.asnumpy()).mean())


def test_mlp_learns_two_spirals():
    rng = np.random.default_rng(0)
    n = 200
    t = rng.uniform(0.5, 3.5, n)
    label = rng.integers(0, 2, n)
    angle = t * 2.0 + np.pi * label
    x = np.stack([t * np.cos(angle), t * np.sin(angle)], 1) + 0.05 * rng.standard_normal((n, 2))
    net = nn.SequentialCell(nn.Dense(2, 64), nn.ReLU(), nn.Dense(64, 64), nn.ReLU(), nn.Dense(64, 2))
    xt, yt = Tensor(x.astype(np.float32)), Tensor(label)
    losses = _train(net, xt, yt, steps=300, lr=0.05)
    assert losses[0] > 0.6
    assert losses[-1] < 0.15, losses[-10:]
    assert _accuracy(net, xt, yt) > 0.95


class SmallCNN(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, pad_mode="pad", padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, pad_mode="pad", padding=1)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(kernel_size=2, stride=2)
        self.flatten = nn.Flatten()
        self.fc = nn.Dense(16 * 2 * 2, 4)

    def construct(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        return self.fc(self.flatten(x))


def test_small_cnn_learns_oriented_bars():
    # Four classes of 8x8 images: a bar that is horizontal, vertical or one of two diagonals,
    # at a random offset, with noise. Only a convolution's local filters see it easily.
    rng = np.random.default_rng(1)
    n = 160
    labels = rng.integers(0, 4, n)
    images = 0.3 * rng.standard_normal((n, 1, 8, 8))
    for i, (c, off) in enumerate(zip(labels, rng.integers(1, 7, n))):
        r = np.arange(8)
        if c == 0:
            images[i, 0, off, :] += 2.0
        elif c == 1:
            images[i, 0, :, off] += 2.0
        elif c == 2:
            images[i, 0, r, r] += 2.0
        else:
            images[i, 0, r, 7 - r] += 2.0
    minidl.set_seed(3)
    net = SmallCNN()
    xt, yt = Tensor(images.astype(np.float32)), Tensor(labels)
    losses = _train(net, xt, yt, steps=60, lr=0.05)
    assert losses[0] > 1.0
    assert losses[-1] < 0.1, losses[-10:]
    assert _accuracy(net, xt, yt) > 0.95
