"""``auto_mixed_precision(network, amp_level, dtype)``: MindSpore 2.10's O0, O2 and O3 on a Cell tree.

MindSpore's O2 is ``network.to_float(float16)`` with each black-listed cell (BatchNorm, LayerNorm)
set back to float32 and its output cast to float16 (``_OutputTo16``), the whole wrapped in
``_OutputTo32``; O3 is ``to_float(float16)`` on everything and ``_OutputTo32``. ``to_float``
means: the cell's float inputs and its parameters are cast to the type when the cell runs.

minidl does the same per cell call. Each cell of the tree gets an instance ``construct``
(``_CastConstruct``, the mechanism ``Cell.recompute`` uses: every runtime calls
``cell.construct``) that, for that call only,

- casts the float Tensor arguments to the cell's type (``ops.Cast``, recorded like any op);
- puts a cast copy of each of the cell's OWN trainable float parameters in place of the
  attribute, and puts the Parameter back when the call ends. The Parameter itself never changes
  dtype: ``Cast``'s backward casts the gradient back, so float32 gradients reach float32 master
  weights and the optimizer updates float32;
- for a black-listed cell, casts its float outputs to the network's low type.

Parameters that do not require grad (BatchNorm's moving statistics) are not cast: the op writes
them in place, and a cast copy would lose the update. A black-listed cell's ``with_relu`` (the
fused BatchNorm + ReLU the ResNet blocks call instead of construct) is wrapped the same way.

The network itself is changed in place, as MindSpore's (its cells' constructs); the returned
network is a new Cell (``_OutputTo32``, no name prefix, so parameter names and checkpoints are
unchanged) whose outputs are float32, so a loss computed on them runs in float32.

Not built: O1 and "auto" (MindSpore casts op by op from white/black/promote lists, which needs an
op-level hook); they raise NotImplementedError rather than do nothing. bfloat16: NumPy has no
bfloat16 and ml_dtypes' type has kind 'V', which minidl's ops and gradients do not treat as a
float (CuPy has none at all), so ``dtype`` must be float16.
"""
import weakref

import numpy

from .. import nn, ops
from ..tensor import Tensor, float16, float32

__all__ = ["auto_mixed_precision", "get_black_list", "AMP_BLACK_LIST"]

# MindSpore's AMP_BLACK_LIST (minidl has no BatchNorm3d); subclasses (SyncBatchNorm) match too.
AMP_BLACK_LIST = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)

_LEVELS = ("O0", "O1", "O2", "O3", "auto")
_BUILT = ("O0", "O2", "O3")

_cast = ops.Cast()


def get_black_list():
    """The cells O2 keeps in float32 (a copy, as MindSpore's ``amp.get_black_list``)."""
    return list(AMP_BLACK_LIST)


def auto_mixed_precision(network, amp_level="O0", dtype=float16):
    """Returns ``network`` set to compute in ``dtype`` at ``amp_level``, as MindSpore 2.10's.

    Args:
        network: a Cell. Its cells are changed in place; O2 and O3 return a wrapper whose
            outputs are float32 (use the returned network).
        amp_level: "O0" (nothing changes; the network itself is returned), "O2" (every cell in
            ``dtype`` but BatchNorm1d/2d and LayerNorm, kept in float32), "O3" (every cell in
            ``dtype``). "O1" and "auto" are MindSpore's op-list levels and are not built in minidl.
        dtype: minidl.float16 (bfloat16: see the module doc).

    Parameters stay float32 (master weights); the casts are ops in forward, so gradients come back
    in the parameters' dtype. Calling it again on a network it returned re-sets every cell.

    Raises:
        TypeError: ``network`` is not a Cell.
        ValueError: an unknown ``amp_level`` or ``dtype``.
        NotImplementedError: "O1" or "auto".

    Example:
        >>> net = amp.auto_mixed_precision(net, "O2")
        >>> net(x).dtype            # the network's output is cast back
        dtype('float32')
    """
    if amp_level not in _LEVELS:
        raise ValueError(f"auto_mixed_precision: amp_level must be one of {list(_LEVELS)}, got {amp_level!r}")
    if not isinstance(network, nn.Cell):
        raise TypeError(f"auto_mixed_precision: for amp_level {amp_level!r}, network must be a Cell, "
                        f"got {type(network).__name__}")
    dtype = _check_dtype(dtype)
    if amp_level == "O0":
        return network
    if amp_level not in _BUILT:
        raise NotImplementedError(f"auto_mixed_precision: amp_level {amp_level!r} (MindSpore's op-by-op white/black "
                                  f"lists) is not built in minidl; the levels that work are {list(_BUILT)}")
    if isinstance(network, _OutputTo32):
        network = network._backbone  # (again on a network it returned: re-set its cells, wrap once)
    black_list = AMP_BLACK_LIST if amp_level == "O2" else ()
    for _, cell in network.cells_and_names():
        if isinstance(cell, black_list):
            _set_cast(cell, float32, dtype)
        else:
            _set_cast(cell, dtype, None)
    wrapped = _OutputTo32(network)
    wrapped._amp_level = amp_level
    return wrapped


