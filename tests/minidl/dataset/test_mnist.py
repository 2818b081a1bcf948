"""MNIST IDX reader: files written here in the IDX format (gzipped or not), read back value for value."""
import gzip
import struct

import numpy as np
import pytest

from minidl.dataset.mnist import IMAGES_MAGIC, LABELS_MAGIC, load_mnist, read_idx

NAMES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def _idx_bytes(array, magic):
    return struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def _write(path, payload, gz):
    if gz:
        with gzip.open(str(path) + ".gz", "wb") as f:
            f.write(payload)
    else:
        path.write_bytes(payload)


def _write_split(folder, split, images, labels, gz=(False, False)):
    _write(folder / NAMES[split][0], _idx_bytes(images, IMAGES_MAGIC), gz[0])
    _write(folder / NAMES[split][1], _idx_bytes(labels, LABELS_MAGIC), gz[1])


def _random_split(seed, n):
    gen = np.random.default_rng(seed)
    return gen.integers(0, 256, (n, 28, 28), dtype=np.uint8), gen.integers(0, 10, n).astype(np.uint8)


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory):
    """Train files plain, test files gzipped: both kinds in one folder."""
    folder = tmp_path_factory.mktemp("mnist")
    data = {"train": _random_split(0, 300), "test": _random_split(1, 120)}
    _write_split(folder, "train", *data["train"])
    _write_split(folder, "test", *data["test"], gz=(True, True))
    return folder, data


@pytest.mark.parametrize("usage", ["train", "test", "all", None, "default"])
def test_load_mnist_reads_every_value(mnist_dir, usage):
    folder, data = mnist_dir
    images, labels = load_mnist(folder) if usage == "default" else load_mnist(folder, usage)
    # "all" (and None, as in MindSpore) is t10k then train: MindSpore reads the files in name order.
    splits = {"train": ["train"], "test": ["test"], "all": ["test", "train"], None: ["test", "train"],
              "default": ["train"]}[usage]
    want_images = np.concatenate([data[s][0] for s in splits])
    want_labels = np.concatenate([data[s][1] for s in splits])
    assert images.shape == (len(want_labels), 28, 28, 1) and images.dtype == np.uint8
    assert labels.dtype == np.int32 and images.flags.writeable
    np.testing.assert_array_equal(images[..., 0], want_images)
    np.testing.assert_array_equal(labels, want_labels)


@pytest.mark.parametrize("gz", [(False, True), (True, False)])
def test_mixed_gzip_and_other_image_sizes(tmp_path, gz):
    gen = np.random.default_rng(2)
    images = gen.integers(0, 256, (50, 5, 7), dtype=np.uint8)  # the header, not 28x28, sets the shape
    labels = gen.integers(0, 10, 50).astype(np.uint8)
    _write_split(tmp_path, "test", images, labels, gz=gz)
    got_images, got_labels = load_mnist(str(tmp_path), "test")
    np.testing.assert_array_equal(got_images, images[..., None])
    np.testing.assert_array_equal(got_labels, labels)


def test_uncompressed_file_wins_over_gz(tmp_path):
    images, labels = _random_split(3, 10)
    _write_split(tmp_path, "test", images, labels)
    _write_split(tmp_path, "test", 255 - images, labels, gz=(True, True))
    np.testing.assert_array_equal(load_mnist(tmp_path, "test")[0][..., 0], images)


