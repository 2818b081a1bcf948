"""Loss scale managers, as MindSpore 2.10's ``amp.FixedLossScaleManager`` and ``amp.DynamicLossScaleManager``.

A float16 gradient smaller than 2^-24 is zero: multiplying the loss by a scale S before backward
lifts the gradients into float16's range, and dividing them by S before the optimizer gives the
update back. Too large an S overflows (an inf or NaN in some gradient): that step is skipped and
S shrinks. The manager holds S and the rule; ``get_update_cell()`` gives the Cell that
``nn.TrainOneStepWithLossScaleCell`` calls each step with the overflow flag
(minidl/nn/loss_scale_cells.py), as ``Model(..., amp_level=..., loss_scale_manager=...)`` does
with a manager (as MindSpore's).

MindSpore's rule (``update_loss_scale``, and the update cell, which agree step for step):

- an overflow divides S by ``scale_factor``, never below 1, and the step's update is skipped;
- ``scale_window`` steps in a row without overflow multiply S by ``scale_factor``;
- 1000 overflows in a row raise RuntimeError (``update_loss_scale`` only, as MindSpore).

Example:
    >>> manager = amp.DynamicLossScaleManager(init_loss_scale=2 ** 10, scale_factor=2, scale_window=3)
    >>> for overflow in (True, False, False, False):
    ...     manager.update_loss_scale(overflow)
    >>> manager.get_loss_scale()
    1024.0
"""
import numbers

__all__ = ["LossScaleManager", "FixedLossScaleManager", "DynamicLossScaleManager"]


def _check_number(who, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {name} must be a number, got {type(value).__name__} {value!r}")


class LossScaleManager:
    """The interface of a loss scale manager (MindSpore's abstract class): the scale, its update
    rule and the update cell a training step calls."""

    def get_loss_scale(self):
        """The current loss scale (the factor the loss is multiplied by)."""
        raise NotImplementedError(f"{type(self).__name__}.get_loss_scale is not defined")

    def update_loss_scale(self, overflow):
        """Updates the scale after a step: ``overflow`` says whether its gradients held an inf or NaN."""
        raise NotImplementedError(f"{type(self).__name__}.update_loss_scale is not defined")

    def get_update_cell(self):
        """The Cell ``nn.TrainOneStepWithLossScaleCell`` calls each step, or None."""
        raise NotImplementedError(f"{type(self).__name__}.get_update_cell is not defined")


class FixedLossScaleManager(LossScaleManager):
    """A loss scale that never changes.

    Args:
        loss_scale: the scale, >= 1. Default 128.0.
        drop_overflow_update: skip the optimizer on a step whose gradients overflowed (default
            True). With False the step cell is a plain ``nn.TrainOneStepCell`` with
            ``sens=loss_scale`` and the optimizer must divide by the scale itself: build it
            with the same ``loss_scale`` (Model checks that they agree).

    Example:
        >>> manager = amp.FixedLossScaleManager(1024.0)
        >>> manager.get_loss_scale(), manager.get_drop_overflow_update()
        (1024.0, True)
    """

    def __init__(self, loss_scale=128.0, drop_overflow_update=True):
        _check_number("FixedLossScaleManager", "loss_scale", loss_scale)
        if not loss_scale >= 1:  # (also refuses NaN)
            raise ValueError(f"FixedLossScaleManager: the argument 'loss_scale' must be >= 1, but got {loss_scale}")
        if not isinstance(drop_overflow_update, bool):
            raise TypeError(f"FixedLossScaleManager: drop_overflow_update must be a bool, got {drop_overflow_update!r}")
        self._loss_scale = loss_scale
        self._drop_overflow_update = drop_overflow_update

    def get_loss_scale(self):
        return self._loss_scale

    def get_drop_overflow_update(self):
        """Whether a step whose gradients overflowed skips the optimizer."""
        return self._drop_overflow_update

    def update_loss_scale(self, overflow):
        """Does nothing: the scale is fixed."""

    def get_update_cell(self):
        """``nn.FixedLossScaleUpdateCell(loss_scale)`` when overflowing steps are dropped, else None."""
        if not self._drop_overflow_update:
            return None
        from ..nn.loss_scale_cells import FixedLossScaleUpdateCell  # (minidl.nn imports the optimizers; amp need not)
        return FixedLossScaleUpdateCell(self._loss_scale)


class DynamicLossScaleManager(LossScaleManager):
    """A loss scale that shrinks on overflow and grows after ``scale_window`` clean steps.

    Args:
        init_loss_scale: the first scale, >= 1. Default 2 ** 24.
        scale_factor: what the scale is divided by on overflow and multiplied by after
            ``scale_window`` clean steps, > 0. Default 2.
        scale_window: clean steps in a row before the scale grows, a positive int. Default 2000.

    Attributes (MindSpore's): ``loss_scale``, ``scale_factor``, ``scale_window``,
    ``increase_ratio``, ``decrease_ratio``, ``cur_iter`` (the next step, from 1),
    ``last_overflow_iter``, ``bad_step`` (overflows in a row), ``bad_step_max`` (1000).

    Example:
        >>> manager = amp.DynamicLossScaleManager()
        >>> manager.update_loss_scale(True)
        >>> manager.get_loss_scale()
        8388608.0
    """

    def __init__(self, init_loss_scale=2 ** 24, scale_factor=2, scale_window=2000):
        who = "DynamicLossScaleManager"
        _check_number(who, "init_loss_scale", init_loss_scale)
        if not init_loss_scale >= 1.0:
            # (MindSpore's message says "> 1" while its check, like this one, accepts 1)
            raise ValueError(f"{who}: the argument 'init_loss_scale' must be >= 1, but got {init_loss_scale}")
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(f"{who}: the argument 'scale_window' must be a positive int, but got {scale_window!r}")
        _check_number(who, "scale_factor", scale_factor)
        if not scale_factor > 0:
            raise ValueError(f"{who}: the argument 'scale_factor' must be > 0, but got {scale_factor}")
        self.loss_scale = init_loss_scale
        self.scale_window = scale_window
        self.scale_factor = scale_factor
        self.increase_ratio = scale_factor
        self.decrease_ratio = 1 / scale_factor
        self.cur_iter = 1
        self.last_overflow_iter = 0
        self.bad_step_max = 1000
        self.bad_step = 0

    def get_loss_scale(self):
        return self.loss_scale

    def update_loss_scale(self, overflow):
        """MindSpore's rule: on overflow divide (never below 1), else multiply when the clean steps
        since the last overflow are a multiple of ``scale_window``.

        Raises:
            RuntimeError: after more than ``bad_step_max`` overflows in a row (the model diverged).
        """
        if overflow:
            self.loss_scale = max(self.loss_scale * self.decrease_ratio, 1)
            self.last_overflow_iter = self.cur_iter
            self.bad_step += 1
        else:
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                self.loss_scale *= self.increase_ratio
            self.bad_step = 0
        if self.bad_step > self.bad_step_max:
            raise RuntimeError(f"DynamicLossScaleManager: the loss scale overflowed {self.bad_step} steps in a row, "
                               f"more than the maximum of {self.bad_step_max}")
        self.cur_iter += 1

    def get_drop_overflow_update(self):
        """Always True: an overflowing step is skipped."""
        return True

    def get_update_cell(self):
        """``nn.DynamicLossScaleUpdateCell(loss_scale, scale_factor, scale_window)``: the same rule, on the step."""
        from ..nn.loss_scale_cells import DynamicLossScaleUpdateCell
        return DynamicLossScaleUpdateCell(self.loss_scale, self.scale_factor, self.scale_window)
