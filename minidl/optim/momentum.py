"""Momentum SGD as MindSpore's nn.Momentum (the ApplyMomentum rule)."""
import numbers

from ..ops.updates import ApplyMomentum, MultiApplyMomentum
from .optimizer import Optimizer

__all__ = ["Momentum"]


class Momentum(Optimizer):
    """Momentum: with momentum u, on the effective gradient g (see Optimizer):

        v = u * v + g                      (v starts at zero)
        p = p - lr * v                     (use_nesterov: p = p - lr * (g + u * v))

    Unlike SGD, there is no dampening and no first-step special case. Buffers:
    "moments.<name>" (v), as MindSpore names them.

    Args:
        params: Parameters or group dicts (see Optimizer).
        learning_rate: float, per-step list or schedule.
        momentum: u >= 0.
        weight_decay, loss_scale: see Optimizer.
        use_nesterov: Nesterov momentum.

    Example:
        >>> opt = Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9, weight_decay=1e-4)
    """

    def __init__(self, params, learning_rate, momentum, weight_decay=0.0, loss_scale=1.0, use_nesterov=False):
        super().__init__(learning_rate, params, weight_decay, loss_scale)
        if isinstance(momentum, bool) or not isinstance(momentum, numbers.Real):
            raise TypeError(f"{self._who}: momentum must be a number, got {momentum!r}")
        if momentum < 0:
            raise ValueError(f"{self._who}: momentum must be >= 0, got {momentum!r}")
        if not isinstance(use_nesterov, bool):
            raise TypeError(f"{self._who}: use_nesterov must be a bool, got {use_nesterov!r}")
        self.momentum = float(momentum)
        self.use_nesterov = use_nesterov
        self._moments = [self._new_buffer("moments", i) for i in range(len(self.parameters))]
        self._apply_momentum = ApplyMomentum(use_nesterov=use_nesterov)
        self._apply_momentum_many = MultiApplyMomentum(use_nesterov=use_nesterov)

    def _update(self, i, w, g, lr):
        # ops.ApplyMomentum, as MindSpore's nn.Momentum: its kernel makes the update one pass.
        self._apply_momentum.apply(w, self._moments[i].data, lr, g, self.momentum, self._scratch(w, 1))

    def _update_many(self, items, lr):
        # One op call for all of them (its kernel makes them one pass, split over the threads):
        # per-parameter calls cost more than the small parameters' arithmetic.
        if len(items) < 2:
            return super()._update_many(items, lr)
        self._apply_momentum_many.apply(tuple(w for _, w, _ in items), tuple(self._moments[i].data for i, _, _ in items),
                                        lr, tuple(g for _, _, g in items), self.momentum)
