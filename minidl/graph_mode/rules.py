"""GRAPH_MODE's fusion rules: one row per fusion, a pattern over consecutive ops and what replaces it.

A pattern starts with a *head* (an op whose output GRAPH_MODE may keep pending: BatchNorm,
MatMul, Dense), may have a *middle* op (the Add of a residual, the BiasAdd of a bias) that stays
pending too, and ends with a *tail* (ReLU) at whose call the whole pattern runs as the
replacement op. A row marked ``at_end`` has no tail: it applies when its ops must run without
one (a pending BiasAdd of a pending MatMul runs as one Dense).

Guards are plain functions: each returns None when its condition holds, else the reason, in
words, that :func:`minidl.graph_mode.explain` prints. A head's guards (``HEADS``) decide whether
its call is deferred at all and raise eager's error for arguments eager would refuse, at the
call; a middle's and a tail's guards (in the rows) decide whether the pattern goes on. Where a
guard fails, the ops run as eager ran them: never a guess.

To add a fusion, add a row (and, for a new head, its entry in ``HEADS``); nothing else changes.
"""
from dataclasses import dataclass

from ..ops.dense import Dense, DenseReLU
from ..ops.linalg import BiasAdd, MatMul, check_matmul
from ..ops.math import Add, ReLU
from ..ops.norm import BatchNorm
from ..ops.norm_relu import BatchNormReLU
from ..tensor import Tensor

__all__ = ["Rule", "RULES", "HEADS", "following", "ending"]


@dataclass(frozen=True)
class Rule:
    """One fusion: ``pattern`` (op classes, head first) runs as ``replacement``.

    ``middle``: the guard of the middle op (its operand, the head's record), when the pattern
    has one; ``head_at``: which of the middle op's arguments the head's output may be (either
    side of an Add; a BiasAdd's input, never its bias, for which eager raises).
    ``fuse(head_record, operand)``: the replacement's (primitive, arguments, the head's arguments
    its own output still needs).
    """

    name: str
    pattern: tuple
    replacement: type
    fuse: object
    middle: object = None
    head_at: tuple = (0, 1)
    at_end: bool = False

    def describe(self):
        return f"{self.name} -> {self.replacement.__name__}" + (" (when its ops must run)" if self.at_end else "")


# ---- the heads: whether a call may wait, its output's (shape, dtype), and eager's errors first ----

def _tensors_local(args, inner):
    """All tensor arguments hold whole values, or the runtime places them (a parallel one)."""
    if inner.intercepts_ops:
        return None
    if any(a.placement is not None for a in args if isinstance(a, Tensor)):
        return "a sharded argument on the local runtime (eager raises for it)"
    return None


def head_batch_norm(prim, args, inner):
    """(shape, dtype) of a BatchNorm's output, or the reason it runs now (NCHW, five Tensors)."""
    if len(args) != 5 or prim.data_format != "NCHW":
        return f"data_format {prim.data_format} (the fused kernel takes NCHW)" if len(args) == 5 else "not 5 arguments"
    x, scale, bias, mean, variance = args
    if not (isinstance(x, Tensor) and isinstance(scale, Tensor) and isinstance(bias, Tensor)
            and all(a is None or isinstance(a, Tensor) for a in (mean, variance))):
        return "an argument is not a Tensor (a raw array could change unwatched)"
    # Reading .data computes a pending x and runs what watches these tensors: eager's order.
    arrays = [None if a is None else a.data for a in args]
    reason = _tensors_local(args, inner)
    if reason is not None:
        return reason
    if not inner.intercepts_ops:
        prim._check(*arrays)  # eager's errors, at the call
        if prim.is_training and arrays[0].size // max(arrays[0].shape[1], 1) < 2:
            return "one value per channel (eager raises)"
    return tuple(x.shape), x.dtype


