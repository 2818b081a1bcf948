"""Memory the CPU kernels reuse for their large arrays, instead of a fresh allocation each call.

Why: glibc's malloc serves a request above its mmap threshold (128 KiB at first, then the largest
block freed so far) with new pages from the kernel, each faulted in and zeroed at its first touch,
and gives them back at ``free``; free heap above its trim threshold goes back too. A training step
allocates and frees the same arrays every step: the user-written ResNet-20 at batch 64 faulted
41,720 pages (163 MiB) per step on an AMD EPYC (benchmarks/bench_step_ab.py --option
buffer_pool=False; docs/performance.md), a quarter of its time. ``mallopt`` would change that for
every library in the process (malloc.py: an opt-in); this pool changes it for minidl's own
arrays only.

How: a block is a uint8 NumPy array the pool owns; :func:`empty` hands out a view of one, 64-byte
aligned (oneDNN's kernels read whole cache lines). NumPy makes every view of a view refer to the
block itself (``base``), so a block is free exactly when nothing but the pool refers to it: every
array handed out from it, and every view of those, is gone. Blocks serve requests of their size
class (the size rounded up to 64 KiB). A class not asked for in the last ``IDLE_REQUESTS``
requests has its free blocks dropped at the next new block (a model whose shapes change leaves no
pile behind); :func:`release` drops every free block at once (as ``torch.cuda.empty_cache``).
Arrays below ``MIN_BYTES`` come from NumPy as usual: malloc's heap serves those without faults.

The ``buffer_pool`` kernels option (default True) turns it off: every array from NumPy.
"""
import sys
import threading

import numpy

from .. import declare_option, get_option

__all__ = ["takes", "empty", "zeros", "release", "held_bytes", "MIN_BYTES", "IDLE_REQUESTS"]

declare_option("buffer_pool", True, "the CPU kernels' large arrays from minidl's pool of reused blocks "
                                    "(kernels/cpu/buffers.py); False: each from NumPy, freshly allocated")

MIN_BYTES = 128 << 10  # glibc's initial mmap threshold: smaller arrays come from its heap, without faults
_CLASS = 64 << 10  # size classes: a request rounded up to a multiple of this
_ALIGN = 64
IDLE_REQUESTS = 4096  # a ResNet-20 step makes a few hundred requests: a class idle for ~10 steps goes
_FREE_REFS = 3  # sys.getrefcount of a free block while the scan looks at it: the pool's list, the loop, the call

_lock = threading.Lock()
_classes = {}  # size class -> [blocks]
_last_asked = {}  # size class -> the request count when it was last asked for
_requests = [0]


def takes(nbytes):
    """Whether an array of ``nbytes`` comes from the pool (it is large and the pool is on)."""
    return nbytes >= MIN_BYTES and get_option("buffer_pool")


def empty(shape, dtype):
    """An uninitialised C-contiguous array of ``shape`` and ``dtype``: from a free block of the pool,
    64-byte aligned, where :func:`takes` its size (module docstring), else from NumPy."""
    dtype = numpy.dtype(dtype)
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    if not takes(nbytes):
        return numpy.empty(shape, dtype)
    block = _block(-(-nbytes // _CLASS) * _CLASS)
    start = -block.ctypes.data % _ALIGN
    return block[start:start + nbytes].view(dtype).reshape(shape)


def zeros(shape, dtype):
    """As :func:`empty`, filled with zeros."""
    out = empty(shape, dtype)
    out.fill(0)
    return out


def _block(size):
    """A free block of ``size`` bytes (+ alignment slack), a new one where none is free."""
    with _lock:
        _requests[0] += 1
        _last_asked[size] = _requests[0]
        blocks = _classes.setdefault(size, [])
        for block in blocks:
            if sys.getrefcount(block) == _FREE_REFS:
                return block
        _drop_idle()
        block = numpy.empty(size + _ALIGN, numpy.uint8)
        blocks.append(block)
        return block


def _drop_idle():
    """Drops the free blocks of classes not asked for in the last IDLE_REQUESTS requests (under _lock)."""
    for size in [s for s, last in _last_asked.items() if _requests[0] - last > IDLE_REQUESTS]:
        _drop_free(size)


def _drop_free(size):
    blocks = _classes[size]
    blocks[:] = [block for block in blocks if sys.getrefcount(block) > _FREE_REFS]
    if not blocks:
        del _classes[size], _last_asked[size]


def release():
    """Drops every block nothing refers to (their memory goes back to malloc); returns its bytes."""
    with _lock:
        before = _held()
        for size in list(_classes):
            _drop_free(size)
        return before - _held()


def _held():
    return sum(block.nbytes for blocks in _classes.values() for block in blocks)


def held_bytes():
    """(bytes of every block the pool holds, bytes of those that are free now)."""
    with _lock:
        free = sum(block.nbytes for blocks in _classes.values() for block in blocks
                   if sys.getrefcount(block) == _FREE_REFS)
        return _held(), free
