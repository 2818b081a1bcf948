"""The strict device double (minidl/testing/cupy_double): what it refuses as CuPy 14.2.0 does,
what it counts, which names exist, and the pointers a fake NCCL will need.

These tests use the double's module object directly, so they run in the normal suite without
replacing ``cupy`` for anything else."""
import pathlib
import pickle
import re
import sys
import threading

import numpy as np
import pytest

from minidl.testing import cupy_double
from minidl.testing.cupy_double import names

cp = cupy_double.cupy_module()
IMPLICIT = "Implicit conversion to a NumPy array is not allowed"
UNSUPPORTED = re.escape("Unsupported type <class 'numpy.ndarray'>")


@pytest.fixture
def x():
    return cp.arange(6, dtype=cp.float32).reshape(2, 3)


# --- implicit device -> host conversion is refused --------------------------------------------

@pytest.mark.parametrize("convert", [np.asarray, np.array, lambda a: a.__array__(),
                                     lambda a: np.asarray(a, dtype=np.float64)])
def test_implicit_conversion_to_numpy_is_refused(x, convert):
    with pytest.raises(TypeError, match=IMPLICIT):
        convert(x)


def test_no_numpy_interfaces_to_bypass_the_refusal(x):
    # NumPy would use either of these to read the memory behind CuPy's back
    assert not hasattr(x, "__array_interface__")
    with pytest.raises(TypeError):
        memoryview(x)


# --- host operands are refused ---------------------------------------------------------------

HOST = np.ones(3, np.float32)


@pytest.mark.parametrize("operation", [
    lambda a: a + HOST, lambda a: HOST + a, lambda a: a * HOST, lambda a: HOST - a, lambda a: a @ HOST.reshape(3, 1),
    lambda a: a > HOST, lambda a: cp.add(a, HOST), lambda a: cp.maximum(HOST, a), lambda a: np.add(a, HOST),
    lambda a: cp.concatenate([a, HOST.reshape(1, 3)]), lambda a: cp.where(a > 0, a, HOST),
    lambda a: cp.matmul(a, HOST), lambda a: cp.einsum("ij,j->i", a, HOST), lambda a: a.dot(HOST),
    lambda a: cp.multiply(a, 2, out=np.empty((2, 3), np.float32)),
], ids=["add", "radd", "mul", "rsub", "matmul-op", "compare", "cp.add", "cp.maximum", "np.add", "concatenate",
        "where", "cp.matmul", "einsum", "dot", "out"])
def test_numpy_operands_are_refused(x, operation):
    with pytest.raises(TypeError, match=r"Unsupported type|Output arguments must be cupy.ndarray"):
        operation(x)


def test_inplace_with_a_numpy_operand_is_refused(x):
    with pytest.raises(TypeError, match=UNSUPPORTED):
        x += HOST
    with pytest.raises(TypeError, match=re.escape("Unsupported type <class 'list'>")):
        cp.add(x, [1.0, 2.0, 3.0])


def test_python_and_numpy_scalars_are_operands(x):
    y = 2.0 - x * np.float32(3) + 1
    assert isinstance(y, cp.ndarray) and y.dtype == np.float32
    np.testing.assert_array_equal(y.get(), 3.0 - np.arange(6, dtype=np.float32).reshape(2, 3) * 3)


def test_numpy_ufuncs_and_functions_dispatch_to_the_device_as_cupys_do(x):
    assert isinstance(np.exp(x), cp.ndarray)
    total = np.sum(x)
    assert isinstance(total, cp.ndarray) and total.shape == ()
    assert isinstance(np.concatenate([x, x]), cp.ndarray)


def test_numpy_functions_cupy_lacks_are_refused(x):
    # numpy.insert has no cupy.insert in 14.x: __array_function__ declines, NumPy raises
    with pytest.raises(TypeError, match="no implementation found"):
        np.insert(x, 0, 1.0)


def test_reductions_and_scalar_indexing_stay_on_the_device(x):
    for value in (x.sum(), x.max(), x[1, 2], cp.mean(x), x.argmax()):
        assert isinstance(value, cp.ndarray) and value.shape == ()


def test_basic_slice_assignment_refuses_host_arrays_advanced_uploads(x):
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        x[0] = HOST
    x[0] = np.float32(7)
    x[cp.asarray([1])] = np.full((1, 3), 5, np.float32)  # CuPy uploads values for advanced indexing
    np.testing.assert_array_equal(x.get(), [[7, 7, 7], [5, 5, 5]])


