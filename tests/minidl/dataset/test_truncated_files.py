"""Data files with fewer records than their format states raise, naming the file and both counts.

A CIFAR-10 binary file has no header: cut exactly at a record boundary it still looks whole, so
the release's own count (10000 records in every file) is what shows it. MNIST's IDX header
states the count of images and of labels.
"""
import struct

import numpy as np
import pytest

from minidl.dataset import Cifar10Dataset
from minidl.dataset.cifar import RECORD_BYTES, RECORDS_PER_FILE, TEST_FILES, TRAIN_FILES, load_cifar10
from minidl.dataset.mnist import IMAGES_MAGIC, LABELS_MAGIC, load_mnist


def _release(folder, records=None):
    """The six files of the release, zero records (label 0, black images) of its exact sizes, written
    sparse so that they cost no disk; ``records`` gives some files another count."""
    records = records or {}
    for name in TRAIN_FILES + TEST_FILES:
        with open(folder / name, "wb") as f:
            f.truncate(records.get(name, RECORDS_PER_FILE) * RECORD_BYTES)


def test_the_release_loads_whole(tmp_path):
    _release(tmp_path)
    images, labels = load_cifar10(tmp_path, "test")
    assert images.shape == (RECORDS_PER_FILE, 32, 32, 3) and labels.shape == (RECORDS_PER_FILE,)


def test_a_test_batch_cut_at_a_record_boundary_raises_naming_the_file_and_both_counts(tmp_path):
    _release(tmp_path, {"test_batch.bin": 9000})
    with pytest.raises(ValueError, match=r"Cifar10Dataset: .*test_batch.bin is truncated: it holds 9000 records of "
                                         r"3073 bytes, but every file of the CIFAR-10 binary release holds 10000 "
                                         r"\(as data_batch_1.bin in the same folder does\); 1000 records are "
                                         r"missing"):
        load_cifar10(tmp_path, "test")
    with pytest.raises(ValueError, match=r"test_batch.bin is truncated: it holds 9000 records"):
        Cifar10Dataset(str(tmp_path), usage="all")


def test_a_train_file_cut_at_a_record_boundary_raises(tmp_path):
    _release(tmp_path, {"data_batch_3.bin": 9999})
    with pytest.raises(ValueError, match=r"data_batch_3.bin is truncated: it holds 9999 records.*1 records are "
                                         r"missing"):
        load_cifar10(tmp_path, "train")
    assert load_cifar10(tmp_path, "test")[0].shape[0] == RECORDS_PER_FILE  # the other files still read


def test_a_cut_down_copy_with_fewer_records_in_every_file_is_read_as_it_is(tmp_path):
    _release(tmp_path, {name: 16 for name in TRAIN_FILES + TEST_FILES})
    images, _ = load_cifar10(tmp_path, "all")
    assert images.shape[0] == 6 * 16


def _idx(array, magic):
    return struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def _mnist(folder, n_images=20, n_labels=20, cut_images=0, cut_labels=0):
    gen = np.random.default_rng(0)
    images = _idx(gen.integers(0, 256, (n_images, 28, 28), dtype=np.uint8), IMAGES_MAGIC)
    labels = _idx(gen.integers(0, 10, n_labels).astype(np.uint8), LABELS_MAGIC)
    (folder / "t10k-images-idx3-ubyte").write_bytes(images[:len(images) - cut_images])
    (folder / "t10k-labels-idx1-ubyte").write_bytes(labels[:len(labels) - cut_labels])


def test_mnist_images_cut_at_an_image_boundary_name_both_counts(tmp_path):
    _mnist(tmp_path, cut_images=2 * 784)
    with pytest.raises(ValueError, match=r"MnistDataset: .*t10k-images-idx3-ubyte is truncated: .*; the header "
                                         r"states 20 images, the file holds 18$"):
        load_mnist(tmp_path, "test")


def test_mnist_images_cut_inside_an_image_name_the_partial_one(tmp_path):
    _mnist(tmp_path, cut_images=100)
    with pytest.raises(ValueError, match=r"the header states 20 images, the file holds 19 and 684 bytes of another"):
        load_mnist(tmp_path, "test")


def test_mnist_labels_cut_name_both_counts(tmp_path):
    _mnist(tmp_path, cut_labels=3)
    with pytest.raises(ValueError, match=r"MnistDataset: .*t10k-labels-idx1-ubyte is truncated: .*; the header "
                                         r"states 20 labels, the file holds 17$"):
        load_mnist(tmp_path, "test")


def test_mnist_images_and_labels_counts_differ(tmp_path):
    _mnist(tmp_path, n_labels=18)  # both files whole, but they disagree
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte holds 20 images but .*t10k-labels-idx1-ubyte "
                                         r"holds 18 labels"):
        load_mnist(tmp_path, "test")
