"""The double's top-level functions: NumPy's, with CuPy's rules about what may go in.

- ufuncs take device arrays, Python scalars and NumPy scalars only; anything else
  (NumPy arrays, lists) is CuPy's TypeError "Unsupported type <class '...'>".
- other functions refuse NumPy arrays anywhere in their arguments. This is stricter than CuPy
  for the few that upload silently (``einsum``, ``pad``): on a GPU that is a hidden host ->
  device copy per call, which the double reports instead.
- ``array``/``asarray``/``asanyarray`` upload host data (a copy, never an alias, as on a GPU).
- results are device arrays; NumPy scalars come back as 0-d arrays, as CuPy's do.
"""
import functools

import numpy

from . import names, syncs
from . import ndarray as _ndarray_module
from .ndarray import is_kernel_scalar, ndarray, refuse_host_arrays, unsupported, unwrap, wrap

_SECTION = "cupy"


class ufunc:
    """A CuPy ufunc: ``__call__`` plus the methods NumPy's ufuncs have."""

    def __init__(self, numpy_ufunc):
        self._ufunc = numpy_ufunc
        self.__name__ = numpy_ufunc.__name__
        self.nin, self.nout, self.nargs = numpy_ufunc.nin, numpy_ufunc.nout, numpy_ufunc.nargs

    def __repr__(self):
        return f"<ufunc '{self.__name__}'>"

    @staticmethod
    def _check(inputs, kwargs):
        for x in inputs:
            if not isinstance(x, ndarray) and not is_kernel_scalar(x):
                raise unsupported(x)
        out = kwargs.get("out")
        if isinstance(out, tuple):
            out = out[0] if len(out) == 1 else out
        if out is not None and not isinstance(out, ndarray):
            raise TypeError(f"Output arguments must be cupy.ndarray: got {type(out)}")
        where = kwargs.get("where")
        if where is not None and not isinstance(where, (ndarray, bool)):
            raise unsupported(where)

    def __call__(self, *inputs, **kwargs):
        self._check(inputs, kwargs)
        return wrap(self._ufunc(*unwrap(inputs), **unwrap(kwargs)))

    def _method(self, name, array, *rest, **kwargs):
        if not isinstance(array, ndarray):
            raise unsupported(array)
        refuse_host_arrays(rest)
        refuse_host_arrays(kwargs)
        return wrap(getattr(self._ufunc, name)(array._a, *unwrap(rest), **unwrap(kwargs)))

    def reduce(self, array, *args, **kwargs):
        return self._method("reduce", array, *args, **kwargs)

    def accumulate(self, array, *args, **kwargs):
        return self._method("accumulate", array, *args, **kwargs)

    def reduceat(self, array, *args, **kwargs):
        return self._method("reduceat", array, *args, **kwargs)

    def outer(self, a, b, **kwargs):
        self._check((a, b), kwargs)
        return wrap(self._ufunc.outer(a._a if isinstance(a, ndarray) else a,
                                      b._a if isinstance(b, ndarray) else b, **unwrap(kwargs)))

    def at(self, array, indices, values=None):
        if not isinstance(array, ndarray):
            raise unsupported(array)
        # CuPy uploads host indices and values (_scatter_op); device arrays stay device
        args = (unwrap(indices),) if values is None else (unwrap(indices), unwrap(values))
        self._ufunc.at(array._a, *args)


# Functions whose output size depends on the data: CuPy must copy a count to the host to
# allocate the result, so each call is a host synchronisation.
DATA_DEPENDENT_SHAPE = frozenset({"nonzero", "argwhere", "flatnonzero", "unique", "extract", "compress"})


def device_function(numpy_function, name):
    """A function over device arrays: NumPy arrays refused, results kept on the device."""

    @functools.wraps(numpy_function)
    def function(*args, **kwargs):
        refuse_host_arrays(args)
        refuse_host_arrays(kwargs)
        if name in DATA_DEPENDENT_SHAPE:
            syncs.record(name)
        return wrap(numpy_function(*unwrap(args), **unwrap(kwargs)))
    function.__name__ = name
    function.__module__ = "cupy"
    return function


def _upload(obj, dtype, copy, order, ndmin=0):
    """``cupy.array``/``asarray``: device arrays pass through, host data is copied up."""
    if isinstance(obj, ndarray):
        result = numpy.array(obj._a, dtype=dtype, copy=copy, order=order or "K", ndmin=ndmin)
        return obj if result is obj._a else wrap(result, obj._device_id)
    if isinstance(obj, (list, tuple)) and _contains_device_array(obj):
        refuse_host_arrays(obj)  # CuPy stacks device arrays on the device; host ones can't join
        return wrap(numpy.array(unwrap(obj), dtype=dtype, order=order or "K", ndmin=ndmin))
    if copy is False:
        raise ValueError("cupy_double: copy=False cannot be honoured for host data (it must be copied "
                         "to the device)")
    syncs.record_upload()
    # always a fresh buffer: a device array never aliases the host memory it came from
    return wrap(numpy.array(obj, dtype=dtype, copy=True, order=order or "K", ndmin=ndmin))