def test_copyto_takes_a_host_source_only_of_one_element(x):
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for copyto"):
        cp.copyto(x, np.ones((2, 3), np.float32))
    cp.copyto(x, np.array([4.0]))
    cp.copyto(x[0], cp.zeros(3, cp.float32))
    np.testing.assert_array_equal(x.get(), [[0, 0, 0], [4, 4, 4]])


def test_out_of_bounds_integer_array_indices_wrap_as_on_cupy():
    a = cp.arange(3)
    np.testing.assert_array_equal(a[cp.asarray([1, 3, 4])].get(), [1, 0, 1])


# --- explicit conversion works and is counted ----------------------------------------------------

@pytest.mark.parametrize("convert, reason", [
    (lambda a: a.get(), "get"), (lambda a: cp.asnumpy(a), "get"), (lambda a: float(a[0, 0]), "float"),
    (lambda a: int(a[0, 0]), "int"), (lambda a: bool(a[0, 1]), "bool"), (lambda a: a[0, 0].item(), "item"),
    (lambda a: a.tolist(), "tolist"), (lambda a: repr(a), "repr"), (lambda a: pickle.dumps(a), "pickle"),
    (lambda a: a[a > 2], "boolean mask indexing"), (lambda a: cp.nonzero(a), "nonzero"),
    (lambda a: a.nonzero(), "nonzero"), (lambda a: cp.unique(a), "unique"),
])
def test_each_explicit_conversion_counts_one_host_sync(x, convert, reason):
    with cupy_double.count_host_syncs() as syncs:
        convert(x)
    assert syncs.by_reason == {reason: 1}
    assert syncs.total == 1


def test_device_work_and_metadata_count_no_sync(x):
    with cupy_double.count_host_syncs() as syncs:
        y = (x * 2).sum(axis=0)
        _ = y.shape, len(x), x.ndim, x.dtype, x.size, x.flags.c_contiguous, x.data.ptr
        cp.asnumpy(np.ones(2))  # host data passes through
    assert syncs.total == 0


def test_counter_totals_and_reset(x):
    cupy_double.reset_host_syncs()
    float(x[0, 0])
    x.get()
    assert cupy_double.host_syncs() == 2
    cupy_double.reset_host_syncs()
    assert cupy_double.host_syncs() == 0


def test_get_and_asarray_copy_never_alias(x):
    host = x.get()
    host[...] = -1
    assert x[0, 1].item() == 1.0
    source = np.zeros(3)
    device = cp.asarray(source)
    source[...] = 9
    np.testing.assert_array_equal(device.get(), 0)


def test_pickle_round_trip(x):
    y = pickle.loads(pickle.dumps(x))
    assert isinstance(y, cp.ndarray)
    np.testing.assert_array_equal(y.get(), x.get())


# --- the namespace is CuPy 14.x's --------------------------------------------------------------------

def test_names_file_pins_a_cupy_14_release():
    assert re.fullmatch(r"14\.\d+\.\d+", names.CUPY_VERSION)
    assert {"asnumpy", "get_array_module", "ndarray", "float32", "cuda", "random"} <= names.allowed("cupy")
    assert {"get", "data", "flags", "item"} <= names.allowed("cupy.ndarray")


def test_absent_names_raise_attribute_error_naming_the_release(x):
    with pytest.raises(AttributeError, match=r"cupy\.insert is absent from CuPy 14\.2\.0"):
        cp.insert
    with pytest.raises(AttributeError, match="absent from CuPy 14"):
        x.flags.writeable  # device memory has no read-only flag
    with pytest.raises(AttributeError, match="absent from CuPy 14"):
        x.itemset
    with pytest.raises(AttributeError, match="absent from CuPy 14"):
        cp.cuda.nonexistent_function
    with pytest.raises(TypeError):
        range(cp.asarray(3))  # cupy.ndarray has no __index__


def test_every_cupy_name_minidl_uses_is_in_the_pinned_release():
    """``xp.NAME`` / ``cupy.NAME`` in minidl and minidl_parallel must exist in CuPy 14.x."""
    root = pathlib.Path(__file__).resolve().parents[2]
    used = set()
    for package in ("minidl", "minidl_parallel"):
        for path in (root / package).rglob("*.py"):
            if "cupy_double" in path.parts:
                continue
            used.update(re.findall(r"\b(?:xp|cupy|_cupy)\.([A-Za-z_][A-Za-z0-9_]*)", path.read_text()))
    used -= {"__name__"}
    assert used, "the scan found no uses: the pattern is broken"
    missing = sorted(used - names.allowed("cupy"))
    assert not missing, f"not in CuPy {names.CUPY_VERSION}: {missing}"


