"""LARS: layer-wise adaptive rate scaling around another optimizer, as MindSpore's nn.LARS."""
import numbers

from ..backend import get_array_module
from ..runtime import get_runtime
from .optimizer import Optimizer, _lr_at

__all__ = ["LARS"]


def _default_lars_filter(param):
    """MindSpore's default: scale every parameter whose name has neither "LayerNorm" nor "bias"."""
    name = param.name or ""
    return "LayerNorm" not in name and "bias" not in name


class LARS(Optimizer):
    """Scales each parameter's gradient by its trust ratio, then lets ``optimizer`` update.

    For a parameter w the filter keeps, with g = gradient / loss_scale and wd the wrapped
    optimizer's weight decay for w (0 where it would not decay w):

        ratio = coefficient * ||w|| / (||g|| + wd * ||w|| + epsilon)
        ratio = min(max(ratio / lr, 0), 1)           (use_clip; lr: w's learning rate now)
        g' = ratio * (g + wd * w)

    (MindSpore's LARSUpdate kernel; ||.|| the 2-norm over the whole parameter.) A kept
    parameter whose norm is 0 gets ratio 0 and never moves, as with MindSpore's kernel: keep
    zero-initialised parameters out with the filter (the default skips biases). A parameter
    the filter skips gets g' = g: no trust ratio and, as in MindSpore, no weight decay either.
    Like MindSpore, LARS takes the weight decay and the loss scale over from the optimizer it
    wraps: from construction on, that optimizer no longer applies them itself. Its rule then
    runs on g' (Momentum in MindSpore's and Horovod's examples).

    LARS shares the wrapped optimizer's parameters, learning rates, global step and state:
    ``get_lr()``, ``state_dict()`` and checkpoints are the wrapped optimizer's (same names), so
    a checkpoint of ``LARS(Momentum(...))`` loads into ``Momentum(...)`` and back.

    Under optimizer parallelism a parameter holds one rank's rows: the norms add the other
    ranks' squares (one all-reduce per step for all of them). Under tensor parallelism a
    parameter may hold one rank's block, whose norm is not the parameter's: LARS refuses such a
    parameter unless its filter skips it.

    Args:
        optimizer: the Optimizer to wrap (not a LARS).
        epsilon: added to the trust ratio's denominator (>= 0).
        coefficient: the trust coefficient (> 0).
        use_clip: clip ratio / lr to [0, 1], so the effective rate is min(ratio, lr).
        lars_filter: ``param -> bool``, True where LARS applies; default: names without
            "LayerNorm" and "bias" (MindSpore's; BatchNorm's gamma and beta are scaled).

    Attributes:
        optimizer: the wrapped optimizer. lars_flag: per parameter, whether LARS scales it.

    Example:
        >>> opt = LARS(Momentum(net.trainable_params(), 0.1, 0.9, weight_decay=1e-4), coefficient=0.02)
        >>> loss, grads = grad_fn(x, y); opt(grads)
    """

    # Not Optimizer.__init__: LARS owns no parameters or schedule of its own; it shares the
    # wrapped optimizer's, so the base's get_lr, state_dict, load_state_dict, step and the
    # gradient checks work on the same objects.
    def __init__(self, optimizer, epsilon=1e-05, coefficient=0.001, use_clip=False,
                 lars_filter=_default_lars_filter):
        who = self._who = type(self).__name__
        if isinstance(optimizer, LARS):
            raise TypeError(f"{who}: optimizer is already a LARS; wrap the inner optimizer once")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{who}: optimizer must be a minidl Optimizer (e.g. nn.Momentum), "
                            f"got {type(optimizer).__name__}")
        if getattr(optimizer, "_lars", None) is not None:
            raise ValueError(f"{who}: this {type(optimizer).__name__} is already wrapped by a LARS, which took its "
                             f"weight decay and loss scale over; wrap a fresh optimizer")
        for name, value in (("epsilon", epsilon), ("coefficient", coefficient)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{who}: {name} must be a float, got {value!r}")
        if epsilon < 0:
            raise ValueError(f"{who}: epsilon must be >= 0, got {epsilon!r}")
        if coefficient <= 0:
            raise ValueError(f"{who}: coefficient must be > 0, got {coefficient!r}")
        if not isinstance(use_clip, bool):
            raise TypeError(f"{who}: use_clip must be a bool, got {use_clip!r}")
        if not callable(lars_filter):
            raise TypeError(f"{who}: lars_filter must be a callable param -> bool, got {type(lars_filter).__name__}")
        self.optimizer = optimizer
        self.epsilon = float(epsilon)
        self.coefficient = float(coefficient)
        self.use_clip = use_clip
        self.lars_flag = tuple(bool(lars_filter(p)) for p in optimizer.parameters)  # MindSpore's name
        # The wrapped optimizer's view of everything the base methods read (shared, not copied).
        for attr in ("parameters", "param_groups", "learning_rate", "_group_of", "_is_group_lr", "_keys",
                     "_global_step", "_buffers", "_buffer_owner", "_max_size"):
            setattr(self, attr, getattr(optimizer, attr))
        self._work = {}
        self._grads = {}  # parameter index -> the array handed to the wrapped optimizer
        # Take the weight decay and the loss scale over (as MindSpore's LARS does).
        self._decay = optimizer._decay
        self.loss_scale = optimizer.loss_scale
        self.weight_decay = optimizer.weight_decay
        optimizer._decay = (False,) * len(optimizer.parameters)
        optimizer.loss_scale = 1.0
        optimizer._lars = self

    def _apply(self, grads):
        grads = self._check_grads(grads)  # all checked before any parameter changes
        step = self.global_step
        lrs = [_lr_at(g["lr"], step) for g in self.param_groups] if self.use_clip else None
        inv_scale = 1.0 / self.loss_scale
        scaled = [None if g is None else self._unscaled(i, p.data, g, inv_scale)
                  for i, (p, g) in enumerate(zip(self.parameters, grads))]
        squares = self._squared_norms(scaled)  # every norm before any parameter changes
        for i, (p, g) in enumerate(zip(self.parameters, scaled)):
            if g is None or not self.lars_flag[i]:
                continue
            group = self._group_of[i]
            wd = self.param_groups[group]["weight_decay"] if self._decay[i] else 0.0
            lr = lrs[group] if lrs is not None else None
            self._apply_trust_ratio(p.data, g, squares[i], wd, lr)
        self.optimizer._apply(scaled)

    def _unscaled(self, i, w, g, inv_scale):
        """g / loss_scale of parameter i, in a buffer kept for it (scaled in place later)."""
        xp = get_array_module(w)
        out = self._grads.get(i)
        if out is None or out.shape != w.shape or out.dtype != w.dtype or get_array_module(out) is not xp:
            out = self._grads[i] = xp.empty_like(w)  # made once (again if w's layout or device changes)
        if inv_scale != 1.0:
            xp.multiply(g, inv_scale, out=out)
        else:
            xp.copyto(out, g)
        return out

    def _squared_norms(self, grads):
        """{i: (||w||^2, ||g||^2)} of the scaled parameters, over the whole parameter: a parameter
        holding one rank's slice (optimizer parallelism) adds the other ranks' sums (the runtime's
        ``sum_over_slices``: one collective for all of them)."""
        squares, parts, sliced = {}, [], []
        for i, (p, g) in enumerate(zip(self.parameters, grads)):
            if g is None or not self.lars_flag[i]:
                continue
            xp = get_array_module(g)
            flat_w, flat_g = p.data.reshape(-1), g.reshape(-1)
            # Norms stay 0-d device values on CuPy: the ratio never visits the host.
            squares[i] = (xp.dot(flat_w, flat_w), xp.dot(flat_g, flat_g))
            if p.placement is not None:
                sliced.append(i)
        if sliced:
            tensors = [self.parameters[i] for i in sliced for _ in (0, 1)]
            parts = [part for i in sliced for part in squares[i]]
            try:
                sums = get_runtime().sum_over_slices(tensors, parts, self._who)
            except ValueError as e:
                raise ValueError(f"{e}; the trust ratio needs the whole parameter's norm: exclude it with "
                                 f"lars_filter") from None
            for k, i in enumerate(sliced):
                squares[i] = (sums[2 * k], sums[2 * k + 1])
        return squares

    def _apply_trust_ratio(self, w, out, squares, wd, lr):
        """out = ratio * (out + wd * w), in place (see the class docstring)."""
        xp = get_array_module(w)
        w_norm, g_norm = xp.sqrt(squares[0]), xp.sqrt(squares[1])
        ratio = self.coefficient * w_norm / (g_norm + wd * w_norm + self.epsilon)
        if lr is not None:
            # ratio / lr clipped to [0, 1]; the wrapped optimizer multiplies by lr again.
            # At lr == 0 nothing moves: take 1 rather than 0 / 0.
            ratio = xp.clip(ratio / lr, 0.0, 1.0) if lr > 0 else 1.0
        if wd:
            t = self._scratch(w, 0)
            xp.multiply(w, wd, out=t)
            out += t
        out *= ratio

    def __repr__(self):
        return (f"LARS({self.optimizer!r}, epsilon={self.epsilon!r}, coefficient={self.coefficient!r}, "
                f"use_clip={self.use_clip!r})")
