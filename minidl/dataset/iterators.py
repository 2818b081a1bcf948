"""The iterators a dataset hands out: one epoch (``EpochIterator``), or a sequence of epochs
(``DatasetIterator``, what ``create_tuple_iterator`` / ``create_dict_iterator`` return).
Rows are loaded by a bounded background thread (prefetch.py) and become Tensors here.
"""
import numbers

import numpy

from ..tensor import Tensor
from .prefetch import Prefetcher

__all__ = ["EpochIterator", "DatasetIterator", "drop_padding"]


def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def drop_padding(row, valid):
    """The real rows of an item of ``epoch_iterator(..., with_validity=True)``, and how many there are.

    Args:
        row: the item's columns (NumPy arrays).
        valid: its validity: a bool for an unbatched row, a bool array (one entry per row
            along axis 0) for a batch.

    Returns:
        ``(columns, count)``: the columns restricted to the real rows (the same arrays when
        all are real) and their number; an unbatched row counts 1, or 0 when it is a repeat.

    Example:
        >>> drop_padding((numpy.array([1, 3, 0]),), numpy.array([True, True, False]))
        ((array([1, 3]),), 2)
    """
    mask = numpy.asarray(valid, dtype=bool)
    if mask.ndim == 0:
        return tuple(row), int(mask)
    if mask.all():
        return tuple(row), mask.size
    out = []
    for j, col in enumerate(row):
        col = numpy.asarray(col)
        if col.shape[:mask.ndim] != mask.shape:
            raise ValueError(f"drop_padding: column {j} has shape {col.shape}, but the batch's validity has shape "
                             f"{mask.shape}; a map after batch must keep one row per batch entry along axis 0")
        out.append(col[mask])
    return tuple(out), int(mask.sum())


class EpochIterator:
    """One epoch's rows, loaded by a Prefetcher, converted to Tensors (or left as NumPy).

    With ``with_validity`` it yields ``(row, valid)`` pairs (see ``Dataset.epoch_iterator``).
    """

    def __init__(self, dataset, epoch, skip, output_numpy, columns=None, names=None, with_validity=False):
        self._rows = Prefetcher(dataset._produce(epoch, skip, with_validity),
                                name=f"minidl-prefetch-{type(dataset).__name__}")
        self._output_numpy = output_numpy
        self._columns = columns
        self._names = names
        self._with_validity = with_validity

    def __iter__(self):
        return self

    def __next__(self):
        if self._with_validity:
            row, valid = next(self._rows)
            return self._finish(row), valid
        return self._finish(next(self._rows))

    def _finish(self, row):
        if self._columns is not None:
            row = tuple(row[i] for i in self._columns)
        if not self._output_numpy:
            # Tensors are made here, in the consumer thread, which owns the current GPU device.
            row = tuple(Tensor(a) for a in row)
        return dict(zip(self._names, row)) if self._names is not None else tuple(row)

    def close(self):
        """Stops loading (the prefetch thread exits)."""
        self._rows.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class DatasetIterator:
    """What ``create_tuple_iterator``/``create_dict_iterator`` return: each pass is one epoch.

    The epoch numbers come from the dataset's counter, which every pass over any of its
    iterators (and every plain ``for row in dataset``) advances, so each pass reshuffles.
    """

    def __init__(self, dataset, num_epochs=-1, output_numpy=False, as_dict=False, columns=None):
        if not _is_int(num_epochs) or not (num_epochs == -1 or num_epochs >= 1):
            raise ValueError(f"create_iterator: num_epochs must be -1 (any number) or an int >= 1, got {num_epochs!r}")
        self._dataset = dataset
        self._num_epochs = num_epochs
        self._output_numpy = output_numpy
        self._names = dataset.get_col_names() if as_dict else None
        self._columns = columns
        self._started = 0
        self._current = None
        self._closed = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._current is None:
            if self._closed or self._started == self._num_epochs:
                raise StopIteration
            self._started += 1
            self._current = EpochIterator(self._dataset, self._dataset._claim_epoch(), 0, self._output_numpy,
                                           self._columns, self._names)
        try:
            return next(self._current)
        except BaseException:
            self._current.close()
            self._current = None
            raise

    def stop(self):
        """Stops loading; later passes yield nothing (MindSpore's ``Iterator.stop``)."""
        self._closed = True
        if self._current is not None:
            self._current.close()
            self._current = None

    close = stop

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False
