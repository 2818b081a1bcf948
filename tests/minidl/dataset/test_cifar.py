"""CIFAR-10 binary reader: files written here in the official format, read back value for value."""
import os

import numpy as np
import pytest

from minidl.dataset.cifar import RECORD_BYTES, TEST_FILES, TRAIN_FILES, load_cifar10


def _write_cifar(path, images, labels):
    """Writes records the way the official release does: label byte, then R, G and B planes."""
    records = np.empty((len(labels), RECORD_BYTES), np.uint8)
    records[:, 0] = labels
    records[:, 1:] = images.transpose(0, 3, 1, 2).reshape(len(labels), -1)
    records.tofile(path)


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    """A parent folder holding cifar-10-batches-bin/ with 5 train files and a test file of random records."""
    root = tmp_path_factory.mktemp("cifar")
    folder = root / "cifar-10-batches-bin"
    folder.mkdir()
    gen = np.random.default_rng(0)
    data = {}
    for i, name in enumerate(TRAIN_FILES + TEST_FILES):
        n = 40 + 7 * i  # unequal files, so a mix-up of order or offsets shows
        images = gen.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        labels = gen.integers(0, 10, n).astype(np.uint8)
        _write_cifar(folder / name, images, labels)
        data[name] = (images, labels)
    (folder / "batches.meta.txt").write_text("airplane\nautomobile\n")  # present in the release; ignored
    return root, data


def _expected(data, names):
    return (np.concatenate([data[n][0] for n in names]),
            np.concatenate([data[n][1] for n in names]).astype(np.int32))


@pytest.mark.parametrize("usage, names", [("train", TRAIN_FILES), ("test", TEST_FILES),
                                          ("all", TRAIN_FILES + TEST_FILES), (None, TRAIN_FILES + TEST_FILES),
                                          ("default", TRAIN_FILES)])
def test_load_cifar10_reads_every_value(cifar_root, usage, names):
    root, data = cifar_root
    # None means "all", as in MindSpore; the array loader's own default is "train".
    images, labels = load_cifar10(root) if usage == "default" else load_cifar10(root, usage=usage)
    want_images, want_labels = _expected(data, names)
    assert images.dtype == np.uint8 and images.shape == (len(want_labels), 32, 32, 3)
    assert labels.dtype == np.int32 and images.flags.c_contiguous and images.flags.writeable
    np.testing.assert_array_equal(images, want_images)
    np.testing.assert_array_equal(labels, want_labels)


def test_load_cifar10_accepts_the_folder_itself_as_a_string(cifar_root):
    root, data = cifar_root
    images, labels = load_cifar10(str(root / "cifar-10-batches-bin"), "test")
    np.testing.assert_array_equal(images, data["test_batch.bin"][0])


def test_hand_made_record_maps_rgb_planes_to_hwc(tmp_path):
    r_plane = [(3 * k) % 256 for k in range(1024)]  # pixel (i, j) is byte i * 32 + j of each plane
    g_plane = [(k // 32) for k in range(1024)]
    b_plane = [255 - (k % 32) for k in range(1024)]
    second = [9] + [1] * 1024 + [2] * 1024 + [3] * 1024
    (tmp_path / "test_batch.bin").write_bytes(bytes([7] + r_plane + g_plane + b_plane + second))
    images, labels = load_cifar10(tmp_path, "test")
    assert labels.tolist() == [7, 9]
    for i, j in [(0, 0), (0, 1), (1, 0), (5, 17), (31, 31)]:
        k = i * 32 + j
        assert images[0, i, j].tolist() == [(3 * k) % 256, i, 255 - j]
    assert (images[1] == [1, 2, 3]).all()


def test_missing_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=r"Cifar10Dataset: dataset_dir .*nowhere' does not exist or is "
                                                r"not a directory; expected the unpacked 'cifar-10-batches-bin'"):
        load_cifar10(missing)


def test_missing_files_are_listed(cifar_root, tmp_path):
    root, data = cifar_root
    _write_cifar(tmp_path / "data_batch_1.bin", *data["data_batch_1.bin"])
    _write_cifar(tmp_path / "data_batch_3.bin", *data["data_batch_3.bin"])
    with pytest.raises(FileNotFoundError, match=r"Cifar10Dataset: missing data_batch_2.bin, data_batch_4.bin, "
                                                r"data_batch_5.bin in .* for usage='train'; expected files: "
                                                r"data_batch_1.bin, data_batch_2.bin, .*data_batch_5.bin"):
        load_cifar10(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"missing data_batch_2.bin, .*, test_batch.bin in .* for usage='all'"):
        load_cifar10(tmp_path, "all")


def test_truncated_file_names_file_size_and_record_size(tmp_path):
    gen = np.random.default_rng(1)
    _write_cifar(tmp_path / "test_batch.bin", gen.integers(0, 256, (3, 32, 32, 3), dtype=np.uint8), [1, 2, 3])
    path = tmp_path / "test_batch.bin"
    with open(path, "r+b") as f:
        f.truncate(3 * RECORD_BYTES - 100)
    with pytest.raises(ValueError, match=rf"Cifar10Dataset: .*test_batch.bin is truncated .*its size "
                                         rf"{3 * RECORD_BYTES - 100} bytes is not a multiple of the record size "
                                         rf"3073 .*2973 bytes left over"):
        load_cifar10(tmp_path, "test")
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"Cifar10Dataset: .*test_batch.bin is empty; expected records of 3073"):
        load_cifar10(tmp_path, "test")


