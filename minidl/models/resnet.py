"""ResNets for 32x32 inputs (CIFAR-10): ResNet-20 (He et al. 2016, section 4.2) and the
ResNet-18 / ResNet-50 variants with a 3x3 stem and no max-pool.

Convolutions use explicit symmetric padding (pad_mode="pad") so that the networks match
their PyTorch counterparts layer for layer (the benchmark runs both). Shortcuts that change
shape are 1x1 convolutions with BatchNorm ("option B").
"""
from .. import nn, ops


def _conv3x3(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 3, stride=stride, pad_mode="pad", padding=1, has_bias=False,
                     weight_init="he_normal")


def _conv1x1(cin, cout, stride=1):
    return nn.Conv2d(cin, cout, 1, stride=stride, pad_mode="valid", has_bias=False, weight_init="he_normal")


def _shortcut(cin, cout, stride):
    """None when the block keeps its shape, else a 1x1 convolution with BatchNorm."""
    if stride == 1 and cin == cout:
        return None
    return nn.SequentialCell(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))


class BasicBlock(nn.Cell):
    """Two 3x3 convolutions with a residual connection."""

    expansion = 1

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = _conv3x3(cin, cout, stride)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = _conv3x3(cout, cout)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down_sample = _shortcut(cin, cout, stride)

    def construct(self, x):
        identity = x if self.down_sample is None else self.down_sample(x)
        out = self.bn1.with_relu(self.conv1(x))
        return self.bn2.with_relu(self.conv2(out), identity)


class Bottleneck(nn.Cell):
    """1x1 reduce, 3x3, 1x1 expand (x4), with a residual connection."""

    expansion = 4

    def __init__(self, cin, width, stride=1):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = _conv1x1(cin, width)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = _conv3x3(width, width, stride)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = _conv1x1(width, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down_sample = _shortcut(cin, cout, stride)

    def construct(self, x):
        identity = x if self.down_sample is None else self.down_sample(x)
        out = self.bn1.with_relu(self.conv1(x))
        out = self.bn2.with_relu(self.conv2(out))
        return self.bn3.with_relu(self.conv3(out), identity)


class ResNet(nn.Cell):
    """A CIFAR ResNet: 3x3 stem, residual stages, global average pool, Dense classifier.

    Args:
        block: BasicBlock or Bottleneck.
        layers: blocks per stage, e.g. (3, 3, 3) for ResNet-20.
        widths: base channels per stage, e.g. (16, 32, 64).
        num_classes: outputs of the classifier.
        in_channels: channels of the input image.
    """

    def __init__(self, block, layers, widths, num_classes=10, in_channels=3):
        super().__init__()
        if len(layers) != len(widths):
            raise ValueError(f"ResNet: layers {layers} and widths {widths} must have the same length")
        self.conv1 = _conv3x3(in_channels, widths[0])
        self.bn1 = nn.BatchNorm2d(widths[0])
        stages, cin = [], widths[0]
        for i, (n, width) in enumerate(zip(layers, widths)):
            blocks = []
            for j in range(n):
                stride = 2 if (i > 0 and j == 0) else 1
                blocks.append(block(cin, width, stride))
                cin = width * block.expansion
            stages.append(nn.SequentialCell(blocks))
        self.layers = nn.SequentialCell(stages)
        self.mean = ops.ReduceMean(keep_dims=False)
        self.fc = nn.Dense(cin, num_classes)

    def construct(self, x):
        x = self.bn1.with_relu(self.conv1(x))
        x = self.layers(x)
        x = self.mean(x, (2, 3))
        return self.fc(x)


def resnet20(num_classes=10):
    """ResNet-20 for CIFAR-10: 3 stages of 3 basic blocks, 16/32/64 channels (0.27 M parameters)."""
    return ResNet(BasicBlock, (3, 3, 3), (16, 32, 64), num_classes)


def resnet18(num_classes=10):
    """ResNet-18 with a 3x3 stem for 32x32 inputs (11 M parameters)."""
    return ResNet(BasicBlock, (2, 2, 2, 2), (64, 128, 256, 512), num_classes)


def resnet50(num_classes=10):
    """ResNet-50 (bottleneck blocks) with a 3x3 stem for 32x32 inputs (23.5 M parameters)."""
    return ResNet(Bottleneck, (3, 4, 6, 3), (64, 128, 256, 512), num_classes)
