"""Sharding rules of Concat, StridedSlice and GetItem (ops whose cut dimensions stay whole), and of
Gather (embedding lookups, with Megatron's vocabulary-parallel table).

Concat joins blocks along an axis that no strategy may cut; every other dimension must be cut
the same way in every input, so each rank concatenates its blocks into its block of the output.

StridedSlice and GetItem run unchanged on each rank's block when every cut dimension of x is
taken whole (``slice(None)``, or any slice covering it with step 1): indexes of the other
dimensions are global = local. The output keeps those cuts at the positions the whole dimensions
move to (ints drop dimensions, None inserts one, index arrays gather theirs into broadcast
dimensions, placed as NumPy places them). Index arrays and bool masks may index whole
dimensions only; a Tensor index must be replicated.

Example (4 devices): x (8, 6, 5) cut (2, 2, 1), ``x[:, None, :, 1:4]`` -> output (8, 1, 6, 3)
laid out ``(a, -, b, -)``; ``x[1:5]`` is refused (dimension 0 is cut 2 but sliced 1:5).

Gather(params, indices, axis), strategy ``(params' cuts, indices' cuts)``: every dimension of both
is a loop of the device matrix, and the output ``params.shape[:axis] + indices.shape +
params.shape[axis + 1:]`` keeps each one's cut. The indices may be cut any way (a batch of token
ids). With params' gathered dimension whole (the table replicated, or cut along its embedding
dimension) each rank gathers its block with no communication; the table's gradient is a sum
over the rank's indices, partial over the indices' cuts, which the dispatcher reduces. With the
gathered dimension cut v (Megatron's vocabulary-parallel embedding: each rank holds
vocab / v rows), each rank looks up the indices falling in its row block, gives zero slices for
the others (Gather's ``row_block``), and the output is a partial sum over that device axis.

Example (8 devices): a (32000, 512) table cut ((4, 1)), ids (16, 128) cut (2, 1): device matrix
[4, 1, 2, 1], output (16, 128, 512) laid out ``(c, -, -) +sum(a)``.
"""
import numpy

from minidl import ops
from minidl.ops.primitive import normalize_axis
from minidl.tensor import Tensor

from ..layout import Layout
from .base import (OpSharding, Rule, StrategyError, TensorSpec, check_strategy_shape, device_matrix_for, largest_cut,
                   register, tensor_specs)
from .elementwise import batch_cut, dims_map, first_accepted, follow

__all__ = ["ConcatRule", "StridedSliceRule", "GetItemRule", "GatherRule", "index_dims"]


def _sharding(strategy, device_num, out_loops, extra=()):
    """OpSharding of x (strategy[0]) whose output dimension j is x's dimension out_loops[j] (or None).

    ``extra``: the ranks of further tensor inputs (a Tensor index), replicated on the device matrix.
    """
    s = tuple(strategy[0])
    dm, off, rep = device_matrix_for(s, device_num)
    x = Layout(dm, dims_map(off, range(len(s))))
    whole = tuple(Layout(dm, ((),) * nd) for nd in extra)
    return OpSharding(tuple(tuple(t) for t in strategy), (x,) + whole, Layout(dm, dims_map(off, out_loops)), rep)


# ---- Concat ---------------------------------------------------------------------------------

