"""Tensor, Parameter and the grad-mode switch.

A Tensor holds ``data`` (a numpy or cupy ndarray), ``requires_grad`` and, when an op that
was being recorded produced it, ``_node``: the op instance that knows its inputs and how
to send a gradient back to them (see minidl/ops/primitive.py). Under tensor parallelism
``placement`` says that ``data`` is one rank's block of a larger tensor: the parallel
package sets it to an object with the global ``shape`` (and a readable ``str``); the core
reads only that shape, so ``x.shape`` means the same on one device and on many, as in
PyTorch's DTensor. Python operators
(``+``, ``@``, ``.sum()`` ...) are attached by minidl/ops/tensor_methods.py, and ``astype``
and ``backward`` by minidl/ops/__init__.py, so that this file imports neither the ops nor the
engine: the imports run tensor <- autograd <- ops, never back (tests/test_layering.py).
"""
import math
import threading

import numpy

from . import backend

float16 = numpy.float16
float32 = numpy.float32
float64 = numpy.float64
int8 = numpy.int8
int32 = numpy.int32
int64 = numpy.int64
uint8 = numpy.uint8
bool_ = numpy.bool_

class _GradMode(threading.local):
    enabled = True  # a class-level default: a missing threading.local attribute is ~8x slower to read


_grad_mode = _GradMode()


def _logical_shape(tensor):
    placement = tensor.placement
    if placement is not None:
        return placement.shape
    data = tensor._data
    return tuple(data.shape) if data is not None else tensor._pending.shape  # pending: known, not computed


def _known(name):
    """A property of the array read without computing a pending value (its shape says it)."""
    def read(self):
        data = self._data
        return getattr(data if data is not None else self._pending, name)
    return read


def is_grad_enabled():
    """True when ops record themselves for backward (per thread)."""
    return _grad_mode.enabled


class no_grad:
    """Context manager (and decorator) that turns recording off, as ``torch.no_grad``.

    Example:
        >>> with minidl.no_grad():
        ...     y = net(x)          # no graph is kept
    """

    def __enter__(self):
        self._prev = is_grad_enabled()
        _grad_mode.enabled = False
        return self

    def __exit__(self, *exc):
        _grad_mode.enabled = self._prev
        return False

    def __call__(self, fn):
        def wrapper(*args, **kwargs):
            with no_grad():
                return fn(*args, **kwargs)
        wrapper.__name__ = getattr(fn, "__name__", "wrapper")
        wrapper.__doc__ = getattr(fn, "__doc__", None)
        return wrapper


def _as_array(data, dtype):
    """The ndarray a Tensor will hold: Python floats default to float32, as in MindSpore."""
    if isinstance(data, Tensor):
        data = data.data
    xp = backend.get_array_module(data)
    if xp is numpy and backend.get_device_target() == "GPU":
        xp = backend.default_xp()
    if hasattr(data, "__array_interface__") or hasattr(data, "__cuda_array_interface__"):
        array = xp.asarray(data)
    else:
        array = numpy.asarray(data)
        if dtype is None and array.dtype == numpy.float64:
            array = array.astype(numpy.float32)
        array = xp.asarray(array)
    if dtype is not None and array.dtype != numpy.dtype(dtype):
        array = array.astype(dtype)
    return array


