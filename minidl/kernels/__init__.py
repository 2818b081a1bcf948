"""Fast paths for operators, apart from their reference bodies.

An operator's class in ``minidl/ops/`` holds its readable reference forward and backward. A
*kernel* is a faster way to compute the same thing for one primitive class on one array module
(``"numpy"`` or ``"cupy"``), registered in one table::

    @kernels.register
    class ReLURows(kernels.Kernel):
        op, backend = ops.ReLU, "numpy"
        def applies(self, node, x): ...            # this call's arrays: may this kernel run them?
        def forward(self, node, x): ...            # like op.forward, keeping what backward needs on node
        def backward(self, node, gy): ...          # like op.backward

``Primitive.apply`` asks :func:`choose` for each call: the first registered kernel of the
primitive's exact class and the inputs' array module whose ``applies`` accepts the arrays runs
instead of the reference body; otherwise the reference runs. Nothing in an op body knows its
kernels.

- ``MINIDL_KERNELS=reference`` (read at import) or :func:`set_reference_only` / the
  :func:`reference_only` context run every operator on its reference body.
- Each kernel states how it may differ from its reference: ``bound = None`` means bit for bit;
  ``(rtol, atol)`` a stated tolerance (a different summation order), or a dict of them per dtype
  name (``{"float32": ..., "float64": ...}``; a dtype missing from it means bit for bit). The differential tests
  (``minidl.testing.check_op`` on every op draw, and each kernel's own ``cases()``) hold every
  kernel to it.
- Tuning knobs are explicit settings (:func:`set_option` / :func:`get_option`), never module
  globals a test patches.
"""
import contextlib
import os
import threading

import numpy

from ..backend import get_array_module

__all__ = ["Kernel", "register", "choose", "registered", "set_reference_only", "reference_only", "is_reference_only",
           "declare_option", "set_option", "get_option", "options", "tracking", "only"]


class Kernel:
    """A fast path for one primitive class (``op``) on one array module (``backend``).

    ``bound``: None when the kernel gives exactly the reference's values, else ``(rtol, atol)``, or
    a dict of those per dtype name (see :meth:`bound_for`).
    ``cases()``: (make_primitive, input arrays) pairs the differential test runs through both the
    kernel and the reference body; shapes where ``applies`` is true (the op harness's small
    draws often fall back to the reference).
    ``priority``: among an op's kernels, those with a higher one are asked first (then in
    registration order): a library kernel before the routes it would otherwise fall back to.
    ``available``: False where the library the kernel calls is not installed (it then never
    applies); ``extra``: the pip extra of minidl that installs it (``pip install -e ".[onednn]"``),
    which the tests name when they skip the kernel's cases.
    """

    op = None
    backend = "numpy"
    bound = None
    priority = 0
    available = True
    extra = None

    @property
    def name(self):
        return type(self).__name__

    def bound_for(self, dtype):
        """(rtol, atol) this kernel may differ from its reference by in ``dtype``; None: bit for bit."""
        if isinstance(self.bound, dict):
            return self.bound.get(str(dtype))
        return self.bound

    def applies(self, node, *args):
        return True

    def forward(self, node, *args):
        raise NotImplementedError(f"{self.name}.forward")

    def backward(self, node, gy):
        raise NotImplementedError(f"{self.name}.backward")

    def cases(self):
        return []

    def __repr__(self):
        return f"<kernel {self.name} for {self.op.__name__} on {self.backend}>"


_table = {}  # primitive class -> [Kernel, ...] in registration order
_state = {"reference_only": os.environ.get("MINIDL_KERNELS", "").lower() == "reference"}
_options = {}


class _Local(threading.local):
    only = None  # kernel classes ``only`` allows, or None: all
    used = None  # the set ``tracking`` fills, or None
    # Class-level defaults: a missing threading.local attribute raises inside getattr, several
    # times slower to read, and choose reads both on every op call.


_local = _Local()


def register(kernel_class):
    """Adds a Kernel subclass to the table (a class decorator); returns the class."""
    kernel = kernel_class()
    if kernel.op is None or kernel.backend not in ("numpy", "cupy"):
        raise ValueError(f"kernels.register: {kernel_class.__name__} must set op (a Primitive class) and backend "
                         f"('numpy' or 'cupy'), got op={kernel.op!r}, backend={kernel.backend!r}")
    kernels = _table.setdefault(kernel.op, [])
    kernels.append(kernel)
    kernels.sort(key=lambda k: -k.priority)  # stable: registration order within a priority
    return kernel_class


def registered(op=None):
    """The registered kernels (of primitive class ``op``, or all), in the order they are asked."""
    if op is not None:
        return list(_table.get(op, ()))
    return [k for ks in _table.values() for k in ks]


def choose(node, arrays):
    """The kernel that runs this call of primitive ``node`` on ``arrays``, or None (the reference)."""
    kernels = _table.get(type(node))
    if not kernels or _state["reference_only"]:
        return None
    backend = "numpy" if get_array_module(*arrays) is numpy else "cupy"
    allowed = _local.only
    for kernel in kernels:
        if allowed is not None and type(kernel) not in allowed:
            continue
        if kernel.backend == backend and kernel.applies(node, *arrays):
            used = _local.used
            if used is not None:
                used.add(kernel)
            return kernel
    return None


def set_reference_only(flag):
    """Runs every operator on its reference body (True) or lets kernels run (False)."""
    _state["reference_only"] = bool(flag)


def is_reference_only():
    return _state["reference_only"]


@contextlib.contextmanager
def reference_only(flag=True):
    """``with kernels.reference_only():`` runs the block on reference bodies, then restores the setting."""
    before = _state["reference_only"]
    _state["reference_only"] = bool(flag)
    try:
        yield
    finally:
        _state["reference_only"] = before


@contextlib.contextmanager
def tracking():
    """``with kernels.tracking() as used:`` collects the kernels that ran in the block (this thread)."""
    before = getattr(_local, "used", None)
    used = _local.used = set()
    try:
        yield used
    finally:
        _local.used = before
        if before is not None:
            before |= used


@contextlib.contextmanager
def only(*kernel_classes):
    """``with kernels.only(K):`` lets only kernels of these classes run in the block (this thread),
    so that a test or benchmark reaches one kernel where another would be asked first."""
    before = getattr(_local, "only", None)
    _local.only = {k if isinstance(k, type) else type(k) for k in kernel_classes}
    try:
        yield
    finally:
        _local.only = before


_defaults = {}  # option -> (default, description), declared by the kernels that read them


def declare_option(name, default, description):
    """Declares a tuning option a kernel reads (its default and what it means)."""
    _defaults[name] = (default, description)


def set_option(name, value):
    """Sets a declared tuning option (``None`` restores its default)."""
    if name not in _defaults:
        raise KeyError(f"kernels.set_option: unknown option {name!r}; declared: {sorted(_defaults)}")
    if value is None:
        _options.pop(name, None)
    else:
        _options[name] = value


def get_option(name):
    """The value of a declared tuning option."""
    if name not in _defaults:
        raise KeyError(f"kernels.get_option: unknown option {name!r}; declared: {sorted(_defaults)}")
    return _options.get(name, _defaults[name][0])


def options():
    """Every declared option: {name: (value, default, description)}."""
    return {k: (get_option(k), d, text) for k, (d, text) in sorted(_defaults.items())}
