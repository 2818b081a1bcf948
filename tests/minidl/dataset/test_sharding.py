"""Shard index math: the contract's properties, stream sharding, validation, no implicit sharding."""
import collections

import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl.dataset import NumpySlicesDataset, GeneratorDataset
from minidl.dataset.sharding import shard_indices, shard_size, shard_stream, epoch_order, resolve_shards


def all_shards(n, num_shards, mode, **kw):
    return [shard_indices(n, num_shards, k, mode=mode, **kw).tolist() for k in range(num_shards)]


orders = dict(shuffle=st.booleans(), seed=st.integers(0, 2**32 - 1), epoch=st.integers(0, 1000))


@given(n=st.integers(0, 60), num_shards=st.integers(1, 9), **orders)
def test_pad_mode_equal_lengths_and_union_is_the_dataset(n, num_shards, shuffle, seed, epoch):
    shards = all_shards(n, num_shards, "pad", shuffle=shuffle, seed=seed, epoch=epoch)
    size = -(-n // num_shards)
    assert [len(s) for s in shards] == [size] * num_shards
    assert all(shard_size(n, num_shards, k) == size for k in range(num_shards))
    counts = collections.Counter(i for s in shards for i in s)
    assert set(counts) == set(range(n))
    # padding wraps around: extra copies are fewer than num_shards, and no sample is seen 3 times
    # unless there are fewer samples than shards
    assert sum(counts.values()) - n == size * num_shards - n < num_shards or n == 0
    if n >= num_shards:
        assert max(counts.values()) <= 2


@given(n=st.integers(0, 60), num_shards=st.integers(1, 9), **orders)
def test_exact_mode_disjoint_and_union_is_the_dataset_once(n, num_shards, shuffle, seed, epoch):
    shards = all_shards(n, num_shards, "exact", shuffle=shuffle, seed=seed, epoch=epoch)
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n))  # disjoint, and every sample exactly once
    lengths = [len(s) for s in shards]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == [shard_size(n, num_shards, k, mode="exact") for k in range(num_shards)]


@given(n=st.integers(10, 60), num_shards=st.integers(1, 4), seed=st.integers(0, 2**32 - 1),
       epoch=st.integers(0, 1000), mode=st.sampled_from(["pad", "exact"]))
def test_order_is_a_function_of_seed_and_epoch(n, num_shards, seed, epoch, mode):
    a = all_shards(n, num_shards, mode, shuffle=True, seed=seed, epoch=epoch)
    b = all_shards(n, num_shards, mode, shuffle=True, seed=seed, epoch=epoch)
    assert a == b  # same seed -> same order (what lets ranks agree without talking)
    other_epoch = all_shards(n, num_shards, mode, shuffle=True, seed=seed, epoch=epoch + 1)
    other_seed = all_shards(n, num_shards, mode, shuffle=True, seed=seed + 1, epoch=epoch)
    assert a != other_epoch and a != other_seed  # n >= 10: a repeat has probability < 1e-6
    assert sorted(epoch_order(n, seed, epoch, True).tolist()) == list(range(n))


@given(n=st.integers(0, 40), num_shards=st.integers(1, 6), mode=st.sampled_from(["pad", "exact"]),
       num_samples=st.none() | st.integers(1, 12), data=st.data())
def test_stream_sharding_matches_index_sharding(n, num_shards, mode, num_samples, data):
    shard_id = data.draw(st.integers(0, num_shards - 1))
    expected = shard_indices(n, num_shards, shard_id, mode=mode, num_samples=num_samples).tolist()
    assert list(shard_stream(iter(range(n)), num_shards, shard_id, mode, num_samples)) == expected
    assert len(expected) == shard_size(n, num_shards, shard_id, mode, num_samples)


def test_stream_sharding_stops_reading_at_num_samples():
    read = []

    def rows():
        for i in range(100):
            read.append(i)
            yield i

    assert list(shard_stream(rows(), 2, 1, "pad", num_samples=3)) == [1, 3, 5]
    assert read == list(range(6))


def test_known_pad_layout_matches_distributed_sampler():
    # 5 samples on 2 shards: order 0 1 2 3 4 wraps to 0 1 2 3 4 0
    assert all_shards(5, 2, "pad") == [[0, 2, 4], [1, 3, 0]]
    assert all_shards(2, 3, "pad") == [[0], [1], [0]]
    assert all_shards(5, 2, "exact") == [[0, 2, 4], [1, 3]]
    assert shard_indices(5, 2, 0, num_samples=2).tolist() == [0, 2]


@pytest.mark.parametrize("kw, exc, match", [
    (dict(num_shards=0, shard_id=0), ValueError, r"num_shards must be >= 1, got 0"),
    (dict(num_shards=-2, shard_id=0), ValueError, r"num_shards must be >= 1, got -2"),
    (dict(num_shards=2, shard_id=2), ValueError, r"shard_id must be in \[0, 1\] for num_shards=2, got 2"),
    (dict(num_shards=2, shard_id=-1), ValueError, r"shard_id must be in \[0, 1\]"),
    (dict(num_shards=2, shard_id=None), ValueError, r"num_shards was given without shard_id"),
    (dict(num_shards=None, shard_id=1), ValueError, r"shard_id was given without num_shards"),
    (dict(num_shards=2.0, shard_id=0), TypeError, r"num_shards must be an int"),
    (dict(num_shards=2, shard_id="1"), TypeError, r"shard_id must be an int in \[0, 1\]"),
    (dict(num_shards=2, shard_id=0, shard_mode="even"), ValueError, r"shard_mode must be one of \('pad', 'exact'\)"),
    (dict(num_samples=0), ValueError, r"num_samples must be None or an int >= 1, got 0"),
])
def test_bad_shard_arguments_name_the_argument(kw, exc, match):
    with pytest.raises(exc, match=r"NumpySlicesDataset: " + match):
        NumpySlicesDataset(np.arange(4), **kw)
    if "shard_mode" not in kw:
        with pytest.raises(exc, match=r"GeneratorDataset: " + match):
            GeneratorDataset(list(range(4)), column_names="x", **kw)


def test_no_sharding_unless_asked():
    assert resolve_shards(None, None, "x") == (1, 0)
    ds = NumpySlicesDataset(np.arange(7), shuffle=False)
    assert (ds.num_shards, ds.shard_id) == (1, 0) and ds.get_dataset_size() == 7
    assert (ds.batch(2).num_shards, ds.batch(2).shard_id) == (1, 0)
    sharded = NumpySlicesDataset(np.arange(7), shuffle=False, num_shards=3, shard_id=2).batch(2)
    assert (sharded.num_shards, sharded.shard_id) == (3, 2)


@given(n=st.integers(1, 30), num_shards=st.integers(1, 5), shuffle=st.booleans(), epoch=st.integers(0, 5),
       mode=st.sampled_from(["pad", "exact"]))
def test_dataset_shards_cover_the_dataset(n, num_shards, shuffle, epoch, mode):
    values = np.arange(n) * 10
    rows = []
    for k in range(num_shards):
        ds = NumpySlicesDataset({"v": values}, shuffle=shuffle, num_shards=num_shards, shard_id=k, shard_mode=mode)
        got = [int(r[0]) for r in ds.epoch_iterator(epoch, output_numpy=True)]
        assert len(got) == ds.get_dataset_size()
        rows += got
    if mode == "exact":
        assert sorted(rows) == values.tolist()
    else:
        assert set(rows) == set(values.tolist()) and len(rows) == -(-n // num_shards) * num_shards
