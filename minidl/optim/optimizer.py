"""The Optimizer base: parameter groups, learning rates, weight decay, loss scale, state.

Two calling styles update the parameters in place (``p.data`` is mutated, never replaced):
- MindSpore: ``optimizer(grads)`` with ``grads`` a tuple aligned with ``optimizer.parameters``
  (as ``value_and_grad(..., weights=optimizer.parameters)`` returns them);
- PyTorch: ``loss.backward(); optimizer.step(); optimizer.zero_grad()`` reads ``p.grad``.

Each step: the gradient is divided by ``loss_scale``, weight decay adds ``wd * p``, the
subclass rule (``_update``) runs with the learning rate of the current global step, and the
global step advances by one. Buffers (momentum ...) and the global step are Parameters, so
``save_checkpoint(optimizer, path)`` and ``load_param_into_net(optimizer, load_checkpoint(path))``
save and restore the optimizer as they do a network.

Weight decay, as in MindSpore: when ``parameters`` is a plain list, decay applies only to
parameters whose name contains neither "beta" nor "gamma" (so BatchNorm's scale and shift are
not decayed; biases are); when parameters are grouped, each group's ``weight_decay`` applies to
every parameter of the group.
"""
import numbers

import numpy

from .. import backend
from ..runtime import get_runtime
from ..tensor import Parameter, Tensor
from .lr_schedule import LearningRateSchedule

__all__ = ["Optimizer"]

_GROUP_KEYS = ("params", "lr", "weight_decay")


def _parse_lr(who, lr):
    """A float, a 1-D float64 NumPy array (per-step rates) or a schedule (callable)."""
    if isinstance(lr, bool):
        raise TypeError(f"{who}: learning_rate must be a number, a list of numbers or a schedule, got {lr!r}")
    if isinstance(lr, numbers.Real):
        if lr < 0:
            raise ValueError(f"{who}: learning_rate must be >= 0, got {lr!r}")
        return float(lr)
    if isinstance(lr, LearningRateSchedule):
        return lr
    if isinstance(lr, Tensor):
        lr = lr.data
    if isinstance(lr, (list, tuple)) or hasattr(lr, "__array_interface__") or hasattr(lr, "__cuda_array_interface__"):
        try:
            arr = numpy.asarray(backend.to_numpy(lr) if not isinstance(lr, (list, tuple)) else lr, dtype=numpy.float64)
        except (TypeError, ValueError):
            raise TypeError(f"{who}: learning_rate list must hold numbers, got {lr!r}") from None
        if arr.ndim == 0:
            return _parse_lr(who, float(arr))
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"{who}: a dynamic learning_rate must be a non-empty 1-D sequence, got shape {arr.shape}")
        if (arr < 0).any():
            raise ValueError(f"{who}: learning_rate values must be >= 0, got {arr[arr < 0][:3].tolist()}")
        return arr
    if callable(lr) and not isinstance(lr, type):
        return lr
    raise TypeError(f"{who}: learning_rate must be a number, a list of numbers or a schedule, "
                    f"got {type(lr).__name__}")


def _lr_at(lr, step):
    """The learning rate at ``step`` (lists hold their last value after their end)."""
    if isinstance(lr, float):
        return lr
    if isinstance(lr, (numpy.ndarray, list, tuple)):
        return float(lr[min(step, len(lr) - 1)])
    if isinstance(lr, numbers.Real):
        return float(lr)
    return float(lr(step))


def _check_weight_decay(who, wd):
    if isinstance(wd, bool) or not isinstance(wd, numbers.Real):
        raise TypeError(f"{who}: weight_decay must be a number, got {wd!r}")
    if wd < 0:
        raise ValueError(f"{who}: weight_decay must be >= 0, got {wd!r}")
    return float(wd)


def _decay_filter(param):
    """MindSpore's default: decay every parameter whose name has neither 'beta' nor 'gamma'."""
    name = param.name or ""
    return "beta" not in name and "gamma" not in name


def _host_parameter(value, name, dtype):
    """A 1-element Parameter kept on the host: read every step, it must not cost a device sync."""
    p = Parameter(numpy.zeros(1, dtype), name=name, requires_grad=False)
    p.data = numpy.full(1, value, dtype)
    return p


