"""Hypothesis profiles: 'ci' (selected when CI=true) keeps example counts bounded and
derandomised so the whole suite stays under 10 minutes on 2 cores; 'dev' explores more.

The device-pinned mode: ``MINIDL_TEST_DEVICE=double`` installs the strict device double
(minidl/testing/cupy_double) as ``cupy`` before minidl is imported and pins every test to
``MINIDL_DEVICE=GPU``, so the whole suite runs minidl's GPU path without a GPU. Tests marked
``cpu_only`` (OpenBLAS threading, the allocator, mpirun jobs, PyTorch comparisons) are skipped
there. ``MINIDL_TEST_DEVICE=gpu`` pins to the real CuPy on a GPU machine.
"""
import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

TEST_DEVICE = os.environ.get("MINIDL_TEST_DEVICE", "").lower()
if TEST_DEVICE not in ("", "cpu", "double", "gpu"):
    raise RuntimeError(f"MINIDL_TEST_DEVICE must be 'cpu', 'double' or 'gpu', got {TEST_DEVICE!r}")
if TEST_DEVICE == "double":
    # before anything imports minidl: its backend caches the cupy module on first use
    from minidl.testing import cupy_double
    cupy_double.install()
if TEST_DEVICE in ("double", "gpu"):
    os.environ["MINIDL_DEVICE"] = "GPU"
DEVICE_PINNED = TEST_DEVICE in ("double", "gpu")

settings.register_profile("ci", max_examples=12, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") == "true" else "dev"))


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: the test is about the CPU path (OpenBLAS threads, the "
                                       "allocator, mpirun jobs, PyTorch); skipped when pinned to a GPU device")
    config.addinivalue_line("markers", "call_site: the test checks a stack location (the file a warning names, "
                                       "a collective's call site); mutmut's trampolines add frames, so "
                                       "tools/mutation.py deselects it")
    config.addinivalue_line("markers", "slow: a whole equivalence matrix, skipped unless MINIDL_SLOW=1 (run before "
                                       "resolving the issue it proves; its time is in docs/testing.md)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("MINIDL_SLOW") != "1":
        skip_slow = pytest.mark.skip(reason="slow matrix: run with MINIDL_SLOW=1 (before resolving an issue)")
        for item in items:
            if item.get_closest_marker("slow"):
                item.add_marker(skip_slow)
    if not DEVICE_PINNED:
        return
    skip = pytest.mark.skip(reason=f"cpu_only test: MINIDL_TEST_DEVICE={TEST_DEVICE} pins the suite to the GPU")
    for item in items:
        if item.get_closest_marker("cpu_only"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _pinned_device():
    """In the device-pinned mode, no test may leave the GPU behind (set_context("CPU") and not
    restore it): the rest of the suite would silently test the CPU path."""
    yield
    if DEVICE_PINNED:
        from minidl import backend
        target = backend.get_device_target()
        if target != "GPU":
            backend.set_context("GPU")  # so one leak does not turn every later test into a CPU test
            pytest.fail(f"MINIDL_TEST_DEVICE={TEST_DEVICE}: the test left the device target at {target}")


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Every test starts from the same framework seed, so failures reproduce."""
    import minidl
    minidl.set_seed(0)
    yield


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def on_the_double(monkeypatch):
    """minidl's GPU path on the strict device double, also in the normal (CPU) suite; yields the
    double's ``cupy`` module (monkeypatch its functions to spy on the GPU path). The device
    target is restored exactly afterwards (a target not yet resolved stays unresolved)."""
    from minidl import backend
    from minidl.testing import cupy_double
    if backend._cupy and backend._cupy is not cupy_double.cupy_module():
        pytest.skip("a real CuPy is in use: its arrays are not the double's")
    for key in ("device_target", "chosen"):
        monkeypatch.setitem(backend._state, key, backend._state[key])
    monkeypatch.setattr(backend, "_cupy", cupy_double.cupy_module())
    monkeypatch.setitem(sys.modules, "cupy", cupy_double.cupy_module())  # what `import cupy` finds, too
    backend.set_context("GPU")
    import minidl
    minidl.set_seed(0)
    yield cupy_double.cupy_module()


@pytest.fixture
def kernels_on():
    """For tests of the kernels themselves: the kernels table on, even when the suite runs on
    reference bodies (MINIDL_KERNELS=reference)."""
    from minidl import kernels
    with kernels.reference_only(False):
        yield
