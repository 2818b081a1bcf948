"""The PyTorch twins of the benchmarked minidl models (imports torch only).

ResNet-20 as ``minidl.models.resnet20`` and models_minidl.resnet20_user: 3x3 stem, three
stages of three basic blocks (16, 32, 64 channels; stride 2 and a 1x1 convolution with
BatchNorm on the shortcut where the shape changes), global average pool, one Linear; no
convolution bias. The MLP is 784-512-512-10 with ReLU between. Written as a PyTorch user
writes them, with separate Conv2d, BatchNorm2d and ReLU modules.
"""
import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.down_sample = None
        if stride != 1 or cin != cout:
            self.down_sample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down_sample is None else self.down_sample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def resnet20(num_classes=10):
    layers, cin = [nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU()], 16
    for i, width in enumerate((16, 32, 64)):
        for j in range(3):
            layers.append(BasicBlock(cin, width, 2 if i > 0 and j == 0 else 1))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes)]
    return nn.Sequential(*layers)


def mlp(sizes=(784, 512, 512, 10)):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def step_fn(arch):
    """A training step ``step(x, y) -> loss`` (SGD with momentum 0.9, cross-entropy) of ``arch``."""
    torch.manual_seed(0)
    net = resnet20() if arch == "resnet20" else mlp()
    net.train()
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        return loss
    return step
