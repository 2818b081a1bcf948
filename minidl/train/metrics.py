"""Evaluation metrics as MindSpore's: Accuracy, Loss, TopKCategoricalAccuracy.

A metric accumulates over batches: ``clear()``, then ``update(...)`` once per batch, then
``eval()``. Inputs may be Tensors or arrays (NumPy or CuPy); they are read on the host.
``Model(metrics=...)`` takes a set or list of names ({"accuracy", "loss"}) or a dict
name -> Metric, as MindSpore's ``Model`` does.

Every built-in metric keeps *sufficient statistics*, counts and sums that add up across
data-parallel ranks: ``statistics()`` returns them as a float64 vector and
``finish(statistics)`` computes the value from them (``eval()`` is
``finish(statistics())``). ``Model.eval`` on a dataset sharded over the ranks adds the
ranks' vectors once at the end and finishes from the sums, so every rank returns the whole
dataset's value, not its shard's. A custom metric joins in by defining both methods.

Example:
    >>> acc = Accuracy("classification")
    >>> acc.clear(); acc.update(logits, labels); acc.eval()
    0.75
"""
import numbers

import numpy

from .. import backend
from ..tensor import Tensor

__all__ = ["Metric", "Accuracy", "Loss", "TopKCategoricalAccuracy", "Top1CategoricalAccuracy",
           "Top5CategoricalAccuracy", "get_metric_fn", "get_metrics", "names", "has_statistics"]


def _host(who, name, x):
    """x as a NumPy array (Tensor, NumPy/CuPy array, list or number)."""
    if isinstance(x, Tensor):
        x = x.data
    if isinstance(x, (list, tuple, numbers.Number)) or hasattr(x, "__array_interface__") \
            or hasattr(x, "__cuda_array_interface__"):
        return numpy.asarray(backend.to_numpy(x))
    raise TypeError(f"{who}: {name} must be a Tensor, an array or a list, got {type(x).__name__}")


class Metric:
    """Base class: subclasses implement ``clear``, ``update(*inputs)`` and ``eval``.

    Calling a metric (``metric(*inputs)``) clears it, updates it once and evaluates it.
    """

    def __init__(self):
        self._indexes = None

    @property
    def indexes(self):
        """Which network outputs ``Model.eval`` passes to ``update`` (None: the defaults)."""
        return self._indexes

    def set_indexes(self, indexes):
        """Selects the outputs of the evaluation network to pass to ``update``, by position."""
        if not isinstance(indexes, (list, tuple)) or not all(isinstance(i, int) for i in indexes):
            raise ValueError(f"{type(self).__name__}.set_indexes: indexes must be a list of ints, got {indexes!r}")
        self._indexes = list(indexes)
        return self

    def clear(self):
        raise NotImplementedError(f"{type(self).__name__} must implement clear()")

    def update(self, *inputs):
        raise NotImplementedError(f"{type(self).__name__} must implement update(*inputs)")

    def eval(self):
        raise NotImplementedError(f"{type(self).__name__} must implement eval()")

    def __call__(self, *inputs):
        self.clear()
        self.update(*inputs)
        return self.eval()

    def statistics(self):
        """The sufficient statistics accumulated so far: a 1-d float64 array that adds up across ranks.

        Counts and sums qualify, a ratio does not: a sharded ``Model.eval`` sums every rank's
        array (``minidl.runtime.get_runtime().sum_over_ranks``) and calls :meth:`finish` on the
        sums. A metric without statistics can only be evaluated where every rank reads the
        whole dataset.
        """
        raise NotImplementedError(f"{type(self).__name__} does not define statistics() and finish(statistics)")

    def finish(self, statistics):
        """The metric's value from ``statistics``: this rank's (``eval()``) or summed over ranks."""
        raise NotImplementedError(f"{type(self).__name__} does not define statistics() and finish(statistics)")

    def _check_inputs(self, inputs, n):
        if len(inputs) != n:
            what = "(predictions, labels)" if n == 2 else "(loss,)"
            raise ValueError(f"{type(self).__name__}.update: needs {n} input(s) {what}, got {len(inputs)}")

    def _empty(self):
        return RuntimeError(f"{type(self).__name__}: cannot be calculated, because the number of samples is 0; "
                            f"call update() before eval()")


