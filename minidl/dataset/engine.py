"""The dataset pipeline: the Dataset base, its map/shuffle/batch/repeat nodes, and the iterators.

How a pipeline runs. For an epoch, each node yields a stream of *thunks*: zero-argument
callables that compute one output row (a tuple of NumPy arrays, one per column) when called.
A source's thunk reads sample i, a map thunk calls its input's thunk and applies the
operations, a batch thunk calls its rows' thunks and stacks them. Building the stream is
cheap; calling the thunks is the work. So:

- ``epoch_iterator(epoch, skip_batches=k)`` drops k thunks without calling them: skipped rows
  are never read nor transformed, yet every later row is the one a full pass yields, because
  each thunk carries its own (epoch, position), which is all its random transforms depend on;
- the prefetch thread (prefetch.py) calls the thunks while the training step computes.

Random transforms (``op.random = True``) are called ``op(*columns, rng=rng)`` with
``rng = numpy.random.default_rng([seed, epoch, index, op_index])``: ``index`` is the row's (or,
after ``batch``, the batch's) position in the map's input stream, times num_shards plus
shard_id, so that ranks draw different augmentations; ``op_index`` counts the operations of
all maps from the source on, so ``ds.map(a).map(b)`` equals ``ds.map([a, b])``.

Padding repeats travel with the thunks. Every thunk has ``valid``: for a row, True, or False
when "pad" sharding repeats it to even out the shards (sharding.py); a map keeps its input's;
shuffle and repeat move thunks as they are; a batch's is a bool array, one entry per row. So
``epoch_iterator(..., with_validity=True)`` can tell, for every row or batch it yields,
which rows are real, and evaluation counts each row of a sharded dataset exactly once.
"""
import itertools
import numbers
import threading

import numpy

from ..backend import to_numpy
from ..tensor import Tensor
from .iterators import DatasetIterator, EpochIterator

__all__ = ["Dataset", "MapDataset", "ShuffleDataset", "BatchDataset", "RepeatDataset", "DatasetIterator"]

_BUFFER_TAG = 2  # see sharding._ORDER_TAG: 5-word keys ending in a tag never collide with row keys
_DRAW_CHUNK = 1024  # the shuffle buffer draws its random slots in blocks: one call, not one per row


def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _names(value, arg, who):
    """A column-name argument as a list of str (one str is one name)."""
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{who}: {arg} must be a column name or a non-empty list of names, got {value!r}")
    if len(set(names)) != len(names):
        raise ValueError(f"{who}: {arg} has repeated names: {list(names)}")
    return list(names)


def _column(value):
    """An operation's output as a NumPy array (Tensors and CuPy arrays come back to the host)."""
    if isinstance(value, numpy.ndarray):
        return value
    if isinstance(value, Tensor):
        return value.asnumpy()
    return to_numpy(value)


class Take:
    """A source row by index, as a thunk; batch reads a run of them from the source at once.

    ``valid`` is False when "pad" sharding repeats the row (see the module docstring).
    """

    __slots__ = ("source", "index", "valid")

    def __init__(self, source, index, valid=True):
        self.source = source
        self.index = index
        self.valid = valid

    def __call__(self):
        return self.source._row(self.index)


def _valid(thunk):
    """A thunk's ``valid`` (True for a callable that predates it, e.g. a custom source's)."""
    return getattr(thunk, "valid", True)


class Thunk:
    """A deferred row or batch: calling it computes ``fn(*args)``; ``valid`` as for :class:`Take`,
    or, for a batch, a bool array with one entry per row."""

    __slots__ = ("fn", "args", "valid")

    def __init__(self, fn, args, valid=True):
        self.fn = fn
        self.args = args
        self.valid = valid

    def __call__(self):
        return self.fn(*self.args)


