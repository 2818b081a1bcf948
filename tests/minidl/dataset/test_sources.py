"""NumpySlicesDataset and GeneratorDataset: data forms, names, source kinds, sharding, bad input."""
import re

import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import backend
from minidl.dataset import NumpySlicesDataset, GeneratorDataset


def rows_of(ds, epoch=0):
    return [tuple(a.tolist() for a in row) for row in ds.epoch_iterator(epoch, output_numpy=True)]


# ------------------------------------------------------------------ NumpySlicesDataset

def test_data_forms_and_default_names():
    x, y = np.arange(6).reshape(3, 2), np.array([5, 6, 7])
    as_dict = NumpySlicesDataset({"x": x, "y": y}, shuffle=False)
    assert as_dict.get_col_names() == ["x", "y"]
    assert rows_of(as_dict) == [([0, 1], 5), ([2, 3], 6), ([4, 5], 7)]
    reordered = NumpySlicesDataset({"x": x, "y": y}, column_names=["y", "x"], shuffle=False)
    assert rows_of(reordered)[0] == (5, [0, 1])
    as_tuple = NumpySlicesDataset((x, y), shuffle=False)
    assert as_tuple.get_col_names() == ["column_0", "column_1"] and rows_of(as_tuple) == rows_of(as_dict)
    # a list is one column, as in MindSpore, unless column_names names one column per element
    assert rows_of(NumpySlicesDataset([1, 2, 3], column_names=["c"], shuffle=False)) == [(1,), (2,), (3,)]
    as_list = NumpySlicesDataset([x, y], column_names=["a", "b"], shuffle=False)
    assert rows_of(as_list) == rows_of(as_dict)
    single = NumpySlicesDataset(x, column_names="img", shuffle=False)
    assert single.get_col_names() == ["img"] and rows_of(single)[2] == ([4, 5],)


def test_rows_are_copies_and_dtypes_kept():
    data = np.arange(4, dtype=np.uint8)
    row = next(NumpySlicesDataset(data, shuffle=False).epoch_iterator(0, output_numpy=True))
    row[0][...] = 99
    assert data[0] == 0 and row[0].dtype == np.uint8 and row[0].shape == ()


