"""Loss cells: LossBase, SoftmaxCrossEntropyWithLogits, CrossEntropyLoss, NLLLoss, MSELoss, L1Loss.

Each loss computes a per-element (or per-sample) loss with the ops and then reduces it
('mean', 'sum' or 'none') in ``LossBase.get_loss``, as MindSpore's losses do.
"""
import numpy

from .. import ops
from ..backend import get_array_module, to_device, to_numpy
from ..ops.loss import _nan_where_out_of_range, host_label_checks
from ..tensor import Tensor
from .cell import Cell

_REDUCTIONS = ("mean", "sum", "none")


class LossBase(Cell):
    """Base of the losses: ``get_loss(x, weights)`` applies the reduction.

    Args:
        reduction: 'mean' (default), 'sum' or 'none'.
    """

    def __init__(self, reduction="mean"):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{type(self).__name__}: reduction must be one of 'mean', 'sum', 'none', "
                             f"got {reduction!r}")
        self.reduction = reduction
        self.reduce_mean = ops.ReduceMean(keep_dims=False)
        self.reduce_sum = ops.ReduceSum(keep_dims=False)
        self.mul = ops.Mul()

    def get_axis(self, x):
        """Every axis of x (the reduction is over all elements)."""
        return tuple(range(x.ndim))

    def get_loss(self, x, weights=1.0):
        """Multiplies x by weights (when not 1.0) and applies the reduction."""
        if not (isinstance(weights, (int, float)) and weights == 1.0):
            x = self.mul(x, weights)
        if self.reduction == "mean":
            return self.reduce_mean(x, ())
        if self.reduction == "sum":
            return self.reduce_sum(x, ())
        return x

    def construct(self, logits, labels):
        raise NotImplementedError(f"{type(self).__name__}: a loss must define construct(self, logits, labels)")

    def extend_repr(self):
        return f"reduction={self.reduction}"


class SoftmaxCrossEntropyWithLogits(LossBase):
    """Cross entropy between softmax(logits) and labels, per sample, then reduced.

    Args:
        sparse: labels are integer class indices of shape (N,) instead of (N, C) one-hot
            labels or probabilities (float labels of the logits' shape with sparse=True raise,
            suggesting sparse=False).
        reduction: 'none' (MindSpore's default here), 'mean' or 'sum'.

    Example:
        >>> loss = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        >>> loss(logits, minidl.Tensor(np.array([1, 0], np.int32)))
    """

    def __init__(self, sparse=False, reduction="none"):
        super().__init__(reduction)
        self.sparse = bool(sparse)
        self.ce = (ops.SparseSoftmaxCrossEntropyWithLogits() if self.sparse
                   else ops.SoftmaxCrossEntropyWithLogits())

    def construct(self, logits, labels):
        if logits.ndim != 2:
            raise ValueError(f"SoftmaxCrossEntropyWithLogits: logits must be (N, C), got shape {tuple(logits.shape)}")
        if self.sparse and getattr(getattr(labels, "dtype", None), "kind", None) == "f" \
                and tuple(getattr(labels, "shape", ())) == tuple(logits.shape):
            # One-hot labels meeting sparse=True: the primitive's dtype error alone does not say
            # that the fix is the flag.
            raise TypeError(f"SoftmaxCrossEntropyWithLogits(sparse=True): labels of dtype {labels.dtype} have the "
                            f"logits' shape {tuple(logits.shape)}, as one-hot labels (or class probabilities) do, but "
                            f"sparse=True expects integer class indices of shape ({logits.shape[0]},); pass "
                            f"sparse=False for one-hot or probability labels, or integer class indices (e.g. "
                            f"labels.argmax(axis=1))")
        return self.get_loss(self.ce(logits, labels))

    def extend_repr(self):
        return f"sparse={self.sparse}, reduction={self.reduction}"


