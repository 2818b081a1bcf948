"""Optimizers (re-exported by minidl.nn) and learning-rate schedules."""
from .optimizer import Optimizer
from .sgd import SGD
from .momentum import Momentum
from .adam import Adam, AdamWeightDecay
from .lars import LARS
from .lr_schedule import (LearningRateSchedule, ExponentialDecayLR, CosineDecayLR, PolynomialDecayLR, WarmUpLR,
                          PiecewiseConstantLR, piecewise_constant_lr, exponential_decay_lr, cosine_decay_lr,
                          warmup_lr)

__all__ = ["Optimizer", "SGD", "Momentum", "Adam", "AdamWeightDecay", "LARS", "LearningRateSchedule",
           "ExponentialDecayLR", "CosineDecayLR",
           "PolynomialDecayLR", "WarmUpLR", "PiecewiseConstantLR", "piecewise_constant_lr",
           "exponential_decay_lr", "cosine_decay_lr", "warmup_lr"]