def test_read_idx_hand_made_bytes(tmp_path):
    path = tmp_path / "labels"
    path.write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 3, 4, 0, 9]))
    assert read_idx(str(path), LABELS_MAGIC).tolist() == [4, 0, 9]
    path.write_bytes(bytes([0, 0, 8, 3, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3]) + bytes(range(6)))
    assert read_idx(str(path), IMAGES_MAGIC).tolist() == [[[0, 1, 2], [3, 4, 5]]]


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"MnistDataset: dataset_dir .*nothing' does not exist"):
        load_mnist(tmp_path / "nothing")
    images, labels = _random_split(4, 5)
    _write(tmp_path / NAMES["train"][0], _idx_bytes(images, IMAGES_MAGIC), False)
    with pytest.raises(FileNotFoundError, match=r"MnistDataset: missing train-labels-idx1-ubyte \(or .gz\) in .*; "
                                                r"expected files: train-images-idx3-ubyte, train-labels-idx1-ubyte"):
        load_mnist(tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="missing t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path, "test")


def test_bad_magic(tmp_path):
    images, labels = _random_split(5, 5)
    # image and label files swapped: each header announces the other kind
    _write(tmp_path / NAMES["test"][0], _idx_bytes(labels, LABELS_MAGIC), False)
    _write(tmp_path / NAMES["test"][1], _idx_bytes(images, IMAGES_MAGIC), False)
    with pytest.raises(ValueError, match=r"MnistDataset: .*t10k-images-idx3-ubyte has magic number 0x00000801; "
                                         r"expected 0x00000803 \(unsigned bytes, 3 dimensions\)"):
        load_mnist(tmp_path, "test")
    (tmp_path / NAMES["test"][0]).write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte is truncated: 2 bytes, shorter than the 4-byte"):
        load_mnist(tmp_path, "test")


def test_truncated_and_overlong_payloads(tmp_path):
    images, labels = _random_split(6, 20)
    payload = _idx_bytes(images, IMAGES_MAGIC)
    _write(tmp_path / NAMES["test"][1], _idx_bytes(labels, LABELS_MAGIC), False)
    _write(tmp_path / NAMES["test"][0], payload[:-100], True)
    with pytest.raises(ValueError, match=r"MnistDataset: .*t10k-images-idx3-ubyte.gz is truncated: header shape "
                                         r"\(20, 28, 28\) needs 15680 bytes of data, found 15580"):
        load_mnist(tmp_path, "test")
    (tmp_path / (NAMES["test"][0] + ".gz")).unlink()
    _write(tmp_path / NAMES["test"][0], payload + b"\x00\x01", False)
    with pytest.raises(ValueError, match=r"is longer than its header says: header shape \(20, 28, 28\) needs 15680 "
                                         r"bytes of data, found 15682"):
        load_mnist(tmp_path, "test")
    _write(tmp_path / NAMES["test"][0], payload[:10], False)
    with pytest.raises(ValueError, match=r"is truncated: 10 bytes, shorter than its 16-byte header"):
        load_mnist(tmp_path, "test")


def test_size_mismatch_counts_the_records_in_the_header_and_in_the_file(tmp_path):
    # 20 images of 28*28 = 784 bytes; the message ends with the counts a reader compares.
    images, labels = _random_split(11, 20)
    payload = _idx_bytes(images, IMAGES_MAGIC)
    _write(tmp_path / NAMES["test"][1], _idx_bytes(labels, LABELS_MAGIC), False)
    for cut, held in [(payload[:-100], "19 and 684 bytes of another"),  # 15580 = 19 * 784 + 684
                      (payload[:-784], "19"),  # cut at an image boundary: only the counts differ
                      (payload + b"\x00\x01", "20 and 2 bytes of another")]:
        _write(tmp_path / NAMES["test"][0], cut, False)
        with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte is .*; the header states 20 images, the file "
                                             rf"holds {held}$"):
            load_mnist(tmp_path, "test")
    _write(tmp_path / NAMES["test"][0], payload, False)
    _write(tmp_path / NAMES["test"][1], _idx_bytes(labels, LABELS_MAGIC)[:-1], False)
    with pytest.raises(ValueError, match=r"t10k-labels-idx1-ubyte is truncated: header shape \(20,\) needs 20 bytes "
                                         r"of data, found 19; the header states 20 labels, the file holds 19$"):
        load_mnist(tmp_path, "test")


def test_headers_with_a_zero_size(tmp_path):
    # No images at all: the header alone is a whole file, read as empty arrays.
    _write_split(tmp_path, "test", np.zeros((0, 28, 28), np.uint8), np.zeros(0, np.uint8))
    images, labels = load_mnist(tmp_path, "test")
    assert images.shape == (0, 28, 28, 1) and labels.shape == (0,) and labels.dtype == np.int32
    # Images of 0 rows need no data: 3 bytes are too many, and no image count can be given.
    _write(tmp_path / NAMES["test"][0], _idx_bytes(np.zeros((5, 0, 28), np.uint8), IMAGES_MAGIC) + b"abc", False)
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte is longer than its header says: header shape "
                                         r"\(5, 0, 28\) needs 0 bytes of data, found 3; the header states 5 images, "
                                         r"the file holds \?$"):
        load_mnist(tmp_path, "test")


def test_a_file_holding_only_the_magic_number(tmp_path):
    path = tmp_path / "labels"
    path.write_bytes(struct.pack(">I", LABELS_MAGIC))
    with pytest.raises(ValueError, match=r"MnistDataset: .*labels is truncated: 4 bytes, shorter than its 8-byte "
                                         r"header"):
        read_idx(str(path), LABELS_MAGIC)
    path.write_bytes(struct.pack(">I", LABELS_MAGIC)[:3])
    with pytest.raises(ValueError, match=r"labels is truncated: 3 bytes, shorter than the 4-byte magic number"):
        read_idx(str(path), LABELS_MAGIC)


