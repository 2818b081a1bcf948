"""Dense, Flatten, Dropout and Identity, plus the helpers the other layer files share."""
import math

from ... import ops
from ...common.initializer import initializer, HeUniform, Uniform
from ...runtime import LOCAL, get_runtime
from ...tensor import Parameter, Tensor, float32
from ..cell import Cell
from .activation import ReLU, get_activation


def check_positive_int(who, arg, value):
    """Validates an int >= 1 at the layer boundary; returns it."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{who}: {arg} must be a positive int, got {value!r}")
    return value


def make_parameter(who, arg, init, shape, dtype=float32, requires_grad=True):
    """A Parameter of ``shape`` from an initializer (name, Initializer, number or Tensor).

    The Parameter is left unnamed: assigning it to a Cell attribute names it.
    """
    if isinstance(init, Tensor) or hasattr(init, "shape"):
        got = tuple(init.shape)
        if got != tuple(shape):
            raise ValueError(f"{who}: {arg} has shape {got}, expected {tuple(shape)}")
    return Parameter(initializer(init, shape, dtype), requires_grad=requires_grad)


def default_weight_init():
    """MindSpore 2.x / PyTorch default for Dense and Conv weights: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return HeUniform(negative_slope=math.sqrt(5))


def default_bias_init(fan_in):
    """MindSpore 2.x / PyTorch default for biases: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    return Uniform(scale=1.0 / math.sqrt(fan_in))


class Dense(Cell):
    """Fully connected layer: ``y = activation(x @ weight.T + bias)``.

    Args:
        in_channels: size of the last input dimension.
        out_channels: size of the last output dimension.
        weight_init: initializer of the (out_channels, in_channels) weight (default
            HeUniform(negative_slope=sqrt(5)), as MindSpore 2.x and PyTorch).
        bias_init: initializer of the bias (default U(-1/sqrt(in), 1/sqrt(in))).
        has_bias: add a bias.
        activation: None, a name ('relu', 'sigmoid', 'tanh', 'softmax') or a Cell.
        dtype: parameter dtype.

    Inputs of rank > 2 are treated as a batch of vectors along the last dimension. The product
    and the bias are one op, ``ops.Dense`` (MindSpore's layer calls MatMul then BiasAdd: the same
    values), and with ``activation="relu"`` the ReLU too, ``ops.DenseReLU``; after ``shard()``
    MatMul, BiasAdd and the activation run, with their strategies.

    Example:
        >>> fc = nn.Dense(3, 4, activation="relu")
        >>> fc(minidl.Tensor(np.ones((2, 3), np.float32))).shape
        (2, 4)
    """

    def __init__(self, in_channels, out_channels, weight_init=None, bias_init=None, has_bias=True,
                 activation=None, dtype=float32):
        super().__init__()
        self.in_channels = check_positive_int("Dense", "in_channels", in_channels)
        self.out_channels = check_positive_int("Dense", "out_channels", out_channels)
        self.has_bias = bool(has_bias)
        if weight_init is None:
            weight_init = default_weight_init()
        self.weight = make_parameter("Dense", "weight_init", weight_init, (out_channels, in_channels), dtype)
        self.bias = None
        if self.has_bias:
            if bias_init is None:
                bias_init = default_bias_init(in_channels)
            self.bias = make_parameter("Dense", "bias_init", bias_init, (out_channels,), dtype)
        if isinstance(activation, str):
            activation = get_activation(activation, "Dense")
        elif activation is not None and not callable(activation):
            raise TypeError(f"Dense: activation must be None, a str or a Cell, got {type(activation).__name__}")
        self.activation = activation
        self.matmul = ops.MatMul(transpose_b=True)
        self.bias_add = ops.BiasAdd()
        self.dense = ops.Dense()  # MatMul and BiasAdd in one op, where neither is sharded (construct)
        self.dense_relu = ops.DenseReLU()  # and with activation="relu" (an nn.ReLU), the ReLU too
        self.reshape = ops.Reshape()

    def construct(self, x):
        shape = x.shape
        if not shape or shape[-1] != self.in_channels:
            raise ValueError(f"Dense: input of shape {tuple(shape)} must have its last dimension equal to "
                             f"in_channels={self.in_channels}")
        flat = len(shape) != 2
        if flat:
            x = self.reshape(x, (math.prod(shape[:-1]), self.in_channels))
        if self.one_op():
            # The same product and bias as the two ops below, in one op call (ops/dense.py): one
            # pass over the output fewer, and half the Python per layer; an nn.ReLU activation
            # joins them (DenseReLU: the ReLU applied in the same sweep).
            fused = type(self.activation) is ReLU
            op = self.dense_relu if fused else self.dense
            x = op(x, self.weight, self.bias) if self.has_bias else op(x, self.weight)
            if self.activation is not None and not fused:
                x = self.activation(x)
        else:
            x = self.matmul(x, self.weight)
            if self.has_bias:
                x = self.bias_add(x, self.bias)
            if self.activation is not None:
                x = self.activation(x)
        if flat:
            x = self.reshape(x, tuple(shape[:-1]) + (self.out_channels,))
        return x

    def one_op(self):
        """Whether construct runs the product and bias as one ``ops.Dense`` (``DenseReLU`` with an
        nn.ReLU activation): neither MatMul nor BiasAdd sharded, on the local runtime. Otherwise
        the two ops run, as their strategies and tensor-parallel rules say (GRAPH_MODE's layer may
        still fuse them into Dense or DenseReLU). Resolved at each call."""
        return self.matmul.in_strategy is None and self.bias_add.in_strategy is None and get_runtime().placing is LOCAL

    def shard(self, strategy):
        """Tensor parallelism: the MatMul's strategy, the bias following its output cut. Returns self.

        The weight is stored (out_channels, in_channels), so ``strategy`` is
        ``((batch cut, in cut), (out cut, in cut))``: ``((dp, 1), (mp, 1))`` is column-parallel
        (each rank computes mp-th of the outputs), ``((dp, mp), (1, mp))`` row-parallel (each
        rank a partial sum over its slice of the inputs).

        Example:
            >>> fc = nn.Dense(32, 16).shard(((2, 1), (4, 1)))      # 8 ranks: batch in 2, outputs in 4
        """
        self.matmul.shard(strategy)
        batch, out = self.matmul.in_strategy[0][0], self.matmul.in_strategy[1][0]
        self.bias_add.shard(((batch, out), (out,)))
        return self

    def extend_repr(self):
        s = f"input_channels={self.in_channels}, output_channels={self.out_channels}, has_bias={self.has_bias}"
        if self.activation is not None:
            s += f", activation={self.activation!r}"
        return s


class Flatten(Cell):
    """Flattens dimensions ``start_dim..end_dim`` into one (default: all but the batch dim).

    Args:
        start_dim: first dimension to flatten.
        end_dim: last dimension to flatten (inclusive).
    """

    def __init__(self, start_dim=1, end_dim=-1):
        super().__init__()
        if not isinstance(start_dim, int) or not isinstance(end_dim, int):
            raise TypeError(f"Flatten: start_dim and end_dim must be ints, got {start_dim!r} and {end_dim!r}")
        self.start_dim, self.end_dim = start_dim, end_dim
        self.flatten = ops.Flatten()
        self.reshape = ops.Reshape()

    def construct(self, x):
        shape = tuple(x.shape)
        if self.start_dim == 1 and self.end_dim == -1 and len(shape) >= 2:
            return self.flatten(x)
        n = max(len(shape), 1)
        start, end = self.start_dim % n, self.end_dim % n
        if not (-n <= self.start_dim < n and -n <= self.end_dim < n) or start > end:
            raise ValueError(f"Flatten: start_dim={self.start_dim} and end_dim={self.end_dim} do not select "
                             f"a range of dimensions of an input of shape {shape}")
        new = shape[:start] + (math.prod(shape[start:end + 1]),) + shape[end + 1:]
        return self.reshape(x, new)

    def extend_repr(self):
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


class Dropout(Cell):
    """Zeroes elements with probability p and scales the others by 1/(1-p), in training only.

    Args:
        keep_prob: probability of keeping an element, in (0, 1] (MindSpore 1.x spelling).
        p: probability of dropping an element, in [0, 1); takes precedence when given.

    In inference mode (``set_train(False)``, the default of a new Cell) it is the identity.
    """

    def __init__(self, keep_prob=0.5, p=None, dtype=float32):
        super().__init__()
        if p is not None:
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
                raise ValueError(f"Dropout: p (the drop probability) must be in [0, 1), got {p!r}")
            keep_prob = 1.0 - p
        elif isinstance(keep_prob, bool) or not isinstance(keep_prob, (int, float)) or not 0 < keep_prob <= 1:
            raise ValueError(f"Dropout: keep_prob must be in (0, 1], got {keep_prob!r}")
        self.keep_prob = float(keep_prob)
        self.dropout = ops.Dropout(self.keep_prob)

    def construct(self, x):
        if not self.training or self.keep_prob == 1.0:
            return x
        return self.dropout(x)

    def extend_repr(self):
        return f"p={1.0 - self.keep_prob:g}"


class Identity(Cell):
    """Returns its input unchanged (it stands where a layer is optional)."""

    def construct(self, x):
        return x