def _check_dtype(dtype):
    try:
        target = numpy.dtype(dtype)
    except TypeError:
        target = None
    if target is not None and target.name == "bfloat16":
        raise ValueError("auto_mixed_precision: dtype bfloat16 is not supported by minidl (NumPy has no bfloat16, "
                         "ml_dtypes' is not a float kind to minidl's ops, CuPy has none); use minidl.float16")
    if target != numpy.dtype(float16):
        raise ValueError(f"auto_mixed_precision: dtype must be minidl.float16, got {dtype!r}")
    return target


def _set_cast(cell, compute_dtype, output_dtype):
    """Gives ``cell`` a casting construct (and a casting with_relu, for a BatchNorm), replacing
    one set before. A recompute wrapper stays outermost: its re-run in backward must cast too."""
    from ..nn.recompute import _RecomputedConstruct  # (only here: amp's one use of recompute)
    current = cell.__dict__.get("construct")
    holder = current if isinstance(current, _RecomputedConstruct) else None
    inner = holder.original if holder is not None else current
    if isinstance(inner, _CastConstruct):
        inner = inner.original
    cast = _CastConstruct(cell, inner, "construct", compute_dtype, output_dtype)
    if holder is not None:
        holder.original = cast
    else:
        object.__setattr__(cell, "construct", cast)
    if hasattr(type(cell), "with_relu"):
        previous = cell.__dict__.get("with_relu")
        original = previous.original if isinstance(previous, _CastConstruct) else previous
        object.__setattr__(cell, "with_relu", _CastConstruct(cell, original, "with_relu", compute_dtype, output_dtype))


class _CastConstruct:
    """What ``cell.construct`` (or ``cell.with_relu``) becomes: the call in ``compute_dtype``.

    Holds the cell weakly, as recompute's wrapper does (cell -> construct -> cell would be a
    cycle); ``__reduce__`` makes copies and pickles hold their own cell.
    """

    def __init__(self, cell, original, method, compute_dtype, output_dtype):
        self._cell = weakref.ref(cell)
        self.original = original  # an instance method the cell had before, else None (its class's)
        self.method = method
        self.compute_dtype = numpy.dtype(compute_dtype)
        self.output_dtype = None if output_dtype is None else numpy.dtype(output_dtype)

    def __reduce__(self):
        return type(self), (self._cell(), self.original, self.method, self.compute_dtype, self.output_dtype)

    def __call__(self, *args, **kwargs):
        cell = self._cell()
        dtype = self.compute_dtype
        args = [_cast_floats(a, dtype) for a in args]
        kwargs = {k: _cast_floats(v, dtype) for k, v in kwargs.items()}
        swapped = []
        d = cell.__dict__
        try:
            for name, p in cell._params.items():
                if p is not None and p.requires_grad and p.dtype.kind == "f" and p.dtype != dtype and d.get(name) is p:
                    d[name] = _cast(p, dtype)
                    swapped.append((name, p))
            if self.original is not None:
                out = self.original(*args, **kwargs)
            else:
                out = getattr(type(cell), self.method)(cell, *args, **kwargs)
        finally:
            for name, p in swapped:
                d[name] = p
        return out if self.output_dtype is None else _cast_floats(out, self.output_dtype)


def _cast_floats(value, dtype):
    """``value`` with its float Tensors (also inside tuples and lists) cast to ``dtype``."""
    if isinstance(value, Tensor):
        return _cast(value, dtype) if value.dtype.kind == "f" and value.dtype != dtype else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    return value


class _OutputTo32(nn.Cell):
    """The network O2 and O3 return: its float outputs cast to float32 (MindSpore's ``_OutputTo32``).

    ``auto_prefix=False`` and the network's parameter paths: the parameters keep their names and
    checkpoint keys, so its checkpoint loads into the float32 network and back. Attributes it lacks
    are read from the network, as MindSpore's wrapper copies them (``net.fc`` still works).
    """

    def __init__(self, backbone):
        super().__init__(auto_prefix=False)
        self._backbone = backbone

    def __getattr__(self, name):
        # (only for names not found normally; dunder and private lookups during copy/pickle fail fast)
        if name.startswith("__") or name == "_backbone" or "_backbone" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["_backbone"], name)

    def parameters_and_names(self, name_prefix="", expand=True):
        # (the wrapper adds no step to the paths, as it adds none to the names; it has no parameters of its own)
        return self._backbone.parameters_and_names(name_prefix, expand) if expand else iter(())

    def construct(self, *args, **kwargs):
        return _cast_floats(self._backbone(*args, **kwargs), float32)
