"""Dataset sources: NumpySlicesDataset (arrays, in memory or memory-mapped) and GeneratorDataset.

A random-access source (arrays, or an object with ``__getitem__`` and ``__len__``) reads each
epoch in the order :func:`sharding.shard_indices` gives: shuffled from (seed, epoch), split
across shards, padded or exact. A pure iterable can only be read front to back, so it is
sharded by position (every num_shards-th row, with the same padding) and shuffled only
through ``.shuffle(buffer_size)``. Either way the rows that "pad" mode repeats are marked
(their thunks' ``valid`` is False; see engine.py).

A source is sharded only when given num_shards and shard_id; otherwise it reads every row,
also under data parallelism (shard explicitly: ``num_shards=get_group_size(),
shard_id=get_rank()``).
"""
import numbers

import numpy

from ..backend import get_seed
from .engine import Dataset, Take, Thunk
from .sharding import (check_num_samples, check_shard_mode, real_count, resolve_shards, shard_indices, shard_size,
                       shard_stream)

__all__ = ["SourceDataset", "NumpySlicesDataset", "GeneratorDataset"]


def _seed(seed, who):
    if seed is None:
        return get_seed() or 0
    if not isinstance(seed, numbers.Integral) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"{who}: seed must be None or an int >= 0, got {seed!r}")
    return int(seed)


class SourceDataset(Dataset):
    """The base of the sources: column names, seed, shard, shuffle and num_samples.

    A subclass calls ``_setup`` from its ``__init__`` and implements ``_thunks(epoch)`` and
    ``get_dataset_size()``; a random-access one just sets ``self._n`` and implements
    ``_row(i)`` (and, when it can read many rows at once, ``_gather(indices)``).
    """

    def _setup(self, who, column_names, shuffle, num_shards, shard_id, num_samples, shard_mode, seed):
        Dataset.__init__(self)
        self._col_names = list(column_names)
        self._shuffle = bool(shuffle)
        self._shards = resolve_shards(num_shards, shard_id, who)
        self._num_samples = check_num_samples(num_samples, who)
        self._shard_mode = check_shard_mode(shard_mode, who)
        self._seed = _seed(seed, who)

    @property
    def shard_mode(self):
        """How the shards split the rows: "pad" or "exact" (see sharding.py)."""
        return self._shard_mode

    def get_col_names(self):
        return list(self._col_names)

    # random-access sources

    def _indices(self, epoch):
        """The sample indices this shard reads in ``epoch``, in order."""
        return shard_indices(self._n, *self._shards, shuffle=self._shuffle, seed=self._seed, epoch=epoch,
                             mode=self._shard_mode, num_samples=self._num_samples)

    def get_dataset_size(self):
        return shard_size(self._n, *self._shards, mode=self._shard_mode, num_samples=self._num_samples)

    def _thunks(self, epoch):
        real = real_count(self._n, *self._shards)  # the shard's rows from this position on repeat others
        for pos, i in enumerate(self._indices(epoch).tolist()):
            yield Take(self, i, pos < real)