class CrossEntropyLoss(LossBase):
    """Cross entropy of logits against class indices or class probabilities (PyTorch semantics).

    Args:
        weight: optional per-class weights, shape (C,).
        ignore_index: class index whose samples contribute nothing (index labels only).
        reduction: 'mean' (divides by the summed weights of the counted samples for index
            labels, by the number of samples for probability labels), 'sum' or 'none'.
        label_smoothing: in [0, 1]; the target becomes (1 - s) * target + s / C.

    Inputs:
        logits: (N, C), (C,) or (N, C, d1, ...).
        labels: integer class indices of shape (N,), () or (N, d1, ...), or float
            probabilities of the logits' shape.

    Example:
        >>> loss = nn.CrossEntropyLoss()
        >>> loss(logits, minidl.Tensor(np.array([1, 0], np.int32)))
    """

    def __init__(self, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
        super().__init__(reduction)
        if weight is not None:
            weight = weight if isinstance(weight, Tensor) else Tensor(weight)
            if weight.ndim != 1:
                raise ValueError(f"CrossEntropyLoss: weight must be 1-D (one per class), got shape {weight.shape}")
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
                or not 0 <= label_smoothing <= 1:
            raise ValueError(f"CrossEntropyLoss: label_smoothing must be in [0, 1], got {label_smoothing!r}")
        if not isinstance(ignore_index, int) or isinstance(ignore_index, bool):
            raise TypeError(f"CrossEntropyLoss: ignore_index must be an int, got {ignore_index!r}")
        self.weight = weight  # a constant Tensor, not a Parameter: nothing learns it
        self.ignore_index = ignore_index
        self.label_smoothing = float(label_smoothing)
        self.log_softmax = ops.LogSoftmax(axis=-1)
        self.sparse_ce = ops.SparseSoftmaxCrossEntropyWithLogits()
        self.reshape = ops.Reshape()
        self.transpose = ops.Transpose()
        self.neg = ops.Neg()
        self.div = ops.RealDiv()

    def construct(self, logits, labels):
        shape = tuple(logits.shape)
        for name, t in (("logits", logits), ("labels", labels)):
            # Tensor parallelism: a tensor holding a block (logical shape != its array's) would
            # mix local arrays with logical shapes below and give a wrong loss without error.
            if isinstance(t, Tensor) and tuple(t.shape) != tuple(t.data.shape):
                raise ValueError(f"CrossEntropyLoss: {name} of logical shape {tuple(t.shape)} is cut across ranks "
                                 f"(this rank holds {tuple(t.data.shape)}); CrossEntropyLoss builds arrays from "
                                 f"local data and cannot run on blocks: use nn.SoftmaxCrossEntropyWithLogits, or "
                                 f"dataset_strategy='full_batch' with whole logits")
        y = labels.data if isinstance(labels, Tensor) else labels
        xp = get_array_module(logits.data if isinstance(logits, Tensor) else logits, y)
        y = xp.asarray(y)
        if len(shape) == 0:
            raise ValueError("CrossEntropyLoss: logits must have a class dimension, got a 0-d tensor")
        # Bring the class axis last and flatten, so the body works on (M, C) rows.
        if len(shape) == 1:
            batch_shape, x = (), self.reshape(logits, (1, shape[0]))
        elif len(shape) == 2:
            batch_shape, x = (shape[0],), logits
        else:
            batch_shape = (shape[0],) + shape[2:]
            perm = (0,) + tuple(range(2, len(shape))) + (1,)
            x = self.reshape(self.transpose(logits, perm), (-1, shape[1]))
        n_classes = shape[0] if len(shape) == 1 else shape[1]
        if self.weight is not None and self.weight.shape[0] != n_classes:
            raise ValueError(f"CrossEntropyLoss: weight has {self.weight.shape[0]} entries but logits of shape "
                             f"{shape} have {n_classes} classes")
        dtype = x.dtype
        if numpy.issubdtype(y.dtype, numpy.floating):
            per, denominator = self._probability_loss(x, y, shape, xp, dtype)
        else:
            per, denominator = self._index_loss(x, y, shape, batch_shape, n_classes, xp, dtype)
        if self.reduction == "none":
            return self.reshape(per, batch_shape)
        total = self.reduce_sum(per, ())
        if self.reduction == "sum":
            return total
        return self.div(total, Tensor._wrap(xp.asarray(denominator, dtype=dtype)))

    def _index_loss(self, x, y, shape, batch_shape, n_classes, xp, dtype):
        if tuple(y.shape) != batch_shape:
            raise ValueError(f"CrossEntropyLoss: class-index labels of shape {tuple(y.shape)} do not match logits "
                             f"of shape {shape}: expected labels of shape {batch_shape}")
        y = y.reshape(-1)
        valid = y != self.ignore_index
        safe = xp.where(valid, y, 0)
        on_device = xp is not numpy
        # Asking whether a device label is out of range reads a value back: a host
        # synchronisation every step. By default device labels are not asked about; a bad one
        # makes its sample's loss NaN below instead (host_label_checks() turns the check on).
        if not on_device or host_label_checks():
            out_of_range = (safe < 0) | (safe >= n_classes)
            if bool(out_of_range.any()):
                bad = sorted(set(to_numpy(safe[out_of_range]).tolist()))
                raise ValueError(f"CrossEntropyLoss: labels {bad[:5]} are outside [0, {n_classes}) "
                                 f"(ignore_index={self.ignore_index})")
        if self.weight is None and self.label_smoothing == 0.0:
            per = self.sparse_ce(x, Tensor._wrap(safe))  # on the device: NaN where safe is out of range
            if on_device or not bool(valid.all()):  # on the device masking costs less than asking
                per = self.mul(per, Tensor._wrap(valid.astype(dtype)))
            return per, valid.sum().astype(dtype)
        # Weighted or smoothed: a constant target matrix T, loss = -sum_c T[n, c] * log p[n, c].
        s = self.label_smoothing
        onehot = (safe[:, None] == xp.arange(n_classes)[None, :]).astype(dtype)
        target = onehot * (1.0 - s) + s / n_classes if s else onehot
        w = None if self.weight is None else to_device(self.weight.data, xp).astype(dtype)
        if w is not None:
            target = target * w[None, :]
        target = target * valid.astype(dtype)[:, None]
        if on_device:  # an out-of-range label matches no class: its loss is NaN, never silently 0
            target = _nan_where_out_of_range(xp, target, safe, n_classes)
            safe = xp.clip(safe, 0, n_classes - 1)  # w[safe] in range (its sample's loss is NaN already)
        per = self.neg(self.reduce_sum(self.mul(self.log_softmax(x), Tensor._wrap(target)), 1))
        picked = valid.astype(dtype) if w is None else w[safe] * valid.astype(dtype)
        return per, picked.sum()

    def _probability_loss(self, x, y, shape, xp, dtype):
        if tuple(y.shape) != shape:
            raise ValueError(f"CrossEntropyLoss: probability labels of shape {tuple(y.shape)} must match the "
                             f"logits' shape {shape}")
        n_classes = x.shape[1]
        if len(shape) > 2:
            y = xp.moveaxis(y, 1, -1)
        target = y.reshape(-1, n_classes).astype(dtype)
        s = self.label_smoothing
        if s:
            target = target * (1.0 - s) + s / n_classes
        if self.weight is not None:
            target = target * to_device(self.weight.data, xp).astype(dtype)[None, :]
        per = self.neg(self.reduce_sum(self.mul(self.log_softmax(x), Tensor._wrap(target)), 1))
        return per, x.shape[0]

    def extend_repr(self):
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction}, "
                f"label_smoothing={self.label_smoothing}")