def head_matmul(prim, args, inner):
    """(shape, dtype) of nn.Dense's product ``x @ w.T`` (2-D, one dtype), or the reason it runs now."""
    if prim.transpose_a or not prim.transpose_b or len(args) != 2 or not all(isinstance(a, Tensor) for a in args):
        return "not x @ w.T of two Tensors"
    x, w = (a.data for a in args)
    reason = _tensors_local(args, inner)
    if reason is not None:
        return reason
    if x.dtype != w.dtype or type(x) is not type(w):
        return "operands of two dtypes or devices (eager's call, and its error)"
    if not inner.intercepts_ops:
        check_matmul(prim.name, x, w, False, True, batched=False)
    return (args[0].shape[0], args[1].shape[0]), x.dtype


def head_dense(prim, args, inner):
    """(shape, dtype) of a Dense call (x @ w.T + b), or the reason it runs now."""
    if len(args) not in (2, 3) or not all(isinstance(a, Tensor) for a in args):
        return "not 2 or 3 Tensor arguments"
    arrays = [a.data for a in args]
    reason = _tensors_local(args, inner)
    if reason is not None:
        return reason
    if len({type(a) for a in arrays}) != 1:
        return "arguments on two devices (eager's call, and its error)"
    if not inner.intercepts_ops:
        prim._check(*arrays) if len(arrays) == 3 else prim._check(*arrays, None)
    return (args[0].shape[0], args[1].shape[0]), arrays[0].dtype


HEADS = {BatchNorm: head_batch_norm, MatMul: head_matmul, Dense: head_dense}


# ---- the middles' guards -------------------------------------------------------------------------

def residual_of_the_same_shape(operand, head):
    """the residual is a Tensor of the BatchNorm output's exact shape and dtype"""
    if tuple(operand.shape) != head.shape or operand.dtype != head.dtype:
        return (f"the residual's shape {tuple(operand.shape)} / dtype {operand.dtype} differs from the output's "
                f"{head.shape} / {head.dtype} (the fused op adds without broadcasting)")
    return None


def bias_of_the_columns(operand, head):
    """the bias is a Tensor of the product's columns, of its dtype"""
    if tuple(operand.shape) != head.shape[1:] or operand.dtype != head.dtype:
        return (f"the bias's shape {tuple(operand.shape)} / dtype {operand.dtype} is not the product's columns "
                f"{head.shape[1:]} / dtype {head.dtype}")
    return None


# ---- what replaces each pattern ---------------------------------------------------------------------

def fused_batch_norm(head, operand):
    op = head.op
    extra = () if operand is None else (operand,)
    kept = head.args[:3] if op.is_training else head.args  # training: the statistics are the batch's
    return BatchNormReLU(op.is_training, op.epsilon, op.momentum), head.args + extra, kept


def fused_dense_relu(head, operand):
    extra = () if operand is None else (operand,)
    return DenseReLU(), head.args + extra, head.args


def fused_dense(head, operand):
    return Dense(), head.args + (operand,), head.args


RULES = (
    Rule("BatchNorm + ReLU", (BatchNorm, ReLU), BatchNormReLU, fused_batch_norm),
    Rule("BatchNorm + Add + ReLU", (BatchNorm, Add, ReLU), BatchNormReLU, fused_batch_norm,
         middle=residual_of_the_same_shape),
    Rule("Dense + ReLU", (Dense, ReLU), DenseReLU, fused_dense_relu),
    Rule("MatMul + ReLU", (MatMul, ReLU), DenseReLU, fused_dense_relu),
    Rule("MatMul + BiasAdd + ReLU", (MatMul, BiasAdd, ReLU), DenseReLU, fused_dense_relu,
         middle=bias_of_the_columns, head_at=(0,)),
    Rule("MatMul + BiasAdd", (MatMul, BiasAdd), Dense, fused_dense, middle=bias_of_the_columns, head_at=(0,),
         at_end=True),
)


def following(chain, cls):
    """The rows whose pattern continues ``chain`` (the pending op classes, head first) with ``cls``."""
    n = len(chain)
    return [rule for rule in RULES
            if len(rule.pattern) > n and rule.pattern[:n] == chain and rule.pattern[n] is cls]


def ending(chain):
    """The ``at_end`` row whose whole pattern is ``chain``, or None."""
    for rule in RULES:
        if rule.at_end and rule.pattern == chain:
            return rule
    return None
