"""How many threads minidl's CPU work may use: one number, which every pool minidl drives reads.

``minidl.set_num_threads(n)`` (threads.py) stores it here and hands it to each pool; a library
loaded later (blas.py's OpenBLAS) reads it here at its load, so the count never depends on which
came first. It sits apart from threads.py because blas.py needs it and threads.py needs blas.py.

The default: ``MINIDL_NUM_THREADS`` when set, else the CPUs this process may run on (its
affinity mask: ``taskset`` and container CPU sets count), like ``torch.get_num_threads``.
"""
import os

_state = {"n": None}


def cores():
    """The CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check(n, who="set_num_threads"):
    """``n`` when it is a positive int, else ValueError naming ``who``, the value and the rule."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{who}: n must be a positive int (1 or more), got {n!r}")
    return n


def default(environ=None):
    """``MINIDL_NUM_THREADS`` from ``environ`` (os.environ unless given) when set, else :func:`cores`."""
    environ = os.environ if environ is None else environ
    text = environ.get("MINIDL_NUM_THREADS")
    if not text:
        return cores()
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"MINIDL_NUM_THREADS must be a positive int, got {text!r}")
    return n


def get():
    """The count in force (:func:`default` until one is put)."""
    if _state["n"] is None:
        _state["n"] = default()
    return _state["n"]


def put(n):
    """Records ``n`` (checked) as the count; the pools are told by threads.set_num_threads."""
    _state["n"] = check(n)
