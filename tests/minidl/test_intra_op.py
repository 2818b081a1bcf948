"""Intra-op threads: chunk splitting, the thread pool, finding NumPy's OpenBLAS (and running
serially without it), sizes from the machine's caches, and ops that give the same results
(against their references) on 1 thread and on several."""
import ctypes.util
import gc
import multiprocessing
import os
import queue
import sys
import threading
import time
import types
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


@needs_local_blas
def test_parallel_map_reraises_a_workers_error_too(threads):
    threads(3)

    def work(i):
        if i == 2:
            raise KeyError("chunk 2 failed")
        return i

    with pytest.raises(KeyError, match="chunk 2 failed"):
        intra_op.parallel_map(work, 3)
    assert intra_op.parallel_map(lambda i: -i, 3) == [0, -1, -2]


def test_parallel_map_refuses_more_calls_than_threads_and_says_both():
    n = minidl.get_num_threads()
    with pytest.raises(ValueError, match=f"parallel_map: {n + 1} calls for {n} threads"):
        intra_op.parallel_map(lambda i: i, n + 1)


@needs_local_blas
def test_parallel_map_runs_the_callers_call_on_a_one_thread_blas_and_gives_its_count_back(threads, monkeypatch):
    """The caller's call runs with OpenBLAS at one thread; afterwards the caller's count is what it
    was. (NumPy's OpenBLAS, a pthreads build, keeps that count process-wide whatever the setter's
    name: so the pool is started first, and the workers' calls leave the count alone.)"""
    monkeypatch.setitem(intra_op._state, "blas", None)  # the library found afresh, as in a new process
    threads(3)
    set_local = intra_op._openblas().openblas_set_num_threads_local  # returns the count it replaces
    started = threading.Barrier(3, timeout=30)
    intra_op.parallel_map(lambda i: started.wait(), 3)  # both workers have started
    own = set_local(1)
    try:
        for count in (1, 2):  # 1: not the BLAS's default (what a setter given 0 restores) on 2 cores or more
            set_local(count)
            assert intra_op.parallel_map(lambda i: set_local(1) if i == 0 else None, 3)[0] == 1
            assert set_local(count) == count
    finally:
        set_local(own)


class ProcessWideCount:
    """A BLAS whose "thread-local" count is one per process, as NumPy's OpenBLAS 0.3.31 keeps it."""

    def __init__(self, count):
        self.count = count

    def openblas_set_num_threads_local(self, count):
        previous, self.count = self.count, count
        return previous


def test_the_workers_calls_run_on_a_one_thread_blas_even_where_the_count_is_per_process(threads, monkeypatch):
    """The count is 1 from before a task is queued until the last one is back, then the caller's
    again: a worker still running after the caller's own call never runs on the caller's count."""
    threads(3)
    intra_op.parallel_map(lambda i: None, 3)  # the pool's workers started (they set their count once)
    blas = ProcessWideCount(4)
    monkeypatch.setitem(intra_op._state, "blas", blas)
    caller_done = threading.Event()

    def count_seen(i):
        if i == 0:
            caller_done.set()  # the caller's call ends first
        else:
            assert caller_done.wait(30)
        return blas.count

    assert intra_op.parallel_map(count_seen, 3) == [1, 1, 1]
    assert blas.count == 4


@needs_local_blas
def test_a_new_pools_workers_hold_the_blas_to_one_thread():
    set_local = intra_op._openblas().openblas_set_num_threads_local
    own = set_local(3)
    pool = intra_op._Pool(2)
    try:
        started, done = threading.Barrier(2, timeout=30), queue.SimpleQueue()

        def count_found(i):
            started.wait()  # each call waits for the other: each worker runs one
            return set_local(1)

        for i in (1, 2):
            pool.tasks.put((count_found, i, done))
        results = sorted(done.get(timeout=30) for _ in range(2))
        assert results == [(1, 1, None), (2, 1, None)]  # (call, the count it found, no error)
    finally:
        pool.close()
        set_local(own)


def _pool_threads():
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("minidl-intra-op-"))


@needs_local_blas
def test_a_pool_for_n_threads_starts_n_minus_one_workers(threads):
    """The caller runs call 0 itself: 3 threads are the caller and 2 workers."""
    threads(1)  # closes the pool: its workers exit
    deadline = time.monotonic() + 30
    while _pool_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _pool_threads() == []
    threads(3)
    assert intra_op.parallel_map(lambda i: i, 3) == [0, 1, 2]
    assert _pool_threads() == ["minidl-intra-op-0", "minidl-intra-op-1"]


def _blocks(start, stop):
    return start, stop


