"""MatMul, BatchMatMul and BiasAdd: the dense-layer ops; ``matmul``, NumPy's matmul built on them."""
from ..backend import get_array_module
from ..tensor import Tensor
from .array import ExpandDims, Squeeze
from .primitive import Primitive, sum_to_shape


def _t(a):
    return a.swapaxes(-1, -2)


class _Product(Primitive):
    """What MatMul and BatchMatMul share: two inputs and their optional transposes."""

    n_inputs = 2

    def __init__(self, transpose_a=False, transpose_b=False):
        super().__init__()
        self.transpose_a = bool(transpose_a)
        self.transpose_b = bool(transpose_b)


class MatMul(_Product):
    """2-D matrix product ``op(x) @ op(w)``, op being an optional transpose.

    Args:
        transpose_a: use x.T.
        transpose_b: use w.T (Dense stores its weight as [out, in] and sets this).
    """

    def forward(self, x, w):
        check_matmul(self.name, x, w, self.transpose_a, self.transpose_b, batched=False)
        self.x, self.w = x, w
        a = x.T if self.transpose_a else x
        b = w.T if self.transpose_b else w
        return a @ b

    def backward(self, gy):
        x, w, ta, tb = self.x, self.w, self.transpose_a, self.transpose_b
        a = x.T if ta else x
        b = w.T if tb else w
        gx = gw = None
        # y = A B with A = op(x), B = op(w): dA = gy B^T, dB = A^T gy. When op transposes, the
        # gradient is formed directly in x's (w's) layout, e.g. dw = gy^T A rather than (A^T gy)^T:
        # BLAS reads transposed operands for free, and the result is contiguous (no copy later).
        if self.needs_grad[0]:
            gx = b @ gy.T if ta else gy @ b.T
        if self.needs_grad[1]:
            gw = gy.T @ a if tb else a.T @ gy
        return gx, gw


class BatchMatMul(_Product):
    """Batched matrix product over the last two dims; leading dims broadcast.

    Args:
        transpose_a, transpose_b: transpose the last two dims of x / w.
    """

    def forward(self, x, w):
        check_matmul(self.name, x, w, self.transpose_a, self.transpose_b, batched=True)
        self.x, self.w = x, w
        a = _t(x) if self.transpose_a else x
        b = _t(w) if self.transpose_b else w
        return get_array_module(x, w).matmul(a, b)

    def backward(self, gy):
        xp = get_array_module(gy)
        x, w, ta, tb = self.x, self.w, self.transpose_a, self.transpose_b
        gx = gw = None
        a = _t(x) if ta else x
        b = _t(w) if tb else w
        # As in MatMul: each gradient is formed directly in its input's layout.
        if self.needs_grad[0]:
            gx = sum_to_shape(xp.matmul(b, _t(gy)) if ta else xp.matmul(gy, _t(b)), x.shape)
        if self.needs_grad[1]:
            gw = sum_to_shape(xp.matmul(_t(gy), a) if tb else xp.matmul(_t(a), gy), w.shape)
        return gx, gw


def check_matmul(op, x, w, ta, tb, batched):
    if not batched and (x.ndim != 2 or w.ndim != 2):
        raise ValueError(f"{op}: x and w must be 2-D, got shapes {tuple(x.shape)} and {tuple(w.shape)}")
    if batched and (x.ndim < 2 or w.ndim < 2):
        raise ValueError(f"{op}: x and w must have at least 2 dims, got shapes {tuple(x.shape)} and {tuple(w.shape)}")
    k1 = x.shape[-2] if ta else x.shape[-1]
    k2 = w.shape[-1] if tb else w.shape[-2]
    if k1 != k2:
        raise ValueError(f"{op}: x of shape {tuple(x.shape)} and w of shape {tuple(w.shape)}"
                         f"{' (transpose_a)' if ta else ''}{' (transpose_b)' if tb else ''}: "
                         f"inner dimensions {k1} and {k2} differ")
    if x.dtype != w.dtype:
        raise TypeError(f"{op}: x has dtype {x.dtype} but w has dtype {w.dtype}; cast one of them")