def test_bad_magic_in_the_labels_file(tmp_path):
    images, labels = _random_split(12, 5)
    _write(tmp_path / NAMES["train"][0], _idx_bytes(images, IMAGES_MAGIC), False)
    _write(tmp_path / NAMES["train"][1], _idx_bytes(labels[:, None], 0x00000802), True)  # 2-D labels
    with pytest.raises(ValueError, match=r"MnistDataset: .*train-labels-idx1-ubyte.gz has magic number 0x00000802; "
                                         r"expected 0x00000801 \(unsigned bytes, 1 dimension\)$"):
        load_mnist(tmp_path, "train")


def test_read_idx_of_two_dimensions(tmp_path):
    # read_idx reads any IDX file of unsigned bytes; its messages count "records" for other kinds.
    magic = 0x00000802
    table = np.arange(12, dtype=np.uint8).reshape(4, 3)
    path = tmp_path / "table.gz"
    _write(tmp_path / "table", _idx_bytes(table, magic), True)
    np.testing.assert_array_equal(read_idx(str(path), magic), table)
    with pytest.raises(ValueError, match=r"table.gz has magic number 0x00000802; expected 0x00000803 \(unsigned bytes, "
                                         r"3 dimensions\)$"):
        read_idx(str(path), IMAGES_MAGIC)
    _write(tmp_path / "table", _idx_bytes(np.zeros((1, 2, 3), np.uint8), IMAGES_MAGIC), True)
    with pytest.raises(ValueError, match=r"table.gz has magic number 0x00000803; expected 0x00000802 \(unsigned bytes, "
                                         r"2 dimensions\)$"):
        read_idx(str(path), magic)
    _write(tmp_path / "table", _idx_bytes(table, magic)[:-2], True)
    with pytest.raises(ValueError, match=r"table.gz is truncated: header shape \(4, 3\) needs 12 bytes of data, "
                                         r"found 10; the header states 4 records, the file holds 3 and 1 bytes of "
                                         r"another$"):
        read_idx(str(path), magic)


def test_corrupt_gzip(tmp_path):
    images, labels = _random_split(7, 20)
    _write_split(tmp_path, "test", images, labels, gz=(True, False))
    path = tmp_path / (NAMES["test"][0] + ".gz")
    path.write_bytes(path.read_bytes()[:200])  # a download cut short
    with pytest.raises(ValueError, match=r"MnistDataset: .*t10k-images-idx3-ubyte.gz is not a valid gzip file"):
        load_mnist(tmp_path, "test")


def test_count_mismatch_and_label_range(tmp_path):
    images, labels = _random_split(8, 20)
    _write_split(tmp_path, "test", images, labels[:19])
    with pytest.raises(ValueError, match=r"MnistDataset: .*t10k-images-idx3-ubyte holds 20 images but "
                                         r".*t10k-labels-idx1-ubyte holds 19 labels; expected the same count"):
        load_mnist(tmp_path, "test")
    labels[[4, 11]] = [10, 255]
    _write_split(tmp_path, "test", images, labels)
    with pytest.raises(ValueError, match=r"MnistDataset: .*t10k-labels-idx1-ubyte label 4 is 10; expected 0..9 "
                                         r"\(2 labels out of range\)"):
        load_mnist(tmp_path, "test")


def test_bad_usage(mnist_dir):
    with pytest.raises(ValueError, match="MnistDataset: usage must be 'train', 'test' or 'all', got 'val'"):
        load_mnist(mnist_dir[0], "val")


# ---------------------------------------------------------------- the dataset

def test_mnist_dataset_without_usage_reads_test_then_train(mnist_dir):
    # As MindSpore 2.10's MnistDataset(path, shuffle=False): usage=None is "all", t10k files first.
    from minidl.dataset import MnistDataset
    folder, data = mnist_dir
    ds = MnistDataset(folder, shuffle=False)
    assert ds.usage == "all" and ds.get_dataset_size() == 120 + 300
    rows = list(ds.create_tuple_iterator(num_epochs=1, output_numpy=True))
    np.testing.assert_array_equal(np.stack([r[0] for r in rows])[..., 0],
                                  np.concatenate([data["test"][0], data["train"][0]]))
    np.testing.assert_array_equal(np.array([r[1] for r in rows]), np.concatenate([data["test"][1], data["train"][1]]))
    assert MnistDataset(folder, usage="train", shuffle=False).get_dataset_size() == 300