class Dataset:
    """The base of every dataset and pipeline node (MindSpore's ``mindspore.dataset.Dataset``).

    A dataset yields rows, tuples with one NumPy array per column (``get_col_names()`` order),
    epoch by epoch. Subclasses implement ``_thunks(epoch)`` (see the module docstring) and
    ``get_dataset_size()``; sources also set the seed and the shard they read.

    Example:
        >>> ds = NumpySlicesDataset({"x": numpy.arange(10.0)}, shuffle=False).batch(4)
        >>> [b[0].shape for b in ds]
        [(4,), (4,), (2,)]
    """

    def __init__(self, input_dataset=None):
        self.input_dataset = input_dataset
        self._epoch_lock = threading.Lock()
        self._next_epoch = 0
        if input_dataset is not None:
            self._seed = input_dataset._seed
            self._shards = input_dataset._shards
            self._op_total = input_dataset._op_total
            self._depth = input_dataset._depth + 1
        else:  # sources fill these in
            self._seed, self._shards, self._op_total, self._depth = 0, (1, 0), 0, 0

    # ---------------------------------------------------------------- pipeline builders

    def map(self, operations, input_columns=None, output_columns=None, num_parallel_workers=None,
            python_multiprocessing=False):
        """Applies ``operations`` (one callable or a list, in order) to some columns of each row.

        Args:
            operations: a callable or a list of callables; each takes the columns (the previous
                one's outputs) and returns one array or a tuple of arrays. One with ``random =
                True`` also gets ``rng=`` (see the module docstring).
            input_columns: a name or list of names (default: the first column).
            output_columns: names of the results (default: input_columns); when their number
                differs from input_columns, the inputs are dropped and the outputs take the
                place of the first of them.
            num_parallel_workers, python_multiprocessing: accepted for MindSpore compatibility
                and ignored: the pipeline runs in one prefetch thread, and transforms are
                vectorised over batches.
        """
        return MapDataset(self, operations, input_columns, output_columns)

    def shuffle(self, buffer_size):
        """Shuffles rows through a buffer of ``buffer_size`` rows; the order depends on (seed, epoch)."""
        return ShuffleDataset(self, buffer_size)

    def batch(self, batch_size, drop_remainder=False, num_parallel_workers=None):
        """Stacks ``batch_size`` consecutive rows per column (``numpy.stack``) into one batch row.

        Args:
            batch_size: rows per batch, >= 1.
            drop_remainder: drop the last, smaller batch instead of yielding it.
            num_parallel_workers: accepted for MindSpore compatibility and ignored.
        """
        return BatchDataset(self, batch_size, drop_remainder)

    def resize_batch(self, batch_size):
        """Sets the batch size of the last ``.batch`` in the pipeline, in place (between epochs, not
        while one is iterated). ``Model.train`` keeps the global batch this way when a checkpoint
        resumes on another number of shards (minidl/train/resize.py). Raises when there is no ``.batch``."""
        node = self
        while node is not None and not isinstance(node, BatchDataset):
            node = node.input_dataset
        if node is None:
            raise ValueError("resize_batch: the pipeline has no .batch() to resize")
        _check_batch_size(batch_size, "resize_batch")
        node._batch_size = int(batch_size)

    def repeat(self, count=None):
        """Repeats the dataset ``count`` times within each epoch (None or -1: forever).

        Repetition r of epoch e runs the input's epoch e * count + r, so it reshuffles.
        """
        return RepeatDataset(self, count)

    # ---------------------------------------------------------------- information

    @property
    def num_shards(self):
        """How many shards the source is split into (1: every rank reads every row)."""
        return self._shards[0]

    @property
    def shard_id(self):
        """Which shard of the source this dataset reads."""
        return self._shards[1]

    def get_col_names(self):
        """The column names, in row order."""
        return self.input_dataset.get_col_names()

    def get_dataset_size(self):
        """Rows (batches after ``.batch``) per epoch for this shard; -1 after an endless repeat."""
        return self.input_dataset.get_dataset_size()

    def get_batch_size(self):
        """The batch size of the last ``.batch`` in the pipeline (1 without one)."""
        return 1 if self.input_dataset is None else self.input_dataset.get_batch_size()

    def output_shapes(self):
        """The shape of each column of the first row of epoch 0."""
        return [list(a.shape) for a in self._first_row()]

    def output_types(self):
        """The dtype of each column of the first row of epoch 0."""
        return [a.dtype for a in self._first_row()]

    def _first_row(self):
        rows = self._produce(0, 0)
        try:
            return next(rows)
        except StopIteration:
            raise ValueError(f"{type(self).__name__}: the dataset is empty, so it has no output shapes/types") \
                from None
        finally:
            rows.close()

    # ---------------------------------------------------------------- iteration

    def _thunks(self, epoch):
        raise NotImplementedError

    def _produce(self, epoch, skip, with_validity=False):
        """The rows of ``epoch`` after the first ``skip`` ones, as NumPy tuples (with their ``valid``)."""
        thunks = self._thunks(epoch)
        for done in range(skip):
            if next(thunks, None) is None:
                raise ValueError(f"epoch_iterator: skip_batches={skip} but epoch {epoch} of this dataset has "
                                 f"only {done} rows/batches")
        for thunk in thunks:
            yield (thunk(), _valid(thunk)) if with_validity else thunk()

    def _claim_epoch(self):
        with self._epoch_lock:
            epoch = self._next_epoch
            self._next_epoch += 1
        return epoch

    def epoch_iterator(self, epoch, skip_batches=0, output_numpy=False, with_validity=False):
        """An iterator over the rows (batches) of one epoch, from row ``skip_batches`` on.

        It yields exactly what a full pass over ``epoch`` yields after its first
        ``skip_batches`` items, without reading or transforming the skipped ones (where the
        source allows). Rows are tuples of Tensors, or of NumPy arrays with ``output_numpy``.
        Loading runs in a prefetch thread; ``close()`` (or dropping the iterator) stops it.

        Args:
            epoch: the epoch number, >= 0; with the seed, it fixes shuffling and augmentation.
            skip_batches: how many leading rows/batches to skip (resuming at a step).
            output_numpy: yield NumPy arrays instead of Tensors.
            with_validity: yield ``(row, valid)`` pairs: ``valid`` is False for a row that
                "pad" sharding repeats (True otherwise) and, for a batch, a bool array with
                one entry per row. :func:`minidl.dataset.iterators.drop_padding` keeps the
                real rows; over all shards they are the dataset exactly once.

        Example:
            >>> ds = NumpySlicesDataset(numpy.arange(5), shuffle=False, num_shards=2, shard_id=1).batch(2)
            >>> it = ds.epoch_iterator(0, output_numpy=True, with_validity=True)
            >>> [(batch[0].tolist(), valid.tolist()) for batch, valid in it]
            [([1, 3], [True, True]), ([0], [False])]
        """
        if not _is_int(epoch) or epoch < 0:
            raise ValueError(f"epoch_iterator: epoch must be an int >= 0, got {epoch!r}")
        if not _is_int(skip_batches) or skip_batches < 0:
            raise ValueError(f"epoch_iterator: skip_batches must be an int >= 0, got {skip_batches!r}")
        return EpochIterator(self, int(epoch), int(skip_batches), output_numpy, with_validity=bool(with_validity))

    def create_tuple_iterator(self, columns=None, num_epochs=-1, output_numpy=False, do_copy=True):
        """An iterator of rows as tuples; each pass (for loop) over it is the dataset's next epoch.

        Args:
            columns: names of the columns to yield, in this order (default: all).
            num_epochs: how many passes it allows (-1: any number).
            output_numpy: yield NumPy arrays instead of Tensors.
            do_copy: accepted for MindSpore compatibility.
        """
        index = None
        if columns is not None:
            names = self.get_col_names()
            index = []
            for name in _names(columns, "columns", "create_tuple_iterator"):
                if name not in names:
                    raise ValueError(f"create_tuple_iterator: columns has {name!r}, which is not a column; "
                                     f"columns are {names}")
                index.append(names.index(name))
        return DatasetIterator(self, num_epochs, output_numpy, columns=index)

    def create_dict_iterator(self, num_epochs=-1, output_numpy=False, do_copy=True):
        """An iterator of rows as {column name: value}; each pass over it is the next epoch."""
        return DatasetIterator(self, num_epochs, output_numpy, as_dict=True)

    def __iter__(self):
        """One epoch (the dataset's next one) of tuples of Tensors."""
        return self.create_tuple_iterator(num_epochs=1)