def _column_names(column_names, count, who):
    """The names checked: a name or a list of distinct names, ``count`` of them (any number where
    count is None); None gives "column_0", "column_1", ..."""
    if column_names is None:
        return [f"column_{i}" for i in range(count)]
    names = [column_names] if isinstance(column_names, str) else column_names
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{who}: column_names must be a name or a list of names, got {column_names!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{who}: column_names has repeated names: {list(names)}")
    if count is not None and len(names) != count:
        raise ValueError(f"{who}: column_names has {len(names)} name(s) {list(names)} but the data has {count} "
                         f"column(s)")
    return list(names)


class NumpySlicesDataset(SourceDataset):
    """Rows from arrays sliced along their first axis (MindSpore's ``NumpySlicesDataset``).

    Args:
        data: a dict {name: array}, a tuple of arrays (one column each), a list (one column,
            as in MindSpore, unless column_names names several: then one column per
            element), or one array. Arrays stay as given (a ``numpy.memmap`` is read lazily).
            A list of arrays of different shapes raises: for columns ``x`` and ``y`` pass the
            tuple ``(x, y)``, not ``[x, y]``.
        column_names: the names (default: the dict's keys, else "column_0", "column_1", ...);
            for a dict, the keys in the order wanted.
        num_samples: at most this many rows per shard and epoch.
        num_parallel_workers: accepted for MindSpore compatibility and ignored.
        shuffle: reshuffle every epoch from (seed, epoch) (default True).
        num_shards, shard_id: read shard ``shard_id`` of ``num_shards`` (see sharding.py);
            give both or neither. Default: no sharding, every row (also under data
            parallelism: pass ``num_shards=get_group_size(), shard_id=get_rank()``).
        shard_mode: "pad" (equal shard lengths, wrapping around) or "exact" (for evaluation).
        seed: the seed of the shuffle and of random transforms (default: minidl.get_seed()
            when the dataset is made, or 0).

    Example:
        >>> ds = NumpySlicesDataset({"x": numpy.arange(6), "y": numpy.arange(6) % 2}, shuffle=False,
        ...                         num_shards=2, shard_id=1)
        >>> [int(x) for x, y in ds.create_tuple_iterator(output_numpy=True)]
        [1, 3, 5]
    """

    def __init__(self, data, column_names=None, num_samples=None, num_parallel_workers=None, shuffle=None,
                 num_shards=None, shard_id=None, shard_mode="pad", seed=None):
        who = type(self).__name__
        if isinstance(data, dict):
            keys = [k for k in data]
            if column_names is not None:
                names = [column_names] if isinstance(column_names, str) else list(column_names)
                if sorted(map(str, names)) != sorted(map(str, keys)):
                    raise ValueError(f"{who}: column_names {names} must be the keys of data {keys} (in any order)")
                keys = names
            names, columns = [str(k) for k in keys], [data[k] for k in keys]
        else:
            if isinstance(data, tuple):
                columns = list(data)
            elif isinstance(data, list) and isinstance(column_names, (list, tuple)) and len(column_names) > 1:
                columns = list(data)
            else:
                columns = [data]
                if isinstance(data, list):
                    self._check_list_column(data, who)
            names = _column_names(column_names, len(columns), who)
        self._columns = [self._as_column(c, name, who) for c, name in zip(columns, names)]
        lengths = {name: len(c) for name, c in zip(names, self._columns)}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"{who}: columns must have the same length (first axis), got {lengths}")
        if not self._columns:
            raise ValueError(f"{who}: data has no columns")
        self._n = len(self._columns[0])
        self._setup(who, names, True if shuffle is None else shuffle, num_shards, shard_id, num_samples,
                    shard_mode, seed)

    @staticmethod
    def _check_list_column(data, who):
        """A list is one column whose elements are its rows; arrays of different shapes in it are
        almost always columns meant as a tuple ``[x, y]``, which NumPy would only call
        inhomogeneous (MindSpore yields them as rows of different shapes)."""
        shapes = list(dict.fromkeys(tuple(e.shape) for e in data if hasattr(e, "shape")))
        if len(shapes) > 1:
            shown = ", ".join(map(str, shapes[:3])) + (", ..." if len(shapes) > 3 else "")
            raise ValueError(f"{who}: data is a list holding arrays of different shapes ({shown}); a list is one "
                             f"column whose elements are its rows (as in MindSpore), so they must have one shape. For "
                             f"one column per array pass a tuple, NumpySlicesDataset((x, y), column_names=['data', "
                             f"'label']), or a dict {{'data': x, 'label': y}}")

    @staticmethod
    def _as_column(c, name, who):
        if isinstance(c, numpy.ndarray):  # numpy.memmap included: keep it lazy
            array = c
        else:
            try:
                array = numpy.asarray(c)
            except ValueError as exc:
                raise ValueError(f"{who}: column {name!r} cannot be made one array ({exc}); its rows must have one "
                                 f"shape") from None
        if array.ndim == 0:
            raise ValueError(f"{who}: column {name!r} is a scalar; columns are sliced along their first axis, so "
                             f"each needs at least one dimension")
        return array

    def _row(self, i):
        return tuple(numpy.array(c[i]) for c in self._columns)  # a copy, never a view of the user's data

    def _gather(self, indices):
        return tuple(numpy.asarray(c[indices]) for c in self._columns)


