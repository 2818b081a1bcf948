"""The double's ``cupy.ndarray``: a NumPy array held where NumPy cannot reach it implicitly.

What it refuses, as CuPy 14.2.0 does (``cupy/_core/core.pyx``):
- ``numpy.asarray(x)`` / ``x.__array__()``: TypeError "Implicit conversion to a NumPy array is
  not allowed...". It has no ``__array_interface__`` and no buffer, so NumPy finds no other way.
- NumPy arrays (and lists) as operands of its arithmetic: TypeError "Unsupported type ...",
  through ``__array_ufunc__``, which sends ``numpy.<ufunc>(x)`` to the double's own ufunc.
- attributes CuPy's ndarray lacks: AttributeError (``flags.writeable``, ``__index__``...).
What it counts (syncs.py): every explicit device -> host conversion.
Results of indexing and reductions stay 0-d device arrays, as CuPy returns them.
"""
import numbers
import threading
import warnings
import weakref

import numpy

from . import names, syncs

# The double's ufuncs and functions, for the NumPy protocols below: functions.py fills this when
# it is imported (it imports this module, so this module cannot import it).
_DISPATCH = {}

_SECTION = "cupy.ndarray"
_PYTHON_SCALARS = (int, float, bool, complex)

# pointer registry: data.ptr -> the double array asked for it, and the live host buffers
# behind them, so a fake NCCL can find the memory a pointer names (pointer_to_buffer).
_registry_lock = threading.Lock()
_arrays_by_ptr = {}
_buffers = {}  # base address -> weakref to the owning NumPy array


def _current_device_id():
    from . import cuda
    return cuda.current_device_id()


def unsupported(value):
    return TypeError(f"Unsupported type {type(value)}")


def is_kernel_scalar(value):
    """The operands CuPy's kernels take besides device arrays (``_scalar.scalar_type_set``)."""
    return type(value) in _PYTHON_SCALARS or isinstance(value, numpy.generic)


