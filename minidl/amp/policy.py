"""The op-by-op cast policy of mixed-precision levels O1 and "auto": what each op call casts.

While an O1 or "auto" network runs on a thread, ``Primitive.__call__`` hands every op call to
the network's :class:`CastPolicy` (``minidl.ops.primitive.cast_policy``, per thread: the threads
world runs one rank per thread). The policy finds the op's rule in its level's lists
(op_lists.py), casts the op's float Tensor inputs with ``ops.Cast`` (recorded like any op, so
its backward casts the gradient back: float32 parameters get float32 gradients), runs the op
as ``Primitive.__call__`` would have, and casts the output where the rule says:

    LOW      inputs to the low type (float16); the output back to float32 under O1, left in
             float16 under "auto"
    HIGH     inputs to float32 ("auto"'s black list)
    PROMOTE  inputs to the widest float type among them ("auto"'s promote list)
    None     nothing cast: the op runs on the types it is given

A fused op of minidl's (op_lists.PARTS) runs as one op when its parts' rules agree (LOW, HIGH or
None: casting between equal parts changes nothing), else as its parts, each cast by its own
rule, so the values are those of the ops MindSpore would have run. GRAPH_MODE sees the casts
as ops: its fusions (minidl/graph_mode/rules.py) join only ops with no cast between them.

A policy's rules never change; :meth:`CastPolicy.inside` gives the one a cell runs under (O1 inside a
white-listed cell: every op LOW), which auto.py's ``_PolicyScope`` puts in place for the cell's call.
"""
import numpy

from .. import ops
from ..runtime import LOCAL, get_runtime
from ..tensor import Tensor, float32
from . import op_lists

LOW, HIGH, PROMOTE, SPLIT = "low", "high", "promote", "split"  # SPLIT: run a fused op as its parts

_cast = ops.Cast()


class CastPolicy:
    """The rules of one level: ``rules`` maps an op class to LOW, HIGH, PROMOTE or SPLIT.

    Args:
        level: "O1" or "auto".
        rules: {op class: rule}; a subclass takes its closest listed base's rule.
        low: the low dtype (float16).
        low_output: the dtype LOW ops' float outputs are cast to (float32 under O1), or None.
        all_low: every op is LOW (O1 inside a white-listed cell).
        base: the level's policy this one is a variant of (:meth:`inside`), else None (itself).
    """

    def __init__(self, level, rules, low, low_output, all_low=False, base=None):
        self.level = level
        self.base = self if base is None else base
        self.rules = dict(rules)
        self.low = numpy.dtype(low)
        self.low_output = None if low_output is None else numpy.dtype(low_output)
        self.all_low = all_low
        self._resolved = {}  # op class -> rule, filled on first use (a dict read per op after that)
        self._inside = {}  # cell class -> the policy its calls run under

    def __repr__(self):
        what = ", every op low" if self.all_low else ""
        return f"CastPolicy({self.level!r}, low={self.low.name}{what})"

    # ---- which rule -------------------------------------------------------------------------------

    def rule(self, cls):
        """The rule for op class ``cls`` (LOW, HIGH, PROMOTE, SPLIT, or None: as given)."""
        try:
            return self._resolved[cls]
        except KeyError:
            rule = self._resolved[cls] = self._find(cls)
            return rule

    def _find(self, cls):
        if cls is ops.Cast:
            return None  # (the policy's own casts; MindSpore never casts a Cast either)
        if self.all_low:
            return LOW
        for base in cls.__mro__:
            if base in self.rules:
                return self.rules[base]
            if base in op_lists.PARTS:
                return self._from_parts(op_lists.PARTS[base])
        return None

    def _from_parts(self, parts):
        rules = {self.rule(part) for part in parts}
        if len(rules) == 1 and rules <= {LOW, HIGH, None}:
            return rules.pop()  # e.g. DenseReLU inside an O1 Dense: one op in float16
        return SPLIT

    def inside(self, cell_type, rules=None, all_low=False):
        """The policy for the ops of a cell of ``cell_type``: this one with ``rules`` added
        (overriding), every op LOW when ``all_low``. Made once per cell type."""
        policy = self._inside.get(cell_type)
        if policy is None:
            policy = self._inside[cell_type] = CastPolicy(self.level, {**self.rules, **(rules or {})}, self.low,
                                                          self.low_output, all_low or self.all_low, self.base)
        return policy

    # ---- running an op ------------------------------------------------------------------------------

    def call(self, prim, args):
        """Runs ``prim`` on ``args`` as its rule says (``Primitive.__call__`` under this policy)."""
        rule = self.rule(type(prim))
        if rule is None:
            return run(prim, args)
        if rule is SPLIT:
            return _SPLITS[_split_base(type(prim))](self, prim, args)
        if rule is LOW:
            dtype = self.low
        elif rule is HIGH:
            dtype = float32
        else:
            dtype = _widest_float(args)
            if dtype is None:
                return run(prim, args)
        keep = _in_place_args(type(prim))
        args = tuple(a if i in keep else _cast_float(a, dtype) for i, a in enumerate(args))
        out = run(prim, args)
        if rule is LOW and self.low_output is not None:
            out = cast_floats(out, self.low_output)
        return out


def run(prim, args):
    """Runs ``prim`` as ``Primitive.__call__`` does when no policy is set (the runtime's way)."""
    runtime = get_runtime()
    if runtime is LOCAL:
        return prim.apply(*args)
    return runtime.call_op(prim, args)


def _cast_float(value, dtype):
    if isinstance(value, Tensor) and value.dtype.kind == "f" and value.dtype != dtype:
        return run(_cast, (value, dtype))
    return value


def cast_floats(value, dtype):
    """``value`` with its float Tensors (also inside tuples and lists) cast to ``dtype``."""
    if isinstance(value, Tensor):
        return _cast_float(value, dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floats(v, dtype) for v in value)
    return value


def _widest_float(args):
    floats = [a.dtype for a in args if isinstance(a, Tensor) and a.dtype.kind == "f"]
    return max(floats, key=lambda d: d.itemsize) if floats else None


def _in_place_args(cls):
    for base in cls.__mro__:
        if base in op_lists.IN_PLACE_ARGS:
            return op_lists.IN_PLACE_ARGS[base]
    return ()


def _split_base(cls):
    for base in cls.__mro__:
        if base in _SPLITS:
            return base
    raise AssertionError(f"{cls.__name__} has no parts")  # (a rule is SPLIT only for an op _SPLITS can split)


# ---- fused ops as their parts (each part's call goes through the policy again) ----------------------

def _dense_as_parts(policy, prim, args):
    """ops.Dense as MatMul(transpose_b=True) then BiasAdd (nn.Dense's ops in MindSpore)."""
    y = policy.call(ops.MatMul(transpose_b=True), tuple(args[:2]))
    return y if len(args) < 3 or args[2] is None else policy.call(ops.BiasAdd(), (y, args[2]))


def _dense_relu_as_parts(policy, prim, args):
    return policy.call(ops.ReLU(), (policy.call(ops.Dense(), tuple(args)),))


def _batch_norm_relu_as_parts(policy, prim, args):
    z = policy.call(ops.BatchNorm(prim.is_training, prim.epsilon, prim.momentum, prim.data_format), tuple(args[:5]))
    if len(args) > 5 and args[5] is not None:
        z = policy.call(ops.Add(), (z, args[5]))
    return policy.call(ops.ReLU(), (z,))


_SPLITS = {ops.Dense: _dense_as_parts, ops.DenseReLU: _dense_relu_as_parts,
           ops.BatchNormReLU: _batch_norm_relu_as_parts}
