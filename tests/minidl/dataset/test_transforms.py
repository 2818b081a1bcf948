"""TypeCast and Compose."""
import numpy as np
import pytest

import minidl
from minidl.dataset import vision
from minidl.dataset.transforms import Compose, TypeCast


@pytest.mark.parametrize("dtype", [np.int32, minidl.float32, "float64", np.dtype("int64"), minidl.uint8])
def test_typecast(dtype):
    x = np.array([[0, 1], [200, 255]], np.uint8)
    out = TypeCast(dtype)(x)
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, x.astype(dtype))
    assert out is not x
    assert TypeCast(dtype)(minidl.Tensor(x)).dtype == np.dtype(dtype)
    assert TypeCast(dtype)(7).dtype == np.dtype(dtype)


def test_typecast_rejects_non_dtypes():
    with pytest.raises(TypeError, match="TypeCast: data_type must be a NumPy or minidl dtype, got 'floaty'"):
        TypeCast("floaty")


def test_compose_applies_in_order_and_passes_rng_to_random_ops():
    x = np.random.default_rng(0).integers(0, 256, (8, 6, 6, 3), dtype=np.uint8)
    ops = [vision.RandomCrop(4, padding=1), vision.RandomHorizontalFlip(), vision.HWC2CHW(), TypeCast(np.float32)]
    aug = Compose(ops)
    assert aug.random is True
    out = aug(x, rng=np.random.default_rng(5))
    gen = np.random.default_rng(5)  # the same generator, handed to each random op in turn
    expected = ops[3](ops[2](ops[1](ops[0](x, rng=gen), rng=gen)))
    np.testing.assert_array_equal(out, expected)
    assert out.shape == (8, 3, 4, 4) and out.dtype == np.float32
    minidl.set_seed(3)
    a = aug(x)
    minidl.set_seed(3)
    np.testing.assert_array_equal(aug(x), a)


def test_compose_of_deterministic_ops_is_not_random_and_chains_tuples():
    aug = Compose([lambda a, b: (a + b, a - b), lambda s, d: s * d])
    assert aug.random is False
    assert aug(5, 3) == 16
    assert Compose([TypeCast(np.int64)])(np.uint8(3)).dtype == np.int64


def test_compose_rejects_bad_lists():
    with pytest.raises(ValueError, match="Compose: transforms must be a non-empty list"):
        Compose([])
    with pytest.raises(TypeError, match="Compose: transforms\\[1\\] is 3, which is not callable"):
        Compose([TypeCast(np.int32), 3])
