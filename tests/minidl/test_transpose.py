"""minidl/_transpose.py: OpenBLAS omatcopy and the NumPy fallback give exactly a.T."""
import numpy as np
import pytest

from minidl import _transpose


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (64, 130), (0, 4)])
def test_equals_numpy_transpose(dtype, shape):
    a = np.arange(np.prod(shape), dtype=dtype).reshape(shape)
    out = np.full(shape[::-1], -1, dtype)
    _transpose.transpose_into(np, a, out)
    np.testing.assert_array_equal(out, a.T)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_strided_rows_in_and_out(dtype):
    """A column block of a wider matrix into a column block of another: row strides only."""
    a = np.random.default_rng(0).standard_normal((5, 12)).astype(dtype)
    out = np.zeros((20, 9), dtype)
    _transpose.transpose_into(np, a[:, 4:10], out[3:9, 2:7])
    np.testing.assert_array_equal(out[3:9, 2:7], a[:, 4:10].T)
    assert not out[:3].any() and not out[9:].any() and not out[:, :2].any() and not out[:, 7:].any()


def test_column_strided_input_uses_the_fallback():
    a = np.arange(24.0).reshape(4, 6)[:, ::2]
    out = np.empty((3, 4))
    _transpose.transpose_into(np, a, out)
    np.testing.assert_array_equal(out, a.T)


def test_shape_error():
    with pytest.raises(ValueError, match=r"out of shape \(3, 3\) cannot hold the transpose of \(2, 3\)"):
        _transpose.transpose_into(np, np.zeros((2, 3)), np.zeros((3, 3)))
