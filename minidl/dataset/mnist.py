"""MNIST in its IDX files (``train-images-idx3-ubyte`` ...), gzipped or not, as arrays or a dataset.

An IDX file is a big-endian header (magic ``0x000008NN``: unsigned bytes, NN dimensions, then
one 4-byte size per dimension) followed by the values, row-major. The header is checked
against the payload so that a truncated download fails loudly instead of yielding fewer images.
"""
import gzip
import os

import numpy

from .sources import NumpySlicesDataset

IMAGES_MAGIC = 0x00000803  # unsigned bytes, 3 dimensions (count, rows, cols)
LABELS_MAGIC = 0x00000801  # unsigned bytes, 1 dimension (count)
NUM_CLASSES = 10

_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# MindSpore reads the files in name order, so "all" is t10k (test) before train.
_USAGE_SPLITS = {"train": ("train",), "test": ("test",), "all": ("test", "train")}


def _find(folder, name):
    """The path of ``name`` or ``name.gz`` in folder (uncompressed first), or None."""
    for candidate in (name, name + ".gz"):
        path = os.path.join(folder, candidate)
        if os.path.isfile(path):
            return path
    return None


def read_idx(path, magic):
    """Reads an IDX file of unsigned bytes (optionally gzipped) into a uint8 array.

    Args:
        path: the file; a name ending in ``.gz`` is decompressed.
        magic: the expected magic number (``IMAGES_MAGIC`` or ``LABELS_MAGIC``).

    Returns:
        uint8 array of the shape the header gives.
    """
    if path.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            try:
                raw = numpy.frombuffer(f.read(), dtype=numpy.uint8)
            except (OSError, EOFError) as e:  # a cut-off .gz fails here, not at open
                raise ValueError(f"MnistDataset: {path} is not a valid gzip file: {e}") from e
    else:
        raw = numpy.fromfile(path, dtype=numpy.uint8)
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if raw.size < 4:
        raise ValueError(f"MnistDataset: {path} is truncated: {raw.size} bytes, shorter than the 4-byte magic number")
    found = int.from_bytes(raw[:4].tobytes(), "big")
    if found != magic:
        raise ValueError(f"MnistDataset: {path} has magic number 0x{found:08X}; expected 0x{magic:08X} "
                         f"(unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})")
    if raw.size < header:
        raise ValueError(f"MnistDataset: {path} is truncated: {raw.size} bytes, shorter than its "
                         f"{header}-byte header")
    shape = tuple(int(d) for d in raw[4:header].view(">u4"))
    expected = int(numpy.prod(shape))
    actual = raw.size - header
    if actual != expected:
        what = "truncated" if actual < expected else "longer than its header says"
        raise ValueError(f"MnistDataset: {path} is {what}: header shape {shape} needs {expected} bytes of "
                         f"data, found {actual}; {_records_found(shape, actual, magic)}")
    return raw[header:].reshape(shape)


def _records_found(shape, actual, magic):
    """'the header states N images, the file holds M': the counts a reader compares (a file cut
    at a record boundary differs from its header only in them)."""
    kind = {IMAGES_MAGIC: "images", LABELS_MAGIC: "labels"}.get(magic, "records")
    record = int(numpy.prod(shape[1:]))  # bytes per image (1 per label)
    held = f"{actual // record}" if record else "?"
    partial = actual % record if record else 0
    tail = f" and {partial} bytes of another" if partial else ""
    return f"the header states {shape[0]} {kind}, the file holds {held}{tail}"


def _load_split(folder, split):
    names = _FILES[split]
    paths = [_find(folder, name) for name in names]
    missing = [name for name, path in zip(names, paths) if path is None]
    if missing:
        raise FileNotFoundError(f"MnistDataset: missing {', '.join(missing)} (or .gz) in {folder}; "
                                f"expected files: {', '.join(names)}, each optionally gzipped")
    images = read_idx(paths[0], IMAGES_MAGIC)
    labels = read_idx(paths[1], LABELS_MAGIC)
    if len(images) != len(labels):
        raise ValueError(f"MnistDataset: {paths[0]} holds {len(images)} images but {paths[1]} holds "
                         f"{len(labels)} labels; expected the same count")
    bad = numpy.flatnonzero(labels >= NUM_CLASSES)
    if bad.size:
        raise ValueError(f"MnistDataset: {paths[1]} label {bad[0]} is {labels[bad[0]]}; expected "
                         f"0..{NUM_CLASSES - 1} ({bad.size} labels out of range)")
    return images, labels


