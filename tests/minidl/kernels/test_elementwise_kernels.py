"""ReLU's row kernel (minidl/kernels/cpu/elementwise.py): which arrays it takes, ``out``, and its
zero rows made afresh (not the ones earlier tests left cached)."""
import numpy as np
import pytest

from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import elementwise

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("kernels_on")]

ROW = 4096  # relu_row's default


def relu_with(x):
    with kernels.tracking() as used:
        y = ops.relu(Tensor(x)).asnumpy()
    return y, {k.name for k in used}


@pytest.mark.parametrize("what, x", [
    ("int64", np.arange(-ROW, ROW).reshape(2, ROW)),
    ("a size the row does not divide", np.linspace(-1, 1, 15).reshape(3, 5)),
    ("strided", np.linspace(-1, 1, 4 * ROW).reshape(2, 2 * ROW)[:, ::2]),
])
def test_relu_rows_leaves_other_arrays_to_the_reference(what, x):
    y, used = relu_with(x)
    assert "ReLURows" not in used, what
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    assert y.dtype == x.dtype


def test_relu_rows_writes_into_out_when_given():
    x = np.linspace(-1, 1, 2 * ROW, dtype=np.float32).reshape(2, ROW)
    want = np.maximum(x, 0)
    buf = np.full_like(x, 5.0)
    assert elementwise.relu_rows(x, out=buf) is buf
    np.testing.assert_array_equal(buf, want)
    assert elementwise.relu_rows(x, out=x) is x  # in place
    np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_relu_rows_with_new_zero_rows_is_numpys_bit_for_bit(monkeypatch, dtype):
    monkeypatch.setattr(elementwise, "_zero_rows", {})
    kernels.set_option("relu_row", 512)
    try:
        x = np.random.default_rng(0).standard_normal((4, 256)).astype(dtype)
        x[0, :3] = [-0.0, np.nan, -np.inf]
        y, used = relu_with(x)
    finally:
        kernels.set_option("relu_row", None)
    assert used == {"ReLURows"}
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    assert y.dtype == dtype
