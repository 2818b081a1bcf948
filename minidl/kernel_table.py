"""The kernel table: which fast path runs each operator call, and the settings that steer it.

The kernels themselves live in minidl/kernels/ (and register through ``minidl.kernels``, which
re-exports this module); the table is a root module beside runtime.py because both sides use
it: ``Primitive.apply`` (minidl/ops/) asks :func:`choose` at every call, and the kernels import
the op classes they speed up. Kept in kernels/, it would make ops/ and kernels/ import each other.

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
- Tuning knobs are explicit settings (:func:`set_option` / :func:`get_option`, the
  :func:`option` context), never module globals a test patches.

Settings follow the runtime's rule (minidl/runtime.py), because the threads world of
minidl_parallel runs one rank per thread: :func:`set_reference_only` and :func:`set_option` set
the process's value, which every thread sees; the ``with`` forms (:func:`reference_only`,
:func:`option`, like :func:`only` and :func:`tracking`) set the calling thread's own value for the
block, which wins over the process's there and nowhere else. Kernels read options on the thread
that runs the op (where :func:`choose` is asked), so a thread's setting covers its ops.
"""
import contextlib
import os
import threading

import numpy

from .backend import get_array_module

__all__ = ["Kernel", "register", "choose", "registered", "set_reference_only", "reference_only", "is_reference_only",
           "declare_option", "set_option", "get_option", "option", "options", "tracking", "only"]


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
_options = {}  # the process's option values (set_option); a missing name: its default


class _Local(threading.local):
    only = None  # kernel classes ``only`` allows, or None: all
    used = None  # the set ``tracking`` fills, or None
    # The process's setting lives on the class (set_reference_only); a ``reference_only`` block
    # gives the thread its own, which shadows it: choose reads one attribute either way.
    reference_only = os.environ.get("MINIDL_KERNELS", "").lower() == "reference"
    options = None  # this thread's own option values ({name: value}, ``option`` blocks), or None
    # Class-level defaults: a missing threading.local attribute raises inside getattr, several
    # times slower to read, and choose reads these on every op call.


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
    if not kernels:
        return None
    local = _local
    if local.reference_only:
        return None
    backend = "numpy" if get_array_module(*arrays) is numpy else "cupy"
    allowed = local.only
    for kernel in kernels:
        if allowed is not None and type(kernel) not in allowed:
            continue
        if kernel.backend == backend and kernel.applies(node, *arrays):
            used = local.used
            if used is not None:
                used.add(kernel)
            return kernel
    return None


def set_reference_only(flag):
    """Runs every operator on its reference body (True) or lets kernels run (False), in every
    thread without a :func:`reference_only` block of its own; returns the previous process value."""
    previous = _Local.reference_only
    _Local.reference_only = bool(flag)
    return previous


def is_reference_only():
    """Whether operators run on their reference bodies on this thread (its own setting, else the process's)."""
    return _local.reference_only


@contextlib.contextmanager
def reference_only(flag=True):
    """``with kernels.reference_only():`` runs the block on reference bodies (``flag=False``: on
    the kernels), on this thread only, then restores the thread's setting."""
    own = vars(_local)  # this thread's own attributes
    had_own, before = "reference_only" in own, own.get("reference_only")
    _local.reference_only = bool(flag)
    try:
        yield
    finally:
        if had_own:
            _local.reference_only = before
        else:
            del _local.reference_only  # back to the process's setting


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


def _check_declared(name, who):
    if name not in _defaults:
        raise KeyError(f"kernels.{who}: unknown option {name!r}; declared: {sorted(_defaults)}")


def set_option(name, value):
    """Sets a declared tuning option for the process (``None`` restores its default): every thread
    without an :func:`option` block of its own for ``name`` sees it."""
    _check_declared(name, "set_option")
    if value is None:
        _options.pop(name, None)
    else:
        _options[name] = value


@contextlib.contextmanager
def option(name, value):
    """``with kernels.option("images_per_chunk", 4):`` sets a declared tuning option for the
    block, on this thread only (``None``: its default), then restores the thread's setting."""
    _check_declared(name, "option")
    before = _local.options
    _local.options = {**(before or {}), name: value}
    try:
        yield
    finally:
        _local.options = before


def get_option(name):
    """The value of a declared tuning option on this thread (its own setting, else the process's)."""
    try:
        default = _defaults[name][0]
    except KeyError:
        raise KeyError(f"kernels.get_option: unknown option {name!r}; declared: {sorted(_defaults)}") from None
    own = _local.options
    if own is not None and name in own:
        value = own[name]
        return default if value is None else value
    return _options.get(name, default)


def options():
    """Every declared option: {name: (its value on this thread, default, description)}."""
    return {k: (get_option(k), d, text) for k, (d, text) in sorted(_defaults.items())}
