"""Losses: the two softmax cross-entropy primitives and functional losses built on primitives.

``SoftmaxCrossEntropyWithLogits`` (dense labels) and ``SparseSoftmaxCrossEntropyWithLogits``
(class indices) are fused primitives: one stable log-softmax, and a backward of
``softmax - labels`` with no chain through exp/log. They differ from MindSpore's primitives
in what they return: MindSpore's dense op returns ``(loss, backprop)`` and its sparse op a
batch mean; here both return the per-sample loss of shape (N,) and the gradient comes from
autograd. The ``nn`` losses apply the reduction.

``NLLLoss`` (``nll_loss``) picks ``-log_probs[n, target[n]]`` from log-probabilities (the output
of LogSoftmax), with class weights, an ignored index and label smoothing, and applies its
reduction itself, as MindSpore's primitive does (which also returns the total weight; here the
loss only).

``cross_entropy`` and ``mse_loss`` are compositions of primitives (log-softmax, Mul,
ReduceSum, ...), so their gradients come for free.
"""
import os

import numpy

from ..backend import get_array_module
from ..tensor import Tensor
from .activation import LogSoftmax
from .math import Mul, Neg, RealDiv, Square, Sub
from .primitive import Primitive
from .reduce import ReduceMean, ReduceSum
from .selection import Select

_REDUCTIONS = ("mean", "sum", "none")


def _log_softmax_rows(x):
    """Stable log-softmax along axis 1 of an (N, C) array."""
    xp = get_array_module(x)
    y = x - x.max(axis=1, keepdims=True)
    y -= xp.log(xp.exp(y).sum(axis=1, keepdims=True))
    return y


def _check_logits(op, logits):
    if getattr(logits, "ndim", None) != 2:
        raise ValueError(f"{op}: logits must be 2-D (N, C), got shape {tuple(getattr(logits, 'shape', ()))}")
    if not numpy.issubdtype(logits.dtype, numpy.floating):
        raise TypeError(f"{op}: logits must be a float tensor, got dtype {logits.dtype}")


class SoftmaxCrossEntropyWithLogits(Primitive):
    """Per-sample ``-sum(labels * log_softmax(logits), axis=1)`` for dense labels.

    Inputs:
        logits: (N, C) floats.
        labels: (N, C) probabilities or one-hot rows, same dtype family as logits.

    Returns the loss of shape (N,) (MindSpore's primitive also returns the backprop; here
    autograd differentiates it, with respect to labels too when they require a gradient).

    Example:
        >>> ops.SoftmaxCrossEntropyWithLogits()(logits, onehot)      # shape (N,)
    """

    n_inputs = 2

    def forward(self, logits, labels):
        _check_logits(self.name, logits)
        if tuple(getattr(labels, "shape", ())) != tuple(logits.shape):
            raise ValueError(f"{self.name}: labels of shape {tuple(getattr(labels, 'shape', ()))} must match "
                             f"logits of shape {tuple(logits.shape)}")
        if not numpy.issubdtype(labels.dtype, numpy.floating):
            raise TypeError(f"{self.name}: labels must be float probabilities, got dtype {labels.dtype}; "
                            f"use SparseSoftmaxCrossEntropyWithLogits for class indices")
        self.log_p = _log_softmax_rows(logits)
        self.labels = labels
        return -(labels * self.log_p).sum(axis=1).astype(logits.dtype, copy=False)

    def backward(self, gy):
        xp = get_array_module(gy)
        g = gy[:, None]
        glogits = glabels = None
        if self.needs_grad[0]:
            # NOTE: d/dx of -sum(t * log p) is p * sum(t) - t; it is MindSpore's softmax - labels
            # when rows of labels sum to 1, and stays exact when they do not.
            glogits = xp.exp(self.log_p)
            glogits *= self.labels.sum(axis=1, keepdims=True)
            glogits -= self.labels
            glogits *= g
            glogits = glogits.astype(self.log_p.dtype, copy=False)
        if self.needs_grad[1]:
            glabels = (-self.log_p * g).astype(self.labels.dtype, copy=False)
        return glogits, glabels