def load_mnist(dataset_dir, usage="train"):
    """Reads MNIST IDX files into arrays.

    Args:
        dataset_dir: the folder holding ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
            ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte`` (each may end in ``.gz``).
        usage: "train", "test" or "all" (test, then train, as MindSpore orders them); None
            means "all". "train" and "test" need their two files; "all" reads whichever of
            the two pairs the folder holds (at least one).

    Returns:
        (images, labels): uint8 of shape (N, 28, 28, 1) (HWC, as MindSpore) and int32 of shape (N,).

    Example:
        >>> images, labels = load_mnist("data/mnist", usage="test")  # doctest: +SKIP
        >>> images.shape  # doctest: +SKIP
        (10000, 28, 28, 1)
    """
    usage = "all" if usage is None else usage  # MindSpore: no usage means every file
    if usage not in _USAGE_SPLITS:
        raise ValueError(f"MnistDataset: usage must be 'train', 'test' or 'all', got {usage!r}")
    folder = os.fspath(dataset_dir)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"MnistDataset: dataset_dir {folder!r} does not exist or is not a directory; "
                                f"expected the folder holding the MNIST IDX files")
    splits = _USAGE_SPLITS[usage]
    if usage == "all":
        # MindSpore's "all" reads whichever pairs are present: its tutorials call
        # MnistDataset("MNIST_Data/train") on a folder holding only the train files. A pair
        # with one of its two files present still fails in _load_split, naming the other.
        splits = tuple(split for split in splits if any(_find(folder, name) for name in _FILES[split]))
        if not splits:
            expected = ", ".join(_FILES["train"] + _FILES["test"])
            raise FileNotFoundError(f"MnistDataset: no MNIST files in {folder}; expected the train pair, the test "
                                    f"pair or both: {expected}, each optionally gzipped")
    parts = [_load_split(folder, split) for split in splits]
    images = numpy.concatenate([p[0] for p in parts]) if len(parts) > 1 else parts[0][0]
    labels = numpy.concatenate([p[1] for p in parts]) if len(parts) > 1 else parts[0][1]
    # A fresh, writable copy with the channel axis that HWC transforms expect.
    return images[..., None].copy(), labels.astype(numpy.int32)


class MnistDataset(NumpySlicesDataset):
    """MNIST from its IDX files, with columns ``image`` (uint8, 28x28x1 HWC) and ``label`` (int32).

    Args:
        dataset_dir: the folder holding the IDX files (each may be gzipped): the train pair,
            the test (t10k) pair, or both.
        usage: "train" (60000 images), "test" (10000) or "all" (70000: test, then train, in
            MindSpore's order); the default, None, means "all", as in MindSpore. "all" reads
            whichever pairs are present, so ``MnistDataset("MNIST_Data/train")`` on a folder
            with only the train files reads those; "train" and "test" need their files.
        num_samples: at most this many rows per shard and epoch (default: all).
        num_parallel_workers: accepted for MindSpore compatibility and ignored (files are read
            once, up front).
        shuffle: reshuffle every epoch, from (seed, epoch) only (default True, as MindSpore).
        num_shards: split every epoch into this many shards (default: none; under data
            parallelism pass the group size, e.g. ``get_group_size()``, as in MindSpore).
        shard_id: the shard this dataset yields, 0 <= shard_id < num_shards.
        shard_mode: "pad" (equal shard lengths, wrapping around, for training) or "exact"
            (every sample exactly once over all shards, for evaluation).
        seed: the seed of the shuffle and of random transforms (default: minidl.get_seed()).

    Example:
        >>> ds = MnistDataset("data/mnist", usage="test", shuffle=False).batch(32)  # doctest: +SKIP
    """

    def __init__(self, dataset_dir, usage=None, num_samples=None, num_parallel_workers=None, shuffle=None,
                 num_shards=None, shard_id=None, shard_mode="pad", seed=None):
        images, labels = load_mnist(dataset_dir, usage)
        self.dataset_dir = os.fspath(dataset_dir)
        self.usage = "all" if usage is None else usage
        super().__init__({"image": images, "label": labels}, column_names=["image", "label"],
                         num_samples=num_samples, shuffle=shuffle, num_shards=num_shards, shard_id=shard_id,
                         shard_mode=shard_mode, seed=seed)
