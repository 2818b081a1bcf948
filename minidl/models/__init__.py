"""Model definitions shared by examples, benchmarks and tests."""
from .resnet import ResNet, BasicBlock, Bottleneck, resnet20, resnet18, resnet50  # noqa: F401
from .mlp import MLP  # noqa: F401
