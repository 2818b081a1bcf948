"""The op base: a Primitive is configured once (``ops.MatMul(transpose_b=True)``), then called.

Each call clones the configured instance, so one primitive object can be called many times
in a network while each call keeps its own saved arrays for backward. A subclass writes:

    forward(self, *args)  -> ndarray     args: ndarrays where Tensors were passed, the
                                          Python values (axis, shape, dtype...) elsewhere
    backward(self, gy)    -> tuple        one gradient ndarray (or None) per positional arg

Inside backward, ``self.needs_grad[i]`` says whether argument i needs a gradient, so work
for the others can be skipped. ``xp = get_array_module(...)`` picks numpy or cupy: one body
serves both.

``shard(in_strategy, out_strategy)`` only stores the strategy here; minidl_parallel reads
it. A call asks the active runtime (minidl/runtime.py) to run the op: the local runtime
calls ``apply``; a parallel one may redistribute the inputs first.
"""
import numpy

from ..runtime import LOCAL, get_runtime
from ..tensor import Tensor, is_grad_enabled


class Primitive:
    """Base of every operator. Subclasses set ``n_inputs`` and write forward/backward."""

    n_inputs = 1  # positional arguments (tensors and attributes alike): an int, or (min, max)
    n_tensor_inputs = None  # how many of them are tensors a strategy describes (default n_inputs)

    def __init__(self):
        self.in_strategy = None
        self.out_strategy = None

    @property
    def name(self):
        return type(self).__name__

    def shard(self, in_strategy, out_strategy=None):
        """Stores a parallel strategy: one tuple of cuts per tensor input. Returns self.

        Example:
            >>> matmul = ops.MatMul().shard(((2, 4), (4, 1)))
        """
        expected = self.n_tensor_inputs if self.n_tensor_inputs is not None else self.n_inputs
        expected = expected if isinstance(expected, int) else None
        self.in_strategy = _check_strategy(self.name, "in_strategy", in_strategy, expected)
        if out_strategy is not None:
            out_strategy = _check_strategy(self.name, "out_strategy", out_strategy, None)
        self.out_strategy = out_strategy
        return self

    def __call__(self, *args):
        runtime = get_runtime()
        if runtime is LOCAL:
            return self.apply(*args)
        return runtime.call_op(self, args)

    def apply(self, *args):
        """Runs the op on this process's arrays and records it when a gradient is needed."""
        n = self.n_inputs
        if n is not None:
            lo, hi = (n, n) if isinstance(n, int) else n
            if not lo <= len(args) <= hi:
                want = lo if lo == hi else f"{lo} to {hi}"
                raise TypeError(f"{self.name}: expected {want} input(s), got {len(args)}")
        node = object.__new__(type(self))
        node.__dict__.update(self.__dict__)
        arrays = [a.data if isinstance(a, Tensor) else a for a in args]
        out = node.forward(*arrays)
        if isinstance(out, numpy.generic):
            out = numpy.asarray(out)  # 0-d numpy arithmetic returns scalars; tensors hold arrays
        # Integer and bool outputs (comparisons, argmax-like ops) carry no gradient.
        if is_grad_enabled() and out.dtype.kind in "fc":
            inputs = tuple((i, a) for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad)
            if inputs:
                needs = [False] * len(args)
                for i, _ in inputs:
                    needs[i] = True
                node.needs_grad = needs
                node.inputs = inputs
                return Tensor._wrap(out, node)
        return Tensor._wrap(out)

    def forward(self, *args):
        raise NotImplementedError(f"{self.name}.forward")

    def backward(self, gy):
        raise NotImplementedError(f"{self.name} has no backward")

    def __repr__(self):
        attrs = {k: v for k, v in self.__dict__.items() if not k.startswith("_") and v is not None
                 and k not in ("in_strategy", "out_strategy")}
        body = ", ".join(f"{k}={v!r}" for k, v in attrs.items())
        strategy = f".shard({self.in_strategy})" if self.in_strategy is not None else ""
        return f"{self.name}({body}){strategy}"


def _check_strategy(op, arg, strategy, expected):
    if not isinstance(strategy, (tuple, list)) or not all(isinstance(s, (tuple, list)) for s in strategy):
        raise TypeError(f"{op}.shard: {arg} must be a tuple of tuples (one per input), got {strategy!r}")
    if expected is not None and len(strategy) != expected:
        raise ValueError(f"{op}.shard: {arg} has {len(strategy)} tuple(s), but {op} takes {expected} "
                         f"tensor input(s): {strategy!r}")
    for s in strategy:
        for cut in s:
            if not isinstance(cut, int) or isinstance(cut, bool) or cut < 1:
                raise ValueError(f"{op}.shard: every cut in {arg} must be a positive int, got {strategy!r}")
    return tuple(tuple(s) for s in strategy)


def sum_to_shape(g, shape):
    """Sums a broadcast gradient back to ``shape`` (the adjoint of numpy broadcasting)."""
    if g.shape == tuple(shape):
        return g
    ndim_extra = g.ndim - len(shape)
    axes = tuple(range(ndim_extra)) + tuple(
        i + ndim_extra for i, n in enumerate(shape) if n == 1 and g.shape[i + ndim_extra] != 1)
    g = g.sum(axis=axes, keepdims=True) if axes else g
    if ndim_extra:
        g = g.reshape(shape)
    return g


def shape_of(x):
    """Shape of an ndarray or a Python scalar (``()``)."""
    return tuple(getattr(x, "shape", ()))


def normalize_axis(op, axis, ndim):
    """Turns int / tuple / None into a sorted tuple of non-negative axes, with a clear error."""
    if axis is None or axis == ():
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    out = []
    for a in axes:
        if not isinstance(a, int) or not -ndim <= a < max(ndim, 1):
            raise ValueError(f"{op}: axis {a} is out of range for a tensor of rank {ndim} "
                             f"(expected -{ndim} <= axis < {ndim})")
        out.append(a % ndim if ndim else 0)
    if len(set(out)) != len(out):
        raise ValueError(f"{op}: repeated axis in {axis!r}")
    return tuple(sorted(out))
