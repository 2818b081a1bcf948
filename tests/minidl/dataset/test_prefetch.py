"""Background prefetch: order, bounded queue, exceptions with their traceback, clean shutdown."""
import gc
import threading
import time
import traceback

import numpy as np
import pytest

from minidl.dataset import GeneratorDataset, NumpySlicesDataset, set_prefetch_size, get_prefetch_size
from minidl.dataset.prefetch import Prefetcher


def wait_for_threads(baseline, timeout=2.0):
    """The thread count, once it is back to baseline or the timeout passes."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


@pytest.fixture
def baseline():
    gc.collect()
    count = threading.active_count()
    yield count
    gc.collect()
    assert wait_for_threads(count) == count, "a test leaked a prefetch thread"


def slow_rows(n, log=None, finished=None):
    def rows():
        try:
            for i in range(n):
                if log is not None:
                    log.append(i)
                yield np.array([i])
        finally:
            if finished is not None:
                finished.set()
    return rows


@pytest.mark.parametrize("size", [0, 1, 3])
def test_items_arrive_in_order(size, baseline):
    with Prefetcher(iter(range(50)), size=size) as items:
        assert list(items) == list(range(50))
    assert wait_for_threads(baseline) == baseline


def test_size_zero_runs_in_the_callers_thread(baseline):
    seen = []

    def rows():
        for i in range(3):
            seen.append(threading.current_thread())
            yield i

    assert list(Prefetcher(rows(), size=0)) == [0, 1, 2]
    assert set(seen) == {threading.current_thread()}


def test_queue_is_bounded(baseline):
    produced = []
    items = Prefetcher((produced.append(i) or i for i in range(1000)), size=2)
    assert next(items) == 0
    time.sleep(0.2)
    # the consumed item, 2 queued, and at most one more waiting for room in the queue
    assert len(produced) <= 4
    items.close()


def test_producer_exception_reaches_consumer_with_traceback(baseline):
    def broken():
        yield 1
        raise KeyError("bad record 7")

    items = Prefetcher(broken(), size=2)
    assert next(items) == 1
    with pytest.raises(KeyError, match="bad record 7") as info:
        next(items)
    assert "broken" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    with pytest.raises(StopIteration):  # closed after the error: no hang on a second call
        next(items)


def test_pipeline_exception_names_the_map_operation(baseline):
    def explode(x):
        raise RuntimeError("transform failed")

    ds = NumpySlicesDataset(np.arange(4), shuffle=False).map(explode)
    with pytest.raises(RuntimeError, match="transform failed") as info:
        list(ds.epoch_iterator(0))
    assert "explode" in [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if hasattr(info.value, "add_note"):
        assert "map operation 0" in notes and "row/batch index 0" in notes


def test_break_stops_the_thread_and_closes_the_source(baseline):
    finished = threading.Event()
    ds = GeneratorDataset(slow_rows(10_000, finished=finished), column_names="x")
    for i, _ in enumerate(ds):
        if i == 2:
            break
    assert wait_for_threads(baseline) == baseline
    assert finished.wait(2.0)  # the user's generator ran its finally block


@pytest.mark.parametrize("how", ["close", "del", "gc_cycle", "generator_close", "context"])
def test_early_stop_leaves_no_thread(how, baseline):
    log = []
    ds = GeneratorDataset(slow_rows(10_000, log), column_names="x").batch(2)
    if how == "generator_close":
        def consume():
            for batch in ds.epoch_iterator(0):
                yield batch
        gen = consume()
        next(gen)
        assert threading.active_count() == baseline + 1
        gen.close()
    elif how == "context":
        with ds.create_tuple_iterator() as it:
            next(it)
            assert threading.active_count() == baseline + 1
    else:
        it = ds.epoch_iterator(0)
        next(it)
        assert threading.active_count() == baseline + 1
        if how == "close":
            it.close()
        elif how == "del":
            del it
        else:
            holder = {"it": it}
            holder["self"] = holder  # a cycle: only the cycle collector frees it
            del it, holder
            gc.collect()
    assert wait_for_threads(baseline, timeout=1.0) == baseline
    produced = len(log)
    time.sleep(0.1)
    assert len(log) == produced  # nothing runs the pipeline any more
    assert produced < 100


def test_stop_is_prompt_when_the_queue_is_full(baseline):
    it = GeneratorDataset(slow_rows(10_000), column_names="x").epoch_iterator(0)
    next(it)
    time.sleep(0.1)  # the producer fills the queue and waits for room
    start = time.monotonic()
    it.close()
    assert time.monotonic() - start < 1.0
    assert threading.active_count() == baseline


def test_full_iteration_leaves_no_thread(baseline):
    ds = NumpySlicesDataset(np.arange(20), shuffle=True).batch(3)
    for _ in range(3):
        assert sum(len(b[0]) for b in ds) == 20
    assert wait_for_threads(baseline) == baseline


def test_prefetch_size_setting(baseline):
    assert get_prefetch_size() == 4
    try:
        set_prefetch_size(0)
        it = NumpySlicesDataset(np.arange(5)).epoch_iterator(0)
        next(it)
        assert threading.active_count() == baseline  # no thread at all
        it.close()
        with pytest.raises(ValueError, match=r"set_prefetch_size: size must be an int >= 0, got -1"):
            set_prefetch_size(-1)
    finally:
        set_prefetch_size(4)
