"""Parameter initializers, with MindSpore's names and formulas.

``initializer(init, shape, dtype)`` returns a Tensor filled by ``init``: a name
("he_normal", "zeros", ...), an Initializer instance, a number (a constant) or an array.
Random values are drawn in float64 from ``minidl.backend.rng()`` (so ``minidl.set_seed``
repeats them, on CPU and GPU alike), cast to ``dtype``, then moved to the context's device.
MindSpore returns a lazily initialised Tensor; ours holds its data at once.

Example:
    >>> from minidl.common.initializer import initializer, HeNormal
    >>> w = initializer(HeNormal(), (64, 3, 3, 3))            # fan_in = 3 * 3 * 3
    >>> b = initializer("zeros", (64,), minidl.float32)
"""
import math
import numbers

import numpy

from .. import backend
from ..tensor import Tensor, float32

__all__ = ["Initializer", "Normal", "Uniform", "Zero", "One", "Constant", "HeNormal", "HeUniform",
           "XavierUniform", "XavierNormal", "TruncatedNormal", "initializer",
           "calculate_fan_in_and_fan_out", "calculate_gain"]


def calculate_fan_in_and_fan_out(shape):
    """(fan_in, fan_out) of a weight shape, as PyTorch and MindSpore compute them.

    Dense weights are (out, in); convolution weights are (out, in, *kernel), whose fans
    include the receptive field: fan_in = in * prod(kernel), fan_out = out * prod(kernel).
    """
    shape = tuple(shape)
    if len(shape) < 2:
        raise ValueError(f"calculate_fan_in_and_fan_out: fan_in and fan_out need a shape with at least "
                         f"2 dimensions, got {shape}")
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


_GAINS = {"linear": 1.0, "conv1d": 1.0, "conv2d": 1.0, "conv3d": 1.0, "conv_transpose1d": 1.0,
          "conv_transpose2d": 1.0, "conv_transpose3d": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3,
          "relu": math.sqrt(2.0), "leaky_relu": None, "selu": 3.0 / 4}


def calculate_gain(nonlinearity, param=None):
    """The recommended gain for a nonlinearity (PyTorch's table; leaky_relu uses ``param``).

    Args:
        nonlinearity: one of linear, conv1d/2d/3d, conv_transpose1d/2d/3d, sigmoid, tanh,
            relu, leaky_relu, selu.
        param: the negative slope of leaky_relu (default 0.01).
    """
    if nonlinearity not in _GAINS:
        raise ValueError(f"calculate_gain: unknown nonlinearity {nonlinearity!r}; expected one of "
                         f"{sorted(_GAINS)}")
    if nonlinearity != "leaky_relu":
        return _GAINS[nonlinearity]
    slope = 0.01 if param is None else param
    if isinstance(slope, bool) or not isinstance(slope, numbers.Real):
        raise ValueError(f"calculate_gain: negative_slope must be a number, got {param!r}")
    return math.sqrt(2.0 / (1 + slope ** 2))


def _fan(shape, mode, who):
    if mode not in ("fan_in", "fan_out"):
        raise ValueError(f"{who}: mode must be one of ['fan_in', 'fan_out'], got {mode!r}")
    fan_in, fan_out = calculate_fan_in_and_fan_out(shape)
    return fan_in if mode == "fan_in" else fan_out


class Initializer:
    """Base class: fills a float64 NumPy array in place (``_initialize``).

    Subclasses override ``_initialize(self, arr)``; calling an instance on an array fills it,
    as in MindSpore. Use ``initializer(init, shape, dtype)`` to get a Tensor.
    """

    def __init__(self, **kwargs):
        self._kwargs = kwargs

    def _initialize(self, arr):
        raise NotImplementedError(f"{type(self).__name__} must implement _initialize(arr)")

    def __call__(self, arr):
        if not isinstance(arr, numpy.ndarray):
            raise TypeError(f"{type(self).__name__}: expected a numpy.ndarray to fill, got {type(arr).__name__}")
        if arr.size:
            self._initialize(arr)
        return arr

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self._kwargs.items())
        return f"{type(self).__name__}({args})"


class Normal(Initializer):
    """N(mean, sigma**2)."""

    def __init__(self, sigma=0.01, mean=0.0):
        super().__init__(sigma=sigma, mean=mean)
        self.sigma, self.mean = sigma, mean

    def _initialize(self, arr):
        arr[...] = backend.rng().normal(self.mean, self.sigma, arr.shape)


class Uniform(Initializer):
    """U(-scale, scale)."""

    def __init__(self, scale=0.07):
        super().__init__(scale=scale)
        self.scale = scale

    def _initialize(self, arr):
        arr[...] = backend.rng().uniform(-self.scale, self.scale, arr.shape)


class Constant(Initializer):
    """Every element equal to ``value``."""

    def __init__(self, value):
        super().__init__(value=value)
        self.value = value

    def _initialize(self, arr):
        arr.fill(self.value)


class Zero(Constant):
    """All zeros."""

    def __init__(self):
        Initializer.__init__(self)
        self.value = 0.0


class One(Constant):
    """All ones."""

    def __init__(self):
        Initializer.__init__(self)
        self.value = 1.0


