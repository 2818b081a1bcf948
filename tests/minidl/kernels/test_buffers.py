"""The CPU kernels' pool of reused blocks (minidl/kernels/cpu/buffers.py): a block is handed out
again only when nothing refers to it (views of views included), small arrays and the option off
bypass it, idle classes and release() give memory back, threads never share a block, and a
training step's arrays reach a steady state instead of growing the pool."""
import threading

import numpy as np
import pytest

import minidl
from minidl import kernels, nn
from minidl.kernels.cpu import buffers

pytestmark = pytest.mark.cpu_only

BIG = (64, 16, 32, 32)  # 4 MiB of float32: above MIN_BYTES


@pytest.fixture(autouse=True)
def empty_pool():
    buffers.release()
    yield
    buffers.release()


def address(a):
    return a.__array_interface__["data"][0]


def test_a_block_is_reused_only_once_nothing_refers_to_it():
    a = buffers.empty(BIG, np.float32)
    assert a.shape == BIG and a.dtype == np.float32 and a.flags.c_contiguous and address(a) % 64 == 0
    first = address(a)
    a[...] = 7.0
    part = a[3:5].reshape(-1)[::2]  # a view of a view: NumPy's base is the block itself
    del a
    b = buffers.empty(BIG, np.float32)
    assert address(b) != first  # the view keeps the block busy
    assert np.all(part == 7.0)
    del part, b
    assert buffers.held_bytes()[1] == buffers.held_bytes()[0]  # both blocks free now
    c = buffers.empty(BIG, np.float32)
    d = buffers.empty(BIG, np.float32)
    assert address(c) != address(d) and first in {address(c), address(d)}
    assert buffers.held_bytes()[1] == 0  # two blocks, both in use: none was made anew