def refuse_host_arrays(obj):
    """Raises CuPy's TypeError when a NumPy array hides in ``obj`` (lists, tuples, dicts)."""
    if isinstance(obj, numpy.ndarray):
        raise unsupported(obj)
    if isinstance(obj, (list, tuple)):
        for item in obj:
            refuse_host_arrays(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            refuse_host_arrays(item)


def unwrap(obj):
    """The NumPy arrays inside double arrays (recursively through lists, tuples, dicts)."""
    if isinstance(obj, ndarray):
        return obj._a
    if isinstance(obj, list):
        return [unwrap(o) for o in obj]
    if isinstance(obj, tuple):
        return tuple(unwrap(o) for o in obj)
    if isinstance(obj, dict):
        return {k: unwrap(v) for k, v in obj.items()}
    return obj


def wrap(obj, device_id=None):
    """Device arrays for NumPy results; NumPy scalars become 0-d arrays, as CuPy returns them."""
    if isinstance(obj, numpy.ndarray):
        return ndarray._from_numpy(obj, device_id)
    if isinstance(obj, numpy.generic):
        return ndarray._from_numpy(numpy.asarray(obj), device_id)
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(wrap(o, device_id) for o in obj)
    if isinstance(obj, list):
        return [wrap(o, device_id) for o in obj]
    return obj


def _root(array):
    while isinstance(array.base, numpy.ndarray):
        array = array.base
    return array


def _address(array):
    return array.__array_interface__["data"][0]


def pointer_to_array(ptr):
    """The live double array whose ``.data.ptr`` was ``ptr`` (the latest one asked)."""
    with _registry_lock:
        ref = _arrays_by_ptr.get(int(ptr))
    array = ref() if ref is not None else None
    if array is None:
        raise ValueError(f"cupy_double: no live device array has data.ptr {ptr:#x} (never taken, or freed)")
    return array


def pointer_to_buffer(ptr, count, dtype):
    """A flat NumPy view of ``count`` elements of ``dtype`` at device pointer ``ptr``.

    The pointer must lie in a live buffer whose ``.data`` was taken, with room for
    ``count`` elements: what NCCL would read or write, checked instead of trusted."""
    dtype = numpy.dtype(dtype)
    ptr, nbytes = int(ptr), int(count) * dtype.itemsize
    with _registry_lock:
        candidates = [(base, ref()) for base, ref in _buffers.items()]
    for base, owner in candidates:
        if owner is None or not base <= ptr < base + max(owner.nbytes, 1):
            continue
        if ptr + nbytes > base + owner.nbytes:
            raise ValueError(f"cupy_double: {count} x {dtype} at {ptr:#x} runs past the end of its "
                             f"buffer ({owner.nbytes} bytes at {base:#x})")
        flat = owner.reshape(-1).view(numpy.uint8)
        return flat[ptr - base:ptr - base + nbytes].view(dtype)
    raise ValueError(f"cupy_double: {ptr:#x} points into no live device buffer")


class MemoryPointer:
    """``x.data``: the device pointer (the real host address of the buffer, unique while alive)."""

    __slots__ = ("ptr", "device_id", "_owner")

    def __init__(self, owner):
        self._owner = owner
        self.ptr = _address(owner._a)
        self.device_id = owner._device_id
        root = _root(owner._a)
        with _registry_lock:
            _arrays_by_ptr[self.ptr] = weakref.ref(owner)
            if root.flags.c_contiguous:
                _buffers[_address(root)] = weakref.ref(root)

    @property
    def device(self):
        from . import cuda
        return cuda.Device(self.device_id)

    def __getattr__(self, name):
        if name in names.allowed("cupy.cuda.MemoryPointer"):
            raise names.not_modelled("cupy.cuda.MemoryPointer", name)
        raise names.absent("cupy.cuda.MemoryPointer", name)


class Flags:
    """``x.flags``: CuPy's Flags has no ``writeable`` (device memory is always writable)."""

    __slots__ = ("c_contiguous", "f_contiguous", "owndata")

    def __init__(self, array):
        self.c_contiguous = bool(array._a.flags.c_contiguous)
        self.f_contiguous = bool(array._a.flags.f_contiguous)
        self.owndata = array._a.base is None

    @property
    def fnc(self):
        return self.f_contiguous and not self.c_contiguous

    @property
    def forc(self):
        return self.f_contiguous or self.c_contiguous

    def __getitem__(self, name):
        return getattr(self, name.lower())

    def __getattr__(self, name):
        raise names.absent("cupy.ndarray.flags", name)


def _rebuild_from_host(host_array):
    """pickle: CuPy's ``__reduce__`` ships the host copy and uploads it on load."""
    return ndarray._from_numpy(numpy.array(host_array))


def _is_bool_index(index):
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, (ndarray, numpy.ndarray)) and p.dtype == numpy.bool_ for p in parts)


def _is_basic_index(index):
    parts = index if isinstance(index, tuple) else (index,)
    return all(p is None or p is Ellipsis or isinstance(p, (slice, numbers.Integral)) for p in parts)


def _wrap_integer_array_indices(index, shape):
    """CuPy wraps out-of-bounds integer-array indices around instead of raising IndexError
    (documented in ``ndarray.__getitem__``): a bounds check that relies on NumPy's
    IndexError is silently absent on a GPU, so the double wraps too."""
    parts = index if isinstance(index, tuple) else (index,)
    if any(p is None or p is Ellipsis for p in parts) or len(parts) > len(shape):
        return index  # positions of axes are ambiguous: keep NumPy's checks
    out = []
    for axis, p in enumerate(parts):
        if isinstance(p, numpy.ndarray) and p.dtype.kind in "iu" and shape[axis] > 0:
            p = numpy.mod(p, shape[axis])
        out.append(p)
    return tuple(out) if isinstance(index, tuple) else out[0]


