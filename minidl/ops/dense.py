"""Dense and DenseReLU: a fully connected layer's product, bias (and ReLU) in one op.

Why one op. MatMul then BiasAdd (then the activation), as MindSpore's nn.Dense calls them, are
three passes over the output and three kept arrays. As one op a fast body adds the bias and
applies the ReLU in one sweep over the GEMM's output, in place, and in backward masks the
gradient and sums the bias gradient from it in one more (minidl/kernels/cpu/dense.py).
``nn.Dense`` calls Dense (unless sharded); GRAPH_MODE (minidl/graph_mode/) runs a Dense and
its ReLU, or a user's MatMul, BiasAdd and ReLU, as DenseReLU, with no model change.

These are the reference bodies: exactly MatMul(transpose_b=True), BiasAdd and ReLU one after
another (tests/minidl/ops/test_dense.py checks both, and finite differences). At a kink
(pre-activation == 0) the gradient is 0, as ReLU's.
"""
from ..backend import get_array_module
from .linalg import check_matmul
from .primitive import Primitive


class Dense(Primitive):
    """``x @ w.T + b``, as MindSpore's ``ops.Dense``; b is optional.

    Inputs:
        x: (N, in); w: (out, in), as nn.Dense stores its weight; b (optional): (out,).

    Gradients flow to x, w and b.

    Example:
        >>> y = ops.Dense()(x, fc.weight, fc.bias)   # what fc(x) computes, for fc = nn.Dense(in, out)
    """

    n_inputs = (2, 3)

    def _check(self, x, w, b):
        check_matmul(self.name, x, w, False, True, batched=False)
        if b is not None and (b.ndim != 1 or b.shape[0] != w.shape[0]):
            raise ValueError(f"{self.name}: b of shape {tuple(b.shape)} must be 1-D of length w.shape[0] = {w.shape[0]}")
        if b is not None and b.dtype != x.dtype:
            raise TypeError(f"{self.name}: b has dtype {b.dtype} but x and w have dtype {x.dtype}; they must match")

    def forward(self, x, w, b=None):
        self._check(x, w, b)
        self.x, self.w = x, w
        y = x @ w.T
        if b is not None:
            y += b  # y is a new array
        return y

    def backward(self, gy):
        needs = self.needs_grad
        gx = gy @ self.w if needs[0] else None
        gw = gy.T @ self.x if needs[1] else None
        if len(needs) < 3:
            return gx, gw
        return gx, gw, (gy.sum(axis=0) if needs[2] else None)


class DenseReLU(Dense):
    """``max(x @ w.T + b, 0)``: Dense, then ReLU; inputs and gradients as Dense.

    Example:
        >>> h = ops.DenseReLU()(x, fc.weight, fc.bias)   # relu(fc(x))
    """

    def forward(self, x, w, b=None):
        y = super().forward(x, w, b)
        self.y = get_array_module(y).maximum(y, 0, out=y)
        return self.y

    def backward(self, gy):
        return super().backward(gy * (self.y > 0))


def dense(input, weight, bias=None):  # noqa: A002 - MindSpore's parameter name
    """``input @ weight.T + bias`` in one op (ops.Dense), as MindSpore's ``ops.dense`` for 2-D input.

    Example:
        >>> y = ops.dense(x, fc.weight, fc.bias)
    """
    return Dense()(input, weight) if bias is None else Dense()(input, weight, bias)


__all__ = ["Dense", "DenseReLU", "dense"]