# --- pointers ----------------------------------------------------------------------------------------------

def test_data_ptr_is_unique_per_live_buffer_and_offset_for_views():
    a, b = cp.zeros(8, cp.float32), cp.zeros(8, cp.float32)
    assert a.data.ptr != b.data.ptr
    assert a[2:].data.ptr == a.data.ptr + 2 * 4
    assert cupy_double.pointer_to_array(a.data.ptr) is a


def test_pointer_to_buffer_finds_and_checks_the_memory():
    a = cp.zeros(8, cp.float32)
    view = cupy_double.pointer_to_buffer(a[2:].data.ptr, 4, np.float32)
    view[...] = 3
    np.testing.assert_array_equal(a.get(), [0, 0, 3, 3, 3, 3, 0, 0])
    with pytest.raises(ValueError, match="runs past the end"):
        cupy_double.pointer_to_buffer(a[2:].data.ptr, 7, np.float32)
    with pytest.raises(ValueError, match="no live"):
        cupy_double.pointer_to_array(12345)


# --- cuda and random ---------------------------------------------------------------------------------------

@pytest.fixture
def two_devices():
    cupy_double.configure(device_count=2)
    yield
    cupy_double.configure(device_count=1)
    cp.cuda.Device(0).use()


def test_cuda_as_minidl_uses_it(two_devices):
    assert cp.cuda.runtime.getDeviceCount() == 2
    with pytest.raises(Exception, match="invalid device ordinal"):
        cp.cuda.Device(2)
    cp.cuda.Device(1).use()
    assert cp.zeros(1).device.id == 1
    seen = []
    thread = threading.Thread(target=lambda: seen.append(cp.cuda.runtime.getDevice()))
    thread.start()
    thread.join()
    assert seen == [0], "the current device is per host thread"
    stream = cp.cuda.Stream(non_blocking=True)
    event = cp.cuda.get_current_stream().record()
    assert isinstance(stream.ptr, int) and event.done
    with cupy_double.count_host_syncs() as syncs:
        event.synchronize()
        cp.cuda.Device().synchronize()
    assert syncs.total == 2


def test_cupy_random_seed_seeds_only_the_current_device(two_devices):
    from minidl.testing.cupy_double import random
    random.reset()

    def draws():
        cp.cuda.Device(0).use()
        cp.random.seed(7)  # what minidl.set_seed does: device 0 only
        first = cp.random.random_sample((4,), dtype=cp.float32).get()
        cp.cuda.Device(1).use()
        second = cp.random.random_sample((4,), dtype=cp.float32).get()
        random.reset()
        return first, second

    (a0, a1), (b0, b1) = draws(), draws()
    np.testing.assert_array_equal(a0, b0)
    assert a0.dtype == np.float32
    assert not np.array_equal(a1, b1), "an unseeded device must not repeat"


def test_random_state_takes_64_bit_seeds():
    seed = 3 * 2**32 + 5
    a = cp.random.RandomState(seed).random_sample((3,), dtype=cp.float32)
    b = cp.random.RandomState(seed).random_sample((3,), dtype=cp.float32)
    assert isinstance(a, cp.ndarray)
    np.testing.assert_array_equal(a.get(), b.get())


# --- installation ------------------------------------------------------------------------------------------

def test_install_serves_import_cupy_and_minidl_backend_picks_it(monkeypatch):
    from minidl import backend
    for name in ("cupy", "cupy.cuda", "cupy.cuda.runtime", "cupy.random", "cupyx"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(backend, "_cupy", None)
    installed = cupy_double.install()
    try:
        import cupy
        import cupyx
        from cupy.cuda import runtime
        assert cupy is installed and runtime.getDeviceCount() == 1
        assert backend.gpu_available()
        a = backend.to_device(np.arange(3.0), backend._import_cupy())
        assert backend.get_array_module(a) is cupy
        cupyx.scatter_add(a, cupy.asarray([0, 0]), 1.0)
        np.testing.assert_array_equal(backend.to_numpy(a), [2.0, 1.0, 2.0])
    finally:
        cupy_double.uninstall()
