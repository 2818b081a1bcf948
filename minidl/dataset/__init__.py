"""Datasets with MindSpore's names: sources, a map/shuffle/batch/repeat pipeline, sharding.

    from minidl.dataset import Cifar10Dataset, vision, transforms
    ds = Cifar10Dataset("cifar-10-batches-bin", usage="train", shuffle=True)
    ds = ds.batch(128, drop_remainder=True)
    ds = ds.map([vision.RandomCrop(32, 4), vision.RandomHorizontalFlip(),
                 vision.Rescale(1 / 255, 0), vision.HWC2CHW()], input_columns="image")
    for image, label in ds.create_tuple_iterator(num_epochs=1):
        ...

Every random decision (the shuffle order, random transforms) is a function of (seed, epoch,
position) only, so data-parallel ranks agree without communicating and a run resumed with
``epoch_iterator(epoch, skip_batches=step)`` sees the same data as an uninterrupted one.

A dataset is sharded only when its source is given ``num_shards`` and ``shard_id``; under
data parallelism each rank asks for its own shard, as in MindSpore:

    ds = Cifar10Dataset(path, usage="train", num_shards=get_group_size(), shard_id=get_rank())
"""
from .engine import Dataset, MapDataset, ShuffleDataset, BatchDataset, RepeatDataset, DatasetIterator
from .sources import SourceDataset, NumpySlicesDataset, GeneratorDataset
from .prefetch import set_prefetch_size, get_prefetch_size
from . import sharding, vision, transforms
from .cifar import Cifar10Dataset, load_cifar10
from .mnist import MnistDataset, load_mnist

__all__ = ["Dataset", "MapDataset", "ShuffleDataset", "BatchDataset", "RepeatDataset", "DatasetIterator",
           "SourceDataset", "NumpySlicesDataset", "GeneratorDataset", "Cifar10Dataset", "MnistDataset",
           "load_cifar10", "load_mnist", "set_prefetch_size", "get_prefetch_size", "sharding", "vision",
           "transforms"]
