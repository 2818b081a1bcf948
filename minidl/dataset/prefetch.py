"""A bounded background prefetch: a thread fills a queue while the training step computes.

The producer thread runs the dataset pipeline (reading, transforms, batching) and hands items
over through a ``queue.Queue(maxsize=size)``, so at most ``size`` items wait in memory. NumPy
releases the GIL in its heavy kernels, which is what lets loading overlap compute.

Shutdown is explicit and prompt: closing the consumer (``close()``, leaving a ``with`` block,
``break`` out of a for loop over a temporary iterator, ``del`` or garbage collection) sets a
stop event; the producer checks it between items and while it waits for room in the queue,
closes its source iterator (so generator ``finally`` blocks run) and exits; ``close()`` joins
it. An exception raised in the producer travels through the queue and is raised again by the
consumer, with the producer's traceback.

The producer runs under the local runtime (minidl/runtime.py): a pipeline's map functions
compute on this process's own samples, so minidl ops they call are never dispatched as
tensor-parallel ops, whatever runtime the training thread has.
"""
import queue
import threading

from ..runtime import LOCAL

__all__ = ["Prefetcher", "set_prefetch_size", "get_prefetch_size"]

_config = {"size": 4}
_POLL_S = 0.05  # how often a producer waiting for room in the queue checks for a stop
_JOIN_S = 10.0  # a producer stuck in user code longer than this is left behind (it is a daemon)


def set_prefetch_size(size):
    """Sets how many items (rows, or batches after ``.batch``) each iterator prefetches; 0: no thread.

    As MindSpore's ``dataset.config.set_prefetch_size``.
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"set_prefetch_size: size must be an int >= 0, got {size!r}")
    _config["size"] = size


def get_prefetch_size():
    """How many items each iterator prefetches (0: none, the pipeline runs in the caller's thread)."""
    return _config["size"]


class _End:
    __slots__ = ()


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc):
        self.exc = exc


_END = _End()


def _put(q, item, stop):
    """Puts item, waiting for room; False when stopped first."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False


def _produce(iterator, q, stop):
    # A module-level function, so the thread holds no reference to the Prefetcher: the
    # consumer's last reference going away is what triggers the shutdown.
    try:
        LOCAL.__enter__()  # this thread's runtime, for its whole life (it exits with the thread)
        while not stop.is_set():  # checked before each item, so a stop costs no extra work
            try:
                item = next(iterator)
            except StopIteration:
                _put(q, _END, stop)
                return
            if not _put(q, item, stop):
                return
    except BaseException as exc:  # noqa: B902 - the consumer decides what to do with it
        _put(q, _Failure(exc), stop)
    finally:
        close = getattr(iterator, "close", None)
        if close is not None:
            try:
                close()
            except Exception:  # the consumer is gone or has its error already
                pass


class Prefetcher:
    """Iterates ``iterator`` in a background thread, ``size`` items ahead of the consumer.

    Args:
        iterator: an iterable of the items to produce (consumed only by the background thread).
        size: queue capacity; default :func:`get_prefetch_size`; 0 iterates in the caller's thread.
        name: the thread's name, for debuggers and ``threading.enumerate()``.

    Example:
        >>> with Prefetcher(iter(range(3)), size=2) as items:
        ...     list(items)
        [0, 1, 2]
    """

    def __init__(self, iterator, size=None, name="minidl-prefetch"):
        size = get_prefetch_size() if size is None else size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"Prefetcher: size must be an int >= 0, got {size!r}")
        iterator = iter(iterator)
        self._done = False
        self._thread = None
        if size == 0:
            self._iterator = iterator
            return
        self._iterator = None
        self._queue = queue.Queue(maxsize=size)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=_produce, args=(iterator, self._queue, self._stop),
                                        name=name, daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        if self._thread is None:
            try:
                return next(self._iterator)
            except BaseException:
                self.close()
                raise
        item = self._queue.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self.close()
            exc = item.exc
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised in the dataset prefetch thread {self._thread.name!r})")
            raise exc
        return item

    def close(self):
        """Stops the producer thread and waits for it to exit; safe to call more than once."""
        if self._done:
            return
        self._done = True
        if self._thread is None:
            close = getattr(self._iterator, "close", None)
            self._iterator = None
            if close is not None:
                close()
            return
        self._stop.set()
        try:  # make room, so a producer blocked in put() sees the stop at once
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
        if self._thread is not threading.current_thread():
            self._thread.join(_JOIN_S)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass
