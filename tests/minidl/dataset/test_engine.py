"""Pipeline nodes (map, shuffle, batch, repeat), iterators, epochs and resuming with skip_batches."""
import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Tensor
from minidl.dataset import NumpySlicesDataset, GeneratorDataset


def rows_of(ds, epoch=0, skip=0):
    return [tuple(a.tolist() for a in row) for row in ds.epoch_iterator(epoch, skip, output_numpy=True)]


def table(n, shuffle=False, **kw):
    return NumpySlicesDataset({"x": np.arange(n, dtype=np.float32), "y": np.arange(n) % 3}, shuffle=shuffle, **kw)


class AddNoise:
    """A random transform, as vision.RandomCrop: draws from the rng the pipeline hands it."""

    random = True

    def __call__(self, x, rng):
        return x + rng.integers(0, 1000, size=np.shape(x))


# ------------------------------------------------------------------ batch

@given(n=st.integers(0, 30), batch_size=st.integers(1, 8), drop=st.booleans())
def test_batch_sizes_and_contents(n, batch_size, drop):
    ds = table(n).batch(batch_size, drop_remainder=drop)
    batches = list(ds.epoch_iterator(0, output_numpy=True))
    expected = n // batch_size if drop else -(-n // batch_size)
    assert len(batches) == ds.get_dataset_size() == expected
    assert all(len(x) == batch_size for x, _ in batches[:n // batch_size])
    kept = (n // batch_size) * batch_size if drop else n
    xs = np.concatenate([x for x, _ in batches]) if batches else np.zeros(0)
    np.testing.assert_array_equal(xs, np.arange(kept, dtype=np.float32))
    assert all(x.dtype == np.float32 and y.dtype == np.arange(1).dtype for x, y in batches)
    assert ds.get_batch_size() == batch_size


def test_batch_stacks_rows_from_a_generator():
    ds = GeneratorDataset(lambda: ((np.full((2, 2), i), i) for i in range(5)), ["img", "label"]).batch(2)
    batches = list(ds.create_tuple_iterator(output_numpy=True))
    assert [b[0].shape for b in batches] == [(2, 2, 2), (2, 2, 2), (1, 2, 2)]
    assert batches[1][1].tolist() == [2, 3]


@pytest.mark.parametrize("bad, exc, match", [
    (0, ValueError, r"batch: batch_size must be >= 1, got 0"),
    (-3, ValueError, r"batch: batch_size must be >= 1, got -3"),
    (2.0, TypeError, r"batch: batch_size must be an int >= 1, got 2.0"),
    (True, TypeError, r"batch: batch_size must be an int >= 1, got True"),
])
def test_bad_batch_size(bad, exc, match):
    with pytest.raises(exc, match=match):
        table(4).batch(bad)


@pytest.mark.parametrize("bad, exc, match", [
    (0, ValueError, r"batch: batch_size must be >= 1, got 0"),
    (2.0, TypeError, r"batch: batch_size must be an int >= 1, got 2.0"),
])
def test_bad_batch_size_for_resize_batch_changes_nothing(bad, exc, match):
    ds = table(4).batch(2)
    with pytest.raises(exc, match=match.replace("batch:", "resize_batch:")):
        ds.resize_batch(bad)
    assert ds.get_batch_size() == 2


def test_resize_batch_resizes_the_last_batch_of_the_pipeline_in_place():
    ds = table(12).batch(2).map(lambda v: v * 10, input_columns="x").batch(3)
    ds.resize_batch(2)
    assert ds.get_batch_size() == 2 and ds.get_dataset_size() == 3
    assert [b[0].shape for b in ds] == [(2, 2), (2, 2), (2, 2)]  # the first batch (2 rows) is untouched
    after = table(12).batch(2).batch(3).map(lambda v: v * 10, input_columns="x")  # a map after the last batch
    after.resize_batch(2)
    assert after.get_batch_size() == 2 and [b[0].shape for b in after] == [(2, 2), (2, 2), (2, 2)]
    with pytest.raises(ValueError, match=r"^resize_batch: the pipeline has no \.batch\(\) to resize$"):
        table(4).map(lambda v: v, input_columns="x").resize_batch(2)


def test_ragged_rows_name_the_column_and_shapes():
    ds = GeneratorDataset(lambda: iter([(np.zeros(3),), (np.zeros(4),)]), "data").batch(2)
    with pytest.raises(ValueError, match=r"batch: column 'data' has rows of different shapes \[\(3,\), \(4,\)\] "
                                         r"in batch 0"):
        list(ds)
    mixed = GeneratorDataset(lambda: iter([1, 2.5]), "v").batch(2)
    with pytest.raises(ValueError, match=r"column 'v' has rows of different dtypes \['float64', 'int64'\]"):
        list(mixed)


# ------------------------------------------------------------------ repeat

def test_repeat_counts_and_reshuffles():
    ds = table(6, shuffle=True).repeat(3)
    assert ds.get_dataset_size() == 18
    xs = [r[0] for r in rows_of(ds)]
    parts = [xs[0:6], xs[6:12], xs[12:18]]
    assert all(sorted(p) == list(range(6)) for p in parts)
    assert parts[0] != parts[1] or parts[1] != parts[2]
    # repetition r of epoch e is the input's epoch e * count + r
    assert xs == [r[0] for e in range(3) for r in rows_of(table(6, shuffle=True), e)]
    assert rows_of(ds, 1) == [r for e in range(3, 6) for r in rows_of(table(6, shuffle=True), e)]


def test_repeat_forever():
    ds = table(3).repeat()
    assert ds.get_dataset_size() == -1
    it = ds.epoch_iterator(0, output_numpy=True)
    assert [int(r[0]) for r in itertools.islice(it, 7)] == [0, 1, 2, 0, 1, 2, 0]
    it.close()
    assert rows_of(table(0).repeat(-1)) == []  # endless repeat of nothing ends instead of spinning


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (-2, ValueError), (1.5, TypeError)])
def test_bad_repeat_count(bad, exc):
    with pytest.raises(exc, match=r"repeat: count must be None, -1 \(forever\) or an int >= 1"):
        table(3).repeat(bad)


# ------------------------------------------------------------------ map

def test_map_one_op_list_and_default_column():
    ds = table(4)
    assert rows_of(ds.map(lambda x: x * 2)) == [(2.0 * i, i % 3) for i in range(4)]
    chained = ds.map([lambda x: x + 1, lambda x: x * 10], input_columns="x")
    assert [r[0] for r in rows_of(chained)] == [10.0 * (i + 1) for i in range(4)]
    assert chained.get_col_names() == ["x", "y"]


def test_map_renames_splits_and_merges_columns():
    ds = table(3)
    renamed = ds.map(lambda y: y + 100, input_columns="y", output_columns="label")
    assert renamed.get_col_names() == ["x", "label"]
    assert rows_of(renamed)[2] == (2.0, 102)
    split = ds.map(lambda x: (x, -x), input_columns="x", output_columns=["pos", "neg"])
    assert split.get_col_names() == ["pos", "neg", "y"]
    assert rows_of(split)[1] == (1.0, -1.0, 1)
    merged = ds.map(lambda x, y: x + y, input_columns=["y", "x"], output_columns="s")
    assert merged.get_col_names() == ["s"]
    assert rows_of(merged) == [(0.0,), (2.0,), (4.0,)]
    swapped = ds.map(lambda y, x: (x, y), input_columns=["y", "x"])  # in place: y <- x, x <- y
    assert rows_of(swapped)[1] == (1, 1.0) and swapped.get_col_names() == ["x", "y"]


def test_map_converts_tensor_outputs_to_numpy():
    ds = table(2).map(lambda x: Tensor(x) * 2)
    row = next(ds.epoch_iterator(0, output_numpy=True))
    assert isinstance(row[0], np.ndarray) and row[0] == 0


@pytest.mark.parametrize("kw, exc, match", [
    (dict(operations=[]), ValueError, r"map: operations is empty"),
    (dict(operations=[abs, 3]), TypeError, r"map: operations\[1\] must be callable, got 3"),
    (dict(operations=abs, input_columns="z"), ValueError,
     r"map: input_columns has 'z', which is not a column; columns are \['x', 'y'\]"),
    (dict(operations=abs, input_columns=["x", "x"]), ValueError, r"map: input_columns has repeated names"),
    (dict(operations=abs, input_columns=3), TypeError, r"map: input_columns must be a column name"),
    (dict(operations=abs, input_columns="x", output_columns="y"), ValueError,
     r"map: output_columns \['y'\] give the columns \['y', 'y'\], where \['y'\] repeat"),
])
def test_bad_map_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        table(3).map(**kw)


def test_map_output_count_mismatch_is_an_error():
    ds = table(3).map(lambda x: (x, x), input_columns="x")
    with pytest.raises(ValueError, match=r"map: the operations returned 2 column\(s\) but output_columns has 1: "
                                         r"\['x'\]"):
        list(ds)


def test_random_ops_reproducible_per_seed_and_epoch():
    def build():
        return table(8, shuffle=True).map(AddNoise(), "x").batch(4).map(AddNoise(), "x")

    minidl.set_seed(7)
    a = build()
    minidl.set_seed(7)
    b = build()
    assert rows_of(a, 0) == rows_of(b, 0) and rows_of(a, 3) == rows_of(b, 3)
    assert rows_of(a, 0) != rows_of(a, 1)  # a new epoch draws new augmentations
    minidl.set_seed(8)
    assert rows_of(build(), 0) != rows_of(a, 0)
    explicit = NumpySlicesDataset(np.zeros(8), shuffle=False, seed=7).map(AddNoise())
    assert rows_of(explicit) == rows_of(NumpySlicesDataset(np.zeros(8), shuffle=False, seed=7).map(AddNoise()))
    noise = [r[0] for r in rows_of(explicit)]
    assert len(set(noise)) > 4  # each row draws its own augmentation
    shards = [NumpySlicesDataset(np.zeros(8), shuffle=False, seed=7, num_shards=2, shard_id=k).map(AddNoise())
              for k in range(2)]
    assert rows_of(shards[0]) != rows_of(shards[1])  # ranks draw different augmentations too


def test_random_op_gets_the_documented_generator():
    seen = []

    class Record:
        random = True

        def __call__(self, x, rng):
            seen.append(rng.integers(2**31))
            return x

    ds = NumpySlicesDataset(np.zeros(4), shuffle=False, seed=5, num_shards=2, shard_id=1)
    list(ds.map(abs).map(Record()).epoch_iterator(3))
    # index = position * num_shards + shard_id; op_index counts ops from the source on
    assert seen == [np.random.default_rng([5, 3, 2 * p + 1, 1]).integers(2**31) for p in range(2)]


def test_chained_maps_equal_one_map_with_a_list():
    ds = table(6, shuffle=True)
    one = ds.map([AddNoise(), AddNoise()], "x")
    two = ds.map(AddNoise(), "x").map(AddNoise(), "x")
    assert rows_of(one, 2) == rows_of(two, 2)


# ------------------------------------------------------------------ shuffle

@given(n=st.integers(0, 40), buffer_size=st.integers(2, 50), epoch=st.integers(0, 100))
def test_buffered_shuffle_is_a_deterministic_permutation(n, buffer_size, epoch):
    ds = table(n).shuffle(buffer_size)
    xs = [r[0] for r in rows_of(ds, epoch)]
    assert sorted(xs) == list(range(n))
    assert xs == [r[0] for r in rows_of(table(n).shuffle(buffer_size), epoch)]
    if n >= 12:
        assert xs != [r[0] for r in rows_of(ds, epoch + 1)]


@pytest.mark.parametrize("bad, exc", [(1, ValueError), (0, ValueError), (None, TypeError)])
def test_bad_shuffle_buffer(bad, exc):
    with pytest.raises(exc, match=r"shuffle: buffer_size must be"):
        table(3).shuffle(bad)


# ------------------------------------------------------------------ skipping (resume)

pipelines = {
    "source": lambda: table(13, shuffle=True),
    "map_batch": lambda: table(13, shuffle=True).map(AddNoise(), "x").batch(3),
    "shuffle_map_batch_map": lambda: table(13).shuffle(4).map(AddNoise(), "x").batch(3, True).map(AddNoise(), "x"),
    "repeat": lambda: table(5, shuffle=True).map(AddNoise(), "x").repeat(2).batch(2),
    "generator": lambda: GeneratorDataset(lambda: iter(np.arange(11.0)), "x").map(AddNoise()).batch(2),
}


@pytest.mark.parametrize("name", sorted(pipelines))
@given(epoch=st.integers(0, 50), data=st.data())
def test_skip_batches_equals_dropping_the_first_batches(name, epoch, data):
    ds = pipelines[name]()
    full = rows_of(ds, epoch)
    assert len(full) == ds.get_dataset_size()
    skip = data.draw(st.integers(0, len(full)))
    assert rows_of(pipelines[name](), epoch, skip) == full[skip:]


def test_skipped_rows_are_not_read_nor_transformed():
    calls = []

    def count(x):
        calls.append(int(x))
        return x

    ds = NumpySlicesDataset(np.arange(10), shuffle=False).map(count).batch(2)
    assert [b[0].tolist() for b in ds.epoch_iterator(0, skip_batches=3, output_numpy=True)] == [[6, 7], [8, 9]]
    assert sorted(calls) == [6, 7, 8, 9]


def test_skip_past_the_end_is_an_error():
    ds = table(5).batch(2)
    assert rows_of(ds, 0, 3) == []
    with pytest.raises(ValueError, match=r"epoch_iterator: skip_batches=4 but epoch 0 of this dataset has only 3"):
        rows_of(ds, 0, 4)
    with pytest.raises(ValueError, match=r"skip_batches must be an int >= 0, got -1"):
        ds.epoch_iterator(0, -1)
    with pytest.raises(ValueError, match=r"epoch must be an int >= 0, got 1.5"):
        ds.epoch_iterator(1.5)


# ------------------------------------------------------------------ iterators and epochs

def test_plain_iteration_advances_the_epoch():
    ds = table(10, shuffle=True)
    first = [tuple(t.asnumpy().tolist() for t in row) for row in ds]
    second = [tuple(t.asnumpy().tolist() for t in row) for row in ds]
    assert first == rows_of(ds, 0) and second == rows_of(ds, 1) and first != second
    assert all(isinstance(t, Tensor) for row in ds for t in row)


def test_tuple_iterator_passes_are_epochs():
    ds = table(6, shuffle=True)
    it = ds.create_tuple_iterator(num_epochs=2, output_numpy=True)
    passes = [[tuple(a.tolist() for a in row) for row in it] for _ in range(3)]
    assert passes == [rows_of(ds, 0), rows_of(ds, 1), []]
    every = ds.create_tuple_iterator(num_epochs=-1)
    assert sum(1 for _ in every) == 6 and sum(1 for _ in every) == 6  # -1: any number of passes


def test_dict_iterator_and_column_selection():
    ds = table(3)
    rows = list(ds.create_dict_iterator(num_epochs=1))
    assert list(rows[0]) == ["x", "y"] and isinstance(rows[0]["x"], Tensor)
    assert int(rows[2]["y"].item()) == 2
    picked = list(ds.create_tuple_iterator(columns=["y"], output_numpy=True))
    assert [r[0].tolist() for r in picked] == [0, 1, 2] and all(len(r) == 1 for r in picked)
    with pytest.raises(ValueError, match=r"columns has 'z', which is not a column"):
        ds.create_tuple_iterator(columns="z")
    with pytest.raises(ValueError, match=r"num_epochs must be -1 \(any number\) or an int >= 1, got 0"):
        ds.create_dict_iterator(num_epochs=0)


def test_stop_ends_the_iterator():
    it = table(6).create_tuple_iterator()
    next(it)
    it.stop()
    assert list(it) == []


def test_information_methods():
    ds = table(10).map(lambda x: np.stack([x, x]), "x").batch(4)
    assert ds.get_col_names() == ["x", "y"]
    assert ds.get_dataset_size() == 3
    assert ds.output_shapes() == [[4, 2], [4]]
    assert ds.output_types() == [np.dtype(np.float32), np.arange(1).dtype]
    assert table(5).get_batch_size() == 1
    with pytest.raises(ValueError, match="the dataset is empty"):
        table(0).output_shapes()