class SparseSoftmaxCrossEntropyWithLogits(Primitive):
    """Per-sample ``-log_softmax(logits)[n, labels[n]]`` for integer class labels.

    Inputs:
        logits: (N, C) floats.
        labels: (N,) integers in [0, C).

    Returns the loss of shape (N,); MindSpore's primitive returns the batch mean instead,
    and ``nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction=...)`` applies the
    reduction here. Labels get no gradient.

    Example:
        >>> ops.SparseSoftmaxCrossEntropyWithLogits()(logits, minidl.Tensor([1, 0]))
    """

    n_inputs = 2

    def forward(self, logits, labels):
        _check_logits(self.name, logits)
        labels = _check_index_labels(self.name, labels, (logits.shape[0],), logits.shape[1], logits.shape)
        xp = get_array_module(logits, labels)
        self.log_p = _log_softmax_rows(logits)
        self.rows = xp.arange(logits.shape[0])
        self.device_labels = xp is not numpy
        if self.device_labels:  # unchecked: gather in range (CuPy wraps), NaN where out of range
            self.n_classes = logits.shape[1]
            self.raw_labels, labels = labels, xp.clip(labels, 0, logits.shape[1] - 1)
        self.labels = labels
        loss = -self.log_p[self.rows, labels]
        if self.device_labels:
            loss = _nan_where_out_of_range(xp, loss, self.raw_labels, self.n_classes)
        return loss

    def backward(self, gy):
        xp = get_array_module(gy)
        gx = xp.exp(self.log_p)
        gx[self.rows, self.labels] -= 1
        gx *= gy[:, None]
        if self.device_labels:
            gx = _nan_where_out_of_range(xp, gx, self.raw_labels, self.n_classes)
        return gx, None


def host_label_checks():
    """Whether device labels are range-checked on the host ($MINIDL_CHECK_LABELS=1, read at each
    call). Off by default: the check reads a device value back, a host synchronisation every
    step; instead a label out of range makes its sample's loss NaN on the device
    (``_nan_where_out_of_range``), which the loss shows (LossMonitor stops on it)."""
    return os.environ.get("MINIDL_CHECK_LABELS", "") not in ("", "0")


def _nan_where_out_of_range(xp, values, labels, n_classes, ignore_index=None):
    """values with NaN at the samples whose label is outside [0, n_classes) (device labels)."""
    bad = (labels < 0) | (labels >= n_classes)
    if ignore_index is not None:
        bad &= labels != ignore_index
    # a Python NaN: a weak scalar keeps values' dtype, and costs no upload
    return xp.where(bad.reshape(bad.shape + (1,) * (values.ndim - bad.ndim)), float("nan"), values)


def _check_index_labels(op, labels, batch_shape, n_classes, logits_shape, ignore_index=None):
    """Validates integer labels; returns them as an array. ignore_index values pass unchecked.

    The range is checked here for host labels, and for device labels only with
    ``host_label_checks()`` (see there)."""
    shape = tuple(getattr(labels, "shape", ()))
    dtype = getattr(labels, "dtype", None)
    if dtype is None or getattr(dtype, "kind", None) not in ("i", "u"):  # (numpy.issubdtype(dtype, integer), cheaper)
        # float labels of the logits' shape: one-hot (or probabilities), which this op does not take
        onehot = (f"; labels of the logits' shape look one-hot (or class probabilities): pass integer class "
                  f"indices of shape {tuple(batch_shape)} (e.g. labels.argmax(axis=1))"
                  if getattr(dtype, "kind", None) == "f" and shape == tuple(logits_shape) else "")
        raise TypeError(f"{op}: labels must be integer class indices, got "
                        f"{'dtype ' + str(dtype) if dtype is not None else type(labels).__name__}{onehot}")
    if shape != tuple(batch_shape):
        raise ValueError(f"{op}: labels of shape {shape} do not match logits of shape {tuple(logits_shape)}: "
                         f"expected labels of shape {tuple(batch_shape)}")
    if labels.size and (isinstance(labels, numpy.ndarray) or host_label_checks()):
        if ignore_index is None and isinstance(labels, numpy.ndarray) and labels.min() >= 0 and labels.max() < n_classes:
            return labels  # all in range: two reductions, where finding the first bad label takes four passes
        bad = (labels < 0) | (labels >= n_classes)
        if ignore_index is not None:
            bad &= labels != ignore_index
        if bool(bad.any()):
            first = int(labels[bad].reshape(-1)[0])
            raise ValueError(f"{op}: label {first} is out of range for {n_classes} classes "
                             f"(expected 0 <= label < {n_classes})")
    return labels