class Optimizer:
    """Base class of the optimizers: subclasses implement ``_update(i, w, g, lr)``.

    Args:
        learning_rate: a float; a list / tuple / 1-D array of per-step rates (step i uses
            ``lr[min(i, len(lr) - 1)]``); or a schedule called with the global step
            (``minidl.optim.lr_schedule``, or any callable step -> float).
        parameters: a list of Parameters, or a list of group dicts with keys "params" (a list
            of Parameters), optionally "lr" and "weight_decay" (defaults: the optimizer's),
            plus optionally one dict {"order_params": [...]} that fixes the update order
            (it must list exactly the grouped parameters).
        weight_decay: L2 coefficient (>= 0); see the module docstring for which parameters.
        loss_scale: gradients are divided by it before anything else (> 0).

    Attributes:
        parameters: the tuple of Parameters, in the order ``grads`` must follow.
        param_groups: list of dicts {"params", "lr", "weight_decay"}; editing "lr" or
            "weight_decay" takes effect at the next step.
        global_step: the number of updates done (an int).
    """

    def __init__(self, learning_rate, parameters, weight_decay=0.0, loss_scale=1.0):
        who = self._who = type(self).__name__
        if isinstance(loss_scale, bool) or not isinstance(loss_scale, numbers.Real) or loss_scale <= 0:
            raise ValueError(f"{who}: loss_scale must be a number > 0, got {loss_scale!r}")
        self.loss_scale = float(loss_scale)
        self.learning_rate = _parse_lr(who, learning_rate)
        self.weight_decay = _check_weight_decay(who, weight_decay)
        self.param_groups, self.parameters, self._group_of, grouped, self._is_group_lr = \
            self._parse_parameters(parameters)
        self._decay = tuple(True if grouped else _decay_filter(p) for p in self.parameters)
        self._keys = self._state_keys()
        self._global_step = _host_parameter(0, "global_step", numpy.int32)
        self._buffers = {}
        self._buffer_owner = {}  # buffer name -> index of the parameter it mirrors
        self._work = {}
        self._max_size = max(int(p.data.size) for p in self.parameters)

    # ---- construction helpers -------------------------------------------------------------

    def _parse_parameters(self, parameters):
        who = self._who
        if isinstance(parameters, (Parameter, dict)) or not hasattr(parameters, "__iter__"):
            raise TypeError(f"{who}: parameters must be a list of Parameters or of group dicts, "
                            f"got {type(parameters).__name__}")
        items = list(parameters)
        if not items:
            raise ValueError(f"{who}: parameters is empty; pass net.trainable_params() or group dicts")
        if all(isinstance(x, Parameter) for x in items):
            groups = [{"params": items}]
            grouped = False
        elif all(isinstance(x, dict) for x in items):
            groups = [x for x in items if "order_params" not in x]
            grouped = True
        else:
            kinds = sorted({type(x).__name__ for x in items})
            raise TypeError(f"{who}: parameters must be all Parameters or all group dicts, found {kinds}")
        param_groups, order, group_of = [], [], {}
        for gi, g in enumerate(groups):
            unknown = sorted(set(g) - set(_GROUP_KEYS))
            if unknown:
                raise ValueError(f"{who}: group {gi} has unsupported keys {unknown}; expected {list(_GROUP_KEYS)} "
                                 f"(or a separate {{'order_params': [...]}})")
            params = list(g.get("params", ()))
            if not params or not all(isinstance(p, Parameter) for p in params):
                raise TypeError(f"{who}: group {gi}: 'params' must be a non-empty list of Parameters")
            for p in params:
                if id(p) in group_of:
                    raise ValueError(f"{who}: parameter {p.name!r} appears more than once in parameters")
                group_of[id(p)] = gi
            lr = _parse_lr(who, g["lr"]) if "lr" in g else self.learning_rate
            wd = _check_weight_decay(who, g["weight_decay"]) if "weight_decay" in g else self.weight_decay
            param_groups.append({"params": params, "lr": lr, "weight_decay": wd})
            order += params
        orders = [x["order_params"] for x in items if isinstance(x, dict) and "order_params" in x]
        if len(orders) > 1:
            raise ValueError(f"{who}: at most one {{'order_params': ...}} dict is allowed, got {len(orders)}")
        if orders:
            ordered = list(orders[0])
            if len(ordered) != len(order) or {id(p) for p in ordered} != set(group_of):
                raise ValueError(f"{who}: order_params must list exactly the grouped parameters "
                                 f"({len(order)} of them), got {len(ordered)}")
            order = ordered
        is_group_lr = grouped and any("lr" in g for g in groups)
        return param_groups, tuple(order), tuple(group_of[id(p)] for p in order), grouped, is_group_lr

    def _state_keys(self):
        """Per-parameter names for the buffers: p.name, or 'param<i>' when unnamed; unique."""
        keys, owner = [], {}
        for i, p in enumerate(self.parameters):
            key = p.name if p.name else f"param{i}"
            if key in owner:
                raise ValueError(f"{self._who}: parameters {owner[key]} and {i} are both named {key!r}; "
                                 f"optimizer state needs unique names")
            owner[key] = i
            keys.append(key)
        return tuple(keys)

    def _new_buffer(self, prefix, i, fill=0.0):
        """A buffer shaped like parameter i, on its device, registered as '<prefix>.<name>'."""
        w = self.parameters[i].data
        xp = backend.get_array_module(w)
        name = f"{prefix}.{self._keys[i]}"
        array = xp.full(w.shape, fill, dtype=w.dtype)
        buf = Parameter(array, name=name, requires_grad=False)
        buf.data = array  # keep the parameter's device even when the context says otherwise
        self._buffers[name] = buf
        self._buffer_owner[name] = i
        return buf

    def _new_flag(self, prefix, i, value):
        """A one-element host buffer for parameter i (e.g. SGD's first-step flag)."""
        name = f"{prefix}.{self._keys[i]}"
        flag = self._buffers[name] = _host_parameter(value, name, numpy.float32)
        return flag

    def _scratch(self, w, k):
        """Work buffer k viewed with w's shape: reused every step, so an update allocates nothing."""
        xp = backend.get_array_module(w)
        key = (xp.__name__, w.dtype.str, k)
        view = self._work.get((key, w.shape))  # the view too is made once: this runs per parameter per step
        if view is not None:
            return view
        buf = self._work.get(key)
        if buf is None or buf.size < w.size:
            for old in [k for k in self._work if k[0] == key]:
                del self._work[old]  # the views of a replaced buffer go with it
            buf = self._work[key] = xp.empty(max(self._max_size, w.size), dtype=w.dtype)
        view = self._work[(key, w.shape)] = buf[:w.size].reshape(w.shape)
        return view

    # ---- state ----------------------------------------------------------------------------

    @staticmethod
    def _host_array(param):
        data = param.data
        if not isinstance(data, numpy.ndarray):  # set_data may have moved it to the GPU
            data = param.data = numpy.asarray(backend.to_numpy(data)).reshape(1).copy()
        return data

    @property
    def global_step(self):
        return int(self._host_array(self._global_step)[0])

    @global_step.setter
    def global_step(self, value):
        self._host_array(self._global_step)[0] = int(value)

    def parameters_and_names(self):
        """Yields (name, Parameter) for the optimizer's state: 'global_step', then the buffers."""
        yield "global_step", self._global_step
        yield from self._buffers.items()

    def state_dict(self):
        """The optimizer state as a dict name -> Parameter (live objects, not copies)."""
        return dict(self.parameters_and_names())

    def load_state_dict(self, state, strict=True):
        """Copies a state (e.g. ``load_checkpoint(path)``) into the buffers, in place.

        Names not belonging to this optimizer (e.g. the network's parameters in the same
        checkpoint) are ignored. Returns the buffer names not found in ``state``; with
        ``strict`` a missing name raises ValueError.
        """
        from ..io.checkpoint import load_param_into_net_quietly  # the network's entries are expected: no warning
        param_not_load, _ = load_param_into_net_quietly(self, state, strict_load=strict, who="Optimizer.load_state_dict")
        return param_not_load

    # ---- learning rate --------------------------------------------------------------------

    def get_lr(self):
        """The learning rate the next update will use: a float, or a tuple (one per group)
        when groups set their own "lr"."""
        step = self.global_step
        lrs = tuple(_lr_at(g["lr"], step) for g in self.param_groups)
        return lrs if self._is_group_lr else lrs[0]

    def get_lr_parameter(self, param):
        """The learning rate the next update will use for ``param`` (or a list for a list)."""
        if isinstance(param, (list, tuple)):
            return [self.get_lr_parameter(p) for p in param]
        for i, p in enumerate(self.parameters):
            if p is param:
                return _lr_at(self.param_groups[self._group_of[i]]["lr"], self.global_step)
        raise ValueError(f"{self._who}: parameter {getattr(param, 'name', param)!r} is not optimized by this optimizer")

    # ---- updates --------------------------------------------------------------------------

    def __call__(self, grads):
        """Updates every parameter in place from ``grads`` (aligned with ``self.parameters``;
        a None entry leaves its parameter unchanged). Returns True."""
        if isinstance(grads, (Tensor, dict)) or not isinstance(grads, (list, tuple)):
            raise TypeError(f"{self._who}: grads must be a tuple of Tensors aligned with the parameters, "
                            f"got {type(grads).__name__}")
        self._apply(grads)
        return True

    def step(self):
        """PyTorch style: updates every parameter whose ``.grad`` is set."""
        self._apply([p.grad for p in self.parameters])

    def zero_grad(self):
        """Clears ``.grad`` of every parameter (sets it to None)."""
        for p in self.parameters:
            p.grad = None

    def _check_grads(self, grads):
        n = len(self.parameters)
        if len(grads) != n:
            names = ", ".join(repr(k) for k in self._keys[:4]) + (", ..." if n > 4 else "")
            raise ValueError(f"{self._who}: got {len(grads)} gradients for {n} parameters ({names})")
        arrays = []
        for i, (p, g) in enumerate(zip(self.parameters, grads)):
            if isinstance(g, Tensor):
                g = g.data
            if g is not None and tuple(g.shape) != tuple(p.data.shape):
                raise ValueError(f"{self._who}: gradient {i} for parameter {self._keys[i]!r} has shape "
                                 f"{tuple(g.shape)}, but the parameter has shape {tuple(p.data.shape)}")
            arrays.append(g)
        return arrays

    def _apply(self, grads):
        self._follow_parameter_layouts()
        grads = self._check_grads(grads)  # all checked before any parameter changes
        step = self.global_step
        lrs = [_lr_at(g["lr"], step) for g in self.param_groups]
        inv_scale = 1.0 / self.loss_scale
        together = {}  # group -> [(i, w, g)]: parameters whose effective gradient is their gradient
        for i, (p, g) in enumerate(zip(self.parameters, grads)):
            if g is None:
                continue
            group = self._group_of[i]
            wd = self.param_groups[group]["weight_decay"] if self._decay[i] else 0.0
            w = p.data
            effective = self._effective_grad(w, g, wd, inv_scale)
            if effective is g:
                together.setdefault(group, []).append((i, w, g))
            else:  # in work buffer 0, which the next parameter's reuses: now
                self._update(i, w, effective, lrs[group])
        for group, items in together.items():
            self._update_many(items, lrs[group])
        self._host_array(self._global_step)[0] += 1

    def _follow_parameter_layouts(self):
        """Cuts buffers made (or loaded) whole like their parameters, once those hold blocks.

        Under tensor parallelism a parameter becomes its rank's block at its first sharded
        use, after the optimizer was built (under optimizer parallelism, its rows after the
        first reduction); its state must become the same block.
        """
        for name, buf in self._buffers.items():
            i = self._buffer_owner.get(name)
            if i is None:
                continue
            param = self.parameters[i]
            # A block may have the whole shape (a rank holding every row of a small parameter): the
            # whole buffer still takes the parameter's placement, or it would be saved as if whole.
            # (A buffer made after its parameter was cut is a block already, without a placement.)
            whole_unplaced = (buf.placement is None and param.placement is not None
                              and tuple(buf.data.shape) == tuple(param.shape))
            if tuple(buf.data.shape) != tuple(param.data.shape) or whole_unplaced:
                buf.data = get_runtime().follow(param, buf)

    def _effective_grad(self, w, g, wd, inv_scale):
        """g / loss_scale + wd * w, in work buffer 0 (g itself when there is nothing to add)."""
        if inv_scale == 1.0 and not wd:
            return g
        xp = backend.get_array_module(w)
        s = self._scratch(w, 0)
        if inv_scale != 1.0:
            xp.multiply(g, inv_scale, out=s)
        else:
            xp.copyto(s, g)
        if wd:
            t = self._scratch(w, 1)
            xp.multiply(w, wd, out=t)
            s += t
        return s

    def _update_many(self, items, lr):
        """Updates the parameters ``items`` = [(i, w, g)] of one learning rate, each as _update; a
        subclass may do them in one call (nn.Momentum: MultiApplyMomentum). Their g are the
        callers' own arrays (no work buffer), so all can be held at once."""
        for i, w, g in items:
            self._update(i, w, g, lr)

    def _update(self, i, w, g, lr):
        """Updates parameter i in place: w is its array, g its effective gradient (read-only:
        it may be the caller's array), lr the learning rate of this step. Work buffer 1
        (``self._scratch(w, 1)``) is free for temporaries."""
        raise NotImplementedError(f"{self._who} must implement _update(i, w, g, lr)")

    def __repr__(self):
        n = len(getattr(self, "parameters", ()))
        return f"{type(self).__name__}(learning_rate={getattr(self, 'learning_rate', None)!r}, {n} parameters)"
