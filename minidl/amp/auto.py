"""``auto_mixed_precision(network, amp_level, dtype)``: MindSpore 2.10's O0, O1, O2, O3 and "auto".

O2 and O3 cast per cell. MindSpore's O2 is ``network.to_float(float16)`` with each black-listed
cell (BatchNorm, LayerNorm) set back to float32 and its output cast to float16 (``_OutputTo16``),
the whole wrapped in ``_OutputTo32``; O3 is ``to_float(float16)`` on everything and
``_OutputTo32``. ``to_float`` means: the cell's float inputs and its parameters are cast to the
type when the cell runs.

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

O1 and "auto" cast per op, from MindSpore's op lists (op_lists.py; the rules are in policy.py):
O1 runs its white-listed ops (MatMul, Conv2D, ReLU, ...) and every op inside its white-listed
cells (nn.Dense, nn.Conv2d, nn.Conv2dTranspose) in float16, each op's output cast back to
float32, and every other op on the types it is given; "auto" runs its white list in float16
(outputs left in float16), its black list in float32, its promote list in the widest float type
of the inputs, and the rest on the types given. ``Primitive.__call__`` consults the cast policy
set on the calling thread. Each cell of the tree gets an instance construct (``_PolicyScope``)
that sets the policy for its call and puts the previous one back when it ends, also by an
exception: ops called while no such cell runs (another network, code outside) are not cast, and
a recomputed cell's re-run in backward casts as its forward did. The white-listed cells' scopes
set a policy of their own (O1: every op in float16; "auto": nn.Dense's ``ops.Dense`` as
MindSpore's layer runs it, MatMul then BiasAdd).

The network itself is changed in place, as MindSpore's O2 and "auto" (its cells' constructs;
MindSpore's O1 rewrites a copy); the returned network is a new Cell (no name prefix, so
parameter names and checkpoints are unchanged): O2's and O3's (``_OutputTo32``) cast their float
outputs to float32; O1's (``_PolicyNetwork``) are float32 by the rule, "auto"'s may be float16
(as MindSpore's: cast them before a loss that needs float32).

bfloat16: NumPy has no bfloat16 and ml_dtypes' type has kind 'V', which minidl's ops and
gradients do not treat as a float (CuPy has none at all), so ``dtype`` must be float16.
"""
import weakref

import numpy

from .. import nn, ops
from ..ops.primitive import cast_policy
from ..tensor import float16, float32
from . import op_lists
from .policy import HIGH, LOW, PROMOTE, SPLIT, CastPolicy, cast_floats

__all__ = ["auto_mixed_precision", "get_black_list", "AMP_BLACK_LIST"]

# MindSpore's AMP_BLACK_LIST (minidl has no BatchNorm3d); subclasses (SyncBatchNorm) match too.
AMP_BLACK_LIST = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm)

_LEVELS = ("O0", "O1", "O2", "O3", "auto")

_cast = ops.Cast()

# The per-op levels' policies (float16 is the only low type: see the module doc).
_POLICIES = {
    "O1": CastPolicy("O1", {op: LOW for op in op_lists.O1_WHITE_OPS}, float16, float32),
    "auto": CastPolicy("auto", {**{op: LOW for op in op_lists.AUTO_WHITE_OPS},
                                **{op: HIGH for op in op_lists.AUTO_BLACK_OPS},
                                **{op: PROMOTE for op in op_lists.AUTO_PROMOTE_OPS}}, float16, None),
}


def get_black_list():
    """The cells O2 keeps in float32 (a copy, as MindSpore's ``amp.get_black_list``)."""
    return list(AMP_BLACK_LIST)


def auto_mixed_precision(network, amp_level="O0", dtype=float16):
    """Returns ``network`` set to compute in ``dtype`` at ``amp_level``, as MindSpore 2.10's.

    Args:
        network: a Cell. Its cells are changed in place; the levels but O0 return a wrapper
            (O2's and O3's outputs are cast to float32; use the returned network).
        amp_level: "O0" (nothing changes; the network itself is returned), "O1" (the white-listed
            ops, and every op of nn.Dense, nn.Conv2d and nn.Conv2dTranspose, in ``dtype``, their
            outputs cast back to float32; other ops as given), "O2" (every cell in ``dtype`` but
            BatchNorm1d/2d and LayerNorm, kept in float32), "O3" (every cell in ``dtype``),
            "auto" (white list in ``dtype``, black list in float32, promote list in the widest
            input type, other ops as given; outputs may be float16). The lists: op_lists.py.
        dtype: minidl.float16 (bfloat16: see the module doc).

    Parameters stay float32 (master weights); the casts are ops in forward, so gradients come back
    in the parameters' dtype. Calling it again on a network it returned re-sets every cell.

    Raises:
        TypeError: ``network`` is not a Cell.
        ValueError: an unknown ``amp_level`` or ``dtype``.

    Example:
        >>> net = amp.auto_mixed_precision(net, "O2")
        >>> net(x).dtype            # the network's output is cast back
        dtype('float32')
        >>> net = amp.auto_mixed_precision(net, "O1")   # (re-sets the cells: O1 now)
        >>> net(x).dtype            # each white-listed op's output is cast back
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
    if isinstance(network, _Wrapper):
        network = network._backbone  # (again on a network it returned: re-set its cells, wrap once)
    if amp_level in _POLICIES:
        policy = _POLICIES[amp_level]
        for _, cell in network.cells_and_names():
            _set_scope(cell, policy)
        wrapped = _PolicyNetwork(network)
    else:
        black_list = AMP_BLACK_LIST if amp_level == "O2" else ()
        for _, cell in network.cells_and_names():
            if isinstance(cell, black_list):
                _set_cast(cell, float32, dtype)
            else:
                _set_cast(cell, dtype, None)
        wrapped = _OutputTo32(network)
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
    what an earlier call set."""
    _set_construct(cell, lambda inner: _CastConstruct(cell, inner, "construct", compute_dtype, output_dtype))
    if hasattr(type(cell), "with_relu"):
        previous = cell.__dict__.get("with_relu")
        original = previous.original if isinstance(previous, _CastConstruct) else previous
        object.__setattr__(cell, "with_relu", _CastConstruct(cell, original, "with_relu", compute_dtype, output_dtype))


