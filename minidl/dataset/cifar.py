"""CIFAR-10 in its official binary release (``cifar-10-batches-bin/``), as arrays or a dataset.

Each ``.bin`` file is a run of 3073-byte records: one label byte, then the 32x32 image as
three 1024-byte planes (red, green, blue), each row-major. The planes are read with one
``numpy.memmap`` per file and turned into HWC by a reshape and a transpose, so loading costs
one copy of the data and no Python loop per record.

The format has no header, so a file cut exactly at a record boundary looks whole. Every file
of the release holds 10000 records: when any standard file in the folder holds exactly that
many (the folder is the release), a file read with fewer raises, naming both counts. A folder
whose files all hold fewer (a cut-down copy, as tests make) is read as it is.
"""
import os

import numpy

from .sources import NumpySlicesDataset

FOLDER = "cifar-10-batches-bin"
TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
IMAGE_SHAPE = (32, 32, 3)
RECORD_BYTES = 1 + 32 * 32 * 3
NUM_CLASSES = 10
RECORDS_PER_FILE = 10000  # every file of the official release: 5 x 10000 training, 10000 test images

_USAGE_FILES = {"train": TRAIN_FILES, "test": TEST_FILES, "all": TRAIN_FILES + TEST_FILES}


def _resolve_usage(usage, name):
    usage = "all" if usage is None else usage  # MindSpore: no usage means every file
    if usage not in _USAGE_FILES:
        raise ValueError(f"{name}: usage must be 'train', 'test' or 'all', got {usage!r}")
    return usage


def _resolve_dir(dataset_dir):
    """The folder holding the .bin files: ``dataset_dir`` itself or its ``cifar-10-batches-bin``."""
    dataset_dir = os.fspath(dataset_dir)
    if not os.path.isdir(dataset_dir):
        raise FileNotFoundError(f"Cifar10Dataset: dataset_dir {dataset_dir!r} does not exist or is not a "
                                f"directory; expected the unpacked '{FOLDER}' folder or its parent")
    inner = os.path.join(dataset_dir, FOLDER)
    return inner if os.path.isdir(inner) else dataset_dir


def _check_size(path):
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"Cifar10Dataset: {path} is empty; expected records of {RECORD_BYTES} bytes "
                         f"(1 label byte + 3072 image bytes)")
    if size % RECORD_BYTES:
        raise ValueError(f"Cifar10Dataset: {path} is truncated or not a CIFAR-10 binary file: its size "
                         f"{size} bytes is not a multiple of the record size {RECORD_BYTES} "
                         f"(1 label byte + 3072 image bytes); {size % RECORD_BYTES} bytes left over")
    return size // RECORD_BYTES


def _check_release_counts(folder, paths, counts):
    """Raises when the folder is the official release (a standard file, read or not, holds its
    10000 records) but a file read holds fewer: cut at a record boundary, its tail is lost."""
    full = [name for name in TRAIN_FILES + TEST_FILES
            if os.path.isfile(os.path.join(folder, name))
            and os.path.getsize(os.path.join(folder, name)) == RECORDS_PER_FILE * RECORD_BYTES]
    if not full:
        return
    for path, count in zip(paths, counts):
        if count < RECORDS_PER_FILE:
            raise ValueError(f"Cifar10Dataset: {path} is truncated: it holds {count} records of {RECORD_BYTES} "
                             f"bytes, but every file of the CIFAR-10 binary release holds {RECORDS_PER_FILE} (as "
                             f"{full[0]} in the same folder does); {RECORDS_PER_FILE - count} records are missing. "
                             f"Download and unpack the release again")