@register(ops.Concat)
class ConcatRule(Rule):
    """Concat(x0, x1, ...) along ``prim.axis``: the axis whole, equal cuts elsewhere, same layout out."""

    def _axis(self, prim, specs):
        x0 = specs[0]
        if x0.ndim == 0:
            raise ValueError(f"{prim.name}: cannot concatenate 0-d tensors (input 0 has shape ())")
        axis = normalize_axis(prim.name, prim.axis, x0.ndim)[0]
        for i, x in enumerate(specs[1:], 1):
            if x.ndim != x0.ndim or any(d != axis and n != m for d, (n, m) in enumerate(zip(x.shape, x0.shape))):
                raise ValueError(f"{prim.name}: input {i} of shape {x.shape} and input 0 of shape {x0.shape} cannot "
                                 f"be concatenated along axis {axis}; only that dimension may differ")
        return axis

    def infer(self, prim, args, strategy, device_num):
        specs = tensor_specs(args)
        check_strategy_shape(strategy, args)
        axis = self._axis(prim, specs)
        s0 = tuple(strategy[0])
        for i, s in enumerate(strategy):
            if s[axis] != 1:
                raise StrategyError(f"the concatenation axis {axis} is cut {s[axis]} in input {i}; it must be whole "
                                    f"(cut 1)")
            if tuple(s) != s0:
                d = next(d for d in range(len(s0)) if s[d] != s0[d])
                raise StrategyError(f"dimension {d} is cut {s0[d]} in input 0 but {s[d]} in input {i}; the inputs "
                                    f"of a concatenation must cut every other dimension the same way")
        sh = _sharding((s0,), device_num, range(len(s0)))
        lay = sh.out_layout
        return OpSharding(tuple(tuple(s) for s in strategy), (lay,) * len(specs), lay, sh.repeat_axes)

    def data_parallel(self, prim, args, device_num):
        specs = tensor_specs(args)
        axis = self._axis(prim, specs)
        batch = [batch_cut(x, device_num) for x in specs]
        # The batch is cut only when an activation (not a Parameter) carries it, and all inputs agree.
        c = max(batch) if axis != 0 else 1
        return tuple((c,) + (1,) * (x.ndim - 1) for x in specs)

    def propagate(self, prim, args, layouts, device_num):
        specs = tensor_specs(args)
        axis = self._axis(prim, specs)
        x0 = specs[0]
        cuts = follow(x0, layouts[0], allowed=[d for d in range(x0.ndim) if d != axis])
        return first_accepted(self, prim, args, device_num, [(cuts,) * len(specs)])


# ---- indexing -------------------------------------------------------------------------------

def _array_facts(op, item):
    """(ndim, is_bool) of an index array (TensorSpec, Tensor, ndarray, list or bool)."""
    if isinstance(item, (list, bool, numpy.bool_)):
        item = numpy.asarray(item)
        if item.dtype.kind == "f" and item.size == 0:
            return 1, False  # [] selects nothing
    kind = numpy.dtype(item.dtype).kind
    if kind not in "iub":
        raise IndexError(f"{op}: index arrays must hold integers or bools, got dtype {item.dtype}")
    return len(item.shape), kind == "b"


def _check_index_tensor(op, item):
    """A Tensor inside the index: its block must be the whole array (untagged or replicated)."""
    from ..tensors import get_layout
    entry = get_layout(item)
    if entry is not None and (entry[0].partial or any(entry[0].tensor_map)):
        raise StrategyError(f"an index Tensor inside the index has layout {entry[0]}; index Tensors must be whole "
                            f"(replicated) on every rank")


