"""Conv2D on oneDNN (minidl/kernels/cpu/conv_onednn.py) against the reference body on hypothesis
draws of geometry (strides, pads, dilation, 1x1 to 4x4 kernels), one and two threads, gradients to
one input only, and where it stands aside (float64, groups, the option off, a geometry oneDNN has
no primitive for); its plans: least recently used evicted, their oneDNN objects destroyed, resident
memory bounded over 1,000 geometries. Skipped where the onednn extra is not installed."""
import gc
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl
from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import conv_onednn
from minidl.kernels.cpu.conv import Conv2DRoutes
from minidl.kernels.cpu.conv_onednn import Conv2DOneDNN
from minidl.testing.gradcheck import check_kernels

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("kernels_on"),
              pytest.mark.skipif(not Conv2DOneDNN.available, reason="the onednn extra is not installed")]


def names(used):
    return {k.name for k in used}


@st.composite
def geometry(draw):
    kh, kw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    stride, dilation = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    h = draw(st.integers((kh - 1) * dilation + 1, 9))
    wd = draw(st.integers((kw - 1) * dilation + 1, 9))
    pad = tuple(draw(st.integers(0, 2)) for _ in range(4))
    shape_x = (draw(st.integers(1, 3)), draw(st.integers(1, 20)), h, wd)
    o = draw(st.integers(1, 20))
    return shape_x, (o, shape_x[1], kh, kw), dict(pad_mode="pad", pad=pad, stride=stride, dilation=dilation)


@settings(max_examples=25, deadline=None)
@given(case=geometry(), seed=st.integers(0, 2**31 - 1))
def test_equals_the_reference_on_drawn_geometry(case, seed):
    x_shape, w_shape, kwargs = case
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    used = check_kernels(lambda a, b: ops.Conv2D(w_shape[0], w_shape[2:], **kwargs)(a, b), [x, w], np.float32)
    assert "Conv2DOneDNN" in names(used)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_resnet_layer_on_one_and_two_threads(threads):
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((8, 32, 16, 16)).astype(np.float32), (rng.standard_normal((32, 32, 3, 3)) / 17).astype(np.float32)
    before = minidl.get_num_threads()
    minidl.set_num_threads(threads)
    try:
        used = check_kernels(lambda a, b: ops.Conv2D(32, 3, pad_mode="pad", pad=1)(a, b), [x, w], np.float32)
    finally:
        minidl.set_num_threads(before)
    assert names(used) == {"Conv2DOneDNN"}


@pytest.mark.parametrize("threads, batch, chunks", [(2, 5, {(3, 1), (2, 1)}), (2, 1, {(1, 2)}), (4, 3, {(1, 1)}),
                                                    (3, 9, {(3, 1)})])
def test_a_batch_is_cut_into_one_chunk_per_thread(monkeypatch, threads, batch, chunks):
    """One chunk of images per intra-op thread, each chunk's plan made for one OpenMP thread; a
    batch smaller than the thread count: one chunk per image, its OpenMP threads sharing the rest.
    Forward and both gradients equal the reference's."""
    monkeypatch.setattr(conv_onednn, "_plans", conv_onednn._Plans(8))
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((batch, 16, 6, 6)).astype(np.float32), rng.standard_normal((8, 16, 3, 3)).astype(np.float32)
    before = minidl.get_num_threads()
    minidl.set_num_threads(threads)
    try:
        used = check_kernels(lambda a, b: ops.Conv2D(8, 3, pad_mode="pad", pad=1)(a, b), [x, w], np.float32)
    finally:
        minidl.set_num_threads(before)
    assert names(used) == {"Conv2DOneDNN"}
    # plan key: (x shape, w shape, stride, dilation, pads, OpenMP threads)
    assert {(key[0][0], key[-1]) for key in conv_onednn._plans._plans} == chunks