class BiasAdd(Primitive):
    """x + b with b added along the channel axis 1 (NCHW, or [N, C] for dense outputs)."""

    n_inputs = 2

    def __init__(self, data_format="NCHW"):
        super().__init__()
        if data_format not in ("NCHW", "NHWC", "NCDHW"):
            raise ValueError(f"BiasAdd: data_format must be 'NCHW' or 'NHWC', got {data_format!r}")
        self.data_format = data_format

    def forward(self, x, b):
        if b.ndim != 1 or x.ndim < 2:
            raise ValueError(f"BiasAdd: x must have rank >= 2 and b rank 1, got shapes {tuple(x.shape)} and {tuple(b.shape)}")
        axis = x.ndim - 1 if self.data_format == "NHWC" else 1
        if x.shape[axis] != b.shape[0]:
            raise ValueError(f"BiasAdd: b of shape {tuple(b.shape)} must match channel dim {axis} "
                             f"of x, which is {x.shape[axis]} (x shape {tuple(x.shape)})")
        self.axis = axis
        shape = [1] * x.ndim
        shape[axis] = b.shape[0]
        return x + b.reshape(shape)

    def backward(self, gy):
        gb = None
        if self.needs_grad[1]:
            axes = tuple(i for i in range(gy.ndim) if i != self.axis)
            gb = gy.sum(axis=axes)
        return gy, gb


def matmul(input, other):  # noqa: A002 - MindSpore's parameter name
    """The matrix product as NumPy's ``matmul`` (and ``@``): vectors and broadcast batches too.

    A 1-D input becomes a row (1, k) and a 1-D other a column (k, 1), and that dimension is
    dropped from the result: vector @ vector is a 0-d tensor. Two 2-D operands run as
    ``MatMul``, anything with a batch as ``BatchMatMul`` (batch dimensions broadcast), so the
    gradients, and the sharding rules under tensor parallelism, are theirs. As in MindSpore
    2.10 (and PyTorch) both operands must have one dtype; the ``ops.MatMul`` primitive itself
    stays 2-D only, with transpose_a / transpose_b.

    Args:
        input, other: tensors of rank >= 1 with equal inner dimensions.

    Example:
        >>> ops.matmul(Tensor(np.ones(3)), Tensor(np.ones((2, 3, 4)))).shape
        (2, 4)
    """
    x, w = input, other
    for name, a in (("input", x), ("other", w)):
        if not isinstance(a, Tensor):
            raise TypeError(f"matmul: {name} must be a Tensor, got {type(a).__name__}")
    if x.ndim == 0 or w.ndim == 0:
        raise ValueError(f"matmul: input and other must have at least 1 dimension, got shapes {x.shape} "
                         f"and {w.shape}")
    if x.dtype != w.dtype:
        raise TypeError(f"matmul: input has dtype {x.dtype} but other has dtype {w.dtype}; cast one of them")
    k1, k2 = x.shape[-1], w.shape[-2 if w.ndim > 1 else -1]
    if k1 != k2:
        raise ValueError(f"matmul: input of shape {x.shape} and other of shape {w.shape}: inner dimensions "
                         f"{k1} and {k2} differ")
    vec_x, vec_w = x.ndim == 1, w.ndim == 1
    if vec_x:
        x = ExpandDims()(x, 0)
    if vec_w:
        w = ExpandDims()(w, -1)
    y = MatMul()(x, w) if x.ndim == 2 and w.ndim == 2 else BatchMatMul()(x, w)
    if vec_x or vec_w:
        y = Squeeze(tuple(a for a, vec in ((-2, vec_x), (-1, vec_w)) if vec))(y)
    return y


def batch_matmul(x, w, transpose_a=False, transpose_b=False):
    """Functional BatchMatMul."""
    return BatchMatMul(transpose_a, transpose_b)(x, w)


bmm = batch_matmul


def bias_add(x, b, data_format="NCHW"):
    """Functional BiasAdd."""
    return BiasAdd(data_format)(x, b)


__all__ = ['MatMul', 'BatchMatMul', 'BiasAdd', 'matmul', 'batch_matmul', 'bias_add', 'bmm']
