"""Sharding rules of MatMul, BatchMatMul and BiasAdd.

MatMul ``(m, k) @ (k, n)`` runs on the device matrix [m, k, n] (a repeat axis first when the
strategy uses fewer devices). Strategies describe each input as stored: with transpose_a, x
is (k, m) and its strategy is (k cut, m cut). x is cut along (m, k), w along (k, n), and
the output (m, n) is a partial sum over the k axis when K is cut.

Example (the quickstart, 8 devices): ``MatMul().shard(((2, 4), (4, 1)))`` gives
x ``(a, b) on [2, 4, 1]``, w ``(b, -)`` and the output ``(a, -) +sum(b)``.

BatchMatMul prepends the output's batch dimensions as loops of the device matrix (they
broadcast as numpy's: a batch dimension of size 1 stays whole). BiasAdd follows x, the bias
cut like x's channel dimension.

Dense and DenseReLU (``x @ w.T + b``, one op: ops/dense.py) run as the ops they fuse,
MatMul(transpose_b), BiasAdd (and ReLU), each sharded from the Dense strategy ``(s_x, s_w,
s_b)``: x (m, k), w stored (n, k), b (n,), so the bias is cut as w's rows. Their fused body
saves passes over a local output; under a strategy the product may be a partial sum that
must be reduced before the bias is added, which the separate ops' redistribution does.

``ops.matmul`` / ``@`` (NumPy's matmul, vectors included) has no rule of its own: it is a
composite of ExpandDims, MatMul or BatchMatMul, and Squeeze, each sharded by its own rule.
"""
from minidl import ops

from ..layout import Layout
from .base import (Decomposed, OpSharding, Rule, StrategyError, check_strategy_shape, device_matrix_for, largest_cut,
                   register, tensor_specs)
from .elementwise import (aligned_map, batch_cut, broadcast_cuts, broadcast_shape, check_counts, dims_map,
                          first_accepted, follow)

__all__ = ["ProductRule", "BiasAddRule", "DenseRule"]


def _logical(transposed, pair):
    """The (rows, cols) of a matrix's last two dims, from their stored order."""
    return (pair[-1], pair[-2]) if transposed else (pair[-2], pair[-1])


def _stored(transposed, rows, cols):
    """(rows, cols) of a matrix written in its stored order."""
    return (cols, rows) if transposed else (rows, cols)


@register(ops.MatMul, ops.BatchMatMul)
class ProductRule(Rule):
    """MatMul (2-D) and BatchMatMul (batch dims broadcast), with transpose_a / transpose_b."""

    def infer(self, prim, args, strategy, device_num):
        strategy = tuple(tuple(s) for s in strategy)
        x, w = check_counts(strategy, args)
        if prim.name == "MatMul" and (x.ndim != 2 or w.ndim != 2):
            raise ValueError(f"{prim.name}: x and w must be 2-D, got shapes {x.shape} and {w.shape}")
        if x.ndim < 2 or w.ndim < 2:
            raise ValueError(f"{prim.name}: x and w must have at least 2 dims, got shapes {x.shape} and {w.shape}")
        s_x, s_w = strategy
        batch = broadcast_shape(prim.name, [x.shape[:-2], w.shape[:-2]])
        b_cuts = broadcast_cuts([x.shape[:-2], w.shape[:-2]], [s_x[:-2], s_w[:-2]], batch, ["x", "w"])
        check_strategy_shape(strategy, args)
        (xm, xk), (wk, wn) = _logical(prim.transpose_a, s_x), _logical(prim.transpose_b, s_w)
        if xk != wk:
            dx = x.ndim - (2 if prim.transpose_a else 1)
            dw = w.ndim - (1 if prim.transpose_b else 2)
            raise StrategyError(f"K cut differently for the two {prim.name} inputs: x's K (dimension {dx}) is cut "
                                f"{xk} but w's K (dimension {dw}) is cut {wk}; both must be cut the same way")
        nb = len(batch)
        dm, off, rep = device_matrix_for(b_cuts + (xm, xk, wn), device_num)
        m, k, n = (off + nb,), (off + nb + 1,), (off + nb + 2,)
        x_map = aligned_map(x.shape[:-2], off, nb) + _stored(prim.transpose_a, m, k)
        w_map = aligned_map(w.shape[:-2], off, nb) + _stored(prim.transpose_b, k, n)
        out = Layout(dm, dims_map(off, range(nb)) + (m, n), ((k[0], "sum"),))
        return OpSharding(strategy, (Layout(dm, x_map), Layout(dm, w_map)), out, rep)

    def data_parallel(self, prim, args, device_num):
        x, w = tensor_specs(args)
        batch = broadcast_shape(prim.name, [x.shape[:-2], w.shape[:-2]])
        nb = len(batch)
        if nb:  # the leading batch dimension, where an activation carries it
            carriers = [s for s in (x, w) if s.ndim - 2 == nb and s.shape[0] != 1]
            c = largest_cut(batch[0], device_num) if any(not s.is_parameter for s in carriers) else 1
            return tuple(tuple(c if d == 0 and s in carriers else 1 for d in range(s.ndim)) for s in (x, w))
        # a plain product: the rows of op(x), the weight whole
        rows = 1 if prim.transpose_a else 0
        c = 1 if x.is_parameter else largest_cut(x.shape[rows], device_num)
        return tuple(c if d == rows else 1 for d in range(2)), (1, 1)

    def propagate(self, prim, args, layouts, device_num):
        x, w = tensor_specs(args)
        nb = len(broadcast_shape(prim.name, [x.shape[:-2], w.shape[:-2]]))
        if nb == 0 and x.is_parameter and not w.is_parameter:  # follow the activation
            wk, wn = _logical(prim.transpose_b, follow(w, layouts[1]))
            return first_accepted(self, prim, args, device_num,
                                  [(_stored(prim.transpose_a, 1, wk), _stored(prim.transpose_b, wk, wn))])
        fx = follow(x, layouts[0])
        xm, xk = _logical(prim.transpose_a, fx)
        b_cuts = [1] * nb
        for d, size in enumerate(x.shape[:-2]):
            if size != 1:
                b_cuts[nb - (x.ndim - 2) + d] = fx[d]
        w_batch = tuple(1 if size == 1 else b_cuts[nb - (w.ndim - 2) + d] for d, size in enumerate(w.shape[:-2]))
        cand = (fx[:-2] + _stored(prim.transpose_a, xm, xk), w_batch + _stored(prim.transpose_b, xk, 1))
        batch_only = (fx[:-2] + (1, 1), w_batch + (1, 1))
        return first_accepted(self, prim, args, device_num, [cand, batch_only])