def test_a_size_class_serves_nearby_sizes_and_other_dtypes():
    a = buffers.empty(BIG, np.float32)
    first = address(a)
    del a
    b = buffers.empty((BIG[0] * BIG[1] * BIG[2] * BIG[3] - 100,), np.float32)  # same 64 KiB class
    assert address(b) == first
    del b
    c = buffers.empty((BIG[0] * BIG[1] * BIG[2] * BIG[3] // 2,), np.float64)  # same bytes, another dtype
    assert address(c) == first and c.dtype == np.float64


def test_small_arrays_and_the_option_off_bypass_the_pool():
    small = buffers.empty((buffers.MIN_BYTES // 4 - 1,), np.float32)
    assert small.nbytes < buffers.MIN_BYTES and buffers.held_bytes() == (0, 0)
    assert not buffers.takes(buffers.MIN_BYTES - 1) and buffers.takes(buffers.MIN_BYTES)
    with kernels.option("buffer_pool", False):
        assert not buffers.takes(1 << 30)
        big = buffers.empty(BIG, np.float32)
    assert big.shape == BIG and buffers.held_bytes() == (0, 0)


def test_zeros_are_zeros_in_a_used_block():
    a = buffers.empty(BIG, np.float32)
    a[...] = np.nan
    first = address(a)
    del a
    z = buffers.zeros(BIG, np.float32)
    assert address(z) == first and not np.any(z)


def test_release_gives_back_the_free_blocks_only():
    busy = buffers.empty(BIG, np.float32)
    free = buffers.empty(BIG, np.float32)
    block = free.base.nbytes
    del free
    assert buffers.held_bytes() == (2 * block, block)
    assert buffers.release() == block
    assert buffers.held_bytes() == (block, 0)
    busy[...] = 1.0  # still its own memory
    assert buffers.release() == 0


def test_an_idle_class_loses_its_free_blocks_at_the_next_new_block(monkeypatch):
    monkeypatch.setattr(buffers, "IDLE_REQUESTS", 3)
    idle = buffers.empty(BIG, np.float32)
    kept_busy = buffers.empty((2,) + BIG[1:], np.float32)  # another class, in use throughout
    idle_block = idle.base.nbytes
    del idle
    other = [buffers.empty((3,) + BIG[1:], np.float32) for _ in range(5)]  # new blocks: each may drop idle ones
    held, free = buffers.held_bytes()
    assert free == 0 and held == kept_busy.base.nbytes + sum(o.base.nbytes for o in other)
    assert idle_block > 0
    kept_busy[...] = 2.0
    assert np.all(kept_busy == 2.0)


def test_a_class_is_idle_after_more_than_idle_requests_others(monkeypatch):
    """With IDLE_REQUESTS = 3: a free block whose class was last asked for 3 requests ago stays;
    one more request of another class (a new block) drops it."""
    monkeypatch.setattr(buffers, "IDLE_REQUESTS", 3)
    idle = buffers.empty(BIG, np.float32)  # request 1
    idle_block = idle.base.nbytes
    del idle
    others = [buffers.empty((k,) + BIG[1:], np.float32) for k in (2, 3, 5)]  # requests 2-4: new blocks
    assert buffers.held_bytes()[1] == idle_block  # idle for 3 requests: kept
    others.append(buffers.empty((6,) + BIG[1:], np.float32))  # request 5: idle for 4
    assert buffers.held_bytes() == (sum(o.base.nbytes for o in others), 0)


def test_a_size_given_as_an_int_is_a_one_dimensional_array():
    a = buffers.empty(1 << 20, np.uint8)
    assert a.shape == (1 << 20,) and buffers.held_bytes()[0] > 0
    assert buffers.zeros(5, np.float32).shape == (5,)


def test_threads_never_get_the_same_block_at_once():
    """Each thread fills its arrays with its own number and checks them after the others ran:
    a block handed to two threads at once would show another thread's number."""
    errors = []

    def work(k):
        for _ in range(50):
            a = buffers.empty((8,) + BIG[1:], np.float32)
            a[...] = k
            b = buffers.empty((8,) + BIG[1:], np.float32)
            b[...] = -k
            if not (np.all(a == k) and np.all(b == -k)):
                errors.append(k)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.fixture
def one_thread_then_two():
    """Runs a test's steps on one intra-op thread, then two; the count is restored afterwards."""
    before = minidl.get_num_threads()
    yield minidl.set_num_threads
    minidl.set_num_threads(before)


def train_steps(n):
    """The pool's held_bytes() after each of n training steps of a small conv net."""
    minidl.set_seed(0)
    net = nn.SequentialCell([nn.Conv2d(3, 16, 3, pad_mode="pad", padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Conv2d(16, 16, 3, pad_mode="pad", padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                             nn.Flatten(), nn.Dense(16 * 16 * 16, 10)])
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), 0.01, 0.9)
    grad_fn = minidl.value_and_grad(lambda a, b: loss_fn(net(a), b), None, opt.parameters)
    rng = np.random.default_rng(0)
    x = minidl.Tensor(rng.standard_normal((32, 3, 16, 16)).astype(np.float32))
    y = minidl.Tensor(rng.integers(0, 10, 32).astype(np.int32))
    held = []
    for _ in range(n):
        loss, grads = grad_fn(x, y)
        opt(grads)
        del loss, grads
        held.append(buffers.held_bytes())
    return held


def test_training_steps_reach_a_steady_pool(one_thread_then_two):
    """A conv net's steps take the same blocks every step: the pool stops growing after the first
    steps, and its blocks are free between steps (nothing a step made outlives it). On one thread,
    where the order of requests is the same every step."""
    one_thread_then_two(1)
    held = train_steps(6)
    assert held[2][0] > 0  # the step's large arrays came from the pool
    assert held[5][0] == held[2][0]
    assert held[5][1] == held[5][0]


def test_on_two_threads_a_step_leaves_its_blocks_free_and_the_pool_bounded(one_thread_then_two):
    """On two threads the pool's size depends on timing: a map's chunks take their scratch blocks at
    once where they overlap, one after the other where a thread was late. So it grows at most to
    what the chunks take when they all overlap (at most twice one thread's pool), and every block is
    free between steps however the threads ran (a worker holds nothing once its caller goes on)."""
    one_thread_then_two(1)
    one_thread = train_steps(3)[-1][0]
    buffers.release()
    one_thread_then_two(2)
    held = train_steps(12)
    assert all(free == total for total, free in held)
    assert 0 < held[-1][0] <= 2 * one_thread
