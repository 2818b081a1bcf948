"""Fixtures for the ops tests: ``on_the_double`` runs minidl's GPU path on the strict device
double (minidl/testing/cupy_double) inside the normal CPU suite too, as
tests/minidl/test_gpu_host_syncs.py does."""
import contextlib

import pytest

import minidl
from minidl import backend
from minidl.testing import cupy_double


@pytest.fixture
def on_the_double(monkeypatch):
    """minidl's GPU path on the double, also in the normal (CPU) suite; restored afterwards.

    Yields the double's ``cupy`` module (monkeypatch its functions to spy on the GPU path)."""
    if backend._cupy and backend._cupy is not cupy_double.cupy_module():
        pytest.skip("a real CuPy is in use: its arrays are not the double's")
    # Asked before the double is in: a device target not yet fixed would default to the GPU it shows.
    before = backend.get_device_target()
    monkeypatch.setattr(backend, "_cupy", cupy_double.cupy_module())
    backend.set_context("GPU")
    minidl.set_seed(0)
    yield cupy_double.cupy_module()
    backend.set_context(before)


@contextlib.contextmanager
def _device_target(target):
    before = backend.get_device_target()
    backend.set_context(target)
    try:
        yield
    finally:
        backend.set_context(before)


@pytest.fixture
def device_target():
    """``with device_target("CPU"):`` runs a block on that device, then puts the previous one back."""
    return _device_target
