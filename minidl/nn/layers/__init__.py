"""Layers: dense, convolution, normalization, pooling, activations."""
from .activation import ReLU, Sigmoid, Tanh, Softmax, LogSoftmax, get_activation
from .basic import Dense, Flatten, Dropout, Identity
from .conv import Conv2d, Conv2dTranspose
from .normalization import BatchNorm1d, BatchNorm2d
from .pooling import MaxPool2d, AvgPool2d
from .attention import MultiheadAttention

__all__ = ["ReLU", "Sigmoid", "Tanh", "Softmax", "LogSoftmax", "get_activation", "Dense", "Flatten", "Dropout",
           "Identity", "Conv2d", "BatchNorm1d", "BatchNorm2d", "MaxPool2d", "AvgPool2d"]
__all__ += ["MultiheadAttention"]
from .activation import GELU, LeakyReLU, SiLU  # noqa: E402
from .normalization import LayerNorm, GroupNorm  # noqa: E402
from .embedding import Embedding  # noqa: E402
__all__ += ["GELU", "LeakyReLU", "SiLU", "LayerNorm", "GroupNorm", "Embedding"]
__all__ += ["Conv2dTranspose"]
