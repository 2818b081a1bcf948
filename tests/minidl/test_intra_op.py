"""Intra-op threads: chunk splitting, the thread pool, finding NumPy's OpenBLAS (and running
serially without it), sizes from the machine's caches, and ops that give the same results
(against their references) on 1 thread and on several."""
import ctypes.util
import gc
import multiprocessing
import os
import threading
import weakref

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import _intra_op as intra_op
from minidl import kernels, ops, Tensor

needs_local_blas = pytest.mark.skipif(not intra_op._openblas(),
                                      reason="NumPy's BLAS has no thread-local thread count")


@pytest.fixture
def threads():
    """Sets the intra-op thread count for one test and restores it afterwards."""
    before = minidl.get_num_threads()
    yield minidl.set_num_threads
    minidl.set_num_threads(before)


@pytest.fixture
def options():
    """Sets kernels options for one test (``options(name=value, ...)``) and restores them afterwards."""
    before = {}

    def set_options(**values):
        for name, value in values.items():
            value_before, default, _ = kernels.options()[name]
            before.setdefault(name, None if value_before == default else value_before)
            kernels.set_option(name, value)
    yield set_options
    for name, value in before.items():
        kernels.set_option(name, value)  # None: back to the default


@given(n=st.integers(1, 200), per_chunk=st.integers(1, 50), t=st.integers(1, 8))
def test_split_covers_every_item_once_in_balanced_chunks(n, per_chunk, t):
    chunks = intra_op.split(n, per_chunk, t)
    assert chunks[0][0] == 0 and chunks[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    sizes = [b - a for a, b in chunks]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1 and max(sizes) <= per_chunk
    # Whole rounds of one chunk per thread, unless there are too few items for that.
    assert len(chunks) == min(n, t * -(-n // (t * per_chunk)))


@needs_local_blas
def test_parallel_map_returns_in_order_with_call_0_on_the_caller(threads):
    threads(3)
    names = intra_op.parallel_map(lambda i: (i, threading.current_thread().name), 3)
    assert [i for i, _ in names] == [0, 1, 2]
    assert names[0][1] == threading.current_thread().name
    assert all(name.startswith("minidl-intra-op-") for _, name in names[1:])


@needs_local_blas
def test_parallel_map_waits_for_every_call_before_raising(threads):
    threads(2)
    finished = []

    def work(i):
        if i == 0:
            raise RuntimeError("chunk 0 failed")
        threading.Event().wait(0.05)
        finished.append(i)

    with pytest.raises(RuntimeError, match="chunk 0 failed"):
        intra_op.parallel_map(work, 2)
    assert finished == [1]  # the worker's call had finished: its buffers are no longer in use
    assert intra_op.parallel_map(lambda i: i * 10, 2) == [0, 10]  # the pool still works


@needs_local_blas
def test_the_pool_keeps_nothing_of_a_finished_call(threads):
    """A worker waiting for its next task holds nothing of the last: that task's closure held an
    op's arrays (activations), which must go with the step (tests/minidl/kernels/test_step_memory.py)."""
    threads(2)
    array = np.ones(1000)
    alive = weakref.ref(array)
    assert intra_op.parallel_map(lambda i, a=array: float(a[i]), 2) == [1.0, 1.0]  # (a default: ``del`` empties a cell)
    del array
    gc.collect()
    assert alive() is None


def test_set_num_threads_rejects_bad_values():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="set_num_threads: n must be a positive int"):
            minidl.set_num_threads(bad)


def test_bad_environment_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("MINIDL_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="MINIDL_NUM_THREADS must be a positive int, got 'two'"):
        intra_op._default_threads()


def conv_step(x, w, stride, pad):
    """Forward and both gradients of one Conv2D, for a fixed upstream gradient."""
    xt, wt = Tensor(x), Tensor(w)
    op = ops.Conv2D(w.shape[0], w.shape[2:], pad_mode="pad", pad=pad, stride=stride)
    gy = np.cos(np.arange(np.prod(op(xt, wt).shape))).reshape(op(xt, wt).shape)
    grad = minidl.grad(lambda a, b: (op(a, b) * Tensor(gy)).sum(), grad_position=(0, 1))
    gx, gw = grad(xt, wt)
    return op(xt, wt).asnumpy(), gx.asnumpy(), gw.asnumpy()


@needs_local_blas
@pytest.mark.parametrize("stride, pad", [(1, 1), (2, 1), (1, 0)])
def test_conv_on_threads_equals_one_thread(threads, options, stride, pad):
    """Chunks of 2 images on 3 threads (uneven rounds) vs the serial loop: the same values;
    the weight gradient differs only by the order its per-thread partial sums are added."""
    options(images_per_chunk=2)
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((9, 3, 7, 6)), rng.standard_normal((4, 3, 3, 3))
    threads(1)
    one = conv_step(x, w, stride, pad)
    threads(3)
    many = conv_step(x, w, stride, pad)
    for a, b, name in zip(one, many, ("y", "gx", "gw")):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12, err_msg=name)


def _conv_in_child(queue):
    x = np.ones((4, 2, 5, 5))
    w = np.ones((3, 2, 3, 3))
    queue.put(float(ops.conv2d(Tensor(x), Tensor(w)).sum().asnumpy()))


@needs_local_blas
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_forked_child_gets_its_own_pool(threads):
    """A child forked after the pool started inherits the pool object but not its threads."""
    threads(2)
    intra_op.parallel_map(lambda i: i, 2)  # start the pool in the parent
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_conv_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == 4 * 3 * 3 * 3 * 18  # 4 images, 3 channels out, 3x3 outputs of 18


@pytest.fixture
def pynative():
    """PYNATIVE_MODE for the test: it checks BatchNorm's and ReLU's own kernels, which GRAPH_MODE
    (MINIDL_MODE=graph) would fuse into BatchNormReLU's."""
    mode = minidl.get_context("mode")
    minidl.set_context(mode=minidl.PYNATIVE_MODE)
    yield
    minidl.set_context(mode=mode)


@needs_local_blas
@pytest.mark.cpu_only  # intra-op row blocks split NumPy work over host threads; a GPU has none
def test_batchnorm_and_relu_in_row_blocks_equal_one_block(threads, options, monkeypatch, kernels_on, pynative):
    """Every array large enough for the kernels and their blocks (thresholds 0), on 3 threads
    (7 images: blocks of 3, 2, 2) vs one block: ReLU exactly, BatchNorm to rounding (the
    per-channel sums add their blocks' partial sums)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((7, 4, 5, 3)) + 2.0
    gamma, beta = rng.standard_normal(4), rng.standard_normal(4)

    def run():
        bn, relu = ops.BatchNorm(is_training=True), ops.ReLU()
        mean, var = Tensor(np.zeros(4)), Tensor(np.ones(4))

        def loss(a, g, b):
            out = relu(bn(a, g, b, mean, var))
            return (out * Tensor(np.sin(np.arange(out.size)).reshape(out.shape))).sum()
        value, grads = minidl.value_and_grad(loss, grad_position=(0, 1, 2))(Tensor(x), Tensor(gamma), Tensor(beta))
        return [value.asnumpy()] + [g.asnumpy() for g in grads] + [mean.asnumpy(), var.asnumpy()]

    options(batchnorm_min_bytes=0, batchnorm_parallel_bytes=0, parallel_min_bytes=0, relu_row=60)
    threads(1)
    one = run()
    threads(3)
    calls = []
    real_map = intra_op.parallel_map
    # A spy that only counts (it changes nothing): the blocked paths ran, on 3 threads.
    monkeypatch.setattr(intra_op, "parallel_map", lambda fn, n: calls.append(n) or real_map(fn, n))
    with kernels.tracking() as used:
        blocked = run()
    assert {k.name for k in used} >= {"BatchNormBlocked", "ReLURows"}
    assert calls and set(calls) == {3}
    for a, b in zip(one, blocked):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)

    relu_x = rng.standard_normal((9, 4096))
    y = ops.ReLU()(Tensor(relu_x)).asnumpy()
    np.testing.assert_array_equal(y, np.maximum(relu_x, 0))


# ---- NumPy's BLAS, and the serial fallback without one ----

def test_numpy_blas_name_reads_numpys_build_configuration():
    config = {"Build Dependencies": {"blas": {"name": "scipy-openblas", "found": True}}}
    assert intra_op.numpy_blas_name(config) == "scipy-openblas"
    assert intra_op.numpy_blas_name({}) == ""  # a build that does not say: look for OpenBLAS anyway
    assert isinstance(intra_op.numpy_blas_name(), str)


def test_another_blas_is_not_searched_and_says_why(tmp_path):
    lib, why = intra_op.find_openblas("accelerate", [str(tmp_path / "libopenblas.so")])
    assert lib is None
    assert "NumPy's BLAS is 'accelerate', not OpenBLAS" in why and "one thread" in why


def test_no_openblas_found_says_so():
    lib, why = intra_op.find_openblas("scipy-openblas", [])
    assert lib is None and "NumPy's OpenBLAS was not found" in why and "one thread" in why


@pytest.mark.skipif(not ctypes.util.find_library("m"), reason="needs a shared library without OpenBLAS in it")
def test_a_library_without_the_thread_local_setter_is_passed_over(tmp_path):
    libm = ctypes.util.find_library("m")
    missing = str(tmp_path / "libopenblas-missing.so")
    lib, why = intra_op.find_openblas("openblas", [missing, libm])
    assert lib is None and "no openblas_set_num_threads_local (OpenBLAS >= 0.3.27)" in why and libm in why


@needs_local_blas
def test_numpys_openblas_is_found_where_the_wheel_or_threadpoolctl_shows_it():
    lib, why = intra_op.find_openblas(intra_op.numpy_blas_name(), intra_op.openblas_paths())
    assert lib and why.startswith("OpenBLAS with a thread-local thread count: ")
    assert intra_op.blas_status() == why


class _FakeOpenBLAS:
    """Stands for a library whose thread count is 64 (more than this process's cores)."""

    def scipy_openblas_get_num_threads64_(self):
        return 64


def test_thread_count_follows_the_blas_at_most_the_cores():
    assert intra_op._default_threads({}, lib=_FakeOpenBLAS()) == min(64, intra_op.cores())
    assert intra_op._default_threads({"MINIDL_NUM_THREADS": "3"}, lib=_FakeOpenBLAS()) == 3
    if hasattr(os, "sched_getaffinity"):
        assert intra_op.cores() == len(os.sched_getaffinity(0))


def test_without_a_thread_local_blas_the_default_is_one_thread():
    assert intra_op._default_threads({}, lib=None) == 1
    assert intra_op._default_threads({"MINIDL_NUM_THREADS": "4"}, lib=None) == 1
    with pytest.raises(ValueError, match="MINIDL_NUM_THREADS must be a positive int, got '0'"):
        intra_op._default_threads({"MINIDL_NUM_THREADS": "0"}, lib=None)


@pytest.fixture
def no_blas(monkeypatch):
    """This process as if NumPy's BLAS had no thread-local setting (restored afterwards)."""
    lib, why = intra_op.find_openblas("scipy-openblas", [])
    for key, value in dict(blas=lib or False, blas_status=why, threads=None, pool=None).items():
        monkeypatch.setitem(intra_op._state, key, value)


@pytest.mark.cpu_only  # intra-op threads split NumPy work; a GPU has none
def test_without_a_thread_local_blas_ops_run_serially_and_give_the_reference(no_blas, options, kernels_on):
    assert minidl.get_num_threads() == 1
    minidl.set_num_threads(4)
    assert minidl.get_num_threads() == 1  # asked for 4, but the BLAS cannot be held to one per thread
    assert "was not found" in intra_op.blas_status()
    options(parallel_min_bytes=0, relu_row=64)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3, 8, 8))
    w = rng.standard_normal((4, 3, 3, 3))
    with kernels.tracking() as used:
        fast = conv_step(x, w, 1, 1) + (ops.ReLU()(Tensor(x)).asnumpy(),)
    assert {k.name for k in used} >= {"Conv2DRoutes", "ReLURows"}
    with kernels.reference_only():
        reference = conv_step(x, w, 1, 1) + (ops.ReLU()(Tensor(x)).asnumpy(),)
    for a, b in zip(fast, reference):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    assert intra_op._state["pool"] is None  # no thread was started


# ---- sizes from the caches ----

def _fake_cache(root, cpu, entries):
    """A sysfs-like tree: root/cpu<cpu>/cache/index<i>/{level,type,size} for each (level, type, size)."""
    for i, fields in enumerate(entries):
        index = root / f"cpu{cpu}" / "cache" / f"index{i}"
        index.mkdir(parents=True)
        for name, value in zip(("level", "type", "size"), fields):
            if value is not None:
                (index / name).write_text(f"{value}\n")


def test_cache_sizes_read_a_sysfs_tree(tmp_path):
    _fake_cache(tmp_path, 3, [(1, "Data", "48K"), (1, "Instruction", "64K"), (2, "Unified", "1280K"),
                              (3, "Unified", "32M"), (4, "Unified", None)])  # no size: skipped
    assert intra_op.cache_sizes(str(tmp_path), cpu=3) == {1: 48 << 10, 2: 1280 << 10, 3: 32 << 20}
    assert intra_op.l2_bytes(str(tmp_path), cpu=3) == 1280 << 10
    assert intra_op.cache_sizes(str(tmp_path), cpu=0) == {}


def test_without_sysfs_the_l2_falls_back_to_the_documented_size(tmp_path):
    assert intra_op.l2_bytes(str(tmp_path / "absent"), cpu=0) == intra_op.FALLBACK_L2_BYTES == 2 << 20
    _fake_cache(tmp_path, 0, [(2, "Unified", "lots")])  # unreadable: the fallback too
    assert intra_op.l2_bytes(str(tmp_path), cpu=0) == intra_op.FALLBACK_L2_BYTES


def test_min_parallel_bytes_is_one_and_a_half_l2s_and_a_kernels_option(options):
    assert intra_op._min_parallel_bytes(2 << 20) == 3 << 20  # the 3 MB measured on a 2 MB-L2 Xeon
    machine = intra_op._min_parallel_bytes(intra_op.l2_bytes())
    assert intra_op.MIN_PARALLEL_BYTES == machine == kernels.options()["parallel_min_bytes"][1]
    assert intra_op.min_parallel_bytes() == machine
    options(parallel_min_bytes=123)
    assert intra_op.min_parallel_bytes() == 123
