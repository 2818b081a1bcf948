"""Cells, layers, losses, and (re-exported from minidl.optim) optimizers, as mindspore.nn.

    from minidl import nn
    net = nn.SequentialCell(nn.Dense(784, 128), nn.ReLU(), nn.Dense(128, 10))
    loss_fn = nn.CrossEntropyLoss()
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
"""
from .cell import Cell, SequentialCell, CellList
from .wrappers import WithLossCell, TrainOneStepCell
from .loss_scale_cells import TrainOneStepWithLossScaleCell, DynamicLossScaleUpdateCell, FixedLossScaleUpdateCell
from .layers import (ReLU, Sigmoid, Tanh, Softmax, LogSoftmax, get_activation, Dense, Flatten, Dropout,
                     Identity, Conv2d, BatchNorm1d, BatchNorm2d, MaxPool2d, AvgPool2d)
from .layers.attention import MultiheadAttention
from .layers import GELU, LeakyReLU, SiLU, LayerNorm, GroupNorm, Embedding
from .layers import Conv2dTranspose
from .loss import NLLLoss
from .loss import LossBase, SoftmaxCrossEntropyWithLogits, CrossEntropyLoss, MSELoss, L1Loss
from ..optim import (Optimizer, SGD, Momentum, LearningRateSchedule, ExponentialDecayLR, CosineDecayLR,
                     PolynomialDecayLR, WarmUpLR, PiecewiseConstantLR, piecewise_constant_lr,
                     exponential_decay_lr, cosine_decay_lr, warmup_lr)
from ..optim import Adam, AdamWeightDecay, LARS

__all__ = ["Cell", "SequentialCell", "CellList",
           "ReLU", "Sigmoid", "Tanh", "Softmax", "LogSoftmax", "get_activation", "Dense", "Flatten", "Dropout",
           "Identity", "Conv2d", "BatchNorm1d", "BatchNorm2d", "MaxPool2d", "AvgPool2d",
           "LossBase", "SoftmaxCrossEntropyWithLogits", "CrossEntropyLoss", "MSELoss", "L1Loss",
           "Optimizer", "SGD", "Momentum", "LearningRateSchedule", "ExponentialDecayLR", "CosineDecayLR",
           "PolynomialDecayLR", "WarmUpLR", "PiecewiseConstantLR", "piecewise_constant_lr",
           "exponential_decay_lr", "cosine_decay_lr", "warmup_lr"]
__all__ += ["MultiheadAttention"]
__all__ += ["GELU", "LeakyReLU", "SiLU", "LayerNorm", "GroupNorm", "Embedding", "NLLLoss"]
__all__ += ["Adam", "AdamWeightDecay", "LARS"]
__all__ += ["Conv2dTranspose"]
__all__ += ["WithLossCell", "TrainOneStepCell", "TrainOneStepWithLossScaleCell", "DynamicLossScaleUpdateCell",
            "FixedLossScaleUpdateCell"]
