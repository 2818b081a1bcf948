"""Datasets are sharded only when the script asks (num_shards=, shard_id=), never by the world.

As in MindSpore and PyTorch: a source built without num_shards reads every row on every
rank, whatever the parallel mode; a data-parallel script shards it explicitly.
"""
import numpy as np
import pytest

import minidl.dataset
from minidl.dataset import GeneratorDataset, NumpySlicesDataset
from minidl_parallel import ParallelMode, get_group_size, get_rank, run_threads, set_auto_parallel_context


def _rows(ds):
    return sorted(int(r[0]) for r in ds.epoch_iterator(0, output_numpy=True))


@pytest.mark.parametrize("mode", [None, ParallelMode.DATA_PARALLEL])
def test_a_source_without_num_shards_reads_every_row_on_every_rank(mode):
    def rank_body():
        if mode is not None:
            set_auto_parallel_context(parallel_mode=mode)
        sources = [NumpySlicesDataset(np.arange(7)), GeneratorDataset(list(range(7)), column_names="x"),
                   GeneratorDataset(lambda: iter(range(7)), column_names="x")]
        pipelines = [ds.map(lambda v: v, input_columns=ds.get_col_names()[0]).shuffle(4) for ds in sources]
        return [(ds.num_shards, ds.get_dataset_size(), _rows(ds)) for ds in pipelines]

    for per_source in run_threads(3, rank_body):
        assert per_source == [(1, 7, list(range(7)))] * 3


def test_explicit_shards_split_the_rows_between_the_ranks():
    def rank_body():
        ds = NumpySlicesDataset(np.arange(7), shuffle=False, num_shards=get_group_size(), shard_id=get_rank())
        return _rows(ds)

    assert run_threads(2, rank_body) == [[0, 2, 4, 6], [0, 1, 3, 5]]  # pad: shard 1 wraps around to row 0


def test_the_default_shards_registry_is_gone():
    assert not hasattr(minidl.dataset, "set_default_shards")
    assert not hasattr(minidl.dataset.sharding, "get_default_shards")
