"""Activation cells: ReLU, Sigmoid, Tanh, Softmax, LogSoftmax, and get_activation(name)."""
from ... import ops
from ..cell import Cell


class ReLU(Cell):
    """max(x, 0), elementwise."""

    def __init__(self):
        super().__init__()
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.relu(x)


class Sigmoid(Cell):
    """1 / (1 + exp(-x)), elementwise."""

    def __init__(self):
        super().__init__()
        self.sigmoid = ops.Sigmoid()

    def construct(self, x):
        return self.sigmoid(x)


class Tanh(Cell):
    """tanh(x), elementwise."""

    def __init__(self):
        super().__init__()
        self.tanh = ops.Tanh()

    def construct(self, x):
        return self.tanh(x)


class Softmax(Cell):
    """exp(x) / sum(exp(x)) along ``axis`` (computed stably).

    Args:
        axis: the axis that sums to one (default the last).
    """

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = axis
        self.softmax = ops.Softmax(axis)

    def construct(self, x):
        return self.softmax(x)

    def extend_repr(self):
        return f"axis={self.axis}"


class LogSoftmax(Cell):
    """log(softmax(x)) along ``axis``, computed without forming softmax(x).

    Args:
        axis: the normalised axis (default the last).
    """

    def __init__(self, axis=-1):
        super().__init__()
        self.axis = axis
        self.log_softmax = ops.LogSoftmax(axis)

    def construct(self, x):
        return self.log_softmax(x)

    def extend_repr(self):
        return f"axis={self.axis}"


_ACTIVATIONS = {
    "relu": ReLU,
    "sigmoid": Sigmoid,
    "tanh": Tanh,
    "softmax": Softmax,
    "logsoftmax": LogSoftmax,
    "log_softmax": LogSoftmax,
}


def get_activation(name, prim_name=None):
    """The activation Cell for a name: 'relu', 'sigmoid', 'tanh', 'softmax', 'log_softmax'.

    Args:
        name: the activation's name (case-insensitive), or None (returns None).
        prim_name: the layer asking, for the error message.
    """
    if name is None:
        return None
    who = prim_name or "get_activation"
    if not isinstance(name, str):
        raise TypeError(f"{who}: activation name must be a str, got {type(name).__name__}")
    cls = _ACTIVATIONS.get(name.lower())
    if cls is None:
        known = ", ".join(repr(k) for k in _ACTIVATIONS)
        raise ValueError(f"{who}: unknown activation {name!r}; expected one of {known}")
    return cls()