def test_label_out_of_range_names_file_record_and_value(tmp_path):
    labels = np.array([0, 9, 3, 12, 200], np.uint8)
    _write_cifar(tmp_path / "test_batch.bin", np.zeros((5, 32, 32, 3), np.uint8), labels)
    with pytest.raises(ValueError, match=r"Cifar10Dataset: .*test_batch.bin record 3 has label 12; expected "
                                         r"0..9 \(2 records out of range\)"):
        load_cifar10(tmp_path, "test")


def test_bad_usage():
    with pytest.raises(ValueError, match="load_cifar10: usage must be 'train', 'test' or 'all', got 'valid'"):
        load_cifar10(".", "valid")


# ---------------------------------------------------------------- the dataset

def _rows(ds):
    return list(ds.create_tuple_iterator(num_epochs=1, output_numpy=True))


def test_cifar10_dataset_yields_image_and_label_columns(cifar_root):
    from minidl.dataset import Cifar10Dataset
    root, data = cifar_root
    ds = Cifar10Dataset(os.fspath(root), usage="test", shuffle=False, num_parallel_workers=4)
    want_images, want_labels = _expected(data, TEST_FILES)
    assert ds.get_col_names() == ["image", "label"]
    assert ds.get_dataset_size() == len(want_labels)
    rows = _rows(ds)
    np.testing.assert_array_equal(np.stack([r[0] for r in rows]), want_images)
    np.testing.assert_array_equal(np.array([r[1] for r in rows]), want_labels)
    assert rows[0][0].shape == (32, 32, 3) and rows[0][0].dtype == np.uint8


def test_cifar10_dataset_without_usage_reads_train_then_test(cifar_root):
    # MindSpore's usage=None is "all": its reader takes the .bin files in name order.
    from minidl.dataset import Cifar10Dataset
    root, data = cifar_root
    ds = Cifar10Dataset(root, shuffle=False)
    want_images, want_labels = _expected(data, TRAIN_FILES + TEST_FILES)
    assert ds.usage == "all" and ds.get_dataset_size() == len(want_labels)
    rows = _rows(ds)
    np.testing.assert_array_equal(np.stack([r[0] for r in rows]), want_images)
    np.testing.assert_array_equal(np.array([r[1] for r in rows]), want_labels)
    assert Cifar10Dataset(root, usage="train", shuffle=False).get_dataset_size() == \
        sum(len(data[n][1]) for n in TRAIN_FILES)


def test_cifar10_dataset_shards_and_samples(cifar_root):
    from minidl.dataset import Cifar10Dataset
    root, data = cifar_root
    want_images, want_labels = _expected(data, TEST_FILES)
    n = len(want_labels)
    shards = [Cifar10Dataset(root, usage="test", shuffle=True, num_shards=3, shard_id=k) for k in range(3)]
    sizes = {ds.get_dataset_size() for ds in shards}
    assert sizes == {-(-n // 3)}  # pad mode: every shard ceil(n / 3) rows
    seen = np.concatenate([np.stack([r[0] for r in _rows(ds)]) for ds in shards])
    flat = {img.tobytes() for img in seen}
    assert flat == {img.tobytes() for img in want_images}  # every image appears, none invented
    assert Cifar10Dataset(root, usage="test", num_samples=5, shuffle=False).get_dataset_size() == 5
    with pytest.raises(ValueError, match="shard_id"):
        Cifar10Dataset(root, usage="test", num_shards=2, shard_id=2)


def test_cifar10_dataset_exact_shards_partition_the_test_set(cifar_root):
    from minidl.dataset import Cifar10Dataset
    root, data = cifar_root
    want_images, _ = _expected(data, TEST_FILES)
    shards = [Cifar10Dataset(root, usage="test", num_shards=4, shard_id=k, shard_mode="exact", seed=3)
              for k in range(4)]
    got = [r[0].tobytes() for ds in shards for r in _rows(ds)]
    assert sorted(got) == sorted(img.tobytes() for img in want_images)  # each image exactly once


def test_cifar10_augmented_pipeline_is_a_function_of_seed_and_epoch(cifar_root):
    from minidl.dataset import Cifar10Dataset, vision
    root, _ = cifar_root

    def pipeline():
        ds = Cifar10Dataset(root, usage="test", shuffle=True, seed=7).batch(16, drop_remainder=True)
        return ds.map([vision.RandomCrop(32, padding=4), vision.RandomHorizontalFlip(),
                       vision.Normalize([125.3, 123.0, 113.9], [63.0, 62.1, 66.7]), vision.HWC2CHW()],
                      input_columns="image")

    def epoch(ds, e):
        return [b[0] for b in ds.epoch_iterator(e, output_numpy=True)]

    first = epoch(pipeline(), 0)
    assert len(first) == len(cifar_root[1]["test_batch.bin"][1]) // 16
    assert first[0].shape == (16, 3, 32, 32) and first[0].dtype == np.float32
    again = epoch(pipeline(), 0)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not np.array_equal(first[0], epoch(pipeline(), 1)[0])
