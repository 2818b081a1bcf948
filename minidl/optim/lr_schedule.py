"""Learning-rate schedules, with MindSpore's names and formulas.

Two forms, as in MindSpore:
- schedules (``LearningRateSchedule``): called with the global step, they return the
  learning rate for that step; give one to an optimizer as ``learning_rate``;
- list builders (``piecewise_constant_lr``, ``cosine_decay_lr``, ...): they return the
  whole list of per-step rates up front; an optimizer given a list uses
  ``lr[min(step, len(lr) - 1)]`` at each step.

Example:
    >>> lr = CosineDecayLR(min_lr=0.001, max_lr=0.1, decay_steps=1000)
    >>> opt = Momentum(net.trainable_params(), learning_rate=lr, momentum=0.9)
"""
import bisect
import math
import numbers

__all__ = ["LearningRateSchedule", "ExponentialDecayLR", "CosineDecayLR", "PolynomialDecayLR", "WarmUpLR",
           "PiecewiseConstantLR", "piecewise_constant_lr", "exponential_decay_lr", "cosine_decay_lr", "warmup_lr"]


def _number(who, name, value, positive=True, allow_zero=False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{who}: {name} must be a number, got {value!r}")
    if positive and (value < 0 or (value == 0 and not allow_zero)):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{who}: {name} must be {bound}, got {value!r}")
    return float(value)


def _positive_int(who, name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{who}: {name} must be an int, got {value!r}")
    if value < 1:
        raise ValueError(f"{who}: {name} must be >= 1, got {value!r}")
    return int(value)


def _step(global_step):
    """The step as a Python int (accepts ints, 0-d / 1-element arrays and Tensors)."""
    if hasattr(global_step, "item"):
        global_step = global_step.item()
    return int(global_step)


class LearningRateSchedule:
    """Base class: ``schedule(global_step)`` -> the learning rate (a Python float).

    Subclasses implement ``construct(step)`` with ``step`` a Python int.
    """

    def construct(self, step):
        raise NotImplementedError(f"{type(self).__name__} must implement construct(step)")

    def __call__(self, global_step):
        return float(self.construct(_step(global_step)))


class ExponentialDecayLR(LearningRateSchedule):
    """learning_rate * decay_rate ** p, with p = step / decay_steps (floored when is_stair).

    Example:
        >>> ExponentialDecayLR(0.1, 0.9, 4)(2)      # 0.1 * 0.9 ** 0.5
        0.0948683...
    """

    def __init__(self, learning_rate, decay_rate, decay_steps, is_stair=False):
        who = "ExponentialDecayLR"
        self.learning_rate = _number(who, "learning_rate", learning_rate)
        self.decay_rate = _number(who, "decay_rate", decay_rate)
        self.decay_steps = _positive_int(who, "decay_steps", decay_steps)
        if not isinstance(is_stair, bool):
            raise TypeError(f"{who}: is_stair must be a bool, got {is_stair!r}")
        self.is_stair = is_stair

    def construct(self, step):
        p = step / self.decay_steps
        if self.is_stair:
            p = math.floor(p)
        return self.learning_rate * self.decay_rate ** p


class CosineDecayLR(LearningRateSchedule):
    """min_lr + 0.5 * (max_lr - min_lr) * (1 + cos(pi * min(step, decay_steps) / decay_steps))."""

    def __init__(self, min_lr, max_lr, decay_steps):
        who = "CosineDecayLR"
        self.min_lr = _number(who, "min_lr", min_lr, allow_zero=True)
        self.max_lr = _number(who, "max_lr", max_lr)
        self.decay_steps = _positive_int(who, "decay_steps", decay_steps)
        if self.min_lr >= self.max_lr:
            raise ValueError(f"{who}: max_lr must be greater than min_lr, got max_lr={max_lr!r}, min_lr={min_lr!r}")

    def construct(self, step):
        p = min(step, self.decay_steps) / self.decay_steps
        return self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (1.0 + math.cos(math.pi * p))


class PolynomialDecayLR(LearningRateSchedule):
    """(lr - end_lr) * (1 - step / decay_steps) ** power + end_lr, with step capped at decay_steps.

    With ``update_decay_steps=True`` the step is not capped; decay_steps grows instead to
    decay_steps * ceil(step / decay_steps), as in MindSpore.
    """

    def __init__(self, learning_rate, end_learning_rate, decay_steps, power, update_decay_steps=False):
        who = "PolynomialDecayLR"
        self.learning_rate = _number(who, "learning_rate", learning_rate)
        self.end_learning_rate = _number(who, "end_learning_rate", end_learning_rate, allow_zero=True)
        self.decay_steps = _positive_int(who, "decay_steps", decay_steps)
        self.power = _number(who, "power", power)
        self.update_decay_steps = bool(update_decay_steps)

    def construct(self, step):
        decay_steps = self.decay_steps
        if self.update_decay_steps:
            decay_steps *= max(math.ceil(step / decay_steps), 1)
        else:
            step = min(step, decay_steps)
        p = step / decay_steps
        return (self.learning_rate - self.end_learning_rate) * (1.0 - p) ** self.power + self.end_learning_rate


class WarmUpLR(LearningRateSchedule):
    """learning_rate * min(step, warmup_steps) / warmup_steps."""

    def __init__(self, learning_rate, warmup_steps):
        self.learning_rate = _number("WarmUpLR", "learning_rate", learning_rate, allow_zero=True)
        self.warmup_steps = _positive_int("WarmUpLR", "warmup_steps", warmup_steps)

    def construct(self, step):
        return self.learning_rate * min(step, self.warmup_steps) / self.warmup_steps


def _check_milestones(who, milestone, learning_rates):
    if not isinstance(milestone, (list, tuple)) or not isinstance(learning_rates, (list, tuple)):
        raise TypeError(f"{who}: milestone and learning_rates must be lists or tuples, "
                        f"got {type(milestone).__name__} and {type(learning_rates).__name__}")
    if len(milestone) != len(learning_rates) or not milestone:
        raise ValueError(f"{who}: milestone and learning_rates must be non-empty and of equal length, "
                         f"got {len(milestone)} and {len(learning_rates)}")
    previous = 0
    for m in milestone:
        _positive_int(who, "each milestone", m)
        if m <= previous:
            raise ValueError(f"{who}: milestone must be strictly increasing positive ints, got {list(milestone)}")
        previous = m
    return [int(m) for m in milestone], [_number(who, "each learning rate", x, allow_zero=True)
                                         for x in learning_rates]


class PiecewiseConstantLR(LearningRateSchedule):
    """learning_rates[i] for step in [milestone[i-1], milestone[i]); the last rate after the last milestone.

    The schedule form of ``piecewise_constant_lr``.

    Example:
        >>> s = PiecewiseConstantLR([2, 5], [0.1, 0.05])
        >>> [s(i) for i in range(6)]
        [0.1, 0.1, 0.05, 0.05, 0.05, 0.05]
    """

    def __init__(self, milestone, learning_rates):
        self.milestone, self.learning_rates = _check_milestones("PiecewiseConstantLR", milestone, learning_rates)

    def construct(self, step):
        i = bisect.bisect_right(self.milestone, step)
        return self.learning_rates[min(i, len(self.learning_rates) - 1)]


def piecewise_constant_lr(milestone, learning_rates):
    """The list y of length milestone[-1] with y[i] = learning_rates[t] for i in [milestone[t-1], milestone[t]).

    Example:
        >>> piecewise_constant_lr([2, 5, 10], [0.1, 0.05, 0.01])
        [0.1, 0.1, 0.05, 0.05, 0.05, 0.01, 0.01, 0.01, 0.01, 0.01]
    """
    milestone, rates = _check_milestones("piecewise_constant_lr", milestone, learning_rates)
    out, last = [], 0
    for m, lr in zip(milestone, rates):
        out += [lr] * (m - last)
        last = m
    return out


def _epoch_args(who, total_step, step_per_epoch, decay_epoch, name="decay_epoch"):
    return (_positive_int(who, "total_step", total_step), _positive_int(who, "step_per_epoch", step_per_epoch),
            _positive_int(who, name, decay_epoch))


def exponential_decay_lr(learning_rate, decay_rate, total_step, step_per_epoch, decay_epoch, is_stair=False):
    """Per-step list: learning_rate * decay_rate ** (epoch / decay_epoch), epoch = floor(i / step_per_epoch).

    With is_stair the exponent is floor(epoch / decay_epoch).
    """
    who = "exponential_decay_lr"
    lr = _number(who, "learning_rate", learning_rate)
    rate = _number(who, "decay_rate", decay_rate)
    total, per_epoch, decay = _epoch_args(who, total_step, step_per_epoch, decay_epoch)
    out = []
    for i in range(total):
        p = (i // per_epoch) / decay
        out.append(lr * rate ** (math.floor(p) if is_stair else p))
    return out


def cosine_decay_lr(min_lr, max_lr, total_step, step_per_epoch, decay_epoch):
    """Per-step list: min_lr + 0.5 * (max_lr - min_lr) * (1 + cos(pi * min(epoch, decay_epoch) / decay_epoch))."""
    who = "cosine_decay_lr"
    lo = _number(who, "min_lr", min_lr, allow_zero=True)
    hi = _number(who, "max_lr", max_lr)
    total, per_epoch, decay = _epoch_args(who, total_step, step_per_epoch, decay_epoch)
    return [lo + 0.5 * (hi - lo) * (1.0 + math.cos(math.pi * min(i // per_epoch, decay) / decay))
            for i in range(total)]


def warmup_lr(learning_rate, total_step, step_per_epoch, warmup_epoch):
    """Per-step list: learning_rate * min(epoch, warmup_epoch) / warmup_epoch."""
    who = "warmup_lr"
    lr = _number(who, "learning_rate", learning_rate, allow_zero=True)
    total, per_epoch, warm = _epoch_args(who, total_step, step_per_epoch, warmup_epoch, "warmup_epoch")
    return [lr * min(i // per_epoch, warm) / warm for i in range(total)]