class MapDataset(Dataset):
    """``dataset.map(...)``: see :meth:`Dataset.map`."""

    def __init__(self, input_dataset, operations, input_columns=None, output_columns=None):
        super().__init__(input_dataset)
        ops = list(operations) if isinstance(operations, (list, tuple)) else [operations]
        if not ops:
            raise ValueError("map: operations is empty; give a callable or a non-empty list of callables")
        for k, op in enumerate(ops):
            if not callable(op):
                raise TypeError(f"map: operations[{k}] must be callable, got {op!r}")
        parent = input_dataset.get_col_names()
        ins = _names(input_columns, "input_columns", "map") if input_columns is not None else parent[:1]
        for name in ins:
            if name not in parent:
                raise ValueError(f"map: input_columns has {name!r}, which is not a column; columns are {parent}")
        outs = _names(output_columns, "output_columns", "map") if output_columns is not None else ins
        in_index = [parent.index(name) for name in ins]
        # A recipe for the output row: j >= 0 takes input column j, -1 - m takes output m.
        if len(outs) == len(ins):
            recipe = [-1 - in_index.index(j) if j in in_index else j for j in range(len(parent))]
        else:
            recipe = [j for j in range(len(parent)) if j not in in_index]
            at = sum(1 for j in recipe if j < min(in_index))
            recipe[at:at] = [-1 - m for m in range(len(outs))]
        names = [parent[j] if j >= 0 else outs[-1 - j] for j in recipe]
        if len(set(names)) != len(names):
            clash = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"map: output_columns {outs} give the columns {names}, where {clash} repeat; "
                             f"rename the outputs or include the clashing columns in input_columns")
        self._ops = ops
        self._random = [getattr(op, "random", False) is True for op in ops]
        self._op_base = input_dataset._op_total
        self._op_total = self._op_base + len(ops)
        self._in_index = in_index
        self._out_names = outs
        self._recipe = recipe
        self._col_names = names

    def get_col_names(self):
        return list(self._col_names)

    def _thunks(self, epoch):
        num_shards, shard_id = self._shards
        for pos, thunk in enumerate(self.input_dataset._thunks(epoch)):
            yield Thunk(self._apply, (thunk, epoch, pos * num_shards + shard_id), _valid(thunk))

    def _apply(self, thunk, epoch, index):
        row = thunk()
        args = [row[j] for j in self._in_index]
        for k, op in enumerate(self._ops):
            try:
                if self._random[k]:
                    out = op(*args, rng=numpy.random.default_rng([self._seed, epoch, index, self._op_base + k]))
                else:
                    out = op(*args)
            except Exception as exc:
                if hasattr(exc, "add_note"):  # Python >= 3.11: say where in the pipeline it failed
                    columns = [self.input_dataset.get_col_names()[j] for j in self._in_index]
                    exc.add_note(f"in map operation {k} ({op!r}) on columns {columns}, epoch {epoch}, "
                                 f"row/batch index {index}")
                raise
            args = list(out) if isinstance(out, tuple) else [out]
        if len(args) != len(self._out_names):
            raise ValueError(f"map: the operations returned {len(args)} column(s) but output_columns has "
                             f"{len(self._out_names)}: {self._out_names}")
        args = [_column(a) for a in args]
        return tuple(row[j] if j >= 0 else args[-1 - j] for j in self._recipe)


