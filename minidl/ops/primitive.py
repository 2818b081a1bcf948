"""The op base: a Primitive is configured once (``ops.MatMul(transpose_b=True)``), then called.

Each call clones the configured instance, so one primitive object can be called many times
in a network while each call keeps its own saved arrays for backward. A subclass writes:

    forward(self, *args)  -> ndarray     args: ndarrays where Tensors were passed, the
                                          Python values (axis, shape, dtype...) elsewhere
    backward(self, gy)    -> tuple        one gradient ndarray (or None) per positional arg

Inside backward, ``self.needs_grad[i]`` says whether argument i needs a gradient, so work
for the others can be skipped. ``xp = get_array_module(...)`` picks numpy or cupy: one body
serves both.

A faster way to compute an op on one array module lives in minidl/kernels, not here: ``apply``
asks ``kernels.choose`` for each call, and a registered kernel that applies runs instead of the
reference ``forward`` / ``backward`` written in the op's class.

``shard(in_strategy, out_strategy)`` only stores the strategy here; minidl_parallel reads
it. A call asks the active runtime (minidl/runtime.py) to run the op: the local runtime
calls ``apply``; a parallel one may redistribute the inputs first; GRAPH_MODE's layer may
defer it and fuse it with the ops after it (minidl/graph_mode/).

Inputs on two devices (a NumPy array or a CPU tensor given to a network whose parameters are
on the GPU) fail inside the op body with CuPy's bare "Unsupported type" TypeError; ``apply``
turns that into one that names the op, which inputs are where, and the fix
(``_device_mix_error``).

While a mixed-precision network of level O1 or "auto" runs on this thread, ``__call__`` hands the
op to that network's cast policy instead (minidl/amp/policy.py), which casts the inputs as its
op lists say and then runs the op as below. ``cast_policy`` holds it; the check is one
thread-local read, the whole cost to every other op call.
"""
import functools
import inspect
import threading
import weakref

import numpy

from .. import backend, kernel_table as kernels  # the table, not minidl/kernels/: that imports the ops
from ..runtime import LOCAL, get_runtime
from ..tensor import Tensor, _grad_mode


class _CastPolicyState(threading.local):
    # A class-level default: a miss in a threading.local's own dict then costs a class lookup,
    # not an AttributeError (see runtime._ThreadState).
    policy = None  # the cast policy of the O1/"auto" network running on this thread (minidl/amp), or None


cast_policy = _CastPolicyState()


class Primitive:
    """Base of every operator. Subclasses set ``n_inputs`` and write forward/backward."""

    n_inputs = 1  # positional arguments (tensors and attributes alike): an int, or (min, max)
    n_tensor_inputs = None  # how many of them are tensors a strategy describes (default n_inputs)
    differentiable = True  # False: never recorded for backward (in-place updates such as ApplyMomentum)

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
        policy = cast_policy.policy
        if policy is not None:  # an O1/"auto" network is running on this thread
            return policy.call(self, args)
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
        kernel = kernels.choose(node, arrays)  # a registered fast path, or None: the reference body
        try:
            out = node.forward(*arrays) if kernel is None else kernel.forward(node, *arrays)
        except (TypeError, ValueError) as exc:
            # Explained here, after the fact, rather than checked before every call: this costs
            # nothing while ops succeed, and host values an op does accept on the GPU (scalars,
            # NumPy index arrays it uploads) keep working. CuPy refuses host arrays with a
            # TypeError in kernels, a ValueError in assignments (``a[...] = host``).
            error = None if _raised_by_minidl(exc) else _device_mix_error(self, args, exc)
            if error is None:
                raise
            raise error from exc
        if isinstance(out, numpy.generic):
            out = numpy.asarray(out)  # 0-d numpy arithmetic returns scalars; tensors hold arrays
        # Integer and bool outputs (comparisons, argmax-like ops) carry no gradient.
        if _grad_mode.enabled and self.differentiable and out.dtype.kind in "fc":  # (is_grad_enabled(), inlined)
            inputs = tuple([(i, a) for i, a in enumerate(args) if isinstance(a, Tensor) and a.requires_grad])
            if inputs:
                needs = [False] * len(args)
                for i, _ in inputs:
                    needs[i] = True
                node.needs_grad = needs
                node.inputs = inputs
                if kernel is not None:  # the instance attribute shadows the class's backward for this call
                    # The node is held weakly: node -> its backward -> node would be a reference cycle,
                    # keeping a graph never backpropagated (and its saved arrays) until the garbage
                    # collector ran. Whoever calls the backward holds the node.
                    node.backward = functools.partial(_kernel_backward, kernel, weakref.ref(node))
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


def _kernel_backward(kernel, node_ref, gy):
    return kernel.backward(node_ref(), gy)


def _raised_by_minidl(exc):
    """Whether minidl's own code raised exc (an op's validation, whose message already says what
    is wrong), rather than the array library it called (minidl.testing stands in for CuPy)."""
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return module.startswith("minidl.") and not module.startswith("minidl.testing.")


def _device_mix_error(prim, args, exc):
    """The TypeError for an op that failed (with ``exc``) on inputs from both the host (NumPy)
    and the GPU (CuPy), naming each such input; None when the inputs are not so mixed."""
    host, device = [], []
    for i, a in enumerate(args):
        data = a.data if isinstance(a, Tensor) else a
        if isinstance(data, numpy.ndarray):
            host.append((i, "a Tensor" if isinstance(a, Tensor) else "a NumPy array"))
        elif hasattr(data, "shape") and backend.get_array_module(data) is not numpy:
            device.append((i, "a Tensor" if isinstance(a, Tensor) else "a CuPy array"))
    if not host or not device:
        return None
    try:  # the names of forward's parameters, to say "x" and "w" rather than input 0 and 1
        params = [p.name for p in inspect.signature(prim.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []

    def describe(entries):
        return ", ".join(f"{params[i]} (input {i}, {what})" if i < len(params) else f"input {i} ({what})"
                         for i, what in entries)

    if backend.get_device_target() == "GPU":
        fix = ("wrap host data as Tensor(a): with device_target='GPU' (the current one), Tensor copies "
               "a NumPy array or a CPU tensor to the GPU")
    else:
        fix = ("the device target is CPU: bring GPU tensors back with Tensor(t.asnumpy()), or set "
               "minidl.set_context(device_target='GPU') and make every tensor with Tensor(a), which "
               "copies a NumPy array or a CPU tensor to the current device")
    return TypeError(f"{prim.name}: inputs on two devices: on the host (NumPy): {describe(host)}; "
                     f"on the GPU (CuPy): {describe(device)}. An op's array inputs must all be on one "
                     f"device; {fix}. (The op failed with {type(exc).__name__}: {exc})")


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