@needs_local_blas
def test_map_rows_gives_each_thread_one_block_of_rows_in_order(threads, options):
    rows = np.zeros((7, 2))
    options(parallel_min_bytes=rows.nbytes)  # from this many bytes on: this array is split
    threads(3)
    assert intra_op.map_rows(np, rows, _blocks) == [(0, 3), (3, 5), (5, 7)]
    threads(2)
    assert intra_op.map_rows(np, rows, _blocks) == [(0, 4), (4, 7)]
    threads(3)
    assert intra_op.map_rows(np, rows[:2], _blocks) == [(0, 2)]  # under the threshold: one block
    options(parallel_min_bytes=0)
    assert intra_op.map_rows(np, rows[:2], _blocks) == [(0, 1), (1, 2)]  # fewer rows than threads
    assert intra_op.map_rows(np, rows[:0], _blocks) == [(0, 0)]


@needs_local_blas
def test_map_rows_leaves_another_array_modules_arrays_in_one_block(threads, options):
    """Only NumPy arrays are split over the host threads (a device array's work is the device's)."""
    rows = np.zeros((5, 3))
    options(parallel_min_bytes=0)
    threads(3)
    assert intra_op.map_rows(types.ModuleType("cupy"), rows, _blocks) == [(0, 5)]
    threads(1)
    assert intra_op.map_rows(np, rows, _blocks) == [(0, 5)]


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


@pytest.mark.skipif(not ctypes.util.find_library("m"), reason="needs a shared library without OpenBLAS in it")
def test_each_fallback_says_why_and_that_ops_run_on_one_thread(tmp_path):
    libm = ctypes.util.find_library("m")
    missing = str(tmp_path / "libopenblas-missing.so")
    other = intra_op.find_openblas("mkl", [])[1]
    absent = intra_op.find_openblas("scipy-openblas", [])[1]
    no_setter = intra_op.find_openblas("openblas", [missing, libm])[1]
    assert other.startswith("NumPy's BLAS is 'mkl', not OpenBLAS: ")
    assert absent.startswith("NumPy's OpenBLAS was not found (no numpy.libs copy; threadpoolctl")
    assert no_setter.startswith(f"no openblas_set_num_threads_local (OpenBLAS >= 0.3.27) in {missing}, {libm}: ")
    for why in (other, absent, no_setter):
        assert why.endswith(": CPU ops run their chunks on one thread")


@needs_local_blas
def test_a_path_that_does_not_load_is_skipped_for_the_next(tmp_path):
    missing = str(tmp_path / "libscipy_openblas-missing.so")
    paths = intra_op.openblas_paths()
    lib, why = intra_op.find_openblas("scipy-openblas", [missing] + paths)
    assert lib and why == f"OpenBLAS with a thread-local thread count: {paths[0]}"


