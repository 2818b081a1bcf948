"""Keeps freed memory in the process instead of returning it to the OS (glibc only).

Why: a training step allocates and frees the same large activations and gradients every
step. With glibc's defaults, blocks above 128 KiB-32 MiB (dynamic) come from mmap and go
back to the OS on free, so every step page-faults its ~100 MB of buffers in again: on a
2-core machine that cost ~25% of a ResNet-20 step (340 -> 260 ms, benchmarks/bench_train.py).
Raising the mmap threshold and the trim threshold makes free memory stay in the heap for
reuse, the same trade a caching allocator (PyTorch's, CuPy's memory pool) makes.

It is process-wide, so it is applied once at import and can be turned off with
MINIDL_MALLOC_TUNING=0 (or by the MALLOC_* environment variables, which take precedence).
"""
import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for this setting
_TRIM_THRESHOLD = 1 << 30

applied = False


def tune():
    """Applies the settings once; returns True when they are in effect."""
    global applied
    if applied:
        return True
    if (not sys.platform.startswith("linux") or os.environ.get("MINIDL_MALLOC_TUNING", "1") == "0"
            or "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return applied
