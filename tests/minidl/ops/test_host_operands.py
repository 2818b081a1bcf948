"""Host (NumPy) arrays given to ops whose other inputs are on the GPU (the device double): one
TypeError that names the op, the inputs on each device and the fix; host values that ops do
accept on the GPU keep working, and errors that are not about devices pass through unchanged."""
import numpy as np
import pytest

from minidl import nn, ops, Tensor
from minidl.ops.primitive import _device_mix_error
from minidl.testing import cupy_double


def test_a_numpy_input_to_a_gpu_conv_names_the_op_the_inputs_and_the_fix(on_the_double):
    x = np.ones((2, 3, 8, 8), np.float32)
    w = Tensor(np.ones((4, 3, 3, 3), np.float32))
    assert isinstance(w.data, cupy_double.ndarray)
    with pytest.raises(TypeError) as info:
        ops.conv2d(x, w, padding=1, pad_mode="pad")
    msg = str(info.value)
    assert msg.startswith("Conv2D: inputs on two devices: on the host (NumPy): x (input 0, a NumPy array); "
                          "on the GPU (CuPy): w (input 1, a Tensor).")
    assert "Tensor(a)" in msg and "device_target='GPU'" in msg
    assert info.value.__cause__ is not None  # CuPy's own error stays in the chain
    assert str(info.value.__cause__) in msg


def test_a_cpu_tensor_given_to_a_gpu_network_names_it(on_the_double, device_target):
    with device_target("CPU"):
        x = Tensor(np.ones((2, 3), np.float32))  # made before the switch to the GPU
    assert isinstance(x.data, np.ndarray)
    dense = nn.Dense(3, 2)
    with pytest.raises(TypeError, match=r"^Dense: inputs on two devices: on the host \(NumPy\): x \(input 0, "
                                        r"a Tensor\); on the GPU \(CuPy\): w \(input 1, a Tensor\), b \(input 2, "
                                        r"a Tensor\)\."):
        dense(x)  # nn.Dense's one op (ops.Dense) names the layer's weight and bias
    # the fix the message gives: Tensor(a) copies it to the current device
    assert dense(Tensor(x)).shape == (2, 2)


def test_inputs_of_a_varargs_op_are_named_by_position(on_the_double):
    with pytest.raises(TypeError, match=r"^Concat: .*host \(NumPy\): input 1 \(a NumPy array\); "
                                        r"on the GPU \(CuPy\): input 0 \(a Tensor\)\."):
        ops.concat((Tensor(np.ones(3)), np.ones(3)))


def test_a_device_tensor_under_a_cpu_target_says_how_to_bring_it_back(on_the_double, device_target):
    y = Tensor(np.ones(3))
    with device_target("CPU"):
        with pytest.raises(TypeError, match=r"^Add: .*the device target is CPU: bring GPU tensors back with "
                                            r"Tensor\(t\.asnumpy\(\)\)"):
            y + Tensor(np.ones(3))


def test_host_values_that_ops_accept_on_the_gpu_still_work(on_the_double):
    x = Tensor(np.arange(5.0))
    for y, want in [(x + 2, np.arange(5.0) + 2), (x * np.float64(3.0), np.arange(5.0) * 3),
                    (2.5 - x, 2.5 - np.arange(5.0)), (x[np.array([1, 3])], [1.0, 3.0]),
                    (x[Tensor(np.array([4, 0]))], [4.0, 0.0])]:
        assert isinstance(y.data, cupy_double.ndarray)
        np.testing.assert_array_equal(y.asnumpy(), want)


def test_errors_that_are_not_about_devices_pass_through_unchanged(on_the_double):
    x, w = Tensor(np.ones((2, 3, 8, 8), np.float32)), Tensor(np.ones((4, 3, 3, 3), np.float64))
    with pytest.raises(TypeError, match=r"^Conv2D: x has dtype float32 but w has dtype float64; cast one of them$"):
        ops.conv2d(x, w)
    with pytest.raises(ValueError, match=r"^Add: shapes \(3,\) and \(4,\) cannot be broadcast"):
        Tensor(np.ones(3)) + Tensor(np.ones(4))
    # an op's own check speaks first, also when its inputs are on two devices
    with pytest.raises(ValueError, match=r"^Conv2D: w of shape \(4, 3, 2, 2\) does not fit x"):
        ops.Conv2D(4, 3)(x, np.ones((4, 3, 2, 2), np.float32))


def test_on_the_cpu_errors_are_unchanged(device_target):
    with device_target("CPU"):  # also in the device-pinned suite
        x, w = Tensor(np.ones((2, 3, 8, 8), np.float32)), Tensor(np.ones((4, 3, 3, 3), np.float64))
        with pytest.raises(TypeError, match=r"^Conv2D: x has dtype float32 but w has dtype float64; cast one of them$"):
            ops.conv2d(x, w)
        with pytest.raises(ValueError, match=r"^Add: shapes \(3,\) and \(4,\) cannot be broadcast"):
            Tensor(np.ones(3)) + Tensor(np.ones(4))
        # and a raw NumPy array is an ordinary operand on the CPU
        np.testing.assert_array_equal((Tensor(np.ones(3)) + np.arange(3.0)).asnumpy(), [1.0, 2.0, 3.0])


def test_only_inputs_on_both_devices_are_explained(on_the_double):
    prim, exc = ops.Add(), TypeError("boom")
    device = on_the_double.ones(3)
    assert _device_mix_error(prim, (np.ones(3), Tensor._wrap(np.ones(3)), 2.0), exc) is None  # all host
    assert _device_mix_error(prim, (device, Tensor(np.ones(3))), exc) is None  # all device
    assert _device_mix_error(prim, (device, 2.0, np.float32(1)), exc) is None  # scalars are not host arrays
    error = _device_mix_error(prim, (device, np.ones(3)), exc)
    assert isinstance(error, TypeError) and "host (NumPy): y (input 1, a NumPy array)" in str(error)
    assert "on the GPU (CuPy): x (input 0, a CuPy array)" in str(error)
    assert str(error).endswith("(The op failed with TypeError: boom)")