class Tensor:
    """An n-dimensional array that can record the ops applied to it.

    ``data`` may be *pending* (GRAPH_MODE, minidl/graph_mode/): an op's output not computed yet,
    or an input a pending op still has to read. ``_pending`` then holds that op, and reading or
    replacing ``data`` first runs it; shape, dtype, ndim and size are known without running it.

    Args:
        data: array-like (list, scalar, numpy or cupy array, Tensor).
        dtype: numpy dtype (``minidl.float32`` ...); default keeps the array's dtype, and
            Python floats become float32.
        requires_grad: whether backward() fills ``.grad`` for this (leaf) tensor.

    Example:
        >>> x = minidl.Tensor([[1., 2.], [3., 4.]], requires_grad=True)
        >>> (x * x).sum().backward(); x.grad
        Tensor([[2., 4.], [6., 8.]], dtype=float32)
    """

    __slots__ = ("_data", "grad", "requires_grad", "_node", "placement", "_pending", "__weakref__")
    __array_priority__ = 1000  # numpy scalars and arrays defer to our operators

    def __init__(self, data, dtype=None, requires_grad=False):
        if data is None:
            raise ValueError("Tensor: data must not be None")
        self._pending = None
        self._data = _as_array(data, dtype)
        self.grad = None
        self.requires_grad = bool(requires_grad)
        self._node = None
        self.placement = None

    @property
    def data(self):
        """The ndarray (numpy or cupy): this rank's block when sharded."""
        pending = self._pending
        if pending is not None:
            pending.resolve()  # GRAPH_MODE: the op this value waits for runs first, as eager's order
        return self._data

    @data.setter
    def data(self, array):
        pending = self._pending
        if pending is not None:
            pending.resolve()
        self._data = array

    def __getstate__(self):
        # copy and pickle see the computed value, never a pending op
        self.data  # noqa: B018
        return {name: getattr(self, name) for cls in type(self).__mro__
                for name in getattr(cls, "__slots__", ()) if name not in ("_pending", "__weakref__")}

    def __setstate__(self, state):
        self._pending = None
        for name, value in state.items():
            setattr(self, name, value)

    @classmethod
    def _wrap(cls, array, node=None):
        """Makes a Tensor around an existing ndarray, without copying or converting."""
        t = Tensor.__new__(Tensor)
        t._pending = None
        t._data = array
        t.grad = None
        t.requires_grad = node is not None
        t._node = node
        t.placement = None
        return t

    shape = property(_logical_shape, doc="The shape, as a tuple: the global shape of a sharded tensor "
                                         "(``data.shape`` is then this rank's block).")
    is_sharded = property(lambda self: self.placement is not None,
                          doc="True when ``data`` is one rank's block of a larger tensor (tensor parallelism).")
    dtype = property(_known("dtype"), doc="The numpy dtype.")
    ndim = property(_known("ndim"), doc="Number of dimensions.")
    size = property(lambda self: math.prod(self.shape), doc="Number of elements.")
    is_leaf = property(lambda self: self.grad_fn is None, doc="True when no recorded op made it.")

    @property
    def grad_fn(self):
        """The recorded op instance that made it (None for a leaf); its ``backward`` sends gradients
        to its inputs."""
        self.data  # noqa: B018 - a pending value is computed first: its op makes the node
        return self._node

    def asnumpy(self):
        """The values as a NumPy array (copied from the GPU when needed)."""
        return backend.to_numpy(self.data)

    numpy = asnumpy

    def item(self):
        """The value of a one-element tensor as a Python number."""
        if self.data.size != 1:
            raise ValueError(f"item: only one-element tensors convert to a Python number, got shape {self.shape}")
        return self.data.reshape(()).item()

    def detach(self):
        """The same data (and placement), cut from the graph."""
        t = Tensor._wrap(self.data)
        t.placement = self.placement
        return t

    def zero_grad(self):
        self.grad = None

    def __len__(self):
        if self.data.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __bool__(self):
        if self.data.size != 1:
            raise ValueError(f"The truth value of a tensor of shape {self.shape} is ambiguous")
        return bool(self.data.reshape(()))

    def __float__(self):
        return float(self.item())

    def __int__(self):
        return int(self.item())

    def __array__(self, dtype=None, copy=None):
        array = self.asnumpy()
        return array if dtype is None else array.astype(dtype)

    def __str__(self):
        """The values alone, as NumPy prints them: what ``print(tensor)`` shows in MindSpore."""
        return str(self.asnumpy())

    def __repr__(self):
        """The values with the dtype (and requires_grad), e.g. ``Tensor([1., 2.], dtype=float32)``."""
        body = numpy.array2string(self.asnumpy(), separator=", ", prefix="Tensor(")
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({body}, dtype={self.dtype}{grad})"

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]


class Parameter(Tensor):
    """A named, trainable Tensor: the state a Cell learns.

    Args:
        data: initial value (array-like or Tensor).
        name: the name used in checkpoints; Cells fill it in from the attribute path.
        requires_grad: False keeps it out of ``trainable_params()``.
    """

    __slots__ = ("name",)

    def __init__(self, data, name=None, requires_grad=True):
        super().__init__(data)
        self.name = name
        self.requires_grad = bool(requires_grad)

    def set_data(self, data):
        """Replaces the value in place (same shape), keeping identity for optimizers."""
        new = _as_array(data, self.data.dtype)
        if tuple(new.shape) != tuple(self.data.shape):
            raise ValueError(f"Parameter {self.name}: set_data got shape {tuple(new.shape)}, expected "
                             f"{tuple(self.data.shape)}")
        self.data = new
        return self

    def __repr__(self):
        return f"Parameter(name={self.name!r}, shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    __str__ = __repr__  # as MindSpore: print(param) describes it rather than listing its values
