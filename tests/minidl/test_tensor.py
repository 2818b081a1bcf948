"""Tensor and Parameter: construction, dtypes, conversions, errors."""
import numpy as np
import pytest

import minidl
from minidl import Tensor, Parameter


def test_python_floats_default_to_float32():
    assert Tensor([1.0, 2.0]).dtype == np.float32
    assert Tensor(3.0).dtype == np.float32
    assert Tensor([1, 2]).dtype == np.int64


def test_numpy_arrays_keep_their_dtype():
    assert Tensor(np.ones(2)).dtype == np.float64
    assert Tensor(np.ones(2, np.float16)).dtype == np.float16


def test_explicit_dtype_converts():
    t = Tensor([1, 2], dtype=minidl.float64)
    assert t.dtype == np.float64
    assert t.shape == (2,)
    np.testing.assert_array_equal(t.asnumpy(), [1.0, 2.0])


def test_tensor_from_tensor_shares_values_not_graph():
    a = Tensor([1.0, 2.0], requires_grad=True)
    b = Tensor(a)
    assert b.is_leaf and not b.requires_grad
    np.testing.assert_array_equal(b.asnumpy(), a.asnumpy())


def test_none_is_rejected():
    with pytest.raises(ValueError, match="Tensor: data must not be None"):
        Tensor(None)


def test_item_and_conversions():
    t = Tensor([[2.5]])
    assert t.item() == 2.5 and float(t) == 2.5 and int(Tensor(3)) == 3
    with pytest.raises(ValueError, match=r"only one-element tensors.*\(2,\)"):
        Tensor([1.0, 2.0]).item()


def test_truth_value_of_many_elements_is_ambiguous():
    with pytest.raises(ValueError, match="ambiguous"):
        bool(Tensor([1.0, 2.0]))


def test_numpy_interop():
    t = Tensor(np.arange(3.0))
    np.testing.assert_array_equal(np.asarray(t), [0.0, 1.0, 2.0])
    assert isinstance(np.float32(2) * t, Tensor)  # numpy scalars defer to Tensor


def test_parameter_name_and_set_data():
    p = Parameter(np.zeros((2, 3)), name="w")
    assert p.requires_grad and p.name == "w" and p.is_leaf
    p.set_data(np.ones((2, 3)))
    np.testing.assert_array_equal(p.asnumpy(), np.ones((2, 3)))
    with pytest.raises(ValueError, match=r"Parameter w: set_data got shape \(3,\), expected \(2, 3\)"):
        p.set_data(np.ones(3))


def test_frozen_parameter():
    assert not Parameter(np.zeros(2), requires_grad=False).requires_grad


def test_detach_cuts_the_graph():
    x = Tensor([1.0], requires_grad=True)
    y = (x * 2).detach()
    assert not y.requires_grad and y.is_leaf


def test_repr_shows_values_and_dtype():
    assert "dtype=float32" in repr(Tensor([1.0]))


def test_str_prints_the_values_as_mindspore():
    # MindSpore 2.10: print(ms.Tensor(np.array([[1., 2.], [3., 4.]], np.float32))) shows the
    # NumPy printout, with no "Tensor(" or dtype; repr keeps them.
    t = Tensor(np.array([[1.0, 2.0], [3.0, 4.0]], np.float32))
    assert str(t) == "[[1. 2.]\n [3. 4.]]" and f"{t}" == str(t)
    assert repr(t) == "Tensor([[1., 2.],\n        [3., 4.]], dtype=float32)"
    assert str(Tensor(1.5)) == "1.5" and str(Tensor(3)) == "3" and str(Tensor(True)) == "True"
    assert str(Tensor(np.array([1, 2, 3], np.int32))) == "[1 2 3]"
    assert str(Tensor(np.array([True, False]))) == "[ True False]"
    assert str(Tensor(np.array([1.5, 2.25], np.float16))) == "[1.5  2.25]"
    assert str(Tensor([1.0], requires_grad=True)) == "[1.]"
    p = Parameter(np.ones(2, np.float32), name="w")
    assert str(p) == repr(p) == "Parameter(name='w', shape=(2,), dtype=float32, requires_grad=True)"


def test_set_context_validates():
    with pytest.raises(ValueError, match="device_target must be 'CPU' or 'GPU'"):
        minidl.set_context(device_target="TPU")
    before = minidl.get_context("device_target")
    try:
        minidl.set_context(device_target="CPU")
        assert minidl.get_context("device_target") == "CPU"
    finally:
        minidl.set_context(device_target=before)  # the device-pinned suite must stay pinned


def test_set_seed_validates():
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        minidl.set_seed(-1)


def test_operators_promote_as_mindspore_and_torch():
    """An integer tensor or scalar never widens a float tensor; int * 2.5 is float32 (NumPy: float64)."""
    f = Tensor(np.ones(2, np.float32))
    i = Tensor(np.array([1, 2]))
    for y in (f + i, i * f, f / i, i * 2.5, i / 2, i / i, 2.5 ** i, f - np.float64(1.0)):
        assert y.dtype == np.float32, y
    assert (i * 2).dtype == np.int64 and (i // 2).dtype == np.int64
    assert (f * Tensor(np.ones(2))).dtype == np.float64  # two float tensors: the wider, as MindSpore