def load_cifar10(dataset_dir, usage="train"):
    """Reads CIFAR-10 binary files into arrays.

    Args:
        dataset_dir: the ``cifar-10-batches-bin`` folder, or the folder that contains it.
        usage: "train" (data_batch_1..5.bin), "test" (test_batch.bin) or "all" (train, then
            test, the files in name order as MindSpore reads them); None means "all".

    Returns:
        (images, labels): uint8 of shape (N, 32, 32, 3) (HWC, RGB) and int32 of shape (N,).

    Example:
        >>> images, labels = load_cifar10("data/cifar-10-batches-bin", usage="test")  # doctest: +SKIP
        >>> images.shape, labels.dtype  # doctest: +SKIP
        ((10000, 32, 32, 3), dtype('int32'))
    """
    usage = _resolve_usage(usage, "load_cifar10")
    folder = _resolve_dir(dataset_dir)
    names = _USAGE_FILES[usage]
    paths = [os.path.join(folder, name) for name in names]
    missing = [name for name, path in zip(names, paths) if not os.path.isfile(path)]
    if missing:
        raise FileNotFoundError(f"Cifar10Dataset: missing {', '.join(missing)} in {folder} for usage={usage!r}; "
                                f"expected files: {', '.join(names)}")
    counts = [_check_size(path) for path in paths]
    _check_release_counts(folder, paths, counts)
    images = numpy.empty((sum(counts),) + IMAGE_SHAPE, dtype=numpy.uint8)
    labels = numpy.empty(sum(counts), dtype=numpy.int32)
    start = 0
    for path, count in zip(paths, counts):
        records = numpy.memmap(path, dtype=numpy.uint8, mode="r", shape=(count, RECORD_BYTES))
        file_labels = records[:, 0]
        bad = numpy.flatnonzero(file_labels >= NUM_CLASSES)
        if bad.size:
            raise ValueError(f"Cifar10Dataset: {path} record {bad[0]} has label {file_labels[bad[0]]}; "
                             f"expected 0..{NUM_CLASSES - 1} ({bad.size} records out of range)")
        labels[start:start + count] = file_labels
        # (count, 3, 32, 32) planes -> (count, 32, 32, 3): the assignment is the only copy.
        images[start:start + count] = records[:, 1:].reshape(count, 3, 32, 32).transpose(0, 2, 3, 1)
        start += count
        del records  # closes the map before the next file
    return images, labels


class Cifar10Dataset(NumpySlicesDataset):
    """CIFAR-10 from its binary release, with columns ``image`` (uint8 HWC) and ``label`` (int32).

    Args:
        dataset_dir: the ``cifar-10-batches-bin`` folder, or the folder that contains it.
        usage: "train" (50000 images), "test" (10000) or "all" (60000: train, then test); the
            default, None, means "all", as in MindSpore.
        num_samples: at most this many rows per shard and epoch (default: all).
        num_parallel_workers: accepted for MindSpore compatibility and ignored: the files are
            read once, up front, with memory maps, so there is nothing to parallelise.
        shuffle: reshuffle every epoch, from (seed, epoch) only (default True, as MindSpore).
        num_shards: split every epoch into this many shards (default: none; under data
            parallelism pass the group size, e.g. ``get_group_size()``, as in MindSpore).
        shard_id: the shard this dataset yields, 0 <= shard_id < num_shards.
        shard_mode: "pad" (equal shard lengths, wrapping around, for training) or "exact"
            (every sample exactly once over all shards, for evaluation).
        seed: the seed of the shuffle and of random transforms (default: minidl.get_seed()).

    Example:
        >>> ds = Cifar10Dataset("data/cifar-10-batches-bin", usage="train", shuffle=True)  # doctest: +SKIP
        >>> ds = ds.map(vision.RandomCrop(32, 4), input_columns="image").batch(128)  # doctest: +SKIP
    """

    def __init__(self, dataset_dir, usage=None, num_samples=None, num_parallel_workers=None, shuffle=None,
                 num_shards=None, shard_id=None, shard_mode="pad", seed=None):
        usage = _resolve_usage(usage, "Cifar10Dataset")
        images, labels = load_cifar10(dataset_dir, usage)
        self.dataset_dir = os.fspath(dataset_dir)
        self.usage = usage
        super().__init__({"image": images, "label": labels}, column_names=["image", "label"],
                         num_samples=num_samples, shuffle=shuffle, num_shards=num_shards, shard_id=shard_id,
                         shard_mode=shard_mode, seed=seed)
