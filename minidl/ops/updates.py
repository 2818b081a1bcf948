"""Optimizer updates as primitives, as MindSpore's ``ops.ApplyMomentum``: in-place, no gradient.

An optimizer's rule is a few elementwise passes over each parameter; as an operator its
readable body lives here and a faster one (one compiled pass: minidl/kernels/cpu/updates.py)
can take its place through the kernels table, as for any other operator. nn.Momentum calls it,
and :class:`MultiApplyMomentum` for the parameters it can update together.
"""
from ..backend import get_array_module
from ..tensor import Tensor
from .primitive import Primitive

__all__ = ["ApplyMomentum", "MultiApplyMomentum"]


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


class MultiApplyMomentum(Primitive):
    """ApplyMomentum on several parameters in one call (a minidl addition, as PyTorch's
    multi-tensor optimizers): one op call per step instead of one per parameter, and one pass a
    fast kernel may split over threads across all of them. In place; returns the variables.

    Why. An MLP step's update is six small arrays and two large ones; a call per parameter cost
    more in Python (per call, its kernel choice and its thread hand-off) than the small arrays'
    arithmetic (minidl/kernels/cpu/updates.py).

    Args:
        use_nesterov: Nesterov momentum, as ApplyMomentum's.

    Inputs:
        variables, accumulations, gradients: sequences of arrays or tensors, one entry per
        parameter (the same length; entry k of each as ApplyMomentum's variable, accumulation
        and gradient); learning_rate, momentum: numbers, shared by all.

    Example:
        >>> ops.MultiApplyMomentum()((w1, w2), (v1, v2), 0.1, (g1, g2), 0.9)
    """

    n_inputs = 5
    differentiable = False

    def __init__(self, use_nesterov=False):
        super().__init__()
        self.use_nesterov = bool(use_nesterov)

    def forward(self, variables, accumulations, learning_rate, gradients, momentum):
        variables, accumulations, gradients = arrays_of(variables), arrays_of(accumulations), arrays_of(gradients)
        if not len(variables) == len(accumulations) == len(gradients):
            raise ValueError(f"{self.name}: got {len(variables)} variables, {len(accumulations)} accumulations "
                             f"and {len(gradients)} gradients; they must pair up")
        one = ApplyMomentum(use_nesterov=self.use_nesterov)
        for variable, accumulation, gradient in zip(variables, accumulations, gradients):
            one.forward(variable, accumulation, learning_rate, gradient, momentum)
        return variables


def arrays_of(items):
    """The arrays of a sequence of tensors or arrays, as a tuple."""
    return tuple(a.data if isinstance(a, Tensor) else a for a in items)
