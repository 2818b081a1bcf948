"""Adam (L2 weight decay in the gradient) and AdamWeightDecay (decoupled), as MindSpore's nn.Adam
and nn.AdamWeightDecay.

Measured against MindSpore 2.10 (CPU, a few steps with fixed gradients): nn.Adam is the ``Adam``
kernel, whose eps is added to sqrt(v) *outside* the bias correction, so it differs from
PyTorch's Adam; nn.AdamWeightDecay has *no* bias correction at all. Both are followed here; see
the class docstrings and docs/optimizers.md.
"""
import math
import numbers

import numpy

from ..backend import get_array_module
from .optimizer import Optimizer, _host_parameter

__all__ = ["Adam", "AdamWeightDecay"]


def _check_betas_eps(who, beta1, beta2, eps):
    """MindSpore's rule: beta1, beta2 in the open interval (0, 1); eps > 0."""
    for name, value in (("beta1", beta1), ("beta2", beta2), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{who}: {name} must be a float, got {value!r}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 < value < 1.0:
            raise ValueError(f"{who}: {name} must be in the open interval (0.0, 1.0), got {value!r}")
    if not eps > 0:
        raise ValueError(f"{who}: eps must be > 0, got {eps!r}")
    return float(beta1), float(beta2), float(eps)


def _check_bool(who, name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{who}: {name} must be a bool, got {value!r}")
    return value


def _update_moments(xp, m, v, g, beta1, beta2, s):
    """m = beta1 m + (1 - beta1) g and v = beta2 v + (1 - beta2) g^2, in place (``s``: scratch like g)."""
    m *= beta1
    xp.multiply(g, 1.0 - beta1, out=s)
    m += s
    v *= beta2
    xp.multiply(g, g, out=s)
    s *= 1.0 - beta2
    v += s


class Adam(Optimizer):
    """Adam as MindSpore's nn.Adam: on the effective gradient g (see Optimizer: g / loss_scale
    + weight_decay * w, i.e. L2 decay *in the gradient*), at step t = 1, 2, ...:

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        lr_t = lr * sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        w = w - lr_t * m / (sqrt(v) + eps)

    ``use_nesterov``: the numerator is ``beta1 * m + (1 - beta1) * g``. ``use_amsgrad``:
    ``vhat = max(vhat, v)`` replaces v in the denominator.

    Differs from PyTorch's torch.optim.Adam only in eps: PyTorch divides by
    ``sqrt(v / (1 - beta2 ** t)) + eps``, which is this rule with eps replaced by
    ``eps / sqrt(1 - beta2 ** t)`` (MindSpore's eps acts ~30x larger at step 1 with the default
    betas). Moments, bias correction and weight decay agree. With parameters not grouped,
    decay skips parameters named with "beta" or "gamma" (MindSpore's rule).

    Buffers (MindSpore's names): "moment1.<name>", "moment2.<name>", "vhat.<name>" (amsgrad),
    and "beta1_power", "beta2_power" (beta ** t after t steps; float64 on the host, so the bias
    correction costs no device sync).

    Args:
        params: Parameters or group dicts (see Optimizer).
        learning_rate: float, per-step list or schedule (default 1e-3).
        beta1, beta2: decay rates of the moments, each in (0, 1).
        eps: added to sqrt(v) (> 0).
        use_locking: accepted for MindSpore's signature; updates never race here.
        use_nesterov: Nesterov's look-ahead numerator (not with use_amsgrad).
        weight_decay, loss_scale: see Optimizer.
        use_amsgrad: AMSGrad's running maximum of v.
        use_lazy: MindSpore's lazy Adam differs only for sparse gradients; minidl's gradients
            are dense, for which it is this Adam.
        use_offload: not supported (MindSpore updates on the host to save device memory).

    Example:
        >>> opt = Adam(net.trainable_params(), learning_rate=1e-3, weight_decay=1e-4)
        >>> loss, grads = grad_fn(x, y); opt(grads)
    """

    def __init__(self, params, learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, use_locking=False,
                 use_nesterov=False, weight_decay=0.0, loss_scale=1.0, use_amsgrad=False, **kwargs):
        super().__init__(learning_rate, params, weight_decay, loss_scale)
        who = self._who
        unknown = sorted(set(kwargs) - {"use_lazy", "use_offload"})
        if unknown:
            raise TypeError(f"{who}: unexpected keyword arguments {unknown}; the extra ones accepted are "
                            f"'use_lazy' and 'use_offload'")
        use_lazy = _check_bool(who, "use_lazy", kwargs.get("use_lazy", False))
        use_offload = _check_bool(who, "use_offload", kwargs.get("use_offload", False))
        self.beta1, self.beta2, self.eps = _check_betas_eps(who, beta1, beta2, eps)
        self.use_locking = _check_bool(who, "use_locking", use_locking)
        self.use_nesterov = _check_bool(who, "use_nesterov", use_nesterov)
        self.use_amsgrad = _check_bool(who, "use_amsgrad", use_amsgrad)
        if use_lazy and use_offload:
            raise ValueError(f"{who}: use_lazy and use_offload cannot both be True")
        if use_amsgrad and (use_lazy or use_offload):
            raise ValueError(f"{who}: use_amsgrad=True cannot be combined with use_lazy or use_offload, "
                             f"got use_lazy={use_lazy}, use_offload={use_offload}")
        if use_offload:
            raise NotImplementedError(f"{who}: use_offload=True (updating on the host to save device memory) "
                                      f"is not supported; leave it False")
        if use_amsgrad and use_nesterov:
            # MindSpore accepts both and silently drops Nesterov (its AMSGrad kernel has none).
            raise ValueError(f"{who}: use_nesterov=True cannot be combined with use_amsgrad=True "
                             f"(MindSpore ignores use_nesterov then; pass one of them)")
        self.use_lazy = use_lazy
        self.use_offload = use_offload
        n = len(self.parameters)
        self._moment1 = [self._new_buffer("moment1", i) for i in range(n)]
        self._moment2 = [self._new_buffer("moment2", i) for i in range(n)]
        self._vhat = [self._new_buffer("vhat", i) for i in range(n)] if use_amsgrad else None
        # One pair for the whole optimizer, as in MindSpore (they advance with the global step).
        for name in ("beta1_power", "beta2_power"):
            self._buffers[name] = _host_parameter(1.0, name, numpy.float64)
        self._lr_factor = None

    def _apply(self, grads):
        b1p = self._host_array(self._buffers["beta1_power"])
        b2p = self._host_array(self._buffers["beta2_power"])
        t1, t2 = float(b1p[0]) * self.beta1, float(b2p[0]) * self.beta2  # host floats: no device sync
        # The bias corrections folded into one factor on lr (the Adam kernel's lr_t).
        self._lr_factor = math.sqrt(1.0 - t2) / (1.0 - t1)
        super()._apply(grads)  # raises before anything changes when grads are wrong
        b1p[0], b2p[0] = t1, t2

    def _update(self, i, w, g, lr):
        xp = get_array_module(w)
        m, v = self._moment1[i].data, self._moment2[i].data
        s = self._scratch(w, 1)
        _update_moments(xp, m, v, g, self.beta1, self.beta2, s)
        if self.use_amsgrad:
            vhat = self._vhat[i].data
            xp.maximum(vhat, v, out=vhat)
            v = vhat
        xp.sqrt(v, out=s)
        s += self.eps  # outside the bias correction: MindSpore's eps, not PyTorch's
        if self.use_nesterov:
            num = self._scratch(w, 2)
            xp.multiply(m, self.beta1, out=num)
            t = self._scratch(w, 3)
            xp.multiply(g, 1.0 - self.beta1, out=t)
            num += t
            xp.divide(num, s, out=s)
        else:
            xp.divide(m, s, out=s)
        s *= lr * self._lr_factor
        w -= s


class AdamWeightDecay(Optimizer):
    """Adam with decoupled weight decay, as MindSpore's nn.AdamWeightDecay: on the gradient g,

        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        w = w - lr * (m / (sqrt(v) + eps) + weight_decay * w)

    There is no bias correction (measured on MindSpore 2.10: three steps match this rule, not
    the bias-corrected one), unlike PyTorch's torch.optim.AdamW, which also differs in its
    defaults (eps 1e-8, weight_decay 0.01) and decays first (``w *= 1 - lr * wd``, the same
    product). The decay never enters m or v. With a zero gradient a step shrinks w by
    ``lr * weight_decay * w``.

    Which parameters decay: with a plain list, those whose name has neither "beta" nor
    "gamma"; with groups, each group's "weight_decay" (MindSpore's pattern
    ``[{'params': decay, 'weight_decay': 0.01}, {'params': no_decay}]``, with the optimizer's
    weight_decay=0.0, keeps LayerNorm and biases undecayed).

    Buffers (MindSpore's names): "adam_m.<name>", "adam_v.<name>".

    Args:
        params: Parameters or group dicts (see Optimizer).
        learning_rate: float, per-step list or schedule (default 1e-3).
        beta1, beta2: decay rates of the moments, each in (0, 1).
        eps: added to sqrt(v) (> 0; default 1e-6, MindSpore's).
        weight_decay: the decoupled decay coefficient (>= 0).

    Example:
        >>> decay = [p for p in net.trainable_params() if "layernorm" not in p.name and "bias" not in p.name]
        >>> rest = [p for p in net.trainable_params() if not any(p is q for q in decay)]
        >>> opt = AdamWeightDecay([{"params": decay, "weight_decay": 0.01}, {"params": rest}], 1e-4)
    """

    def __init__(self, params, learning_rate=1e-3, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.0):
        super().__init__(learning_rate, params, weight_decay)
        self.beta1, self.beta2, self.eps = _check_betas_eps(self._who, beta1, beta2, eps)
        n = len(self.parameters)
        self._moment1 = [self._new_buffer("adam_m", i) for i in range(n)]
        self._moment2 = [self._new_buffer("adam_v", i) for i in range(n)]

    def _effective_grad(self, w, g, wd, inv_scale):
        # Decoupled: the decay is applied in _update, never through the gradient.
        return super()._effective_grad(w, g, 0.0, inv_scale)

    def _update(self, i, w, g, lr):
        xp = get_array_module(w)
        m, v = self._moment1[i].data, self._moment2[i].data
        s = self._scratch(w, 1)
        _update_moments(xp, m, v, g, self.beta1, self.beta2, s)
        xp.sqrt(v, out=s)
        s += self.eps
        xp.divide(m, s, out=s)
        wd = self.param_groups[self._group_of[i]]["weight_decay"] if self._decay[i] else 0.0
        if wd:
            t = self._scratch(w, 2)
            xp.multiply(w, wd, out=t)  # w before this step's update, as MindSpore's kernel reads it
            s += t
        s *= lr
        w -= s
