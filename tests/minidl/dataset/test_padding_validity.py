"""Padding repeats are marked from the source through map/shuffle/batch/repeat, and no source
is ever sharded unless asked."""
import collections

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl.dataset
from minidl.dataset import GeneratorDataset, NumpySlicesDataset, sharding
from minidl.dataset.iterators import drop_padding
from minidl.dataset.sharding import real_count, shard_indices, shard_stream


def test_there_is_no_default_shards_registry():
    # Sharding is only what the user writes (num_shards=, shard_id=), as in MindSpore and PyTorch.
    for name in ("set_default_shards", "get_default_shards"):
        assert not hasattr(minidl.dataset, name)
        assert not hasattr(sharding, name)
        assert name not in minidl.dataset.__all__


@given(n=st.integers(0, 40), num_shards=st.integers(1, 6))
def test_real_count_marks_the_wrapped_positions(n, num_shards):
    for k in range(num_shards):
        idx = shard_indices(n, num_shards, k, mode="pad")
        real = real_count(n, num_shards, k)
        # the positions k, k + num_shards, ... below n are real; the rest wrap around
        assert real == sum(1 for j in range(len(idx)) if k + j * num_shards < n)
        assert list(idx[:real]) == list(range(k, n, num_shards))


def test_shard_stream_tags_the_wrapped_rows():
    assert list(shard_stream(iter(range(5)), 2, 1, "pad", with_validity=True)) == [(1, True), (3, True), (0, False)]
    assert list(shard_stream(iter(range(5)), 3, 2, "pad", with_validity=True)) == [(2, True), (0, False)]
    assert list(shard_stream(iter(range(5)), 2, 1, "exact", with_validity=True)) == [(1, True), (3, True)]


def _source(kind, values, **kw):
    if kind == "slices":
        return NumpySlicesDataset({"v": values}, **kw)
    if kind == "random_access":
        return GeneratorDataset(list(values), column_names=["v"], **kw)
    rows = list(values)
    return GeneratorDataset(lambda: iter(rows), column_names=["v"], **{k: v for k, v in kw.items() if k != "shuffle"})


def _pipeline(ds, batch, buffer):
    if buffer:
        ds = ds.shuffle(buffer)
    ds = ds.map(lambda v: v + 0, input_columns="v")
    if batch:
        ds = ds.batch(batch).map(lambda v: v + 0, input_columns="v")  # a map after batch keeps the mask
    return ds


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 23), num_shards=st.integers(1, 5), mode=st.sampled_from(["pad", "exact"]),
       kind=st.sampled_from(["slices", "random_access", "iterable"]), shuffle=st.booleans(),
       batch=st.sampled_from([None, 1, 3, 4]), buffer=st.sampled_from([None, 2, 5]), epoch=st.integers(0, 3))
def test_real_rows_over_all_shards_are_the_dataset_once(n, num_shards, mode, kind, shuffle, batch, buffer, epoch):
    values = np.arange(n) * 10
    seen, everything = [], []
    for k in range(num_shards):
        kw = dict(num_shards=num_shards, shard_id=k, shard_mode=mode)
        if kind != "iterable":
            kw["shuffle"] = shuffle
        ds = _pipeline(_source(kind, values, **kw), batch, buffer)
        plain = [r[0].tolist() for r in ds.epoch_iterator(epoch, output_numpy=True)]
        flagged = list(ds.epoch_iterator(epoch, output_numpy=True, with_validity=True))
        # asking for validity changes nothing in the rows themselves
        assert [r[0].tolist() for r, _ in flagged] == plain
        for row, valid in flagged:
            if batch:
                assert isinstance(valid, np.ndarray) and valid.dtype == bool and valid.shape == row[0].shape[:1]
            real, count = drop_padding(row, valid)
            values_here = np.atleast_1d(real[0]).tolist() if count else []
            assert len(values_here) == count
            seen += values_here
            everything += np.atleast_1d(row[0]).tolist()
    assert collections.Counter(seen) == collections.Counter(values.tolist())
    if mode == "pad" and num_shards > 1 and n % num_shards:
        assert len(everything) > n  # there was padding to leave out


def test_repeat_keeps_the_marks():
    ds = NumpySlicesDataset(np.arange(5), shuffle=False, num_shards=2, shard_id=1).repeat(2)
    got = [(int(r[0]), bool(v)) for r, v in ds.epoch_iterator(0, output_numpy=True, with_validity=True)]
    assert got == [(1, True), (3, True), (0, False)] * 2


def test_validity_after_skip_batches_is_the_full_pass_tail():
    ds = NumpySlicesDataset(np.arange(7), shuffle=True, num_shards=3, shard_id=1).batch(2)
    full = [(r[0].tolist(), v.tolist()) for r, v in ds.epoch_iterator(2, output_numpy=True, with_validity=True)]
    tail = [(r[0].tolist(), v.tolist()) for r, v in ds.epoch_iterator(2, skip_batches=1, output_numpy=True,
                                                                      with_validity=True)]
    assert tail == full[1:] and full[-1][1] == [False]


def test_validity_with_tensors_and_selected_columns():
    ds = NumpySlicesDataset({"x": np.arange(3), "y": np.arange(3) * 2}, shuffle=False, num_shards=2, shard_id=1)
    (row, valid), (row2, valid2) = list(ds.epoch_iterator(0, with_validity=True))
    assert int(row[1].asnumpy()) == 2 and valid is True and valid2 is False


def test_drop_padding_keeps_the_arrays_when_all_rows_are_real_and_checks_shapes():
    x = np.arange(6).reshape(3, 2)
    row, count = drop_padding((x,), np.array([True, True, True]))
    assert row[0] is x and count == 3
    assert drop_padding((x,), False)[1] == 0 and drop_padding((x,), True)[1] == 1
    with pytest.raises(ValueError, match=r"drop_padding: column 0 has shape \(\), but"):
        drop_padding((np.float32(1.0),), np.array([True, False]))
