"""Loss scaling's Cells, with MindSpore's names (its nn/wrap/loss_scale.py): the update cells of
the dynamic and fixed rules, and ``TrainOneStepWithLossScaleCell``, the training step
(wrappers.py's ``TrainOneStepCell``) with the loss scaled, the gradients unscaled and checked for
overflow, and the step skipped on one. The managers that make the update cells are minidl.amp's.
"""
import numbers

import numpy

from .. import backend
from ..runtime import get_runtime
from ..tensor import Parameter, Tensor
from .cell import Cell
from .wrappers import TrainOneStepCell

__all__ = ["TrainOneStepWithLossScaleCell", "DynamicLossScaleUpdateCell", "FixedLossScaleUpdateCell"]


def _check_scale_parameter(who, loss_scale):
    if not isinstance(loss_scale, Parameter):
        raise TypeError(f"{who}: loss_scale must be the Parameter holding the scale (the step cell's "
                        f"scale_sense), got {type(loss_scale).__name__}")


class DynamicLossScaleUpdateCell(Cell):
    """MindSpore's dynamic loss-scale rule as a Cell: ``construct(loss_scale, overflow)`` divides
    the scale Parameter by ``scale_factor`` (never below 1) when ``overflow``, multiplies it after
    ``scale_window`` steps in a row without one, and returns ``overflow``.

    It computes in float32 as MindSpore's (``max(scale * (1 / factor), 1)``), and counts steps in
    two int32 Parameters, ``current_iterator_step`` (from 1) and ``last_overflow_iterator_step``,
    which checkpoints keep, so a resumed run continues the same sequence.
    ``amp.DynamicLossScaleManager.get_update_cell()`` returns one; ``nn.TrainOneStepWithLossScaleCell``
    calls it every step.

    Args:
        loss_scale_value: the first scale (what ``get_loss_scale()`` returns).
        scale_factor: the divisor on overflow and the multiplier after a clean window.
        scale_window: clean steps in a row before the scale grows.
    """

    def __init__(self, loss_scale_value, scale_factor, scale_window):
        super().__init__()
        who = "DynamicLossScaleUpdateCell"
        for name, value in (("loss_scale_value", loss_scale_value), ("scale_factor", scale_factor)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise ValueError(f"{who}: {name} must be a number > 0, got {value!r}")
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(f"{who}: scale_window must be a positive int, got {scale_window!r}")
        self.loss_scale_value = loss_scale_value
        self.scale_factor = numpy.float32(scale_factor)
        self.scale_window = scale_window
        self.cur_iter = Parameter(numpy.array(1, numpy.int32), name="current_iterator_step", requires_grad=False)
        self.last_overflow_iter = Parameter(numpy.array(0, numpy.int32), name="last_overflow_iterator_step",
                                            requires_grad=False)

    def get_loss_scale(self):
        """The first loss scale (the step cell starts from it)."""
        return self.loss_scale_value

    def construct(self, loss_scale, overflow):
        _check_scale_parameter("DynamicLossScaleUpdateCell", loss_scale)
        overflow = bool(overflow)
        scale = numpy.float32(backend.to_numpy(loss_scale.data).reshape(()))
        cur_iter, last_overflow_iter = int(self.cur_iter.asnumpy()), int(self.last_overflow_iter.asnumpy())
        if overflow:
            scale = max(scale * (numpy.float32(1) / self.scale_factor), numpy.float32(1))
        should_inc = self.scale_window <= cur_iter - last_overflow_iter
        if overflow or should_inc:
            self.last_overflow_iter.set_data(numpy.array(cur_iter, numpy.int32))
        if should_inc and not overflow:
            scale = scale * self.scale_factor
        loss_scale.set_data(numpy.full(loss_scale.shape, scale, numpy.float32))
        self.cur_iter.set_data(numpy.array(cur_iter + 1, numpy.int32))
        return overflow


class FixedLossScaleUpdateCell(Cell):
    """The update cell of a fixed scale: ``construct(loss_scale, overflow)`` returns ``overflow``
    and changes nothing (``amp.FixedLossScaleManager.get_update_cell()``).

    Args:
        loss_scale_value: the scale (what ``get_loss_scale()`` returns).
    """

    def __init__(self, loss_scale_value):
        super().__init__()
        if isinstance(loss_scale_value, bool) or not isinstance(loss_scale_value, numbers.Real) \
                or not loss_scale_value > 0:
            raise ValueError(f"FixedLossScaleUpdateCell: loss_scale_value must be a number > 0, got {loss_scale_value!r}")
        self.loss_scale_value = loss_scale_value

    def get_loss_scale(self):
        return self.loss_scale_value

    def construct(self, _, overflow):
        return bool(overflow)


def _any_non_finite(grads):
    """Whether any gradient holds an inf or NaN (one host read for all of them)."""
    flags = [(~backend.get_array_module(g.data).isfinite(g.data)).any() for g in grads if g is not None]
    return bool(sum(flags)) if flags else False


class TrainOneStepWithLossScaleCell(TrainOneStepCell):
    """One training step with loss scaling, as MindSpore's ``nn.TrainOneStepWithLossScaleCell``:
    backward starts from the scale (the gradients are the scaled loss's), each gradient is
    divided by the scale before the gradient reducer, and a step whose reduced gradients hold an
    inf or NaN skips the optimizer. ``construct(*inputs)`` returns ``(loss, overflow, scale)``.

    Args:
        network: a Cell returning the loss (e.g. ``nn.WithLossCell``), as for TrainOneStepCell.
        optimizer: the Optimizer.
        scale_sense: a Cell with ``get_loss_scale()`` that updates the scale each step
            (``nn.DynamicLossScaleUpdateCell``, ``nn.FixedLossScaleUpdateCell``, a manager's
            ``get_update_cell()``), or a Tensor of shape () or (1,): a scale that changes only
            by ``set_sense_scale``. It becomes the float32 Parameter ``scale_sense`` (not
            trainable; checkpoints keep it), which the update cell changes in place.

    Returns (of a call): the loss (detached, unscaled), the overflow flag (a bool Tensor) and the
    scale this step used (a Tensor copy; MindSpore's PyNative returns the Parameter, which then
    already holds the next step's scale: read ``cell.scale_sense`` for that).

    Overflow is agreed across ranks: when the runtime trains in lockstep (data or tensor
    parallelism), the flag is summed over the ranks (``get_runtime().sum_over_ranks``, as
    MindSpore's AllReduce of the flag), so one rank's inf skips the step, and updates the scale,
    on every rank. The data-parallel all-reduce of the gradients would carry an inf to every rank
    by itself; the explicit sum also covers gradients no all-reduce carries (tensor-parallel
    blocks, reduce-scattered slices). On a call where the reducer only accumulates
    (``grad_accumulation_step`` > 1) nothing is checked or updated: the flag is False.

    Example:
        >>> manager = amp.DynamicLossScaleManager(init_loss_scale=2 ** 12, scale_window=1000)
        >>> step = nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(net, loss_fn), opt,
        ...                                        scale_sense=manager.get_update_cell())
        >>> step.set_train()
        >>> loss, overflow, scale = step(data, label)
    """

    def __init__(self, network, optimizer, scale_sense):
        super().__init__(network, optimizer, sens=None)
        who = "For 'TrainOneStepWithLossScaleCell'"
        self.loss_scaling_manager = None
        if isinstance(scale_sense, Cell):
            get_loss_scale = getattr(scale_sense, "get_loss_scale", None)
            if not callable(get_loss_scale):
                raise TypeError(f"{who}, a Cell 'scale_sense' must have get_loss_scale() (an update cell such as "
                                f"nn.DynamicLossScaleUpdateCell), got {type(scale_sense).__name__}")
            self.loss_scaling_manager = scale_sense
            value = numpy.array(get_loss_scale(), numpy.float32)
        elif isinstance(scale_sense, Tensor):
            if tuple(scale_sense.shape) not in ((), (1,)):
                raise ValueError(f"{who}, the shape of 'scale_sense' must be (1,) or (), but got "
                                 f"{tuple(scale_sense.shape)}.")
            value = backend.to_numpy(scale_sense.data).astype(numpy.float32)
        else:
            raise TypeError(f"{who}, the 'scale_sense' must be Cell or Tensor, but got 'scale_sense' type: "
                            f"{type(scale_sense).__name__}.")
        self.scale_sense = Parameter(value, name="scale_sense", requires_grad=False)

    def set_sense_scale(self, sens):
        """Sets the scale (a Tensor of the scale's shape), as MindSpore's."""
        if not isinstance(sens, Tensor):
            raise TypeError(f"For 'TrainOneStepWithLossScaleCell', the type of 'sens' must be Tensor, but got "
                            f"{type(sens).__name__}")
        self.scale_sense.set_data(sens.data)

    def get_overflow_status(self, status, compute_output):
        """Whether any of the gradients ``compute_output`` holds an inf or NaN on any rank.

        ``status`` is MindSpore's Ascend float-status buffer; minidl checks the values and ignores it.
        """
        overflow = _any_non_finite(compute_output)
        runtime = get_runtime()
        if runtime.trains_in_lockstep():
            # Every rank must take the same branch (the optimizer and the scale), so every rank
            # must see the same flag: sum it (a collective every rank reaches, once per step).
            overflow = bool(runtime.sum_over_ranks(numpy.array([float(overflow)]))[0] >= 1)
        return overflow

    def process_loss_scale(self, overflow):
        """Calls the update cell with the scale and ``overflow``; returns ``overflow``."""
        if self.loss_scaling_manager is not None:
            return self.loss_scaling_manager(self.scale_sense, overflow)
        return overflow

    def construct(self, *inputs):
        reducer = self._reducer()
        self._broadcast_if_due()
        scale = self.scale_sense.data.copy()  # the scale of this step (the update cell replaces the Parameter's)

        def scaled_forward(*args):
            loss = self._loss_of(self.network(*args))
            # Backward of loss * scale starts the network's backward from the scale (MindSpore's
            # sens of ones_like(loss) * cast(scale, dtype(loss))).
            return loss * Tensor(scale.astype(loss.dtype).reshape(())), loss

        def unscale(grad):
            # MindSpore's _grad_scale: grad * cast(1 / scale, dtype(grad)); exact for a power of 2.
            data = grad.data
            return Tensor(data * (1 / scale.reshape(())).astype(data.dtype))

        loss, grads = self._gradients(inputs, reducer, scaled_forward, unscale)
        overflow = False
        if grads is not None:  # None: the reducer only accumulated; the optimizer waits
            overflow = self.process_loss_scale(self.get_overflow_status(None, grads))
            if not overflow:
                self.optimizer(grads)
        return loss, Tensor(numpy.array(overflow)), Tensor(scale)