class HeNormal(Initializer):
    """Kaiming normal: N(0, std**2) with std = gain / sqrt(fan).

    Args:
        negative_slope: the slope of leaky_relu's negative part (0 gives ReLU's gain sqrt(2)).
        mode: "fan_in" keeps the forward variance, "fan_out" the backward one.
        nonlinearity: see ``calculate_gain``.
    """

    def __init__(self, negative_slope=0, mode="fan_in", nonlinearity="leaky_relu"):
        super().__init__(negative_slope=negative_slope, mode=mode, nonlinearity=nonlinearity)
        _fan((1, 1), mode, type(self).__name__)  # validates mode now, not at first use
        self.gain = calculate_gain(nonlinearity, negative_slope)
        self.mode = mode

    def _std(self, shape):
        return self.gain / math.sqrt(_fan(shape, self.mode, type(self).__name__))

    def _initialize(self, arr):
        arr[...] = backend.rng().normal(0.0, self._std(arr.shape), arr.shape)


class HeUniform(HeNormal):
    """Kaiming uniform: U(-bound, bound) with bound = gain * sqrt(3 / fan)."""

    def _initialize(self, arr):
        bound = math.sqrt(3.0) * self._std(arr.shape)
        arr[...] = backend.rng().uniform(-bound, bound, arr.shape)


class XavierUniform(Initializer):
    """Glorot uniform: U(-bound, bound) with bound = gain * sqrt(6 / (fan_in + fan_out))."""

    def __init__(self, gain=1):
        super().__init__(gain=gain)
        self.gain = gain

    def _initialize(self, arr):
        fan_in, fan_out = calculate_fan_in_and_fan_out(arr.shape)
        bound = self.gain * math.sqrt(6.0 / (fan_in + fan_out))
        arr[...] = backend.rng().uniform(-bound, bound, arr.shape)


class XavierNormal(Initializer):
    """Glorot normal: N(0, std**2) with std = gain * sqrt(2 / (fan_in + fan_out))."""

    def __init__(self, gain=1):
        super().__init__(gain=gain)
        self.gain = gain

    def _initialize(self, arr):
        fan_in, fan_out = calculate_fan_in_and_fan_out(arr.shape)
        std = self.gain * math.sqrt(2.0 / (fan_in + fan_out))
        arr[...] = backend.rng().normal(0.0, std, arr.shape)


class TruncatedNormal(Initializer):
    """N(0, sigma**2) restricted to [-2 sigma, 2 sigma] (values outside are redrawn)."""

    def __init__(self, sigma=0.01):
        super().__init__(sigma=sigma)
        self.sigma = sigma

    def _initialize(self, arr):
        gen = backend.rng()
        flat = gen.standard_normal(arr.size)
        # Rejection sampling: each round redraws only the ~4.6% outside two sigmas.
        bad = numpy.flatnonzero(numpy.abs(flat) > 2.0)
        while bad.size:
            flat[bad] = gen.standard_normal(bad.size)
            bad = bad[numpy.abs(flat[bad]) > 2.0]
        arr[...] = (flat * self.sigma).reshape(arr.shape)


_NAMES = {"normal": Normal, "uniform": Uniform, "zeros": Zero, "zero": Zero, "ones": One, "one": One,
          "he_normal": HeNormal, "he_uniform": HeUniform, "xavier_uniform": XavierUniform,
          "xavier_normal": XavierNormal, "truncatednormal": TruncatedNormal, "truncated_normal": TruncatedNormal}


def _check_shape(shape):
    if isinstance(shape, numbers.Integral) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        shape = tuple(shape)
    except TypeError:
        raise TypeError(f"initializer: shape must be an int or a sequence of ints, got {shape!r}") from None
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 0:
            raise ValueError(f"initializer: shape must hold non-negative ints, got {shape}")
    return tuple(int(d) for d in shape)


def _as_initializer(init):
    if isinstance(init, Initializer):
        return init
    if isinstance(init, str):
        cls = _NAMES.get(init.lower())
        if cls is None:
            raise ValueError(f"initializer: unknown initializer {init!r}; expected one of {sorted(_NAMES)}")
        return cls()
    if isinstance(init, numbers.Number):
        return Constant(init)
    if isinstance(init, type) and issubclass(init, Initializer):
        return init()
    raise TypeError(f"initializer: init must be a str, an Initializer, a number, a Tensor or an array, "
                    f"got {type(init).__name__}")


def initializer(init, shape=None, dtype=float32):
    """A Tensor of ``shape`` and ``dtype`` filled by ``init``.

    Args:
        init: a name (see ``sorted(_NAMES)``: "normal", "uniform", "zeros", "ones",
            "he_normal", "he_uniform", "xavier_uniform", "xavier_normal", "truncatednormal"),
            an Initializer instance, a number (every element equal to it) or an array /
            Tensor (copied; its shape must equal ``shape`` when given).
        shape: int or sequence of ints; may be omitted only when init is an array.
        dtype: the numpy dtype of the result (default float32).

    Example:
        >>> initializer("xavier_uniform", [10, 20]).shape
        (10, 20)
    """
    dtype = numpy.dtype(dtype)
    if isinstance(init, Tensor) or hasattr(init, "__array_interface__") or hasattr(init, "__cuda_array_interface__"):
        data = backend.to_numpy(init.data if isinstance(init, Tensor) else init)
        if shape is not None and tuple(data.shape) != _check_shape(shape):
            raise ValueError(f"initializer: init array has shape {tuple(data.shape)} but shape "
                             f"{_check_shape(shape)} was requested")
        arr = numpy.array(data, dtype=dtype)  # always a copy, so the Tensor owns its values
    else:
        init = _as_initializer(init)
        if shape is None:
            raise ValueError(f"initializer: shape is required with init {init!r}")
        arr = init(numpy.empty(_check_shape(shape), dtype=numpy.float64))
        arr = arr.astype(dtype, copy=False)
    return Tensor._wrap(backend.to_device(arr))