def _set_scope(cell, policy):
    """Gives ``cell`` a ``_PolicyScope`` for the network's ``policy``, replacing what an earlier
    call set (O2's casts included)."""
    if policy.level == "O1" and isinstance(cell, op_lists.O1_WHITE_CELLS):
        own = policy.inside(type(cell), all_low=True)
    elif policy.level == "auto" and isinstance(cell, nn.Dense):
        own = policy.inside(type(cell), rules={ops.Dense: SPLIT})  # MindSpore's layer: MatMul, then BiasAdd
    else:
        own = None
    _set_construct(cell, lambda inner: _PolicyScope(cell, inner, policy, own))
    previous = cell.__dict__.get("with_relu")
    if isinstance(previous, _CastConstruct):  # (O2's, from an earlier call)
        if previous.original is None:
            del cell.__dict__["with_relu"]
        else:
            object.__setattr__(cell, "with_relu", previous.original)


def _set_construct(cell, wrap):
    """Makes ``wrap(inner)`` the construct of ``cell``, ``inner`` being the construct under the
    wrapper an earlier call set (None: the class's). A recompute wrapper stays outermost: its
    re-run in backward must cast too."""
    from ..nn.recompute import _RecomputedConstruct  # (only here: amp's one use of recompute)
    current = cell.__dict__.get("construct")
    holder = current if isinstance(current, _RecomputedConstruct) else None
    inner = holder.original if holder is not None else current
    while isinstance(inner, (_CastConstruct, _PolicyScope)):
        inner = inner.original
    if holder is not None:
        holder.original = wrap(inner)
    else:
        object.__setattr__(cell, "construct", wrap(inner))


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
        args = [cast_floats(a, dtype) for a in args]
        kwargs = {k: cast_floats(v, dtype) for k, v in kwargs.items()}
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
        return out if self.output_dtype is None else cast_floats(out, self.output_dtype)


class _PolicyScope:
    """What ``cell.construct`` becomes under O1 / "auto": the call with a cast policy on this
    thread (see the module doc), the previous one put back when it ends, also by an exception.

    The policy: the cell's ``own`` if it has one (an O1 white-listed cell's every-op-low policy);
    else the one already running when it is this network's (a cell inside an O1 Dense keeps the
    Dense's); else the network's. Every cell has one, so the network's cells cast wherever they
    are called from: inside the returned network, alone, or in a recomputed cell's re-run in
    backward (after the network's call has ended). Holds the cell weakly, as _CastConstruct.
    """

    def __init__(self, cell, original, policy, own=None):
        self._cell = weakref.ref(cell)
        self.original = original  # an instance construct the cell had before, else None (its class's)
        self.policy = policy
        self.own = own

    def __reduce__(self):
        return type(self), (self._cell(), self.original, self.policy, self.own)

    def __call__(self, *args, **kwargs):
        cell = self._cell()
        previous = cast_policy.policy
        policy = self.own
        if policy is None:
            policy = previous if previous is not None and previous.base is self.policy.base else self.policy
        if policy is previous:
            return self._run(cell, args, kwargs)
        cast_policy.policy = policy
        try:
            return self._run(cell, args, kwargs)
        finally:
            cast_policy.policy = previous

    def _run(self, cell, args, kwargs):
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(cell).construct(cell, *args, **kwargs)


class _Wrapper(nn.Cell):
    """A network auto_mixed_precision returns: it runs ``backbone`` (subclasses say how).

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


class _OutputTo32(_Wrapper):
    """The network O2 and O3 return: its float outputs cast to float32 (MindSpore's ``_OutputTo32``)."""

    def construct(self, *args, **kwargs):
        return cast_floats(self._backbone(*args, **kwargs), float32)


class _PolicyNetwork(_Wrapper):
    """The network O1 and "auto" return: the backbone, whose cells (itself included) set the cast
    policy while they run (``_PolicyScope``); its outputs are the backbone's."""

    def construct(self, *args, **kwargs):
        return self._backbone(*args, **kwargs)
