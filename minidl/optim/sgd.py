"""Stochastic gradient descent with optional momentum, dampening and Nesterov (MindSpore nn.SGD)."""
import numbers

from ..backend import get_array_module
from .optimizer import Optimizer

__all__ = ["SGD"]


def _real(who, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {name} must be a number, got {value!r}")
    return float(value)


class SGD(Optimizer):
    """SGD: with momentum u and dampening d, on the effective gradient g (see Optimizer):

        v = g                              at a parameter's first update
        v = u * v + (1 - d) * g            afterwards
        p = p - lr * v                     (nesterov: p = p - lr * (g + u * v))

    As in MindSpore (its ``stat`` buffer) and PyTorch, the first update takes v = g
    undampened. Buffers: "accum.<name>" (v) and "stat.<name>" (1 until the first update),
    only when momentum > 0.

    Args:
        params: Parameters or group dicts (see Optimizer).
        learning_rate: float, per-step list or schedule (default 0.1).
        momentum: u >= 0. dampening: d >= 0. nesterov: needs momentum > 0 and dampening 0.
        weight_decay, loss_scale: see Optimizer.

    Example:
        >>> opt = SGD(net.trainable_params(), learning_rate=0.01, momentum=0.9, nesterov=True)
        >>> loss, grads = grad_fn(x, y); opt(grads)
    """

    def __init__(self, params, learning_rate=0.1, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, loss_scale=1.0):
        super().__init__(learning_rate, params, weight_decay, loss_scale)
        who = self._who
        self.momentum = _real(who, "momentum", momentum)
        self.dampening = _real(who, "dampening", dampening)
        if self.momentum < 0:
            raise ValueError(f"{who}: momentum must be >= 0, got {momentum!r}")
        if self.dampening < 0:
            raise ValueError(f"{who}: dampening must be >= 0, got {dampening!r}")
        if not isinstance(nesterov, bool):
            raise TypeError(f"{who}: nesterov must be a bool, got {nesterov!r}")
        if nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError(f"{who}: nesterov needs momentum > 0 and dampening == 0, "
                             f"got momentum={momentum!r}, dampening={dampening!r}")
        self.nesterov = nesterov
        if self.momentum > 0:
            self._accum = [self._new_buffer("accum", i) for i in range(len(self.parameters))]
            self._stat = [self._new_flag("stat", i, 1.0) for i in range(len(self.parameters))]

    def _update(self, i, w, g, lr):
        xp = get_array_module(w)
        s = self._scratch(w, 1)
        u = self.momentum
        if u > 0:
            v = self._accum[i].data
            stat = self._host_array(self._stat[i])
            if stat[0]:
                xp.copyto(v, g)
                stat[0] = 0
            else:
                v *= u
                if self.dampening:
                    xp.multiply(g, 1.0 - self.dampening, out=s)
                    v += s
                else:
                    v += g
            if self.nesterov:
                xp.multiply(v, u, out=s)
                s += g
                s *= lr
            else:
                xp.multiply(v, lr, out=s)
        else:
            xp.multiply(g, lr, out=s)
        w -= s
