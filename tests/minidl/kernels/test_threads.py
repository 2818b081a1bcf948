"""Intra-op threads and the one owner of thread counts (minidl/kernels/cpu/threads.py): chunk
splitting, the thread pool, every pool set by minidl.set_num_threads, running serially without a
BLAS minidl sets, sizes from the machine's caches, and ops that give the same results (against
their references) on 1 thread and on several."""
import gc
import multiprocessing
import os
import queue
import threading
import time
import types
import weakref

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import blas, onednn, thread_count, threads as intra_op

needs_local_blas = pytest.mark.skipif(not blas.chunks_may_run_in_parallel(),
                                      reason="needs a BLAS minidl sets the threads of: pip install -e '.[openblas]' "
                                             "(or '.[mkl]')")
needs_openblas_wheel = pytest.mark.skipif(not blas.installed("openblas"),
                                          reason="needs the OpenBLAS wheel: pip install -e '.[openblas]'")


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
def test_a_worker_lets_go_of_its_call_before_the_caller_hears_back(threads, monkeypatch):
    """The caller's next op may reuse the finished call's blocks (buffers.py: free when nothing refers
    to them), so a worker holds nothing of its call once the caller has its result, even when the
    worker is paused right after handing it back (as the OS may pause it; this test makes it sleep)."""
    class PausingQueue(queue.SimpleQueue):
        def put(self, item):
            super().put(item)
            if threading.current_thread().name.startswith("minidl-intra-op"):
                time.sleep(0.2)

    monkeypatch.setattr(intra_op.queue, "SimpleQueue", PausingQueue)
    threads(2)
    array, result = np.ones(1000), np.zeros(1)
    alive, result_alive = weakref.ref(array), weakref.ref(result)
    assert intra_op.parallel_map(lambda i, a=array, r=result: r if i else float(a[i]), 2) == [1.0, result]
    del array, result
    assert alive() is None and result_alive() is None  # no gc.collect(): the worker is still asleep


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


@needs_openblas_wheel
def test_every_call_of_a_map_runs_on_a_one_thread_openblas_then_the_count_is_back(threads, options):
    """The caller's call and the workers' see the OpenBLAS wheel at one thread, also a worker still
    running after the caller's call; after the map its count is the thread count again."""
    options(blas="openblas")
    blas.load("openblas")
    threads(3)
    assert blas.num_threads("openblas") == 3
    caller_done = threading.Event()

    def count_seen(i):
        if i == 0:
            caller_done.set()  # the caller's call ends first
        else:
            assert caller_done.wait(30)
        return blas.num_threads("openblas")

    assert intra_op.parallel_map(count_seen, 3) == [1, 1, 1]
    assert blas.num_threads("openblas") == 3


@needs_openblas_wheel
def test_overlapping_maps_keep_openblas_at_one_thread_until_the_last_ends(threads):
    """OpenBLAS's count is process-wide: two threads' blocks that overlap leave it at 1 until both
    have ended, whichever ends first; a count set meanwhile applies at the end."""
    blas.load("openblas")
    threads(2)
    first, second = blas.one_thread(), blas.one_thread()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert blas.num_threads("openblas") == 1
    minidl.set_num_threads(3)
    assert blas.num_threads("openblas") == 1
    second.__exit__(None, None, None)
    assert blas.num_threads("openblas") == 3


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


def test_set_num_threads_rejects_bad_values_naming_them_and_changes_nothing():
    before = minidl.get_num_threads()
    for bad in (0, -1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match=f"set_num_threads: n must be a positive int \\(1 or more\\), got {bad!r}"):
            minidl.set_num_threads(bad)
    assert minidl.get_num_threads() == before


def test_the_environment_gives_the_count_one_included(monkeypatch):
    assert thread_count.default({"MINIDL_NUM_THREADS": "1"}) == 1
    monkeypatch.setenv("MINIDL_NUM_THREADS", "3")
    assert thread_count.default() == 3  # os.environ when no mapping is given
    monkeypatch.delenv("MINIDL_NUM_THREADS")
    assert thread_count.default() == thread_count.cores()


def test_the_count_is_the_default_until_one_is_put_and_is_read_once(monkeypatch):
    monkeypatch.setattr(thread_count, "_state", {"n": None})  # as in a new process
    monkeypatch.setenv("MINIDL_NUM_THREADS", "3")
    assert thread_count.get() == 3
    monkeypatch.setenv("MINIDL_NUM_THREADS", "5")
    assert thread_count.get() == 3  # read once: the environment is the starting value only