def softmax_cross_entropy(logits, labels):
    """Per-sample cross entropy of (N, C) logits against dense (N, C) labels; shape (N,)."""
    return SoftmaxCrossEntropyWithLogits()(logits, labels)


def sparse_softmax_cross_entropy(logits, labels):
    """Per-sample cross entropy of (N, C) logits against (N,) class indices; shape (N,)."""
    return SparseSoftmaxCrossEntropyWithLogits()(logits, labels)


def _check_reduction(op, reduction):
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")


def _reduce(per, reduction, denominator, xp, dtype):
    """Applies 'none' / 'sum' / 'mean' (the mean divides by ``denominator``)."""
    if reduction == "none":
        return per
    total = ReduceSum()(per, ())
    if reduction == "sum":
        return total
    return RealDiv()(total, xp.asarray(denominator, dtype=dtype))


def _raw(a):
    return a.data if isinstance(a, Tensor) else a


def cross_entropy(input, target, weight=None, ignore_index=-100, reduction="mean",  # noqa: A002
                  label_smoothing=0.0):
    """Cross entropy of logits against class indices or class probabilities (PyTorch semantics).

    Args:
        input: logits of shape (C,), (N, C) or (N, C, d1, ...); the class axis is 1 (0 for 1-D).
        target: integer class indices of shape (), (N,) or (N, d1, ...), or float probabilities
            of the input's shape.
        weight: optional per-class weights, shape (C,) (a constant: it gets no gradient).
        ignore_index: index targets equal to it contribute nothing (index targets only).
        reduction: 'mean', 'sum' or 'none'. The mean divides by the summed weights of the
            counted samples for index targets, by the number of samples for probabilities.
        label_smoothing: s in [0, 1]; the target becomes (1 - s) * target + s / C.

    Example:
        >>> ops.cross_entropy(logits, minidl.Tensor(np.array([1, 0], np.int32)))   # a scalar
    """
    op = "cross_entropy"
    _check_reduction(op, reduction)
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) \
            or not 0 <= label_smoothing <= 1:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    x, t = _raw(input), _raw(target)
    xp = get_array_module(x, t)
    if getattr(x, "ndim", 0) == 0:
        raise ValueError(f"{op}: input must have a class dimension, got shape {tuple(getattr(x, 'shape', ()))}")
    if not numpy.issubdtype(x.dtype, numpy.floating):
        raise TypeError(f"{op}: input must be float logits, got dtype {x.dtype}")
    t = xp.asarray(t)
    dtype, shape = x.dtype, tuple(x.shape)
    axis = 0 if x.ndim == 1 else 1
    n_classes = shape[axis]
    at_class_axis = (1,) * axis + (n_classes,) + (1,) * (x.ndim - axis - 1)  # broadcasts a (C,) vector
    w = None
    if weight is not None:
        w = xp.asarray(_raw(weight)).astype(dtype, copy=False)
        if w.shape != (n_classes,):
            raise ValueError(f"{op}: weight of shape {tuple(w.shape)} must be ({n_classes},), one per class "
                             f"of input of shape {shape}")
    s = float(label_smoothing)

    if numpy.issubdtype(t.dtype, numpy.floating):
        if tuple(t.shape) != shape:
            raise ValueError(f"{op}: probability target of shape {tuple(t.shape)} must match input of shape {shape}")
        target_p = t.astype(dtype, copy=False)
        if s:
            target_p = target_p * (1.0 - s) + s / n_classes
        if w is not None:
            target_p = target_p * w.reshape(at_class_axis)
        per = Neg()(ReduceSum()(Mul()(LogSoftmax(axis)(input), target_p), axis))
        return _reduce(per, reduction, x.size // max(n_classes, 1), xp, dtype)

    batch_shape = shape[:axis] + shape[axis + 1:]
    t = _check_index_labels(op, t, batch_shape, n_classes, shape, ignore_index)
    valid = t != ignore_index
    safe = xp.where(valid, t, 0)
    if x.ndim == 2 and w is None and not s:
        # The common case (N, C) with plain labels: the fused primitive, no (N, C) target.
        per = SparseSoftmaxCrossEntropyWithLogits()(input, safe)
        if xp is not numpy or not bool(valid.all()):  # on the GPU masking costs less than asking
            per = Select()(valid, per, 0.0)  # an ignored row's loss may be inf (a -inf logit): never 0 * inf
        return _reduce(per, reduction, valid.sum(), xp, dtype)
    # Weighted or smoothed or N-d: loss = -sum_c T[c] * log p[c] with a constant target T.
    classes = xp.arange(n_classes).reshape(at_class_axis)
    target_p = (xp.expand_dims(safe, axis) == classes).astype(dtype)
    if s:
        target_p = target_p * (1.0 - s) + s / n_classes
    if w is not None:
        target_p = target_p * w.reshape(at_class_axis)
    target_p = target_p * xp.expand_dims(valid, axis).astype(dtype)
    if xp is not numpy:  # an out-of-range label matches no class: make its loss NaN, never silently 0
        target_p = _nan_where_out_of_range(xp, target_p, xp.expand_dims(t, axis), n_classes, ignore_index)
    # a class of target weight 0 adds 0, also where its log-probability is -inf (a masked logit)
    log_p = Select()(target_p != 0, LogSoftmax(axis)(input), 0.0)
    per = Neg()(ReduceSum()(Mul()(log_p, target_p), axis))
    denominator = valid.sum() if w is None else (w[safe] * valid).sum()
    return _reduce(per, reduction, denominator, xp, dtype)


class NLLLoss(Primitive):
    """Negative log-likelihood of class-index targets under log-probabilities, reduced.

    ``loss[n] = -weight[t] * inputs[n, t]`` with ``t = target[n]`` (0 where t == ignore_index);
    with label smoothing s, ``(1 - s) * loss[n] + s / C * -sum_c(weight[c] * inputs[n, c])``.

    Args:
        reduction: 'mean' (default; divides the sum by the summed weights of the counted
            targets, as MindSpore and PyTorch do: NaN when every target is ignored), 'sum' or 'none'.
        ignore_index: targets equal to it count nothing (default -100).
        label_smoothing: s in [0, 1] (MindSpore's ``ops.nll_loss`` has it; its primitive does not).

    Inputs:
        inputs: log-probabilities (C,), (N, C) or (N, C, d1, ...); the class axis is 1 (0 for 1-D).
        target: integers of the batch shape: (), (N,) or (N, d1, ...).
        weight: optional per-class weights (C,), a constant (no gradient).

    Returns the loss: a scalar, or of the batch shape for 'none'. A target out of range raises on
    the host; on the GPU its loss is NaN (see ``host_label_checks``).

    Example:
        >>> ops.NLLLoss()(ops.log_softmax(logits), minidl.Tensor(np.array([1, 0])))
    """

    n_inputs = (2, 3)

    def __init__(self, reduction="mean", ignore_index=-100, label_smoothing=0.0):
        super().__init__()
        _check_reduction(self.name, reduction)
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"{self.name}: ignore_index must be an int, got {ignore_index!r}")
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
            raise TypeError(f"{self.name}: label_smoothing must be a float, got {label_smoothing!r}")
        if not 0 <= label_smoothing <= 1:
            raise ValueError(f"{self.name}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
        self.reduction, self.ignore_index, self.label_smoothing = reduction, ignore_index, float(label_smoothing)

    def forward(self, x, target, weight=None):
        op = self.name
        if getattr(x, "ndim", 0) == 0:
            raise ValueError(f"{op}: inputs must have a class dimension, got shape {tuple(getattr(x, 'shape', ()))}")
        if not numpy.issubdtype(x.dtype, numpy.floating):
            raise TypeError(f"{op}: inputs must be float log-probabilities, got dtype {x.dtype}")
        xp = get_array_module(x, target)
        self.axis = axis = 0 if x.ndim == 1 else 1
        n_classes, dtype = x.shape[axis], x.dtype
        batch_shape = x.shape[:axis] + x.shape[axis + 1:]
        target = _check_index_labels(op, target, batch_shape, n_classes, x.shape, self.ignore_index)
        if weight is not None and tuple(getattr(weight, "shape", ())) != (n_classes,):
            raise ValueError(f"{op}: weight of shape {tuple(getattr(weight, 'shape', ()))} must be ({n_classes},), one "
                             f"per class of inputs of shape {tuple(x.shape)}")
        valid = target != self.ignore_index
        # the picked class per sample: 0 where ignored (its weight is 0); in range on the device,
        # where an out-of-range target is not checked (its loss becomes NaN below)
        safe = xp.clip(xp.where(valid, target, 0), 0, n_classes - 1)
        self.picked = xp.expand_dims(safe, axis)
        w = valid.astype(dtype) if weight is None else weight.astype(dtype, copy=False)[safe] * valid
        self.w_picked = w
        # an ignored target counts nothing, also where its log-probabilities hold -inf (never 0 * -inf)
        x = xp.where(xp.expand_dims(valid, axis), x, 0)
        per = -(w * xp.take_along_axis(x, self.picked, axis).reshape(batch_shape))
        s = self.label_smoothing
        if s:
            self.smooth_w = self._class_vector(xp, weight, n_classes, dtype, x.ndim) * xp.expand_dims(valid, axis)
            per = (1 - s) * per - s / n_classes * (x * self.smooth_w).sum(axis=axis)
        self.bad = None
        if xp is not numpy:
            self.bad = ((target < 0) | (target >= n_classes)) & valid
            per = xp.where(self.bad, float("nan"), per)
        self.x_shape, self.n_classes = tuple(x.shape), n_classes
        if self.reduction == "none":
            return per.astype(dtype, copy=False)
        total = per.sum()
        if self.reduction == "mean":
            self.denominator = w.sum()
            total = total / self.denominator
        return xp.asarray(total, dtype=dtype)

    @staticmethod
    def _class_vector(xp, weight, n_classes, dtype, ndim):
        """The class weights (ones when None) shaped to broadcast along class axis 1 (0 for 1-D)."""
        w = xp.ones(n_classes, dtype) if weight is None else weight.astype(dtype, copy=False)
        return w.reshape((n_classes,) + (1,) * (ndim - 2)) if ndim > 1 else w

    def backward(self, gy):
        xp, axis = get_array_module(gy), self.axis
        g = gy / self.denominator if self.reduction == "mean" else gy  # a scalar unless 'none'
        s = self.label_smoothing
        gx = xp.zeros(self.x_shape, gy.dtype)
        picked = -(1 - s) * self.w_picked * g
        xp.put_along_axis(gx, self.picked, xp.expand_dims(picked.astype(gy.dtype, copy=False), axis), axis)
        if s:
            gx -= (s / self.n_classes) * self.smooth_w * (xp.expand_dims(g, axis) if self.reduction == "none" else g)
        if self.bad is not None:
            gx = xp.where(xp.expand_dims(self.bad, axis), float("nan"), gx)
        return gx, None, None


def nll_loss(inputs, target, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0):
    """Negative log-likelihood of target under log-probabilities inputs (see NLLLoss).

    Example:
        >>> ops.nll_loss(ops.log_softmax(logits), labels)            # == ops.cross_entropy(logits, labels)
    """
    args = (inputs, target) if weight is None else (inputs, target, weight)
    return NLLLoss(reduction, ignore_index, label_smoothing)(*args)


def mse_loss(input, target, reduction="mean"):  # noqa: A002
    """Mean squared error ``(input - target) ** 2``, reduced ('mean', 'sum' or 'none'); broadcasts.

    Example:
        >>> ops.mse_loss(pred, y)          # a scalar
    """
    _check_reduction("mse_loss", reduction)
    sq = Square()(Sub()(input, target))
    if reduction == "none":
        return sq
    return (ReduceMean() if reduction == "mean" else ReduceSum())(sq, ())


__all__ = ['SoftmaxCrossEntropyWithLogits', 'SparseSoftmaxCrossEntropyWithLogits', 'NLLLoss',
           'softmax_cross_entropy', 'sparse_softmax_cross_entropy', 'cross_entropy', 'nll_loss', 'mse_loss']
