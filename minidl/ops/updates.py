"""Optimizer updates as primitives, as MindSpore's ``ops.ApplyMomentum``: in-place, no gradient.

An optimizer's rule is a few elementwise passes over each parameter; as an operator its
readable body lives here and a faster one (one compiled pass: minidl/kernels/cpu/updates.py)
can take its place through the kernels table, as for any other operator. nn.Momentum calls it.
"""
from ..backend import get_array_module
from .primitive import Primitive

__all__ = ["ApplyMomentum"]


class ApplyMomentum(Primitive):
    """Momentum's update, in place: ``accumulation = momentum * accumulation + gradient``, then
    ``variable -= learning_rate * accumulation`` (use_nesterov: ``variable -= learning_rate *
    (gradient + momentum * accumulation)``). Returns variable.

    Args:
        use_nesterov: Nesterov momentum.
        use_locking: accepted for MindSpore's signature (updates here are never concurrent).
        gradient_scale: the gradient is multiplied by it first.

    Inputs:
        variable, accumulation: arrays or tensors of one float dtype, updated in place;
        learning_rate, momentum: numbers; gradient: an array of variable's shape;
        scratch (optional, minidl's addition): an array of variable's shape for the step, so the
        update allocates nothing (nn.Momentum passes its work buffer).

    Example:
        >>> ops.ApplyMomentum()(w, v, 0.1, g, 0.9)    # v = 0.9 * v + g; w -= 0.1 * v
    """

    n_inputs = (5, 6)
    differentiable = False

    def __init__(self, use_nesterov=False, use_locking=False, gradient_scale=1.0):
        super().__init__()
        self.use_nesterov = bool(use_nesterov)
        self.use_locking = bool(use_locking)
        self.gradient_scale = float(gradient_scale)

    def forward(self, variable, accumulation, learning_rate, gradient, momentum, scratch=None):
        if tuple(gradient.shape) != tuple(variable.shape) or tuple(accumulation.shape) != tuple(variable.shape):
            raise ValueError(f"{self.name}: variable {tuple(variable.shape)}, accumulation "
                             f"{tuple(accumulation.shape)} and gradient {tuple(gradient.shape)} must have one shape")
        xp = get_array_module(variable, accumulation, gradient)
        if self.gradient_scale != 1.0:
            gradient = gradient * self.gradient_scale
        accumulation *= momentum
        accumulation += gradient
        step = xp.multiply(accumulation, momentum if self.use_nesterov else learning_rate, out=scratch)
        if self.use_nesterov:
            step += gradient
            step *= learning_rate
        variable -= step
        return variable