def test_a_map_from_inside_a_pool_task_runs_on_that_thread(threads):
    """A task on a pool worker knows it is one (in_worker: oneDNN's kernel stands aside there), and
    a parallel_map it makes runs its calls in turn on its own thread: the pool's workers are busy
    with the outer map, so queueing would wait on itself."""
    threads(2)
    import threading as _threading

    def outer(i):
        inner = intra_op.parallel_map(lambda j: _threading.get_ident(), 2, calls_blas=False)
        return intra_op.in_worker(), _threading.get_ident(), inner
    results = intra_op.parallel_map(outer, 2, calls_blas=False)
    assert results[0][0] is False and results[1][0] is True
    worker_ident = results[1][1]
    assert results[1][2] == [worker_ident, worker_ident]
    assert results[0][1] == _threading.get_ident() != worker_ident


def test_bad_environment_value_names_the_variable():
    with pytest.raises(ValueError, match="MINIDL_NUM_THREADS must be a positive int, got 'two'"):
        thread_count.default({"MINIDL_NUM_THREADS": "two"})


def _pools():
    """Each pool's count by its library's own getter (None: that library is not installed)."""
    return {"intra-op": minidl.get_num_threads(),
            "openblas": blas.num_threads("openblas") if blas.load("openblas") else None,
            "mkl": blas.num_threads("mkl") if blas.load("mkl") else None,
            "onednn": _onednn_chunks()}


def _onednn_chunks():
    """How many threads oneDNN's convolution of 8 images runs on: one chunk of images per thread
    (conv_onednn.py); None where oneDNN is not installed."""
    from minidl.kernels.cpu import conv_onednn
    if not onednn.installed():
        return None
    chunks = conv_onednn._Chunks(ops.Conv2D(4, 3), (8, 4, 6, 6), (4, 4, 3, 3))
    assert all(plan.threads == 1 for plan in chunks.plans)  # one OpenMP thread per chunk
    return len(chunks.bounds)


def test_set_num_threads_sets_every_pool_minidl_uses(threads):
    """One owner: the intra-op threads, the OpenBLAS wheel, MKL (its count outside a MatMul's call,
    which gets the thread count thread-locally: kernels/cpu/matmul.py) and oneDNN's convolutions
    (one chunk of the batch per intra-op thread) all follow it."""
    threads(2)
    pools = _pools()
    assert pools["intra-op"] == 2
    assert pools["openblas"] in (2, None) and pools["onednn"] in (2, None)  # None: not installed
    threads(1)
    assert set(_pools().values()) <= {1, None} and _pools()["intra-op"] == 1


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


# ---- the default count, and the serial fallback without a BLAS minidl sets ----

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
        monkeypatch.setattr(thread_count, "os", fake)  # cores()
        monkeypatch.setattr(intra_op, "os", fake)  # the first CPU, whose caches are read
    return set_machine


def test_cores_are_the_affinity_mask_else_the_cpu_count(machine):
    machine(affinity={0, 5, 7}, cpu_count=16)
    assert intra_op.cores() == 3
    machine(affinity=None, cpu_count=16)
    assert intra_op.cores() == 16
    machine(affinity=None, cpu_count=None)  # os.cpu_count() cannot tell
    assert intra_op.cores() == 1


def test_the_default_count_is_the_environment_else_the_cores(machine):
    machine(affinity={0, 1, 2, 3}, cpu_count=16)
    assert thread_count.default({}) == 4
    assert thread_count.default({"MINIDL_NUM_THREADS": "7"}) == 7
    assert thread_count.default({"MINIDL_NUM_THREADS": ""}) == 4
    with pytest.raises(ValueError, match="MINIDL_NUM_THREADS must be a positive int, got '0'"):
        thread_count.default({"MINIDL_NUM_THREADS": "0"})


@pytest.fixture
def no_blas(monkeypatch, options):
    """This process as if no BLAS minidl sets the threads of were installed (restored afterwards):
    the kernels' GEMMs take NumPy's routes."""
    monkeypatch.setattr(blas, "load", lambda name: {})
    monkeypatch.setitem(intra_op._state, "pool", None)
    real_option = blas.get_option  # the blas option as if unset, also where MINIDL_BLAS names a library
    monkeypatch.setattr(blas, "get_option", lambda name: None if name == "blas" else real_option(name))


@pytest.mark.cpu_only  # intra-op threads split NumPy work; a GPU has none
def test_without_a_blas_minidl_sets_ops_run_serially_and_give_the_reference(no_blas, options, kernels_on, threads):
    threads(3)
    assert minidl.get_num_threads() == 3  # the count stands (oneDNN's threads follow it); the chunks run in turn
    assert intra_op.blas_status().startswith("no BLAS minidl binds is installed (pip install scipy-openblas64")
    assert intra_op.blas_status().endswith("CPU ops run their chunks on one thread")
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