# A fresh process: the threads it has after a warm-up (the intra-op pool started) and after a
# ResNet layer's forward and backward on oneDNN, which must start no GNU OpenMP team.
THREADS_AFTER_CONVOLUTIONS = """
import os, sys
import numpy as np
import minidl
from minidl import ops, Tensor, kernels
from minidl.kernels.cpu import threads as intra_op
minidl.set_num_threads(2)
tasks = lambda: len(os.listdir("/proc/self/task"))
intra_op.parallel_map(lambda i: i, 2, calls_blas=False)
before = tasks()
x = Tensor(np.ones((int(sys.argv[1]), 16, 16, 16), np.float32), requires_grad=True)
w = Tensor(np.ones((16, 16, 3, 3), np.float32), requires_grad=True)
with kernels.tracking() as used:
    ops.Conv2D(16, 3, pad_mode="pad", pad=1)(x, w).sum().backward()
assert {k.name for k in used} >= {"Conv2DOneDNN"}, used
print(before, tasks())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores for 2 threads")
def test_a_batch_on_two_threads_starts_no_openmp_team():
    """Batch 8 on two threads: two chunks on minidl's threads, one OpenMP thread each, so GNU
    OpenMP starts no thread of its own (none spins after the primitive). One image on two threads
    runs on two OpenMP threads: its team shows that the count would see one."""
    import subprocess
    import sys

    def threads_before_and_after(batch):
        done = subprocess.run([sys.executable, "-c", THREADS_AFTER_CONVOLUTIONS, str(batch)], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return tuple(map(int, done.stdout.split()))
    before, after = threads_before_and_after(8)
    assert after == before
    before, after = threads_before_and_after(1)
    assert after == before + 1


@pytest.mark.parametrize("wanted", ["x", "w"])
def test_a_gradient_to_one_input_only(wanted):
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((2, 16, 6, 6)).astype(np.float32), rng.standard_normal((8, 16, 3, 3)).astype(np.float32)
    gy = rng.standard_normal((2, 8, 6, 6)).astype(np.float32)

    def grads():
        tx, tw = Tensor(x, requires_grad=wanted == "x"), Tensor(w, requires_grad=wanted == "w")
        ops.Conv2D(8, 3, pad_mode="pad", pad=1)(tx, tw).backward(Tensor(gy))
        return tx.grad, tw.grad
    with kernels.tracking() as used:
        fast = grads()
    with kernels.reference_only():
        ref = grads()
    assert names(used) == {"Conv2DOneDNN"}
    for f, r in zip(fast, ref):
        assert (f is None) == (r is None)
        if f is not None:
            np.testing.assert_allclose(f.asnumpy(), r.asnumpy(), rtol=1e-4, atol=1e-3)


def conv_kernel_of(x, w, **kwargs):
    with kernels.tracking() as used:
        ops.Conv2D(w.shape[0], w.shape[2:], **kwargs)(Tensor(x), Tensor(w))
    return names(used)


def test_where_it_stands_aside(monkeypatch):
    x32, w32 = np.ones((2, 4, 5, 5), np.float32), np.ones((6, 4, 3, 3), np.float32)
    assert conv_kernel_of(x32, w32) == {"Conv2DOneDNN"}
    assert conv_kernel_of(x32.astype(np.float64), w32.astype(np.float64)) == {"Conv2DRoutes"}   # float64
    assert conv_kernel_of(x32, np.ones((6, 2, 3, 3), np.float32), group=2) == {"Conv2DRoutes"}  # groups
    kernels.set_option("onednn", False)
    try:
        assert conv_kernel_of(x32, w32) == {"Conv2DRoutes"}
    finally:
        kernels.set_option("onednn", None)
    # A geometry oneDNN makes no primitive for: conv.py's routes, and it is not asked again.
    def refuse(*args):
        raise conv_onednn.dnnl.Error("oneDNN: no primitive (test)")
    monkeypatch.setattr(conv_onednn, "_Plan", refuse)
    monkeypatch.setattr(conv_onednn, "_plans", conv_onednn._Plans(8))
    assert conv_kernel_of(x32, w32) == {"Conv2DRoutes"}
    assert conv_onednn._plans.values() == [None]


def test_one_plan_per_geometry(monkeypatch):
    monkeypatch.setattr(conv_onednn, "_plans", conv_onednn._Plans(8))
    x, w = np.ones((2, 4, 5, 5), np.float32), np.ones((6, 4, 3, 3), np.float32)
    for _ in range(3):
        conv_kernel_of(x, w, pad_mode="pad", pad=1)
    conv_kernel_of(x, w)  # 'valid': another geometry
    assert len(conv_onednn._plans) == 2


def test_only_steers_the_table_to_one_kernel():
    x, w = np.ones((2, 4, 5, 5), np.float32), np.ones((6, 4, 3, 3), np.float32)
    with kernels.only(Conv2DRoutes):
        assert conv_kernel_of(x, w) == {"Conv2DRoutes"}
    assert conv_kernel_of(x, w) == {"Conv2DOneDNN"}


def test_thread_ranks_running_one_geometry_at_once_get_their_own_results():
    """minidl_parallel's in-process ranks are threads: convolutions of one plan (shared primitives,
    memory objects, stream) called from several at once must each see their own arrays."""
    from minidl_parallel import run_threads
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal((4, 16, 16, 16)).astype(np.float32) for _ in range(4)]
    w = (rng.standard_normal((16, 16, 3, 3)) / 12).astype(np.float32)
    with kernels.reference_only():
        want = [ops.Conv2D(16, 3, pad_mode="pad", pad=1)(Tensor(x), Tensor(w)).asnumpy() for x in xs]

    def rank():
        import minidl_parallel
        r = minidl_parallel.get_rank()
        with kernels.reference_only(False), kernels.tracking() as used:
            outs = [ops.Conv2D(16, 3, pad_mode="pad", pad=1)(Tensor(xs[r]), Tensor(w)).asnumpy() for _ in range(20)]
        return outs, names(used)
    for r, (outs, used) in enumerate(run_threads(4, rank, timeout=120)):
        assert used == {"Conv2DOneDNN"}
        for out in outs:
            np.testing.assert_allclose(out, want[r], rtol=1e-4, atol=1e-4)


def test_a_child_forked_after_onednn_ran_takes_the_other_routes():
    """GNU OpenMP hangs a forked child that runs a parallel region after the parent's threads
    started: the child must not call oneDNN (it runs conv.py's routes), and must finish."""
    import signal
    x, w = Tensor(np.ones((8, 16, 16, 16), np.float32)), Tensor(np.ones((16, 16, 3, 3), np.float32))
    conv = ops.Conv2D(16, 3, pad_mode="pad", pad=1)
    assert conv_kernel_of(x.asnumpy(), w.asnumpy(), pad_mode="pad", pad=1) == {"Conv2DOneDNN"}
    expected = float(conv(x, w).asnumpy().sum())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report the kernel and the sum, then leave without pytest's teardown
        try:
            signal.alarm(60)
            with kernels.tracking() as used:
                total = float(conv(x, w).asnumpy().sum())
            os.write(write, f"{','.join(sorted(names(used)))} {total}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        report = pipe.read()
    os.waitpid(pid, 0)
    used, total = report.split()
    assert used == "Conv2DRoutes" and float(total) == pytest.approx(expected, rel=1e-5)


# ---- the plans: an LRU whose evicted plans' oneDNN objects are destroyed ----

def tiny_geometries(count):
    """``count`` distinct (x shape, w shape) of a 2x2 convolution, all small enough for a few ms each."""
    shapes = [((1, c, h, w), (3, c, 2, 2)) for c in range(1, 31) for h in range(3, 13) for w in range(3, 13)]
    assert len(shapes) >= count
    return shapes[:count]


def forward(x_shape, w_shape):
    x, w = Tensor(np.ones(x_shape, np.float32)), Tensor(np.ones(w_shape, np.float32))
    with minidl.no_grad():
        return ops.Conv2D(w_shape[0], 2)(x, w).asnumpy()


@pytest.fixture
def one_onednn_thread(monkeypatch):
    """Tiny convolutions gain nothing from threads, and on a loaded host two OpenMP threads meeting
    at each primitive's end made the 1,000 geometries take 17 s instead of 4."""
    before = minidl.get_num_threads()
    minidl.set_num_threads(1)
    yield
    minidl.set_num_threads(before)


def resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_the_plans_of_1000_geometries_keep_resident_memory_bounded(one_onednn_thread):
    """The plan cache keeps 256 geometries: from the 300th to the 1,000th, its evictions must give
    back what they took. Before plans were destroyed (every plan's primitives, primitive
    descriptors and memory objects leaked), the same run grew by 94 MiB (0.13 MiB a geometry)."""
    geometries = tiny_geometries(1000)
    with kernels.tracking() as used:
        for shapes in geometries[:300]:
            forward(*shapes)
        gc.collect()
        after_300 = resident_mib()
        for shapes in geometries[300:]:
            forward(*shapes)
        gc.collect()
        growth = resident_mib() - after_300
    assert names(used) == {"Conv2DOneDNN"}
    assert growth < 24, f"resident memory grew by {growth:.1f} MiB over 700 new geometries (bound: 24 MiB)"
    assert len(conv_onednn._plans) == conv_onednn._MAX_PLANS


def test_evicted_and_cleared_plans_destroy_every_onednn_object(monkeypatch, one_onednn_thread):
    dnnl = conv_onednn.dnnl
    conv_onednn.clear_plans()
    gc.collect()
    before = dnnl.live_handles()
    monkeypatch.setattr(conv_onednn, "_plans", conv_onednn._Plans(3))
    geometries = tiny_geometries(12)
    for shapes in geometries[:3]:
        forward(*shapes)
    three = dnnl.live_handles()
    assert three["primitive"] > before.get("primitive", 0)
    for shapes in geometries[3:6]:  # three others of the same sizes evict the first three
        forward(*shapes)
    assert len(conv_onednn._plans) == 3
    assert dnnl.live_handles() == three
    conv_onednn.clear_plans()
    assert dnnl.live_handles() == before


def test_the_least_recently_used_plan_is_evicted():
    made = []

    def maker(key):
        return lambda: made.append(key) or f"plan {key}"
    plans = conv_onednn._Plans(2)
    for key in "abac":  # 'a' used again after 'b': 'b' is the one evicted by 'c'
        assert plans.get(key, maker(key)) == f"plan {key}"
    assert plans.values() == ["plan a", "plan c"]
    plans.get("b", maker("b"))
    assert made == ["a", "b", "c", "b"]


def test_a_node_keeps_its_plan_for_backward_after_the_plans_are_cleared():
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((2, 16, 6, 6)).astype(np.float32), rng.standard_normal((8, 16, 3, 3)).astype(np.float32)
    gy = rng.standard_normal((2, 8, 6, 6)).astype(np.float32)

    def grads(clear):
        tx, tw = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        y = ops.Conv2D(8, 3, pad_mode="pad", pad=1)(tx, tw)
        if clear:
            conv_onednn.clear_plans()
            gc.collect()
        y.backward(Tensor(gy))
        return tx.grad.asnumpy(), tw.grad.asnumpy()
    with kernels.tracking() as used:
        fast = grads(clear=True)
    with kernels.reference_only():
        ref = grads(clear=False)
    assert names(used) == {"Conv2DOneDNN"}
    for f, r in zip(fast, ref):
        np.testing.assert_allclose(f, r, rtol=1e-4, atol=1e-3)


def test_thread_ranks_evicting_each_others_plans_get_their_own_results(monkeypatch):
    """A cache of one plan and four ranks of four geometries: each rank's plan is evicted while
    another may be running it; a running call holds its plan, so none is destroyed under it."""
    from minidl_parallel import run_threads
    monkeypatch.setattr(conv_onednn, "_plans", conv_onednn._Plans(1))
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal((2, 8, 6 + r, 7)).astype(np.float32) for r in range(4)]
    w = (rng.standard_normal((8, 8, 3, 3)) / 8).astype(np.float32)
    with kernels.reference_only():
        want = [ops.Conv2D(8, 3, pad_mode="pad", pad=1)(Tensor(x), Tensor(w)).asnumpy() for x in xs]

    def rank():
        import minidl_parallel
        r = minidl_parallel.get_rank()
        with kernels.reference_only(False), kernels.tracking() as used:
            outs = [ops.Conv2D(8, 3, pad_mode="pad", pad=1)(Tensor(xs[r]), Tensor(w)).asnumpy() for _ in range(15)]
        return outs, names(used)
    for r, (outs, used) in enumerate(run_threads(4, rank, timeout=120)):
        assert used == {"Conv2DOneDNN"}
        for out in outs:
            np.testing.assert_allclose(out, want[r], rtol=1e-4, atol=1e-4)
