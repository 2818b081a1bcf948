"""Initializers: statistics, fans and gains, seeding, dtypes, array inputs, errors."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st
from hypothesis.extra import numpy as hnp

import minidl
from minidl import Tensor
from minidl.common.initializer import (initializer, calculate_fan_in_and_fan_out, calculate_gain, Initializer,
                                       Normal, Uniform, Zero, One, Constant, HeNormal, HeUniform, XavierUniform,
                                       XavierNormal, TruncatedNormal)

BIG = (256, 128, 3, 3)  # 295k samples: std estimates within ~0.2%; fan_in = 1152, fan_out = 2304


def values(init, shape=BIG, dtype=minidl.float64):
    t = initializer(init, shape, dtype)
    assert isinstance(t, Tensor) and t.shape == tuple(shape) and t.dtype == np.dtype(dtype)
    return t.asnumpy()


@pytest.mark.parametrize("init, std", [
    (Normal(), 0.01),
    (Normal(sigma=0.5, mean=2.0), 0.5),
    (HeNormal(), math.sqrt(2 / 1152)),
    (HeNormal(mode="fan_out"), math.sqrt(2 / 2304)),
    (HeNormal(negative_slope=0.5, nonlinearity="leaky_relu"), math.sqrt(2 / 1.25 / 1152)),
    (HeNormal(nonlinearity="tanh"), 5 / 3 / math.sqrt(1152)),
    (XavierNormal(), math.sqrt(2 / (1152 + 2304))),
    (XavierNormal(gain=3), 3 * math.sqrt(2 / (1152 + 2304))),
    ("normal", 0.01), ("he_normal", math.sqrt(2 / 1152)), ("xavier_normal", math.sqrt(2 / 3456)),
])
def test_normal_family_statistics(init, std):
    x = values(init)
    mean = getattr(init, "mean", 0.0)
    assert abs(x.mean() - mean) < 5 * std / math.sqrt(x.size)
    assert x.std() == pytest.approx(std, rel=0.01)


@pytest.mark.parametrize("init, bound", [
    (Uniform(), 0.07), (Uniform(scale=2.0), 2.0), ("uniform", 0.07),
    (HeUniform(), math.sqrt(6 / 1152)),
    (HeUniform(negative_slope=math.sqrt(5)), 1 / math.sqrt(1152)),  # the Dense / Conv default
    ("he_uniform", math.sqrt(6 / 1152)),
    (XavierUniform(), math.sqrt(6 / 3456)), (XavierUniform(gain=2), 2 * math.sqrt(6 / 3456)),
    ("xavier_uniform", math.sqrt(6 / 3456)),
])
def test_uniform_family_bounds_and_spread(init, bound):
    x = values(init)
    assert np.abs(x).max() <= bound
    assert np.abs(x).max() > 0.999 * bound  # the whole interval is used
    assert x.std() == pytest.approx(bound / math.sqrt(3), rel=0.01)
    assert abs(x.mean()) < 5 * bound / math.sqrt(3 * x.size)


def test_truncated_normal_stays_within_two_sigma():
    x = values(TruncatedNormal(sigma=0.3), (400, 500))
    assert np.abs(x).max() <= 0.6
    # the std of N(0, 1) truncated to [-2, 2] is 0.8796
    assert x.std() == pytest.approx(0.3 * 0.8796, rel=0.01)
    assert values("truncatednormal", (1000,)).std() < 0.01


@pytest.mark.parametrize("init, value", [("zeros", 0), ("zero", 0), (Zero(), 0), ("ones", 1), ("ONES", 1),
                                         (One(), 1), (Constant(2.5), 2.5), (-3, -3), (0.25, 0.25)])
def test_constants(init, value):
    np.testing.assert_array_equal(values(init, (3, 4), minidl.float32), np.full((3, 4), value, np.float32))


@given(shape=hnp.array_shapes(min_dims=2, max_dims=5, min_side=1, max_side=6))
def test_fans_follow_the_weight_layout(shape):
    fan_in, fan_out = calculate_fan_in_and_fan_out(shape)
    receptive = int(np.prod(shape[2:]))
    assert (fan_in, fan_out) == (shape[1] * receptive, shape[0] * receptive)


def test_fans_of_dense_and_conv():
    assert calculate_fan_in_and_fan_out((10, 20)) == (20, 10)  # Dense (out, in)
    assert calculate_fan_in_and_fan_out((64, 3, 3, 3)) == (27, 576)  # Conv2d (out, in, kh, kw)
    with pytest.raises(ValueError, match=r"at least 2 dimensions, got \(5,\)"):
        calculate_fan_in_and_fan_out((5,))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        initializer("he_normal", (5,))


def test_gains():
    assert calculate_gain("relu") == pytest.approx(math.sqrt(2))
    assert calculate_gain("tanh") == pytest.approx(5 / 3)
    assert calculate_gain("conv2d") == calculate_gain("linear") == calculate_gain("sigmoid") == 1.0
    assert calculate_gain("leaky_relu") == pytest.approx(math.sqrt(2 / (1 + 0.01 ** 2)))
    assert calculate_gain("leaky_relu", 0) == pytest.approx(math.sqrt(2))
    assert calculate_gain("selu") == 0.75
    with pytest.raises(ValueError, match="unknown nonlinearity 'gelu'.*'relu'"):
        calculate_gain("gelu")


@pytest.mark.parametrize("init", ["normal", "uniform", "he_normal", "he_uniform", "xavier_uniform",
                                  "xavier_normal", "truncatednormal"])
def test_set_seed_repeats_draws(init):
    minidl.set_seed(123)
    a = values(init, (6, 5))
    b = values(init, (6, 5))
    minidl.set_seed(123)
    np.testing.assert_array_equal(values(init, (6, 5)), a)
    assert not np.array_equal(a, b)  # the stream moves on between draws
    minidl.set_seed(124)
    assert not np.array_equal(values(init, (6, 5)), a)


@pytest.mark.parametrize("dtype", [minidl.float16, minidl.float32, minidl.float64])
def test_draws_in_float64_then_casts(dtype):
    minidl.set_seed(7)
    x = values("he_normal", (8, 4), dtype)
    minidl.set_seed(7)
    ref = values("he_normal", (8, 4), minidl.float64)
    np.testing.assert_array_equal(x, ref.astype(dtype))


def test_default_dtype_is_float32_and_shape_may_be_an_int():
    t = initializer("ones", 5)
    assert t.dtype == np.float32 and t.shape == (5,)
    assert initializer("zeros", (), minidl.int32).asnumpy().dtype == np.int32


def test_empty_shapes_give_empty_tensors():
    for init in ["he_normal", "xavier_uniform", "normal", "truncatednormal", "ones"]:
        assert values(init, (0, 5)).shape == (0, 5)


@given(data=hnp.arrays(np.float64, hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
                       elements=st.floats(-10, 10)))
def test_arrays_and_tensors_are_copied(data):
    t = initializer(data, data.shape, minidl.float64)
    np.testing.assert_array_equal(t.asnumpy(), data)
    original = data.copy()
    data += 1.0
    np.testing.assert_array_equal(t.asnumpy(), original)  # a copy, not a view
    u = initializer(t, None, minidl.float32)
    assert u.dtype == np.float32 and u.data is not t.data
    np.testing.assert_allclose(u.asnumpy(), original.astype(np.float32))


def test_array_shape_must_match():
    with pytest.raises(ValueError, match=r"init array has shape \(2, 3\) but shape \(3, 2\) was requested"):
        initializer(np.ones((2, 3)), (3, 2))


def test_custom_initializer_subclass():
    class Arange(Initializer):
        def _initialize(self, arr):
            arr[...] = np.arange(arr.size).reshape(arr.shape)

    np.testing.assert_array_equal(values(Arange(), (2, 3)), np.arange(6.0).reshape(2, 3))
    assert values(Arange, (2,)).tolist() == [0.0, 1.0]  # a class is instantiated
    filled = Normal()(np.zeros((3, 3)))  # MindSpore style: fills an array in place
    assert filled.std() > 0


def test_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match=r"unknown initializer 'gaussian'; expected one of \[.*'he_normal'.*\]"):
        initializer("gaussian", (2, 2))
    with pytest.raises(ValueError, match=r"mode must be one of \['fan_in', 'fan_out'\], got 'fan_avg'"):
        HeNormal(mode="fan_avg")
    with pytest.raises(ValueError, match="mode must be one of"):
        HeUniform(mode="in")
    with pytest.raises(ValueError, match="unknown nonlinearity"):
        HeNormal(nonlinearity="swish")
    with pytest.raises(ValueError, match="shape is required"):
        initializer("normal")
    with pytest.raises(ValueError, match=r"non-negative ints, got \(2, -1\)"):
        initializer("normal", (2, -1))
    with pytest.raises(TypeError, match="init must be"):
        initializer(object(), (2,))
    with pytest.raises(TypeError, match="shape must be an int or a sequence"):
        initializer("normal", 2.5)