def index_dims(op, shape, index):
    """How ``x[index]`` treats each dimension of x, and where each output dimension comes from.

    Args:
        op: the operator's name (for messages).
        shape: x's global shape.
        index: a tuple of ints, slices, None, Ellipsis and index arrays (TensorSpecs, Tensors,
            arrays, lists, bools), as x[...] takes.

    Returns:
        ``(kinds, out_loops)``: ``kinds[d]`` is "whole" (a slice covering dimension d with step
        1), "slice", "int" or "array"; ``out_loops[j]`` is the x dimension output dimension j
        keeps whole, or None (new axes, broadcast index dimensions, partial slices).
    """
    nd = len(shape)
    items = []  # (kind, payload, how many x dimensions it consumes)
    for item in index:
        if item is None:
            items.append(("new", None, 0))
        elif item is Ellipsis:
            items.append(("ellipsis", None, 0))
        elif isinstance(item, slice):
            items.append(("slice", item, 1))
        elif isinstance(item, (int, numpy.integer)) and not isinstance(item, (bool, numpy.bool_)):
            items.append(("int", int(item), 1))
        elif isinstance(item, (TensorSpec, list, bool, numpy.bool_)) or hasattr(item, "dtype"):
            if isinstance(item, Tensor):
                _check_index_tensor(op, item)
            ndim, is_bool = _array_facts(op, item)
            items.append(("array", 1 if is_bool else ndim, ndim if is_bool else 1))
        else:
            raise TypeError(f"{op}: unsupported index {item!r} of type {type(item).__name__}; expected int, slice, "
                            f"None, Ellipsis, or an integer / bool array")
    if sum(1 for k, _, _ in items if k == "ellipsis") > 1:
        raise IndexError(f"{op}: an index can only have a single ellipsis (index {index!r})")
    used = sum(n for _, _, n in items)
    if used > nd:
        raise IndexError(f"{op}: the index {index!r} indexes {used} dimensions but x has shape {tuple(shape)}")
    expanded = []
    for kind, payload, n in items:
        if kind == "ellipsis":
            # An Ellipsis of no dimensions does not separate index arrays (NumPy's placement).
            expanded += [("slice", slice(None), 1)] * (nd - used)
            used = nd
        else:
            expanded.append((kind, payload, n))
    expanded += [("slice", slice(None), 1)] * (nd - used)

    advanced = any(k == "array" for k, _, _ in expanded)
    kinds, entries, d = [], [], 0  # entries: per expanded item, the output dims it yields
    for kind, payload, n in expanded:
        if kind == "slice":
            try:
                whole = payload.indices(shape[d]) == (0, shape[d], 1)
            except TypeError:
                raise TypeError(f"{op}: slice bounds must be ints or None, got {payload!r}") from None
            kinds.append("whole" if whole else "slice")
            entries.append(("basic", d if whole else None))
        elif kind == "new":
            entries.append(("basic", None))
        elif kind == "int" and not advanced:
            kinds.append("int")
        else:  # with an index array present, ints are broadcast with the arrays (NumPy's rule)
            kinds += ["int" if kind == "int" else "array"] * n
            entries.append(("advanced", payload if kind == "array" else 0))
        d += n
    basic = [(p, e[1]) for p, e in enumerate(entries) if e[0] == "basic"]
    adv = [p for p, e in enumerate(entries) if e[0] == "advanced"]
    if not adv:
        return tuple(kinds), [src for _, src in basic]
    block = [None] * max(entries[p][1] for p in adv)
    if adv[-1] - adv[0] + 1 == len(adv):  # adjacent: the broadcast dimensions replace them in place
        out = [src for p, src in basic if p < adv[0]] + block + [src for p, src in basic if p > adv[-1]]
    else:
        out = block + [src for _, src in basic]
    return tuple(kinds), out


class _IndexRule(Rule):
    """x[index] with the index computed from the call's other arguments (subclasses: ``index``)."""

    def index(self, prim, args, x):
        raise NotImplementedError

    def extra(self, args):
        """Ranks of tensor arguments after x (a Tensor index)."""
        return tuple(s.ndim for s in tensor_specs(args)[1:])

    def full_strategy(self, args, strategy):
        """.shard() gives x's tuple only (n_tensor_inputs 1); a Tensor index is whole."""
        strategy = tuple(tuple(s) for s in strategy)
        if len(strategy) == 1:
            strategy += tuple((1,) * nd for nd in self.extra(args))
        return strategy

    def infer(self, prim, args, strategy, device_num):
        strategy = self.full_strategy(args, strategy)
        check_strategy_shape(strategy, args)
        x = tensor_specs(args)[0]
        for i, s in enumerate(strategy[1:], 1):
            if any(c != 1 for c in s):
                raise StrategyError(f"input {i} (the index) has strategy {s}; an index must be whole (all 1)")
        kinds, out_loops = index_dims(prim.name, x.shape, self.index(prim, args, x))
        s = strategy[0]
        for d, (c, kind) in enumerate(zip(s, kinds)):
            if c > 1 and kind != "whole":
                how = {"slice": "sliced", "int": "indexed by an int (shrunk)", "array": "indexed by an array"}[kind]
                raise StrategyError(f"dimension {d} of x is cut {c} but {how}; a cut dimension must be taken whole "
                                    f"(slice(None))")
        return _sharding(strategy, device_num, out_loops, self.extra(args))

    def data_parallel(self, prim, args, device_num):
        x = tensor_specs(args)[0]
        kinds, _ = index_dims(prim.name, x.shape, self.index(prim, args, x))
        c = batch_cut(x, device_num) if kinds and kinds[0] == "whole" else 1
        s = (c,) + (1,) * (x.ndim - 1) if x.ndim else ()
        return self.full_strategy(args, (s,))

    def propagate(self, prim, args, layouts, device_num):
        x = tensor_specs(args)[0]
        kinds, _ = index_dims(prim.name, x.shape, self.index(prim, args, x))
        cuts = follow(x, layouts[0], allowed=[d for d, k in enumerate(kinds) if k == "whole"])
        return first_accepted(self, prim, args, device_num, [self.full_strategy(args, (cuts,))])