def test_memmap_column(tmp_path):
    path = tmp_path / "images.bin"
    images = np.arange(5 * 4 * 4 * 3, dtype=np.uint8).reshape(5, 4, 4, 3)
    images.tofile(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r", shape=images.shape)
    ds = NumpySlicesDataset({"image": mapped, "label": np.arange(5)}, shuffle=True, seed=3)
    assert ds._columns[0] is mapped  # kept lazy, not read into memory up front
    order = [label for _, label in rows_of(ds)]
    batches = list(ds.batch(2).epoch_iterator(0, output_numpy=True))
    assert type(batches[0][0]) is np.ndarray
    np.testing.assert_array_equal(np.concatenate([b[0] for b in batches]), images[order])


def test_shuffle_defaults_to_true():
    ds = NumpySlicesDataset(np.arange(20))
    assert [r[0] for r in rows_of(ds)] != list(range(20))
    assert sorted(r[0] for r in rows_of(ds)) == list(range(20))
    assert [r[0] for r in rows_of(NumpySlicesDataset(np.arange(20), shuffle=False))] == list(range(20))


def test_num_samples_caps_rows_per_shard():
    ds = NumpySlicesDataset(np.arange(10), shuffle=False, num_samples=3, num_shards=2, shard_id=1)
    assert ds.get_dataset_size() == 3 and rows_of(ds) == [(1,), (3,), (5,)]
    assert NumpySlicesDataset(np.arange(4), num_samples=10).get_dataset_size() == 4


@pytest.mark.parametrize("kw, exc, match", [
    (dict(data={"a": np.zeros(3), "b": np.zeros(4)}), ValueError,
     r"columns must have the same length \(first axis\), got \{'a': 3, 'b': 4\}"),
    (dict(data={"a": np.zeros(3)}, column_names=["b"]), ValueError, r"column_names \['b'\] must be the keys of data"),
    (dict(data=(np.zeros(3), np.zeros(3)), column_names=["a"]), ValueError,
     r"column_names has 1 name\(s\) \['a'\] but the data has 2 column\(s\)"),
    (dict(data=(np.zeros(3), np.zeros(3)), column_names=["a", "a"]), ValueError, r"column_names has repeated names"),
    (dict(data=np.float32(3.0)), ValueError, r"column 'column_0' is a scalar"),
    (dict(data=[[1, 2], [3]]), ValueError, r"column 'column_0' cannot be made one array"),
    (dict(data=np.zeros(3), seed=-1), ValueError, r"seed must be None or an int >= 0, got -1"),
])
def test_bad_numpy_slices(kw, exc, match):
    with pytest.raises(exc, match=r"NumpySlicesDataset: " + match):
        NumpySlicesDataset(**kw)


def test_list_of_arrays_of_different_shapes_suggests_a_tuple():
    x, y = np.arange(30.0).reshape(10, 3), np.arange(10) % 2
    # NumPy alone says only "inhomogeneous shape": the list was meant as the tuple (x, y)
    with pytest.raises(ValueError, match=r"NumpySlicesDataset: data is a list holding arrays of different shapes "
                                         r"\(\(10, 3\), \(10,\)\); a list is one column .* pass a tuple, "
                                         r"NumpySlicesDataset\(\(x, y\), column_names=\['data', 'label'\]\), "
                                         r"or a dict"):
        NumpySlicesDataset([x, y])
    # a list of one shape stays one column (MindSpore's reading), its arrays the rows
    ds = NumpySlicesDataset([x, x + 1], shuffle=False)
    assert ds.get_col_names() == ["column_0"] and ds.get_dataset_size() == 2
    np.testing.assert_array_equal(rows_of(ds)[1][0], x + 1)
    # with a name per element the list is one column per element, as before
    ds = NumpySlicesDataset([x, y], column_names=["data", "label"], shuffle=False)
    assert ds.get_dataset_size() == 10 and rows_of(ds)[3][1] == 1
    assert NumpySlicesDataset((x, y), shuffle=False).get_col_names() == ["column_0", "column_1"]


def shuffled(seed=None, **kw):
    return [r[0] for r in rows_of(NumpySlicesDataset(np.arange(20), seed=seed, **kw))]


def test_the_seed_is_the_one_given_else_set_seeds_else_0(monkeypatch):
    assert shuffled(seed=1) != shuffled(seed=2) and sorted(shuffled(seed=1)) == list(range(20))
    monkeypatch.setitem(backend._state, "seed", None)
    assert shuffled() == shuffled(seed=0)
    monkeypatch.setitem(backend._state, "seed", 7)  # as after minidl.set_seed(7), read when the dataset is made
    assert shuffled() == shuffled(seed=7) != shuffled(seed=0)
    assert shuffled(seed=0) == shuffled(seed=np.int64(0))  # any integral type
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match=rf"NumpySlicesDataset: seed must be None or an int >= 0, got {bad!r}"):
            NumpySlicesDataset(np.arange(3), seed=bad)


def test_a_dict_column_may_be_named_by_a_string():
    ds = NumpySlicesDataset({"img": np.arange(3)}, column_names="img", shuffle=False)
    assert ds.get_col_names() == ["img"] and rows_of(ds) == [(0,), (1,), (2,)]


@pytest.mark.parametrize("data", [(), {}])
def test_data_without_columns(data):
    with pytest.raises(ValueError, match=r"^NumpySlicesDataset: data has no columns$"):
        NumpySlicesDataset(data)


def test_column_names_must_be_strings():
    with pytest.raises(TypeError, match=r"^NumpySlicesDataset: column_names must be a name or a list of names, "
                                        r"got \['a', 1\]$"):
        NumpySlicesDataset((np.zeros(3), np.zeros(3)), column_names=["a", 1])