@register(ops.BiasAdd)
class BiasAddRule(Rule):
    """x + b along x's channel axis (1, or the last for NHWC): b is cut like that axis."""

    @staticmethod
    def _axis(prim, x):
        return x.ndim - 1 if prim.data_format == "NHWC" else 1

    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        x, b = tensor_specs(args)
        if b.ndim != 1 or x.ndim < 2:
            raise ValueError(f"BiasAdd: x must have rank >= 2 and b rank 1, got shapes {x.shape} and {b.shape}")
        s_x, s_b = (tuple(s) for s in strategy)
        axis = self._axis(prim, x)
        if s_b[0] != s_x[axis]:
            raise StrategyError(f"the bias's cut {s_b[0]} must equal the cut {s_x[axis]} of x's channel dimension "
                                f"{axis}")
        dm, off, rep = device_matrix_for(s_x, device_num)
        lay = Layout(dm, dims_map(off, range(x.ndim)))
        return OpSharding((s_x, s_b), (lay, Layout(dm, ((off + axis,),))), lay, rep)

    def data_parallel(self, prim, args, device_num):
        x, b = tensor_specs(args)
        c = batch_cut(x, device_num)
        return (c,) + (1,) * (x.ndim - 1), (1,)

    def propagate(self, prim, args, layouts, device_num):
        x, b = tensor_specs(args)
        if x.ndim < 2:
            return self.data_parallel(prim, args, device_num)
        fx = follow(x, layouts[0])
        return first_accepted(self, prim, args, device_num, [(fx, (fx[self._axis(prim, x)],))])


@register(ops.Dense, ops.DenseReLU)
class DenseRule(Rule):
    """Dense / DenseReLU as MatMul(transpose_b), BiasAdd (and ReLU), sharded from one strategy."""

    _product = ProductRule()

    def infer(self, prim, args, strategy, device_num):
        strategy = tuple(tuple(s) for s in strategy)
        specs = check_counts(strategy, args)
        if specs[0].ndim != 2 or specs[1].ndim != 2:
            raise ValueError(f"{prim.name}: x and w must be 2-D, got shapes {specs[0].shape} and {specs[1].shape}")
        check_strategy_shape(strategy, args)
        (m, _), (n, _) = strategy[:2]
        if len(strategy) == 3 and strategy[2] != (n,):
            raise StrategyError(f"the bias's cut {strategy[2][0]} must equal the cut {n} of w's rows (dimension 0)")
        matmul = ops.MatMul(False, True).shard(strategy[:2])
        bias_add = ops.BiasAdd().shard(((m, n), (n,))) if len(strategy) == 3 else None
        relu = ops.ReLU().shard(((m, n),)) if type(prim) is ops.DenseReLU else None

        def fn(x, w, b=None):
            y = matmul(x, w)
            y = y if bias_add is None else bias_add(y, b)
            return y if relu is None else relu(y)
        return Decomposed(fn, f"{prim.name} as MatMul(transpose_b), BiasAdd" + (" and ReLU" if relu else ""))

    def data_parallel(self, prim, args, device_num):
        specs = tensor_specs(args)
        return self._product.data_parallel(ops.MatMul(False, True), args[:2], device_num) + ((1,),) * (len(specs) - 2)

    def propagate(self, prim, args, layouts, device_num):
        s_x, s_w = self._product.propagate(ops.MatMul(False, True), args[:2], layouts[:2], device_num)
        return (s_x, s_w) + ((s_w[0],),) * (len(tensor_specs(args)) - 2)