@register(ops.StridedSlice)
class StridedSliceRule(_IndexRule):
    """StridedSlice(x, begin, end, strides) with its masks (see the module docstring)."""

    def index(self, prim, args, x):
        return prim._index(tuple(x.shape), *args[1:4])


@register(ops.GetItem)
class GetItemRule(_IndexRule):
    """GetItem(x, index): Python / NumPy indexing (see the module docstring)."""

    def index(self, prim, args, x):
        index = args[1]
        return index if isinstance(index, tuple) else (index,)


# ---- Gather ---------------------------------------------------------------------------------

@register(ops.Gather)
class GatherRule(Rule):
    """Gather(params, indices, axis): indices cut any way; params whole or vocabulary-parallel (module docstring)."""

    @staticmethod
    def _facts(prim, args):
        params, indices = tensor_specs(args)[:2]
        if params.ndim == 0:
            raise ValueError(f"{prim.name}: params must have at least 1 dimension, got a 0-d tensor")
        if len(args) < 3 or isinstance(args[2], TensorSpec):
            raise StrategyError("the axis must be a Python int when Gather runs sharded")
        axis = normalize_axis(prim.name, args[2], params.ndim)[0]
        return params, indices, axis

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        params, indices, axis = self._facts(prim, args)
        s_p, s_i = (tuple(s) for s in strategy)
        dm, off, rep = device_matrix_for(s_p + s_i, device_num)
        np_, ni = params.ndim, indices.ndim
        out_loops = list(range(axis)) + list(range(np_, np_ + ni)) + list(range(axis + 1, np_))
        v = s_p[axis]
        partial = ((off + axis, "sum"),) if v > 1 else ()
        out = Layout(dm, dims_map(off, out_loops), partial)
        in_layouts = (Layout(dm, dims_map(off, range(np_))), Layout(dm, dims_map(off, range(np_, np_ + ni))))
        local_attrs = _row_block(off + axis, params.shape[axis] // v, params.shape[axis]) if v > 1 else None
        return OpSharding((s_p, s_i), in_layouts, out, rep, local_attrs=local_attrs)

    def data_parallel(self, prim, args, device_num):
        params, indices, _ = self._facts(prim, args)
        s_i = (largest_cut(indices.shape[0], device_num),) + (1,) * (indices.ndim - 1) if indices.ndim else ()
        return (1,) * params.ndim, s_i

    def propagate(self, prim, args, layouts, device_num):
        params, indices, _ = self._facts(prim, args)
        s_p, s_i = follow(params, layouts[0]), follow(indices, layouts[1])
        return first_accepted(self, prim, args, device_num, [(s_p, s_i), ((1,) * params.ndim, s_i)])


def _row_block(vocab_axis, rows, total):
    """``local_attrs(site)``: the block of ``rows`` rows (of ``total``) this rank's coordinate on vocab_axis holds."""
    def local_attrs(site):
        return {"row_block": (site.coords[vocab_axis] * rows, total)}
    return local_attrs
