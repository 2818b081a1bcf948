"""The kernels table: every registered kernel against its reference body (bit for bit or within its
stated bound) on its own cases, and the table's switches."""
import os
import subprocess
import sys

import numpy as np
import pytest

import minidl
from minidl import kernels, ops, Tensor
from minidl.testing.gradcheck import check_kernels

# These tests are about the kernels: they run with the kernels table on (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("kernels_on")

ALL = kernels.registered()


def test_every_kernel_has_cases():
    assert ALL, "no kernel is registered"
    for k in ALL:
        assert k.cases(), f"{k.name} has no differential cases"


@pytest.mark.cpu_only  # the CuPy kernels' cases run on the device double (test_conv_kernels.py)
@pytest.mark.parametrize("kernel", [k for k in ALL if k.backend == "numpy"], ids=lambda k: k.name)
def test_kernel_equals_its_reference(kernel):
    if not getattr(kernel, "available", True):
        pytest.skip(f"{kernel.name} needs an optional extra that is not installed")
    for make, arrays in kernel.cases():
        with kernels.only(kernel):  # (not another kernel of the op that is asked first)
            used = check_kernels(lambda *ts: make()(*ts), arrays, arrays[0].dtype)
        assert kernel in used, f"{kernel.name} did not run on its own case {[getattr(a, 'shape', a) for a in arrays]}"


def test_reference_only_runs_no_kernel():
    x = Tensor(np.random.default_rng(0).standard_normal((2, 4096)).astype(np.float32))
    with kernels.tracking() as used:
        ops.relu(x)
    expected = set() if minidl.backend.get_device_target() == "GPU" else {k for k in ALL if k.op is ops.ReLU}
    assert used == expected
    with kernels.reference_only(), kernels.tracking() as used:
        ops.relu(x)
    assert used == set()


def test_environment_switch_runs_reference_bodies():
    code = "import minidl; print(minidl.kernels.is_reference_only())"
    env = dict(os.environ, MINIDL_KERNELS="reference")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "True", out.stderr


def test_options_are_declared_settings():
    assert kernels.get_option("relu_row") == 4096
    kernels.set_option("relu_row", 1024)
    try:
        assert kernels.get_option("relu_row") == 1024
        x = np.random.default_rng(1).standard_normal((3, 1024))
        check_kernels(lambda t: ops.relu(t), [x])
    finally:
        kernels.set_option("relu_row", None)
    assert kernels.get_option("relu_row") == 4096
    with pytest.raises(KeyError, match="unknown option 'relu_rows'; declared: .*relu_row"):
        kernels.set_option("relu_rows", 1)


def test_register_refuses_a_kernel_without_an_op():
    class Broken(kernels.Kernel):
        pass
    with pytest.raises(ValueError, match="Broken must set op"):
        kernels.register(Broken)


@pytest.mark.cpu_only  # ReLU's kernel is a NumPy one
def test_a_kernel_node_never_backpropagated_is_freed_without_the_garbage_collector():
    # The kernel's backward is bound to its node weakly: no node -> backward -> node cycle keeping
    # a forward's saved arrays alive until a collection.
    import gc
    import weakref
    x = Tensor(np.random.default_rng(0).standard_normal((2, 8, 32, 32)).astype(np.float32), requires_grad=True)
    gc.disable()
    try:
        with kernels.tracking() as used:
            y = ops.ReLU()(x)
        assert used, "no kernel ran: the test needs one"
        node = weakref.ref(y._node)
        del y
        assert node() is None
    finally:
        gc.enable()
    y = ops.ReLU()(x)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), (x.asnumpy() > 0).astype(np.float32))
