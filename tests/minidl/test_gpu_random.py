"""Dropout on the GPU path draws repeatable masks on every device and in every thread-rank
(issue 16, bug 3: CuPy's random state is per device, and cupy.random.seed seeds only the
current one). Runs on the device double, also in the normal suite."""
import threading

import numpy as np
import pytest

import minidl
from minidl import Tensor, backend, ops
from minidl.testing import cupy_double


@pytest.fixture
def two_double_devices(monkeypatch):
    if backend._cupy and backend._cupy is not cupy_double.cupy_module():
        pytest.skip("a real CuPy is in use: its arrays are not the double's")
    monkeypatch.setattr(backend, "_cupy", cupy_double.cupy_module())
    cupy_double.configure(device_count=2)
    before = backend.get_device_target()
    backend.set_context("GPU")
    cupy_double.random.reset()  # every device starts unseeded, as in a fresh process
    yield cupy_double.cupy_module()
    backend.set_context(before)
    cupy_double.cupy_module().cuda.Device(0).use()
    cupy_double.configure(device_count=1)


def _mask():
    y = ops.Dropout(keep_prob=0.5)(Tensor(np.ones(64, np.float32)))
    assert isinstance(y.data, cupy_double.ndarray)
    return y.asnumpy()


def test_set_seed_repeats_dropout_masks_on_another_device(two_double_devices):
    cupy = two_double_devices
    minidl.set_seed(3)
    on_device_0 = _mask()
    minidl.set_seed(3)
    cupy.cuda.Device(1).use()  # a rank >= 1 after init(): the seed was set on device 0
    np.testing.assert_array_equal(_mask(), on_device_0)


def test_thread_ranks_sharing_a_device_draw_the_same_masks(two_double_devices):
    minidl.set_seed(5)
    alone = _mask()
    minidl.set_seed(5)
    masks = [None, None]

    def rank(r):
        masks[r] = _mask()
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in masks:
        np.testing.assert_array_equal(m, alone)


def test_restoring_the_framework_generator_repeats_device_masks(two_double_devices):
    """A checkpoint saves backend.rng()'s state: restoring it must repeat the device's masks
    too, or a resumed GPU run is not bit-identical."""
    minidl.set_seed(9)
    _mask()
    saved = backend.rng().bit_generator.state
    first = _mask()
    backend.rng().bit_generator.state = saved
    np.testing.assert_array_equal(_mask(), first)