def has_statistics(metric):
    """Whether ``metric`` defines both ``statistics()`` and ``finish(statistics)`` (so ranks can add them up)."""
    cls = type(metric)
    return cls.statistics is not Metric.statistics and cls.finish is not Metric.finish


def _ratio(metric, statistics):
    """numerator / denominator of a (count, total) statistics pair; raises when total is 0."""
    hits, total = (float(v) for v in statistics)
    if total == 0:
        raise metric._empty()
    return hits / total


def _class_labels(who, y_pred, y):
    """(predictions (N, C), labels (N,) int) from labels given as indices or one-hot."""
    if y_pred.ndim != 2:
        raise ValueError(f"{who}: predictions must have shape (N, C), got {y_pred.shape}")
    if y.ndim == 2 and y.shape == y_pred.shape:
        y = y.argmax(axis=1)  # one-hot or probabilities
    if y.ndim != 1 or y.shape[0] != y_pred.shape[0]:
        raise ValueError(f"{who}: labels must have shape ({y_pred.shape[0]},) (class indices) or "
                         f"{y_pred.shape} (one-hot), got {y.shape}")
    if y.size and (y.min() < 0 or y.max() >= y_pred.shape[1]):
        raise ValueError(f"{who}: labels must be class indices in [0, {y_pred.shape[1]}), got values in "
                         f"[{y.min()}, {y.max()}]")
    return y_pred, y.astype(numpy.int64)


class Accuracy(Metric):
    """The fraction of correctly classified samples.

    Args:
        eval_type: "classification" (predictions (N, C) scores, labels (N,) indices or
            (N, C) one-hot; the prediction is the argmax) or "multilabel" (predictions and
            labels (N, C) of 0/1; a sample counts when all its labels match).
    """

    def __init__(self, eval_type="classification"):
        super().__init__()
        if eval_type not in ("classification", "multilabel"):
            raise ValueError(f"Accuracy: eval_type must be 'classification' or 'multilabel', got {eval_type!r}")
        self.eval_type = eval_type
        self.clear()

    def clear(self):
        self._correct_num = 0
        self._total_num = 0

    def update(self, *inputs):
        """Adds a batch: ``update(predictions, labels)``."""
        self._check_inputs(inputs, 2)
        y_pred = _host("Accuracy.update", "predictions", inputs[0])
        y = _host("Accuracy.update", "labels", inputs[1])
        if self.eval_type == "classification":
            y_pred, y = _class_labels("Accuracy.update", y_pred, y)
            correct = y_pred.argmax(axis=1) == y
        else:
            if y_pred.shape != y.shape or y_pred.ndim != 2:
                raise ValueError(f"Accuracy.update: multilabel predictions and labels must both have shape (N, C), "
                                 f"got {y_pred.shape} and {y.shape}")
            correct = (y_pred.round() == y).all(axis=1)
        self._correct_num += int(correct.sum())
        self._total_num += int(correct.shape[0])

    def statistics(self):
        """[correct samples, samples]."""
        return numpy.array([self._correct_num, self._total_num], dtype=numpy.float64)

    def finish(self, statistics):
        return _ratio(self, statistics)

    def eval(self):
        """The accuracy so far, a float in [0, 1]."""
        return self.finish(self.statistics())


class Loss(Metric):
    """The weighted mean of the losses given to ``update`` (each batch's loss is first averaged).

    Each update weighs ``rows`` (default 1, MindSpore's mean of the batch means).
    ``Model.eval`` passes every batch's number of rows, so its "loss" is the mean loss per
    sample: the same however the dataset is batched or sharded over ranks (the mean of the
    batch means would give a smaller last batch more weight than its rows have).
    """

    def __init__(self):
        super().__init__()
        self.clear()

    def clear(self):
        self._sum_loss = 0.0
        self._total_num = 0

    def update(self, *inputs, rows=None):
        """Adds a batch: ``update(loss)`` with loss a scalar or a 1-D array (averaged first).

        Args:
            rows: the weight of this batch, its number of samples (default 1).
        """
        self._check_inputs(inputs, 1)
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, numbers.Integral) or rows < 0):
            raise ValueError(f"Loss.update: rows must be None or an int >= 0, got {rows!r}")
        loss = _host("Loss.update", "loss", inputs[0])
        if loss.ndim > 1:
            raise ValueError(f"Loss.update: loss must be a scalar or 1-D, got shape {loss.shape}")
        weight = 1 if rows is None else int(rows)
        self._sum_loss += float(loss.mean()) * weight if loss.size else 0.0
        self._total_num += weight

    def statistics(self):
        """[sum of the batch losses times their rows, rows]."""
        return numpy.array([self._sum_loss, self._total_num], dtype=numpy.float64)

    def finish(self, statistics):
        return _ratio(self, statistics)

    def eval(self):
        """The average loss so far."""
        return self.finish(self.statistics())