def test_openblas_paths_are_the_wheels_copies_then_threadpoolctls_openblas(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    (site / "numpy").mkdir(parents=True)
    libs = site / "numpy.libs"
    libs.mkdir()
    for name in ("libscipy_openblas64_-b.so", "libscipy_openblas64_-a.so", "libgfortran-c.so"):
        (libs / name).write_bytes(b"")
    loaded, mkl = tmp_path / "libopenblas.so.0", tmp_path / "libmkl_rt.so"
    monkeypatch.setattr(intra_op, "numpy", types.SimpleNamespace(__file__=str(site / "numpy" / "__init__.py")))
    monkeypatch.setitem(sys.modules, "threadpoolctl", types.SimpleNamespace(threadpool_info=lambda: [
        {"internal_api": "mkl", "filepath": str(mkl)},
        {"internal_api": "openblas", "filepath": str(loaded)},
        {"internal_api": "openblas", "filepath": str(libs / "libscipy_openblas64_-a.so")},  # the wheel's: once
        {"user_api": "openmp", "filepath": str(tmp_path / "libgomp.so")},
    ]))
    wheel = [os.path.realpath(libs / "libscipy_openblas64_-a.so"), os.path.realpath(libs / "libscipy_openblas64_-b.so")]
    assert intra_op.openblas_paths() == wheel + [os.path.realpath(loaded)]
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # threadpoolctl not installed
    assert intra_op.openblas_paths() == wheel


def test_numpys_blas_is_looked_for_once_and_another_blas_leaves_ops_serial(monkeypatch):
    monkeypatch.setitem(intra_op._state, "blas", None)
    monkeypatch.setitem(intra_op._state, "blas_status", None)
    monkeypatch.setattr(intra_op, "numpy_blas_name", lambda config=None: "mkl")
    looked = []
    monkeypatch.setattr(intra_op, "openblas_paths", lambda: looked.append(1) or [])
    assert intra_op._openblas() is False
    assert intra_op._openblas() is False and looked == [1]
    assert intra_op.blas_status().startswith("NumPy's BLAS is 'mkl', not OpenBLAS")


@needs_local_blas
def test_numpys_openblas_is_found_once_and_kept(monkeypatch):
    monkeypatch.setitem(intra_op._state, "blas", None)
    monkeypatch.setitem(intra_op._state, "blas_status", None)
    real_paths, looked = intra_op.openblas_paths, []
    monkeypatch.setattr(intra_op, "openblas_paths", lambda: looked.append(1) or real_paths())
    lib = intra_op._openblas()
    assert lib is intra_op._openblas() and looked == [1]
    assert hasattr(lib, "openblas_set_num_threads_local")
    assert intra_op.blas_status() == f"OpenBLAS with a thread-local thread count: {real_paths()[0]}"


@pytest.fixture
def machine(monkeypatch):
    """``machine(affinity={...} or None, cpu_count=...)``: the probes see a machine where this
    process (pid 0) may run on ``affinity`` (None: an OS without sched_getaffinity)."""
    def set_machine(affinity=None, cpu_count=None):
        fake = types.SimpleNamespace(path=os.path, environ=os.environ, cpu_count=lambda: cpu_count)
        if affinity is not None:
            def sched_getaffinity(pid):
                if pid != 0:
                    raise ProcessLookupError(pid)
                return set(affinity)
            fake.sched_getaffinity = sched_getaffinity
        monkeypatch.setattr(intra_op, "os", fake)
    return set_machine


def test_cores_are_the_affinity_mask_else_the_cpu_count(machine):
    machine(affinity={0, 5, 7}, cpu_count=16)
    assert intra_op.cores() == 3
    machine(affinity=None, cpu_count=16)
    assert intra_op.cores() == 16
    machine(affinity=None, cpu_count=None)  # os.cpu_count() cannot tell
    assert intra_op.cores() == 1


class _FakeBLAS:
    """A library whose (global) thread count is ``n``."""

    def __init__(self, n):
        self.n = n

    def openblas_get_num_threads(self):
        return self.n


def test_thread_count_is_the_blas_count_within_one_and_the_cores(machine):
    machine(affinity={0, 1, 2, 3})
    assert [intra_op._default_threads({}, lib=_FakeBLAS(n)) for n in (0, 1, 3, 64)] == [1, 1, 3, 4]
    assert intra_op._default_threads({}, lib=object()) == 4  # no thread count to read: the cores
    assert intra_op._default_threads({"MINIDL_NUM_THREADS": "1"}, lib=_FakeBLAS(3)) == 1


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
    for n in (2, 4):
        minidl.set_num_threads(n)
        assert minidl.get_num_threads() == 1  # asked for n, but the BLAS cannot be held to one per thread
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


def test_cache_sizes_take_a_b_suffix_and_plain_bytes_and_skip_odd_entries(tmp_path):
    _fake_cache(tmp_path, 0, [(1, "Data", "lots"), (1, "Data", "32KB"), (2, "Unified", "2MB"),
                              (3, "Unified", "8388608"), (4, "Unified", "1gb")])
    assert intra_op.cache_sizes(str(tmp_path), cpu=0) == {1: 32 << 10, 2: 2 << 20, 3: 8 << 20, 4: 1 << 30}


def test_the_caches_read_are_those_of_the_first_cpu_this_process_may_run_on(tmp_path, machine):
    l2_kb = intra_op.l2_bytes() // 1024 + 256  # an L2 unlike this machine's (its own is kept)
    for cpu, kb in ((0, 512), (1, 768), (3, l2_kb)):
        _fake_cache(tmp_path, cpu, [(2, "Unified", f"{kb}K")])
    machine(affinity={5, 3})
    assert intra_op.cache_sizes(str(tmp_path)) == {2: l2_kb << 10}
    assert intra_op.l2_bytes(str(tmp_path)) == l2_kb << 10
    machine(affinity=None)  # no affinity on this OS: cpu0
    assert intra_op.cache_sizes(str(tmp_path)) == {2: 512 << 10}


def test_the_machines_own_l2_is_read_once_and_kept(monkeypatch):
    monkeypatch.delitem(intra_op._state, "l2", raising=False)
    real, reads = intra_op.cache_sizes, []
    monkeypatch.setattr(intra_op, "cache_sizes", lambda *args: reads.append(args) or real(*args))
    first = intra_op.l2_bytes()
    assert first == (real().get(2) or intra_op.FALLBACK_L2_BYTES)
    assert intra_op.l2_bytes() == first and len(reads) == 1


def test_min_parallel_bytes_is_a_whole_number_of_bytes():
    assert intra_op._min_parallel_bytes(1280 << 10) == 1920 << 10
    assert intra_op._min_parallel_bytes(1001) == 1501 and isinstance(intra_op._min_parallel_bytes(1001), int)