@pytest.mark.parametrize("count, shown", [(3, "(3,), (3, 1), (3, 2)"), (4, "(3,), (3, 1), (3, 2), ...")])
def test_a_list_of_many_shapes_shows_the_first_three(count, shown):
    arrays = [np.zeros(3)] + [np.zeros((3, k)) for k in range(1, count)]
    with pytest.raises(ValueError, match=r"data is a list holding arrays of different shapes \(" + re.escape(shown)
                                         + r"\); a list"):
        NumpySlicesDataset(arrays)


def test_subclass_reports_its_own_name():
    class MyDataset(NumpySlicesDataset):
        pass

    with pytest.raises(ValueError, match=r"MyDataset: num_shards must be >= 1"):
        MyDataset(np.zeros(3), num_shards=0, shard_id=0)


# ------------------------------------------------------------------ GeneratorDataset

class Squares:
    """A random-access source."""

    def __init__(self, n):
        self.n = n

    def __getitem__(self, i):
        return np.array(i * i), np.array(i % 2)

    def __len__(self):
        return self.n


class Stream:
    """A re-iterable source without random access."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return ((np.array(i * i), np.array(i % 2)) for i in range(self.n))


def gen_squares(n):
    def rows():
        for i in range(n):
            yield np.array(i * i), np.array(i % 2)
    return rows


def test_source_kinds_agree():
    expected = [(i * i, i % 2) for i in range(7)]
    for source in (Squares(7), gen_squares(7), Stream(7)):
        ds = GeneratorDataset(source, ["sq", "parity"], shuffle=False)
        assert rows_of(ds) == expected and rows_of(ds, 1) == expected
        assert ds.get_dataset_size() == 7


def test_random_access_source_shuffles_by_default():
    ds = GeneratorDataset(Squares(20), ["sq", "parity"])
    first = [r[0] for r in rows_of(ds)]
    assert sorted(first) == [i * i for i in range(20)] and first != sorted(first)
    assert [r[0] for r in rows_of(ds, 1)] != first
    plain = GeneratorDataset(gen_squares(5), ["sq", "parity"])  # iterables default to their own order
    assert [r[0] for r in rows_of(plain)] == [0, 1, 4, 9, 16]


@given(n=st.integers(0, 25), num_shards=st.integers(1, 4), mode=st.sampled_from(["pad", "exact"]),
       num_samples=st.none() | st.integers(1, 8), data=st.data())
def test_iterable_shards_like_random_access(n, num_shards, mode, num_samples, data):
    shard_id = data.draw(st.integers(0, num_shards - 1))
    kw = dict(column_names=["sq", "parity"], shuffle=False, num_shards=num_shards, shard_id=shard_id,
              shard_mode=mode, num_samples=num_samples)
    by_index = GeneratorDataset(Squares(n), **kw)
    by_stream = GeneratorDataset(gen_squares(n), **kw)
    assert rows_of(by_stream) == rows_of(by_index)
    assert by_stream.get_dataset_size() == by_index.get_dataset_size() == len(rows_of(by_index))


def test_one_shot_iterator_allows_one_epoch():
    ds = GeneratorDataset(gen_squares(3)(), ["sq", "parity"])
    with pytest.raises(ValueError, match=r"^GeneratorDataset: the size of a one-shot iterator \(e\.g\. a generator "
                                         r"object\) is unknown without consuming it; pass a callable that returns a "
                                         r"fresh iterable \(e\.g\. the generator function itself\)$"):
        ds.get_dataset_size()
    assert len(rows_of(ds)) == 3
    with pytest.raises(ValueError, match=r"^GeneratorDataset: the source is a one-shot iterator \(e\.g\. a generator "
                                         r"object\) that was already read; for more than one epoch pass a callable "
                                         r"that returns a fresh iterable \(e\.g\. the generator function itself\)"):
        rows_of(ds, 1)


def test_single_column_rows_may_be_bare_values():
    ds = GeneratorDataset(lambda: iter(range(3)), column_names="n")
    assert rows_of(ds) == [(0,), (1,), (2,)]
    assert rows_of(GeneratorDataset(np.arange(6).reshape(3, 2), "v", shuffle=False))[1] == ([2, 3],)


class SizedStream(Stream):
    """A re-iterable source that knows its length but has no random access; counts the rows read."""

    rows_read = 0

    def __iter__(self):
        for row in super().__iter__():
            self.rows_read += 1
            yield row

    def __len__(self):
        return self.n


def test_a_sized_stream_is_read_in_order_and_sized_without_reading_it():
    source = SizedStream(5)
    ds = GeneratorDataset(source, ["sq", "parity"])
    assert ds.get_dataset_size() == 5 and source.rows_read == 0  # its __len__, as MindSpore does
    assert [r[0] for r in rows_of(ds)] == [0, 1, 4, 9, 16]  # no __getitem__: in order, never source[i]
    with pytest.raises(ValueError, match=r"this SizedStream can only be read in order"):
        GeneratorDataset(source, ["sq", "parity"], shuffle=True)


@pytest.mark.parametrize("source", [gen_squares(5), Squares(5)], ids=["stream", "random_access"])
def test_generator_shard_modes(source):
    """Shard 1 of 2 over 5 rows: "exact" reads rows 1, 3; "pad" wraps around to equal lengths."""
    exact = GeneratorDataset(source, ["sq", "parity"], shuffle=False, num_shards=2, shard_id=1, shard_mode="exact")
    assert exact.get_dataset_size() == 2 and [r[0] for r in rows_of(exact)] == [1, 9]
    pad = GeneratorDataset(source, ["sq", "parity"], shuffle=False, num_shards=2, shard_id=1)
    assert pad.get_dataset_size() == 3 and [r[0] for r in rows_of(pad)] == [1, 9, 0]


def test_generator_seed_orders_the_shuffle():
    order = [[r[0] for r in rows_of(GeneratorDataset(Squares(20), ["sq", "parity"], seed=s))] for s in (1, 1, 2)]
    assert order[0] == order[1] != order[2]


@pytest.mark.parametrize("make, exc, match", [
    (lambda: GeneratorDataset(gen_squares(3), shuffle=True, column_names=["a", "b"]), ValueError,
     r"shuffle=True needs a random-access source \(with __getitem__ and __len__\); .* \.shuffle\(buffer_size\)"),
    (lambda: GeneratorDataset(gen_squares(3)), ValueError, r"column_names is required"),
    (lambda: GeneratorDataset(5, column_names="a"), TypeError, r"source must be random-access .* got int$"),
    (lambda: GeneratorDataset(Squares(3), column_names=5), TypeError,
     r"column_names must be a name or a list of names, got 5$"),
    (lambda: GeneratorDataset(Squares(3), column_names=["a", 2]), TypeError,
     r"column_names must be a name or a list of names, got \['a', 2\]$"),
    (lambda: GeneratorDataset(Squares(3), column_names=[]), ValueError, r"column_names must name at least one"),
    (lambda: GeneratorDataset(Squares(3), column_names=["a", "b"], num_shards=3), ValueError,
     r"num_shards was given without shard_id"),
])
def test_bad_generator_arguments(make, exc, match):
    with pytest.raises(exc, match=r"GeneratorDataset: " + match):
        make()


def test_row_width_must_match_column_names():
    ds = GeneratorDataset(Squares(3), ["only"])
    with pytest.raises(ValueError, match=r"GeneratorDataset: the source gave a row of 2 value\(s\) but column_names "
                                         r"has 1: \['only'\]"):
        rows_of(ds)
    with pytest.raises(TypeError, match=r"source\(\) must return an iterable, got int"):
        rows_of(GeneratorDataset(lambda: 3, "x"))