class TopKCategoricalAccuracy(Metric):
    """The fraction of samples whose true class is among the k highest scores.

    Args:
        k: how many of the best-scored classes count (>= 1). Ties are broken towards the
            lower class index.
    """

    def __init__(self, k):
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{type(self).__name__}: k must be an int >= 1, got {k!r}")
        self.k = k
        self.clear()

    def clear(self):
        self._correct_num = 0
        self._samples_num = 0

    def update(self, *inputs):
        """Adds a batch: ``update(predictions (N, C), labels (N,) or one-hot (N, C))``."""
        who = f"{type(self).__name__}.update"
        self._check_inputs(inputs, 2)
        y_pred, y = _class_labels(who, _host(who, "predictions", inputs[0]), _host(who, "labels", inputs[1]))
        if self.k > y_pred.shape[1]:
            raise ValueError(f"{who}: k={self.k} is larger than the number of classes {y_pred.shape[1]}")
        top = numpy.argsort(-y_pred, axis=1, kind="stable")[:, :self.k]
        self._correct_num += int((top == y[:, None]).any(axis=1).sum())
        self._samples_num += int(y.shape[0])

    def statistics(self):
        """[samples whose class is in the top k, samples]."""
        return numpy.array([self._correct_num, self._samples_num], dtype=numpy.float64)

    def finish(self, statistics):
        return _ratio(self, statistics)

    def eval(self):
        """The top-k accuracy so far, a float in [0, 1]."""
        return self.finish(self.statistics())


class Top1CategoricalAccuracy(TopKCategoricalAccuracy):
    """TopKCategoricalAccuracy with k=1."""

    def __init__(self):
        super().__init__(1)


class Top5CategoricalAccuracy(TopKCategoricalAccuracy):
    """TopKCategoricalAccuracy with k=5."""

    def __init__(self):
        super().__init__(5)


_METRICS = {
    "accuracy": Accuracy,
    "acc": Accuracy,
    "loss": Loss,
    "top_1_accuracy": Top1CategoricalAccuracy,
    "top_5_accuracy": Top5CategoricalAccuracy,
}


def names():
    """The metric names ``get_metric_fn`` knows."""
    return sorted(_METRICS)


def get_metric_fn(name, *args, **kwargs):
    """A new metric by name ("accuracy", "acc", "loss", "top_1_accuracy", "top_5_accuracy")."""
    if name not in _METRICS:
        raise ValueError(f"get_metric_fn: unknown metric {name!r}; expected one of {names()}")
    return _METRICS[name](*args, **kwargs)


def get_metrics(metrics):
    """The dict name -> Metric for ``Model(metrics=...)``.

    Args:
        metrics: None, a set / list / tuple of names, or a dict name -> Metric instance.
    """
    if metrics is None:
        return {}
    if isinstance(metrics, dict):
        for name, m in metrics.items():
            if not isinstance(name, str):
                raise TypeError(f"Model: metric names must be str, got {name!r}")
            if not isinstance(m, Metric):
                raise TypeError(f"Model: metric {name!r} must be a Metric instance, got {type(m).__name__}")
        return dict(metrics)
    if isinstance(metrics, (set, frozenset, list, tuple)):
        out = {}
        for name in (sorted(metrics) if isinstance(metrics, (set, frozenset)) else metrics):
            if not isinstance(name, str):
                raise TypeError(f"Model: metrics given as a collection must be names (str), got {name!r}")
            out[name] = get_metric_fn(name)
        return out
    raise TypeError(f"Model: metrics must be a set/list of names or a dict name -> Metric, "
                    f"got {type(metrics).__name__}")
