"""Intra-op threads: chunk splitting, the thread pool, and ops that give the same results
(against their references) on 1 thread and on several."""
import multiprocessing
import os
import threading

import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import _intra_op as intra_op
from minidl import ops, Tensor

needs_local_blas = pytest.mark.skipif(not intra_op._openblas(),
                                      reason="NumPy's BLAS has no thread-local thread count")


@pytest.fixture
def threads():
    """Sets the intra-op thread count for one test and restores it afterwards."""
    before = minidl.get_num_threads()
    yield minidl.set_num_threads
    minidl.set_num_threads(before)


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
def test_conv_on_threads_equals_one_thread(threads, monkeypatch, stride, pad):
    """Chunks of 2 images on 3 threads (uneven rounds) vs the serial loop: the same values;
    the weight gradient differs only by the order its per-thread partial sums are added."""
    from minidl.ops import im2col
    monkeypatch.setattr(im2col, "_images_per_chunk", lambda xp, n, nbytes, threads=1: 2)
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


@needs_local_blas
@pytest.mark.cpu_only  # intra-op row blocks split NumPy work over host threads; a GPU has none
def test_batchnorm_and_relu_in_row_blocks_equal_one_block(threads, monkeypatch):
    """Every array large enough for blocks (threshold 0), on 3 threads (7 images: blocks of
    3, 2, 2) vs one block: ReLU exactly, BatchNorm to rounding (the per-channel sums add
    their blocks' partial sums)."""
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

    threads(1)
    one = run()
    monkeypatch.setattr(intra_op, "MIN_PARALLEL_BYTES", 0)
    threads(3)
    calls = []
    real_map = intra_op.parallel_map
    monkeypatch.setattr(intra_op, "parallel_map", lambda fn, n: calls.append(n) or real_map(fn, n))
    blocked = run()
    assert calls and set(calls) == {3}  # the blocked paths ran
    for a, b in zip(one, blocked):
        np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)

    relu_x = rng.standard_normal((9, 4096))
    y = ops.ReLU()(Tensor(relu_x)).asnumpy()
    np.testing.assert_array_equal(y, np.maximum(relu_x, 0))