class ShuffleDataset(Dataset):
    """``dataset.shuffle(buffer_size)``: a buffered shuffle whose order depends on (seed, epoch).

    The first ``buffer_size`` rows fill a buffer; then each incoming row replaces a random
    buffer slot, whose row is emitted; at the end the buffer is emitted in random order. A
    buffer at least as large as the dataset gives a uniform permutation.
    """

    def __init__(self, input_dataset, buffer_size):
        super().__init__(input_dataset)
        if not _is_int(buffer_size):
            raise TypeError(f"shuffle: buffer_size must be an int >= 2, got {buffer_size!r}")
        if buffer_size < 2:
            raise ValueError(f"shuffle: buffer_size must be >= 2 (1 would not shuffle), got {buffer_size}")
        self._buffer_size = int(buffer_size)

    def _thunks(self, epoch):
        rng = numpy.random.default_rng([self._seed, epoch, self._depth, 0, _BUFFER_TAG])
        size = self._buffer_size
        buffer = []
        slots = iter(())
        for thunk in self.input_dataset._thunks(epoch):
            if len(buffer) < size:
                buffer.append(thunk)
                continue
            slot = next(slots, None)
            if slot is None:
                slots = iter(rng.integers(0, size, _DRAW_CHUNK).tolist())
                slot = next(slots)
            yield buffer[slot]
            buffer[slot] = thunk
        for slot in rng.permutation(len(buffer)).tolist():
            yield buffer[slot]