def _contains_device_array(obj):
    if isinstance(obj, ndarray):
        return True
    return isinstance(obj, (list, tuple)) and any(_contains_device_array(o) for o in obj)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    return _upload(obj, dtype, True if copy is None else copy, order, ndmin)


def asarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    return _upload(a, dtype, copy, order)


def asanyarray(a, dtype=None, order=None, *, copy=None, blocking=False):
    return _upload(a, dtype, copy, order)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    """Device -> host, counted; host data passes through (as CuPy's does)."""
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    result = numpy.asarray(a, order=order)
    if out is not None:
        out[...] = result
        return out
    return result


# The package's cupy module object, set by the package when it is imported: this module is
# imported by the package (and by modules it imports), so it cannot import the package back.
_namespace = {"cupy_module": None}


def get_array_module(*args):
    return _namespace["cupy_module"]() if any(isinstance(a, ndarray) for a in args) else numpy


def copyto(dst, src, casting="same_kind", where=None):
    """CuPy's copyto: a device destination; a host source only when it holds one element."""
    if not isinstance(dst, ndarray):
        raise TypeError(f"copyto: dst must be cupy.ndarray, got {type(dst)}")
    if isinstance(src, numpy.ndarray):
        if src.size != 1:
            raise ValueError("non-scalar numpy.ndarray cannot be used for copyto")
        src = src.squeeze()[()]
    elif not isinstance(src, ndarray) and not is_kernel_scalar(src):
        raise unsupported(src)
    if where is not None and not isinstance(where, ndarray):
        raise unsupported(where)
    numpy.copyto(dst._a, unwrap(src), casting=casting, where=True if where is None else where._a)


def _fill_like(maker):
    def like(a, *args, **kwargs):
        if not isinstance(a, ndarray):
            raise TypeError(f"{maker.__name__}: prototype must be cupy.ndarray, got {type(a)}")
        refuse_host_arrays(args)
        return wrap(maker(a._a, *unwrap(args), **unwrap(kwargs)), a._device_id)
    like.__name__ = maker.__name__
    return like


class _MemoryPool:
    """``get_default_memory_pool()``: the accounting calls code makes on it."""

    def used_bytes(self):
        return 0

    def total_bytes(self):
        return 0

    def free_all_blocks(self, stream=None):
        pass

    def set_limit(self, size=None, fraction=None):
        pass

    def get_limit(self):
        return 0


_memory_pool, _pinned_pool = _MemoryPool(), _MemoryPool()

_OVERRIDES = {
    "ndarray": ndarray,
    "array": array,
    "asarray": asarray,
    "asanyarray": asanyarray,
    "asnumpy": asnumpy,
    "get_array_module": get_array_module,
    "copyto": copyto,
    "empty_like": _fill_like(numpy.empty_like),
    "zeros_like": _fill_like(numpy.zeros_like),
    "ones_like": _fill_like(numpy.ones_like),
    "full_like": _fill_like(numpy.full_like),
    "get_default_memory_pool": lambda: _memory_pool,
    "get_default_pinned_memory_pool": lambda: _pinned_pool,
    "is_available": lambda: True,
}

_ufunc_cache = {}


def cupy_ufunc(name):
    """The double's ufunc called ``name``, or None when CuPy 14.x has none."""
    if name not in names.allowed(_SECTION) or not isinstance(getattr(numpy, name, None), numpy.ufunc):
        return None
    if name not in _ufunc_cache:
        _ufunc_cache[name] = ufunc(getattr(numpy, name))
    return _ufunc_cache[name]


def cupy_function_for(numpy_function):
    """What ``__array_function__`` dispatches ``numpy.<f>`` to: the double's ``cupy.<f>``
    (same submodule path), or None where CuPy has none (NumPy then raises TypeError)."""
    module = _namespace["cupy_module"]()
    try:
        for part in numpy_function.__module__.split(".")[1:]:
            module = getattr(module, part)
        found = getattr(module, numpy_function.__name__)
    except AttributeError:
        return None
    return None if found is numpy_function else found


def resolve(name):
    """Builds the function or value ``cupy.<name>`` for a name the pinned release has (the
    package resolves the submodules ``cuda``, ``random`` and ``lib`` itself)."""
    if name in _OVERRIDES:
        return _OVERRIDES[name]
    numpy_value = getattr(numpy, name, None)
    if numpy_value is None:
        if name == "newaxis":
            return None
        raise names.not_modelled(_SECTION, name)
    if isinstance(numpy_value, numpy.ufunc):
        return cupy_ufunc(name)
    if isinstance(numpy_value, type) or not callable(numpy_value):
        return numpy_value  # dtypes, iinfo/finfo, constants: CuPy re-exports NumPy's own
    return device_function(numpy_value, name)


# ndarray's NumPy protocols dispatch here; ndarray.py cannot import this module (it imports ndarray.py).
_ndarray_module._DISPATCH.update(ufunc=cupy_ufunc, function_for=cupy_function_for)
