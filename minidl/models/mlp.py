"""A multilayer perceptron: Dense layers with ReLU between them."""
from .. import nn


class MLP(nn.Cell):
    """Dense -> ReLU -> ... -> Dense.

    Args:
        sizes: layer widths, input first, e.g. (784, 512, 512, 10).
    """

    def __init__(self, sizes):
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"MLP: sizes needs at least an input and an output width, got {sizes}")
        layers = []
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Dense(a, b))
            if i < len(sizes) - 2:
                layers.append(nn.ReLU())
        self.net = nn.SequentialCell(layers)

    def construct(self, x):
        return self.net(x)
