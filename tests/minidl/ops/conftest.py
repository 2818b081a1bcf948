"""Fixtures for the ops tests: ``on_the_double`` runs minidl's GPU path on the strict device
double (minidl/testing/cupy_double) inside the normal CPU suite too, as
tests/minidl/test_gpu_host_syncs.py does."""
import contextlib

import pytest

from minidl import backend


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
