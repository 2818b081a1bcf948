"""Activation cells: ReLU, Sigmoid, Tanh, Softmax, LogSoftmax, GELU, LeakyReLU, SiLU, and
get_activation(name)."""
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


class GELU(Cell):
    """Gaussian error linear unit, elementwise.

    Args:
        approximate: True (default, MindSpore 2.10's) for the tanh form
            ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))``, False for the exact
            ``x * Phi(x)``. (PyTorch's nn.GELU takes a string and defaults to the exact 'none';
            ``ops.gelu`` does too.)

    Example:
        >>> nn.GELU()(minidl.Tensor([-1.0, 2.0]))      # [-0.1588, 1.9546]
    """

    def __init__(self, approximate=True):
        super().__init__()
        if not isinstance(approximate, bool):
            raise TypeError(f"GELU: approximate must be a bool, got {approximate!r}")
        self.approximate = approximate
        self.gelu = ops.GeLU("tanh" if approximate else "none")

    def construct(self, x):
        return self.gelu(x)

    def extend_repr(self):
        return f"approximate={self.approximate}"


class LeakyReLU(Cell):
    """``x`` where x > 0, ``alpha * x`` elsewhere.

    Args:
        alpha: the negative slope (default 0.2, MindSpore's; PyTorch's default is 0.01).
    """

    def __init__(self, alpha=0.2):
        super().__init__()
        self.leaky_relu = ops.LeakyReLU(alpha)
        self.alpha = self.leaky_relu.alpha

    def construct(self, x):
        return self.leaky_relu(x)

    def extend_repr(self):
        return f"alpha={self.alpha}"


class SiLU(Cell):
    """x * sigmoid(x), elementwise (also called swish)."""

    def __init__(self):
        super().__init__()
        self.silu = ops.SiLU()

    def construct(self, x):
        return self.silu(x)


_ACTIVATIONS = {
    "relu": ReLU,
    "sigmoid": Sigmoid,
    "tanh": Tanh,
    "softmax": Softmax,
    "logsoftmax": LogSoftmax,
    "log_softmax": LogSoftmax,
    "gelu": GELU,
    "leakyrelu": LeakyReLU,
    "silu": SiLU,
}


def get_activation(name, prim_name=None):
    """The activation Cell for a name: 'relu', 'sigmoid', 'tanh', 'softmax', 'log_softmax', 'gelu',
    'leakyrelu', 'silu' (MindSpore's names; each with its default arguments).

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