def test_mnist_dataset_columns_order_and_shards(mnist_dir):
    from minidl.dataset import MnistDataset
    folder, data = mnist_dir
    ds = MnistDataset(folder, usage="test", shuffle=False)
    assert ds.get_col_names() == ["image", "label"]
    assert ds.get_dataset_size() == 120
    rows = list(ds.create_tuple_iterator(num_epochs=1, output_numpy=True))
    np.testing.assert_array_equal(np.stack([r[0] for r in rows])[..., 0], data["test"][0])
    np.testing.assert_array_equal(np.array([r[1] for r in rows]), data["test"][1])
    assert rows[0][0].shape == (28, 28, 1)
    shards = [MnistDataset(folder, usage="test", shuffle=False, num_shards=4, shard_id=k) for k in range(4)]
    got = [r[0].tobytes() for ds in shards for r in ds.create_tuple_iterator(num_epochs=1, output_numpy=True)]
    assert all(ds.get_dataset_size() == 30 for ds in shards)
    assert sorted(got) == sorted(img[..., None].tobytes() for img in data["test"][0])  # each image once
    with pytest.raises(ValueError, match="num_shards"):
        MnistDataset(folder, usage="test", num_shards=0, shard_id=0)


# ---------------------------------------------------------------- usage=None / "all": the pairs present

@pytest.mark.parametrize("present", ["train", "test"])
def test_all_reads_the_one_pair_present(tmp_path, present):
    # As MindSpore 2.10: MnistDataset("MNIST_Data/train") (usage None) on a folder holding only the
    # train files reads them (its tutorials' layout); the same for a folder of t10k files alone.
    from minidl.dataset import MnistDataset
    images, labels = _random_split(9, 12)
    _write_split(tmp_path, present, images, labels, gz=(present == "test", False))
    for usage in (None, "all"):
        got_images, got_labels = load_mnist(tmp_path, usage)
        np.testing.assert_array_equal(got_images[..., 0], images)
        np.testing.assert_array_equal(got_labels, labels)
    ds = MnistDataset(str(tmp_path), shuffle=False)
    assert ds.get_dataset_size() == 12
    rows = list(ds.create_tuple_iterator(num_epochs=1, output_numpy=True))
    np.testing.assert_array_equal(np.array([r[1] for r in rows]), labels)
    other = "test" if present == "train" else "train"  # asked for by name, the missing pair still raises
    with pytest.raises(FileNotFoundError, match=f"MnistDataset: missing {NAMES[other][0]}, {NAMES[other][1]}"):
        MnistDataset(str(tmp_path), usage=other)


def test_all_without_any_pair_or_with_half_a_pair(tmp_path):
    (tmp_path / "README").write_text("not MNIST")
    with pytest.raises(FileNotFoundError, match=r"MnistDataset: no MNIST files in .*; expected the train pair, the "
                                                r"test pair or both: train-images-idx3-ubyte, train-labels-idx1-ubyte, "
                                                r"t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, each optionally"):
        load_mnist(tmp_path, None)
    images, labels = _random_split(10, 6)
    _write_split(tmp_path, "train", images, labels)
    _write(tmp_path / NAMES["test"][0], _idx_bytes(images, IMAGES_MAGIC), True)  # t10k images, no t10k labels
    # MindSpore raises too (as many image files as label files); here the missing file is named.
    with pytest.raises(FileNotFoundError, match=r"MnistDataset: missing t10k-labels-idx1-ubyte \(or .gz\)"):
        load_mnist(tmp_path, "all")


def test_mnist_dataset_passes_its_arguments_to_the_source(mnist_dir, tmp_path):
    """num_samples, seed, shard_mode and the folder reach the dataset (MindSpore's arguments)."""
    from minidl.dataset import MnistDataset
    folder, data = mnist_dir
    ds = MnistDataset(folder, usage="test", num_samples=7, shuffle=False)
    assert ds.get_dataset_size() == 7 and ds.dataset_dir == str(folder) and ds.usage == "test"
    assert ds.get_col_names() == ["image", "label"]

    def labels(seed):
        ds = MnistDataset(folder, usage="test", shuffle=True, seed=seed)
        return [int(r[1]) for r in ds.create_tuple_iterator(num_epochs=1, output_numpy=True)]

    assert labels(1) == labels(1) != labels(2)  # the seed given, not the global one, orders the rows
    exact = MnistDataset(folder, usage="test", shuffle=False, num_shards=7, shard_id=6, shard_mode="exact")
    assert exact.shard_mode == "exact" and exact.get_dataset_size() == 17  # 120 = 7 * 17 + 1: no padding
    assert MnistDataset(folder, usage="test", shuffle=False, num_shards=7, shard_id=6).get_dataset_size() == 18
    with pytest.raises(ValueError, match="shard_mode"):
        MnistDataset(folder, usage="test", num_shards=2, shard_id=0, shard_mode="spread")