class BatchDataset(Dataset):
    """``dataset.batch(batch_size, drop_remainder)``: see :meth:`Dataset.batch`."""

    def __init__(self, input_dataset, batch_size, drop_remainder):
        super().__init__(input_dataset)
        _check_batch_size(batch_size, "batch")
        self._batch_size = int(batch_size)
        self._drop_remainder = bool(drop_remainder)

    def get_dataset_size(self):
        n = self.input_dataset.get_dataset_size()
        if n < 0:
            return n
        return n // self._batch_size if self._drop_remainder else -(-n // self._batch_size)

    def get_batch_size(self):
        return self._batch_size

    def _thunks(self, epoch):
        rows = self.input_dataset._thunks(epoch)
        for b in itertools.count():
            chunk = list(itertools.islice(rows, self._batch_size))
            if not chunk or (self._drop_remainder and len(chunk) < self._batch_size):
                return
            yield Thunk(self._stack, (chunk, b), numpy.array([_valid(t) for t in chunk]))

    def _stack(self, chunk, b):
        source = chunk[0].source if isinstance(chunk[0], Take) else None
        gather = getattr(source, "_gather", None)
        if gather is not None and all(isinstance(t, Take) and t.source is source for t in chunk):
            return gather(numpy.array([t.index for t in chunk]))  # one fancy index per column
        rows = [thunk() for thunk in chunk]
        names = self.get_col_names()
        batch = []
        for j, name in enumerate(names):
            values = [row[j] for row in rows]
            shapes = {v.shape for v in values}
            if len(shapes) > 1:
                raise ValueError(f"batch: column {name!r} has rows of different shapes {sorted(shapes)} in batch {b}; "
                                 f"rows must have one shape to be stacked (resize or pad them in a map before batch)")
            dtypes = {v.dtype for v in values}
            if len(dtypes) > 1:
                raise ValueError(f"batch: column {name!r} has rows of different dtypes {sorted(map(str, dtypes))} in "
                                 f"batch {b}; cast them to one dtype (transforms.TypeCast) before batch")
            batch.append(numpy.stack(values))
        return tuple(batch)


def _check_batch_size(batch_size, who):
    if not _is_int(batch_size):
        raise TypeError(f"{who}: batch_size must be an int >= 1, got {batch_size!r}")
    if batch_size < 1:
        raise ValueError(f"{who}: batch_size must be >= 1, got {batch_size}")


def _pair(epoch, r):
    """Cantor's pairing: distinct (epoch, repetition) pairs get distinct inner epoch numbers."""
    return (epoch + r) * (epoch + r + 1) // 2 + r


class RepeatDataset(Dataset):
    """``dataset.repeat(count)``: see :meth:`Dataset.repeat`."""

    def __init__(self, input_dataset, count=None):
        super().__init__(input_dataset)
        if count is not None and not _is_int(count):
            raise TypeError(f"repeat: count must be None, -1 (forever) or an int >= 1, got {count!r}")
        if count is not None and count != -1 and count < 1:
            raise ValueError(f"repeat: count must be None, -1 (forever) or an int >= 1, got {count}")
        self._count = None if count in (None, -1) else int(count)

    def get_dataset_size(self):
        if self._count is None:
            return -1
        n = self.input_dataset.get_dataset_size()
        return n if n < 0 else n * self._count

    def _thunks(self, epoch):
        for r in itertools.count():
            if self._count is not None and r == self._count:
                return
            inner = epoch * self._count + r if self._count is not None else _pair(epoch, r)
            empty = True
            for thunk in self.input_dataset._thunks(inner):
                empty = False
                yield thunk
            if empty:  # an endless repeat of nothing would spin forever
                return
