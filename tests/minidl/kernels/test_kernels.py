"""The kernels table: every registered kernel against its reference body (bit for bit or within its
stated bound) on its own cases, and the table's switches."""
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import minidl
from minidl import kernel_table, kernels, ops, Tensor
from minidl.testing.gradcheck import check_kernels

# These tests are about the kernels: they run with the kernels table on (see tests/conftest.py).
pytestmark = pytest.mark.usefixtures("kernels_on")

ALL = kernels.registered()


def extras_of_the_project():
    """The names under [project.optional-dependencies] in pyproject.toml."""
    text = (Path(__file__).resolve().parents[3] / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*=", section, re.M))


def test_a_kernel_on_an_optional_library_names_the_extra_that_installs_it():
    """Its tests skip with that name where the library is missing (the README's command installs
    only [test,mpi]), so a newcomer knows what to install to run them."""
    extras = extras_of_the_project()
    assert {"mkl", "numba", "onednn", "bench"} <= extras, extras
    optional = [k for k in ALL if any("available" in vars(c) for c in type(k).__mro__ if c is not kernels.Kernel)]
    assert {k.name for k in optional} >= {"Conv2DOneDNN", "MatMulThreaded"}
    for k in optional:
        assert k.extra in extras, f"{k.name}: extra={k.extra!r} is not an extra of pyproject.toml ({sorted(extras)})"


def test_every_kernel_has_cases():
    assert ALL, "no kernel is registered"
    for k in ALL:
        assert k.cases(), f"{k.name} has no differential cases"


def test_the_numpy_kernels_cases_run_in_each_float_dtype_they_take():
    # The differential test runs a case in its first array's dtype; float32 and float64 differ in
    # their bounds and in the BLAS call, so the cases hold each kernel to both.
    for k in ALL:
        if k.backend == "numpy" and type(k).__module__.startswith("minidl."):  # (not a test's own kernel)
            want = {"float32"} if k.name == "Conv2DOneDNN" else {"float32", "float64"}  # oneDNN's: float32 only
            assert {str(np.asarray(arrays[0]).dtype) for _, arrays in k.cases()} == want, k.name


@pytest.mark.cpu_only  # the CuPy kernels' cases run on the device double (test_conv_kernels.py)
@pytest.mark.parametrize("kernel", [k for k in ALL if k.backend == "numpy"], ids=lambda k: k.name)
def test_kernel_equals_its_reference(kernel):
    if not kernel.available:
        pytest.skip(f"{kernel.name} needs the {kernel.extra} extra: pip install -e '.[{kernel.extra}]'")
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


def test_registered_lists_an_ops_kernels_or_none():
    assert [k.name for k in kernels.registered(ops.ReLU)] == ["ReLURows"]
    assert kernels.registered(ops.Softmax) == []  # an op without kernels: none, not an error
    assert set(ALL) <= set(kernels.registered())  # (other tests may register more)


def in_threads(*bodies):
    """Runs each body on a thread of its own, all at once; re-raises the first error one raised."""
    errors = []

    def run(body):
        try:
            body()
        except BaseException as error:  # noqa: B902 - handed to the test's thread
            errors.append(error)
    threads = [threading.Thread(target=run, args=(body,)) for body in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish"
    if errors:
        raise errors[0]


def relu_kernels(x):
    """The names of the kernels that ran ops.relu(x) on this thread."""
    with kernels.tracking() as used:
        ops.relu(Tensor(x))
    return {k.name for k in used}


@pytest.mark.cpu_only  # ReLU's kernel is a NumPy one
def test_set_reference_only_switches_the_table_for_the_process_and_says_so():
    # (This thread holds kernels_on's own setting, which wins over the process's: a new thread,
    # with none of its own, is what sees the process's.)
    x = np.random.default_rng(0).standard_normal((2, 4096))
    seen = []

    def look():
        seen.append((kernels.is_reference_only(), relu_kernels(x)))
    previous = kernels.set_reference_only(1)  # any truthy value
    try:
        in_threads(look)
        assert kernels.set_reference_only(0) is True  # the previous process value
        in_threads(look)
    finally:
        kernels.set_reference_only(previous)
    assert seen == [(True, set()), (False, {"ReLURows"})]
    assert kernels.is_reference_only() is False  # this thread's own setting (kernels_on) all along


@pytest.mark.cpu_only  # ReLU's kernel is a NumPy one
def test_a_reference_only_block_holds_on_its_own_thread_only():
    # minidl_parallel's threads world runs one rank per thread: one rank's block must not switch
    # the kernels off under the others.
    x = np.random.default_rng(0).standard_normal((2, 4096))
    inside, beside_done = threading.Event(), threading.Event()
    seen = {}

    def in_block():
        with kernels.reference_only():
            inside.set()
            assert beside_done.wait(timeout=30)  # the other thread ran while this block was open
            seen["block"] = (kernels.is_reference_only(), relu_kernels(x))
        seen["after"] = kernels.is_reference_only()

    def beside():
        assert inside.wait(timeout=30)
        seen["beside"] = (kernels.is_reference_only(), relu_kernels(x))
        beside_done.set()
    previous = kernels.set_reference_only(False)  # (kernels on for threads without their own, as under kernels_on)
    try:
        in_threads(in_block, beside)
    finally:
        kernels.set_reference_only(previous)
    assert seen == {"block": (True, set()), "beside": (False, {"ReLURows"}), "after": False}


@pytest.mark.cpu_only  # ReLU's kernel is a NumPy one
def test_an_option_block_holds_on_its_own_thread_only():
    # ReLURows takes an array whose size is a multiple of the relu_row option: 3 x 1024 only at 1024.
    x = np.random.default_rng(0).standard_normal((3, 1024))
    inside, beside_done = threading.Event(), threading.Event()
    seen = {}

    def in_block():
        with kernels.option("relu_row", 1024):
            inside.set()
            assert beside_done.wait(timeout=30)
            seen["block"] = (kernels.get_option("relu_row"), relu_kernels(x))
        seen["after"] = kernels.get_option("relu_row")

    def beside():
        assert inside.wait(timeout=30)
        seen["beside"] = (kernels.get_option("relu_row"), relu_kernels(x), kernels.options()["relu_row"][0])
        beside_done.set()
    previous = kernels.set_reference_only(False)  # (kernels on for threads without their own, as under kernels_on)
    try:
        in_threads(in_block, beside)
    finally:
        kernels.set_reference_only(previous)
    assert seen == {"block": (1024, {"ReLURows"}), "beside": (4096, set(), 4096), "after": 4096}
    assert kernels.get_option("relu_row") == 4096


def test_process_settings_reach_every_thread_without_its_own():
    seen = {}

    def plain():
        seen["plain"] = (kernels.get_option("relu_row"), kernels.is_reference_only())

    def own():
        with kernels.option("relu_row", 2048), kernels.reference_only(False):
            seen["own"] = (kernels.get_option("relu_row"), kernels.is_reference_only())
        with kernels.option("relu_row", None):  # None in a block: the default, whatever the process's
            seen["default"] = kernels.get_option("relu_row")
    kernels.set_option("relu_row", 1024)
    previous = kernels.set_reference_only(True)
    try:
        in_threads(plain, own)
    finally:
        kernels.set_option("relu_row", None)
        kernels.set_reference_only(previous)
    assert seen == {"plain": (1024, True), "own": (2048, False), "default": 4096}


def test_an_option_block_and_get_option_name_an_unknown_option():
    with pytest.raises(KeyError, match="kernels.option: unknown option 'relu_rows'; declared: .*relu_row"):
        with kernels.option("relu_rows", 1):
            pass
    with pytest.raises(KeyError, match="kernels.get_option: unknown option 'relu_rows'; declared: .*relu_row"):
        kernels.get_option("relu_rows")


def test_options_lists_each_declared_option_with_its_value_default_and_meaning(monkeypatch):
    monkeypatch.setattr(kernel_table, "_defaults", dict(kernel_table._defaults))  # the declaration below is this test's
    kernels.declare_option("test_only_rows", 8, "rows a test kernel takes at once")
    assert kernels.get_option("test_only_rows") == 8
    kernels.set_option("test_only_rows", 3)
    try:
        assert kernels.options()["test_only_rows"] == (3, 8, "rows a test kernel takes at once")
    finally:
        kernels.set_option("test_only_rows", None)
    listed = kernels.options()
    assert listed["relu_row"] == (4096, 4096, "elements per row of the zero operand ReLU's CPU kernel takes x in")
    assert list(listed) == sorted(listed)


def test_a_kernel_without_its_own_methods_applies_and_names_what_it_lacks():
    class Bare(kernels.Kernel):
        op = ops.ReLU
    bare = Bare()
    assert bare.applies(None, np.ones(3)) is True and bare.cases() == []
    with pytest.raises(NotImplementedError, match=r"^Bare\.forward$"):
        bare.forward(None, np.ones(3))
    with pytest.raises(NotImplementedError, match=r"^Bare\.backward$"):
        bare.backward(None, np.ones(3))