class GeneratorDataset(SourceDataset):
    """Rows from Python code (MindSpore's ``GeneratorDataset``).

    Args:
        source: one of
            - a random-access object (``__getitem__(i)`` and ``__len__``): ``source[i]`` is row i;
              shuffling and sharding work by index;
            - a callable returning an iterable (a generator function): called once per epoch;
            - an iterable: iterated once per epoch (a one-shot iterator, such as a generator
              object, allows one epoch only).
            A row is a tuple (or list) with one value per column, or one value for one column.
        column_names: a name or list of names (required).
        shuffle: reshuffle every epoch (random-access sources only; default True for them,
            False for iterables, which shuffle with ``.shuffle(buffer_size)`` instead).
        num_shards, shard_id, shard_mode, num_samples, seed: as in :class:`NumpySlicesDataset`;
            an iterable is sharded by position, every num_shards-th row.
        num_parallel_workers, python_multiprocessing: accepted for MindSpore compatibility
            and ignored.

    Example:
        >>> def rows():
        ...     for i in range(3):
        ...         yield numpy.array([i, i]), numpy.int32(i % 2)
        >>> ds = GeneratorDataset(rows, column_names=["data", "label"])
        >>> [int(label) for _, label in ds.create_tuple_iterator(output_numpy=True)]
        [0, 1, 0]
    """

    def __init__(self, source, column_names=None, shuffle=None, num_shards=None, shard_id=None, num_samples=None,
                 num_parallel_workers=None, python_multiprocessing=False, shard_mode="pad", seed=None):
        who = "GeneratorDataset"
        if column_names is None:
            raise ValueError(f"{who}: column_names is required, e.g. column_names=['data', 'label']")
        names = _column_names(column_names, None, who)
        if not names:
            raise ValueError(f"{who}: column_names must name at least one column")
        self._source = source
        self._random_access = hasattr(source, "__getitem__") and hasattr(source, "__len__")
        self._factory = not self._random_access and callable(source)
        if not (self._random_access or self._factory or hasattr(source, "__iter__")):
            raise TypeError(f"{who}: source must be random-access (__getitem__ and __len__), a callable returning "
                            f"an iterable, or an iterable; got {type(source).__name__}")
        self._one_shot = not (self._random_access or self._factory) and iter(source) is source
        self._used = False
        self._count = None
        if shuffle is None:
            shuffle = self._random_access
        elif shuffle and not self._random_access:
            raise ValueError(f"{who}: shuffle=True needs a random-access source (with __getitem__ and __len__); "
                             f"this {type(source).__name__} can only be read in order: use shuffle=False and "
                             f"shuffle with .shuffle(buffer_size)")
        if self._random_access:
            self._n = len(source)
        self._setup(who, names, shuffle, num_shards, shard_id, num_samples, shard_mode, seed)

    def _as_row(self, value):
        values = tuple(value) if isinstance(value, (tuple, list)) else (value,)
        if len(values) != len(self._col_names):
            raise ValueError(f"GeneratorDataset: the source gave a row of {len(values)} value(s) but column_names "
                             f"has {len(self._col_names)}: {self._col_names}")
        return tuple(numpy.asarray(v) for v in values)

    def _row(self, i):
        return self._as_row(self._source[i])

    def _open(self):
        """A fresh iterator over the source's rows (for the non-random-access kinds)."""
        if self._factory:
            rows = self._source()
            if not hasattr(rows, "__iter__"):
                raise TypeError(f"GeneratorDataset: source() must return an iterable, got {type(rows).__name__}")
            return iter(rows)
        if self._one_shot:
            if self._used:
                raise ValueError("GeneratorDataset: the source is a one-shot iterator (e.g. a generator object) "
                                 "that was already read; for more than one epoch pass a callable that returns a "
                                 "fresh iterable (e.g. the generator function itself)")
            self._used = True
        return iter(self._source)

    def get_dataset_size(self):
        if self._random_access:
            return super().get_dataset_size()
        if self._count is None:
            if hasattr(self._source, "__len__"):
                self._count = len(self._source)
            elif self._one_shot:
                raise ValueError("GeneratorDataset: the size of a one-shot iterator (e.g. a generator object) is "
                                 "unknown without consuming it; pass a callable that returns a fresh iterable "
                                 "(e.g. the generator function itself)")
            else:
                self._count = sum(1 for _ in self._open())  # MindSpore counts the same way
        return shard_size(self._count, *self._shards, mode=self._shard_mode, num_samples=self._num_samples)

    def _thunks(self, epoch):
        if self._random_access:
            yield from super()._thunks(epoch)
            return
        for value, real in shard_stream(self._open(), *self._shards, mode=self._shard_mode,
                                        num_samples=self._num_samples, with_validity=True):
            yield Thunk(self._as_row, (value,), real)