def _host_index(index):
    """Index parts as NumPy takes them. CuPy uploads NumPy arrays and lists used as indices
    (``_prepare_slice_list``), so those are allowed here."""
    parts = index if isinstance(index, tuple) else (index,)
    converted = []
    for p in parts:
        if isinstance(p, ndarray):
            p = p._a
        elif isinstance(p, list):
            p = numpy.asarray(unwrap(p))
        converted.append(p)
    return tuple(converted) if isinstance(index, tuple) else converted[0]


class ndarray:
    """The device double's array; see the module docstring for what it refuses and counts."""

    __slots__ = ("_a", "_device_id", "__weakref__")
    __array_priority__ = 100
    __hash__ = None

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None:
            raise NotImplementedError("cupy_double: ndarray(memptr=...) is not modelled")
        self._a = numpy.empty(shape, dtype=dtype, order=order)
        self._device_id = _current_device_id()

    @classmethod
    def _from_numpy(cls, array, device_id=None):
        self = cls.__new__(cls)
        self._a = array
        self._device_id = _current_device_id() if device_id is None else device_id
        return self

    # --- what CuPy refuses -------------------------------------------------------------
    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)  # NumPy and copy probe dunders CuPy does not define
        if name not in names.allowed(_SECTION):
            raise names.absent(_SECTION, name)
        method = getattr(self._a, name, None)
        if method is None or not callable(method):
            raise names.not_modelled(_SECTION, name)
        device_id = self._device_id

        def device_method(*args, **kwargs):
            refuse_host_arrays(args)
            refuse_host_arrays(kwargs)
            if name in ("nonzero", "compress"):
                syncs.record(name)  # the result's size must reach the host first
            return wrap(method(*unwrap(args), **unwrap(kwargs)), device_id)
        device_method.__name__ = name
        return device_method

    # --- explicit transfers (each counted) ---------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        syncs.record("get")
        if out is not None:
            if not isinstance(out, numpy.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
            numpy.copyto(out, self._a)
            return out
        return numpy.array(self._a, order=order, copy=True)

    def set(self, arr, stream=None):
        if not isinstance(arr, numpy.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray: got {type(arr)}")
        if arr.shape != self.shape or arr.dtype != self.dtype:
            raise ValueError("Shape and dtype mismatch in cupy.ndarray.set")
        syncs.record_upload()
        numpy.copyto(self._a, arr)

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        syncs.record("item")
        return self._a.item()

    def tolist(self):
        syncs.record("tolist")
        return self._a.tolist()

    def tobytes(self, order="C"):
        syncs.record("tobytes")
        return self._a.tobytes(order)

    def __float__(self):
        syncs.record("float")
        return float(self._a)

    def __int__(self):
        syncs.record("int")
        return int(self._a)

    def __complex__(self):
        syncs.record("complex")
        return complex(self._a)

    def __bool__(self):
        if self.size == 0:
            warnings.warn("The truth value of an empty array is ambiguous. Returning False, but in "
                          "future this will result in an error.", DeprecationWarning, stacklevel=2)
            return False
        if self.size != 1:
            raise ValueError("The truth value of an array with more than one element is ambiguous. "
                             "Use a.any() or a.all()")
        syncs.record("bool")
        return bool(self._a)

    def __repr__(self):
        syncs.record("repr")
        return repr(self._a)

    def __str__(self):
        syncs.record("str")
        return str(self._a)

    def __format__(self, spec):
        syncs.record("format")
        return format(self._a, spec)

    def __reduce__(self):
        syncs.record("pickle")
        return _rebuild_from_host, (numpy.array(self._a),)

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    # --- attributes ----------------------------------------------------------------------
    @property
    def shape(self):
        return self._a.shape

    @shape.setter
    def shape(self, value):
        self._a.shape = value

    @property
    def dtype(self):
        return self._a.dtype

    @property
    def ndim(self):
        return self._a.ndim

    @property
    def size(self):
        return self._a.size

    @property
    def itemsize(self):
        return self._a.itemsize

    @property
    def nbytes(self):
        return self._a.nbytes

    @property
    def strides(self):
        return self._a.strides

    @property
    def T(self):
        return wrap(self._a.T, self._device_id)

    @property
    def mT(self):
        return wrap(self._a.mT, self._device_id)

    @property
    def real(self):
        return wrap(self._a.real, self._device_id)

    @property
    def imag(self):
        return wrap(self._a.imag, self._device_id)

    @property
    def flags(self):
        return Flags(self)

    @property
    def data(self):
        return MemoryPointer(self)

    @property
    def device(self):
        from . import cuda
        return cuda.Device(self._device_id)

    @property
    def base(self):
        return None if self._a.base is None else wrap(_root(self._a), self._device_id)

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "descr": self.dtype.descr,
                "data": (self.data.ptr, False), "version": 3,
                "strides": None if self._a.flags.c_contiguous else self.strides}

    def fill(self, value):
        if isinstance(value, ndarray):
            if value.shape != ():
                raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
            value = value._a
        elif isinstance(value, numpy.ndarray):
            if value.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
        elif not is_kernel_scalar(value):
            raise unsupported(value)
        self._a[...] = value

    # --- container -------------------------------------------------------------------------
    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, index):
        host_index = _host_index(index)
        if _is_bool_index(host_index):
            syncs.record("boolean mask indexing")  # the result's size must reach the host
        elif not _is_basic_index(host_index):
            host_index = _wrap_integer_array_indices(host_index, self.shape)
        return wrap(self._a[host_index], self._device_id)

    def __setitem__(self, index, value):
        host_index = _host_index(index)
        if _is_basic_index(host_index):
            # CuPy's basic-slice assignment refuses host arrays ("gh-2079") and fills scalars.
            if isinstance(value, ndarray):
                self._a[host_index] = value._a
            elif isinstance(value, numpy.ndarray):
                if value.shape != ():
                    raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
                self._a[host_index] = value
            elif is_kernel_scalar(value):
                self._a[host_index] = value
            else:
                raise unsupported(value)
            return
        if not _is_bool_index(host_index):
            host_index = _wrap_integer_array_indices(host_index, self.shape)
        # advanced indexing uploads a host value (``core.array(value)`` in _scatter_op)
        if not isinstance(value, ndarray) and not is_kernel_scalar(value):
            syncs.record_upload()
        self._a[host_index] = unwrap(value)

    # --- NumPy protocols, as CuPy implements them ---------------------------------------------
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        cupy_ufunc = _DISPATCH["ufunc"]
        inout = inputs
        if "out" in kwargs:
            out = kwargs["out"]
            if len(out) != 1:
                raise ValueError("The 'out' parameter must have exactly one array value")
            inout += out
            kwargs["out"] = out[0]
        if method not in ("__call__", "outer", "at", "reduce", "accumulate", "reduceat"):
            return NotImplemented
        func = cupy_ufunc(ufunc.__name__)
        if func is None:
            return NotImplemented
        for x in inout:
            if not is_kernel_scalar(x) and not isinstance(x, (ndarray, numpy.ndarray)):
                return NotImplemented
        if method != "__call__":
            func = getattr(func, method)
        return func(*inputs, **kwargs)

    def __array_function__(self, func, types, args, kwargs):
        cupy_function_for = _DISPATCH["function_for"]
        cupy_func = cupy_function_for(func)
        if cupy_func is None:
            return NotImplemented
        for t in types:
            if not issubclass(t, (ndarray, numpy.ndarray)):
                return NotImplemented
        return cupy_func(*args, **kwargs)

    # --- operators (CuPy: a device array operand, else NumPy's ufunc -> __array_ufunc__) ------
    def _binary(self, other, name, reflected=False):
        if not isinstance(other, ndarray):
            other_ufunc = getattr(other, "__array_ufunc__", False)
            if other_ufunc is None or (other_ufunc is False and
                                       getattr(other, "__array_priority__", 0) > self.__array_priority__):
                return NotImplemented
        ufunc = getattr(numpy, name)
        return ufunc(other, self) if reflected else ufunc(self, other)

    def _inplace(self, other, name):
        cupy_ufunc = _DISPATCH["ufunc"]
        return cupy_ufunc(name)(self, other, out=self)

    def __add__(self, o): return self._binary(o, "add")
    def __radd__(self, o): return self._binary(o, "add", True)
    def __sub__(self, o): return self._binary(o, "subtract")
    def __rsub__(self, o): return self._binary(o, "subtract", True)
    def __mul__(self, o): return self._binary(o, "multiply")
    def __rmul__(self, o): return self._binary(o, "multiply", True)
    def __matmul__(self, o): return self._binary(o, "matmul")
    def __rmatmul__(self, o): return self._binary(o, "matmul", True)
    def __truediv__(self, o): return self._binary(o, "true_divide")
    def __rtruediv__(self, o): return self._binary(o, "true_divide", True)
    def __floordiv__(self, o): return self._binary(o, "floor_divide")
    def __rfloordiv__(self, o): return self._binary(o, "floor_divide", True)
    def __mod__(self, o): return self._binary(o, "remainder")
    def __rmod__(self, o): return self._binary(o, "remainder", True)
    def __pow__(self, o, modulo=None): return self._binary(o, "power")
    def __rpow__(self, o): return self._binary(o, "power", True)
    def __and__(self, o): return self._binary(o, "bitwise_and")
    def __rand__(self, o): return self._binary(o, "bitwise_and", True)
    def __or__(self, o): return self._binary(o, "bitwise_or")
    def __ror__(self, o): return self._binary(o, "bitwise_or", True)
    def __xor__(self, o): return self._binary(o, "bitwise_xor")
    def __rxor__(self, o): return self._binary(o, "bitwise_xor", True)
    def __lshift__(self, o): return self._binary(o, "left_shift")
    def __rshift__(self, o): return self._binary(o, "right_shift")
    def __lt__(self, o): return self._binary(o, "less")
    def __le__(self, o): return self._binary(o, "less_equal")
    def __gt__(self, o): return self._binary(o, "greater")
    def __ge__(self, o): return self._binary(o, "greater_equal")

    def __eq__(self, o):
        if o is None or (not isinstance(o, ndarray) and type(o).__eq__ is object.__eq__):
            return wrap(numpy.zeros(self.shape, dtype=bool), self._device_id)
        return self._binary(o, "equal")

    def __ne__(self, o):
        if o is None or (not isinstance(o, ndarray) and type(o).__eq__ is object.__eq__):
            return wrap(numpy.ones(self.shape, dtype=bool), self._device_id)
        return self._binary(o, "not_equal")

    def __iadd__(self, o): return self._inplace(o, "add")
    def __isub__(self, o): return self._inplace(o, "subtract")
    def __imul__(self, o): return self._inplace(o, "multiply")
    def __itruediv__(self, o): return self._inplace(o, "true_divide")
    def __ifloordiv__(self, o): return self._inplace(o, "floor_divide")
    def __imod__(self, o): return self._inplace(o, "remainder")
    def __ipow__(self, o): return self._inplace(o, "power")
    def __iand__(self, o): return self._inplace(o, "bitwise_and")
    def __ior__(self, o): return self._inplace(o, "bitwise_or")
    def __ixor__(self, o): return self._inplace(o, "bitwise_xor")

    def __neg__(self):
        return numpy.negative(self)

    def __pos__(self):
        return numpy.positive(self)

    def __abs__(self):
        return numpy.absolute(self)

    def __invert__(self):
        return numpy.invert(self)


ndarray.__module__ = "cupy"
ndarray.__qualname__ = "ndarray"