class NLLLoss(LossBase):
    """Negative log-likelihood of class indices under log-probabilities (``ops.NLLLoss``).

    Args:
        weight: optional per-class weights, shape (C,) (a constant, not learnt).
        ignore_index: targets equal to it contribute nothing (default -100).
        reduction: 'mean' (default: divides by the summed weights of the counted targets),
            'sum' or 'none'.

    Inputs:
        logits: log-probabilities (N, C), (C,) or (N, C, d1, ...), e.g. ``nn.LogSoftmax(axis=1)``'s.
        labels: integer class indices of the batch shape.

    The reduction is the primitive's, so the cell runs on blocks under tensor parallelism (batch cut).

    Example:
        >>> loss = nn.NLLLoss()
        >>> loss(nn.LogSoftmax()(logits), minidl.Tensor(np.array([1, 0], np.int32)))
    """

    def __init__(self, weight=None, ignore_index=-100, reduction="mean"):
        super().__init__(reduction)
        if weight is not None:
            weight = weight if isinstance(weight, Tensor) else Tensor(weight)
            if weight.ndim != 1:
                raise ValueError(f"NLLLoss: weight must be 1-D (one per class), got shape {weight.shape}")
        self.weight = weight  # a constant Tensor, not a Parameter: nothing learns it
        self.nll = ops.NLLLoss(reduction, ignore_index)
        self.ignore_index = ignore_index

    def construct(self, logits, labels):
        args = (logits, labels) if self.weight is None else (logits, labels, self.weight)
        return self.nll(*args)

    def extend_repr(self):
        return f"ignore_index={self.ignore_index}, reduction={self.reduction}"


class MSELoss(LossBase):
    """Mean squared error: reduce((logits - labels) ** 2).

    Args:
        reduction: 'mean' (default), 'sum' or 'none'.
    """

    def __init__(self, reduction="mean"):
        super().__init__(reduction)
        self.sub = ops.Sub()
        self.square = ops.Square()

    def construct(self, logits, labels):
        return self.get_loss(self.square(self.sub(logits, labels)))


class L1Loss(LossBase):
    """Mean absolute error: reduce(|logits - labels|).

    Args:
        reduction: 'mean' (default), 'sum' or 'none'.
    """

    def __init__(self, reduction="mean"):
        super().__init__(reduction)
        self.sub = ops.Sub()
        self.abs = ops.Abs()

    def construct(self, logits, labels):
        return self.get_loss(self.abs(self.sub(logits, labels)))
