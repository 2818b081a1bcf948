"""Device selection and seeding."""
import os
import subprocess
import sys

import numpy as np
import pytest

import minidl
from minidl import backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _device_in_fresh_process(env_value):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("MINIDL_DEVICE", None)
    if env_value is not None:
        env["MINIDL_DEVICE"] = env_value
    code = "import minidl; print(minidl.get_context('device_target'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_env_var_selects_the_device():
    out = _device_in_fresh_process("cpu")
    assert out.returncode == 0 and out.stdout.strip() == "CPU"


@pytest.mark.cpu_only  # the fresh process imports the machine's own CuPy (none here), not the device double
def test_default_is_gpu_only_when_cupy_sees_one():
    out = _device_in_fresh_process(None)
    assert out.stdout.strip() == ("GPU" if backend.gpu_available() else "CPU")


@pytest.mark.skipif(backend.gpu_available(), reason="this machine has a GPU")
def test_asking_for_a_missing_gpu_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"needs CuPy and a CUDA device: .*pip install 'minidl\[gpu\]'"):
        minidl.set_context(device_target="GPU")
    out = _device_in_fresh_process("GPU")
    assert out.returncode != 0 and "needs CuPy and a CUDA device" in out.stderr


def _fake_cupy(monkeypatch, device_count):
    """A cupy module whose CUDA runtime fails as a machine with a too-old driver does."""
    import types

    def get_device_count():
        if isinstance(device_count, Exception):
            raise device_count
        return device_count
    runtime = types.SimpleNamespace(getDeviceCount=get_device_count)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(backend, "_cupy", None)
    monkeypatch.setattr(backend, "_cupy_error", None)
    monkeypatch.setitem(backend._state, "device_target", "CPU")


def test_the_real_cuda_error_is_shown_not_swallowed(monkeypatch):
    # cudaErrorInsufficientDriver, as CuPy raises it when the driver is older than the toolkit
    _fake_cupy(monkeypatch, RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                                         "for CUDA runtime version"))
    with pytest.raises(RuntimeError, match=r"CuPy is installed but CUDA failed: RuntimeError: "
                                           r"cudaErrorInsufficientDriver: CUDA driver version is insufficient"):
        minidl.set_context(device_target="GPU")
    assert "cudaErrorInsufficientDriver" in backend.gpu_unavailable_reason()


def test_a_cuda_without_devices_is_named(monkeypatch):
    _fake_cupy(monkeypatch, 0)
    assert not backend.gpu_available()
    assert "getDeviceCount() returned 0" in backend.gpu_unavailable_reason()


def test_cpu_tensors_are_numpy():
    before = minidl.get_context("device_target")
    try:
        minidl.set_context(device_target="CPU")
        assert isinstance(minidl.Tensor([1.0]).data, np.ndarray)
        assert backend.get_array_module(np.ones(1)) is np
    finally:
        minidl.set_context(device_target=before)  # the device-pinned suite must stay pinned


def test_set_seed_makes_initialisation_repeat():
    from minidl import nn
    minidl.set_seed(7)
    a = nn.Dense(5, 3).weight.asnumpy()
    minidl.set_seed(7)
    b = nn.Dense(5, 3).weight.asnumpy()
    minidl.set_seed(8)
    c = nn.Dense(5, 3).weight.asnumpy()
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.fixture
def fresh_device_state(monkeypatch):
    """The device target as in a fresh process (nothing chosen, nothing asked), GPU visible
    through the device double; restored afterwards."""
    from minidl.testing import cupy_double
    monkeypatch.delenv("MINIDL_DEVICE", raising=False)
    monkeypatch.setattr(backend, "_cupy", cupy_double.cupy_module())
    monkeypatch.setitem(backend._state, "device_target", None)
    monkeypatch.setitem(backend._state, "chosen", False)


def test_a_preferred_device_applies_only_while_nothing_fixed_the_target(fresh_device_state, monkeypatch):
    assert backend.prefer_device_target("cpu") == "CPU"  # nothing chosen or used: the preference wins
    assert not backend.device_target_chosen()
    assert backend.prefer_device_target("GPU") == "CPU"  # now used: a later preference cannot move it
    monkeypatch.setitem(backend._state, "device_target", None)
    assert backend.get_device_target() == "GPU"  # the default, used before any preference...
    assert backend.prefer_device_target("CPU") == "GPU"  # ...stays
    monkeypatch.setitem(backend._state, "device_target", None)
    monkeypatch.setenv("MINIDL_DEVICE", "gpu")  # the user's choice beats the preference
    assert backend.prefer_device_target("CPU") == "GPU" and backend.device_target_chosen()
    with pytest.raises(ValueError, match="target must be 'CPU' or 'GPU', got 'TPU'"):
        backend.prefer_device_target("tpu")


def test_set_context_counts_as_a_choice(fresh_device_state):
    minidl.set_context(device_target="CPU")
    assert backend.device_target_chosen() and backend.prefer_device_target("GPU") == "CPU"


def _mode_in_fresh_process(env_value):
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("MINIDL_MODE", None)
    if env_value is not None:
        env["MINIDL_MODE"] = env_value
    code = ("import minidl; from minidl.runtime import LOCAL, get_runtime; "
            "print(minidl.get_context('mode'), get_runtime() is not LOCAL)")  # GRAPH_MODE's layer, or none
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("value, expected", [(None, "1 False"), ("pynative", "1 False"), ("graph", "0 True"),
                                             ("GRAPH", "0 True")])
def test_minidl_mode_sets_the_default_mode(value, expected):
    out = _mode_in_fresh_process(value)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected   # GRAPH_MODE's hooks installed with it


def test_a_bad_minidl_mode_is_a_clear_error():
    out = _mode_in_fresh_process("eager")
    assert out.returncode != 0 and "MINIDL_MODE must be 'graph' or 'pynative', got 'eager'" in out.stderr


def test_setting_the_mode_runs_what_graph_mode_left_deferred():
    from minidl import graph_mode, ops
    before = minidl.get_context("mode")
    try:
        minidl.set_context(mode=minidl.GRAPH_MODE)
        mean = minidl.Tensor(np.zeros(2, np.float32))
        ones = minidl.Tensor(np.ones(2, np.float32))
        y = ops.BatchNorm(is_training=True)(minidl.Tensor(np.arange(8, dtype=np.float32).reshape(4, 2)),
                                            ones, mean * 1, mean, ones * 1)
        assert graph_mode.is_deferred(y)
        minidl.set_context(mode=minidl.GRAPH_MODE)   # even to the same mode
        assert not graph_mode.is_deferred(y)
        np.testing.assert_allclose(mean.asnumpy(), [0.3, 0.4])   # 0.1 * the batch mean (3, 4)
    finally:
        minidl.set_context(mode=before)
