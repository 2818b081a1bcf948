"""Opt-in: keep freed memory in the process instead of returning it to the OS (glibc only).

Off by default: ``import minidl`` leaves glibc's malloc settings alone, because they are
process-wide and every other library in the process would allocate under them. The user
switches it on with ``MINIDL_MALLOC_TUNING=1`` (read when minidl is imported) or by calling
:func:`tune`.

Why it helps: a training step allocates and frees the same large activations and gradients
every step. With glibc's defaults, blocks above a threshold (128 KiB, raised dynamically up
to 32 MiB) come from mmap, and free memory at the top of the heap goes back to the OS, so
every step page-faults its buffers in again. Raising the mmap threshold and the trim
threshold keeps free memory in the heap for reuse, the trade a caching allocator (PyTorch's
CUDA allocator, CuPy's memory pool) makes.

Measured (benchmarks/bench_step_ab.py --env MINIDL_MALLOC_TUNING=0, processes alternating,
median CPU time per step; 2-core Intel Xeon with AVX-512, shared host, 2026-11-25, when the
tuning was still on by default):

    step (threads)                          tuned     MINIDL_MALLOC_TUNING=0   page faults per step
    MLP 784-512-512-10, batch 256 (1)       7.8 ms    10.5 ms  (1.35x)         0 vs 1,640
    ResNet-20, batch 64 (1)                 361 ms    391 ms   (1.09x)         1 vs 22,500 (88 MB)
    ResNet-20, batch 64 (2)                 381 ms    409 ms   (1.07x)         1 vs 22,000
    user-written ResNet-20, batch 64 (1)    383 ms    425 ms   (1.11x)         2 vs 36,100

The price, process-wide: every library in the process allocates through the same settings,
and memory a step frees stays resident (ResNet-20 at batch 64: 166 MiB resident between steps
and after the model is freed, against 110 MiB untuned; the peak is the same 166 MiB). glibc's
own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``, when set, win: minidl then
changes nothing.
"""
import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's upper bound for this setting
_TRIM_THRESHOLD = 1 << 30
ENV = "MINIDL_MALLOC_TUNING"
GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")

applied = False


def requested(environ=None):
    """Whether ``MINIDL_MALLOC_TUNING`` asks for the tuning at import: "1" yes; "0" or unset no.

    Raises:
        ValueError: any other value (naming the allowed ones).
    """
    environ = os.environ if environ is None else environ
    setting = environ.get(ENV, "0")
    if setting not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 or unset (glibc's defaults, the default) or 1 (keep freed memory "
                         f"in the process), got {setting!r}")
    return setting == "1"


def tune():
    """Switches the tuning on for the whole process (once); returns True when it is in effect.

    Nothing is changed (and False returned) where the C library is not glibc, or where glibc's
    own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` are set: the user's glibc
    settings win.

    Example:
        >>> import minidl.kernels.cpu.malloc
        >>> minidl.kernels.cpu.malloc.tune()
        True
    """
    global applied
    if applied:
        return True
    if not sys.platform.startswith("linux") or any(name in os.environ for name in GLIBC_VARIABLES):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...): nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    applied = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    return applied


def tune_if_requested():
    """What ``import minidl`` does: :func:`tune` when ``MINIDL_MALLOC_TUNING=1``, else nothing."""
    return tune() if requested() else False
