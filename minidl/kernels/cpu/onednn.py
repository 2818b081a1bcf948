"""A ctypes binding to the part of oneDNN's C API that the convolution kernel uses.

oneDNN (Intel's deep-learning primitives library, what PyTorch's CPU convolutions run on) ships
on PyPI as ``onednn-cpu-gomp`` (the ``onednn`` extra): one ``libdnnl.so.3`` under sys.prefix/lib,
threaded by GNU OpenMP. This module loads it by that soname at the first convolution (never at
import), checks its version (:func:`check_version`), keeps one CPU engine and one stream, and
offers what conv_onednn.py needs: memory descriptors, primitive descriptors, primitives, and
running them on NumPy arrays. Nothing here knows about convolutions' maths.

oneDNN chooses its own (blocked) layouts for the fast kernels when a descriptor says "any"; the
caller reorders NCHW arrays into them and back (``Reorder``). Every array handed to oneDNN
stays alive in the caller for the call's duration: oneDNN holds raw pointers only.

Ownership: every handle made here has one Python owner (a :class:`Desc`, :class:`PrimitiveDesc`
or :class:`Primitive`) that destroys it exactly once, when the owner is garbage collected
(``weakref.finalize``); :func:`live_handles` counts those not yet destroyed. An owner keeps alive
what its handle points into (a queried descriptor its primitive descriptor, a primitive its
descriptor), so no handle outlives what it refers to, and a primitive is never destroyed while a
call runs it: the call holds its owner. The engine and the stream are made once and never
destroyed: every other handle refers to the engine, and they live as long as the process (two
small objects; the OS takes them back at exit). Handles still alive at interpreter exit are left
to the OS too (``atexit = False``): destroying them then would run oneDNN while Python tears
its modules down, in no defined order, for memory that is about to go anyway.
"""
import ctypes
import os
import sys
import threading
import warnings
import weakref

import numpy

from . import thread_count
from .load_settings import environment_during

__all__ = ["installed", "available", "version", "check_version", "set_num_threads", "get_num_threads",
           "live_handles", "primitive_desc", "dims", "Desc", "PrimitiveDesc", "Primitive", "Reorder", "buffer",
           "Error", "MAJOR", "SPIN_VARIABLE"]

MAJOR = 3  # the oneDNN major version the values below were copied from; _load refuses others
# The values below are copied from oneDNN 3.x's C headers, include/oneapi/dnnl/dnnl_common_types.h
# (dnnl_f32, dnnl_cpu, dnnl_stream_in_order, DNNL_MAX_NDIMS) and dnnl_types.h (the rest), and
# checked against 3.2 (the onednn-cpu-gomp wheel) and 3.12 (PyTorch's headers). oneDNN keeps enum
# values within a major version; a new major may renumber them, hence MAJOR.
_P = ctypes.c_void_p
_DIMS = ctypes.c_int64 * 12  # dnnl_dims_t: DNNL_MAX_NDIMS
F32, TAG_ANY, TAG_PLAIN4 = 3, 1, 5  # dnnl_f32, dnnl_format_tag_any, dnnl_abcd (NCHW / OIHW)
# dnnl_query_*_md: what a primitive descriptor chose for each argument
SRC_MD, DIFF_SRC_MD, WEIGHTS_MD, DIFF_WEIGHTS_MD, DST_MD, DIFF_DST_MD = 129, 130, 131, 132, 133, 134
IMPL_INFO = 8  # dnnl_query_impl_info_str
# DNNL_ARG_*: execution argument slots
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS = 1, 17, 33, 129, 145, 161
FORWARD_TRAINING, CONVOLUTION_DIRECT = 64, 1  # dnnl_forward_training, dnnl_convolution_direct
_CPU, _IN_ORDER = 1, 1  # dnnl_cpu, dnnl_stream_in_order
_ALIGN = 64  # bytes: oneDNN's kernels read whole cache lines
# GNU OpenMP's threads spin 300000 times (about 0.1-0.3 ms) after a parallel region by default,
# on the core the next op's intra-op thread needs: the user-written ResNet-20's step measured
# 1.09x and 1.11x faster in wall time, 1.4x in CPU time, with no spin on a 2-core Intel Xeon
# (python benchmarks/bench_step_ab.py --model resnet20_user --mode graph --env
# GOMP_SPINCOUNT=300000, against 0; docs/performance.md); on 2 cores of a shared AMD EPYC (--env
# MINIDL_OMP_SPIN=0) 0.98x when quiet (A/A noise 1.15x), 3.3x and 4.7x with other jobs running
# (docs/devices.md). It is now an opt-in: the one way to set it is the environment libgomp reads
# once, when it loads, and it then holds for every user of that libgomp in the process.
# MINIDL_OMP_SPIN=n sets GOMP_SPINCOUNT for that load only (_environ_for_load); unset, GNU
# OpenMP's default holds. (Checked: with MINIDL_OMP_SPIN=10**11 the idle thread keeps spinning
# after os.environ is restored, as with GOMP_SPINCOUNT itself; tests/minidl/kernels/test_onednn.py.)
SPIN_VARIABLE = "MINIDL_OMP_SPIN"


class Error(RuntimeError):
    """A oneDNN call returned a status other than dnnl_success, or the library was refused."""


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _P)]


class _Version(ctypes.Structure):  # dnnl_version_t (dnnl_common_types.h)
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint), ("gpu_runtime", ctypes.c_uint)]


_state = {"threads": None}
_load_lock = threading.Lock()  # two thread ranks' first convolutions load the library once
# One primitive runs at a time: its memory objects (their data pointers set per run), the one
# stream and oneDNN's default scratchpad (one per process in its default build) are shared. Only
# minidl_parallel's in-process thread ranks call convolutions from several threads at once.
_run_lock = threading.Lock()
# (kind, address) of every handle made here and not yet destroyed; set.add and set.discard are
# single calls under the GIL, so finalizers running on any thread keep it exact.
_live = set()


def _path():
    return os.path.join(sys.prefix, "lib", "libdnnl.so.3")  # the soname onednn-cpu-gomp installs


def installed():
    """Whether oneDNN's library is there (``pip install 'minidl[onednn]'``), without loading it."""
    return os.path.exists(_path())


def check_version(found):
    """Raises Error unless ``found`` (major, minor, patch) is a oneDNN of major version MAJOR, the
    one this binding's enum values were copied from."""
    if found[0] != MAJOR:
        raise Error(f"oneDNN: {_path()} is oneDNN {'.'.join(map(str, found))}, but minidl's binding "
                    f"needs oneDNN {MAJOR}.x (its enum values are copied from oneDNN {MAJOR}'s dnnl_types.h): "
                    f"pip install 'minidl[onednn]' installs one; convolutions take conv.py's routes meanwhile")


def _environ_for_load():
    """GOMP_SPINCOUNT=$MINIDL_OMP_SPIN while libgomp loads (GNU OpenMP reads its environment once,
    in its constructor, so the value present at dlopen is the one that holds), then os.environ as
    it was. Nothing when MINIDL_OMP_SPIN is unset, or when the user set GOMP_SPINCOUNT: theirs holds."""
    spin = os.environ.get(SPIN_VARIABLE)
    if spin is not None and "GOMP_SPINCOUNT" not in os.environ and not (spin.isascii() and spin.isdigit()):
        raise ValueError(f"{SPIN_VARIABLE} must be a non-negative int (GNU OpenMP's spin count; 0: "
                         f"its threads sleep as soon as a primitive ends), got {spin!r}")
    return environment_during({"GOMP_SPINCOUNT": spin})


def _load():
    """The library, libgomp, engine and stream; None (with a warning saying why) where they do not load."""
    if not installed():
        return None
    try:
        with _environ_for_load():
            lib = ctypes.CDLL(_path())
            gomp = ctypes.CDLL("libgomp.so.1")  # the one libdnnl.so.3 links (DT_NEEDED), already loaded with it
    except OSError as e:
        warnings.warn(f"oneDNN: {_path()} does not load ({e}); convolutions take conv.py's routes", stacklevel=3)
        return None
    lib.dnnl_version.restype = ctypes.POINTER(_Version)
    found = lib.dnnl_version().contents
    try:
        check_version((found.major, found.minor, found.patch))
    except Error as e:
        warnings.warn(str(e), stacklevel=3)
        return None
    lib.dnnl_primitive_desc_query_md.restype = _P
    lib.dnnl_primitive_desc_query_md.argtypes = [_P, ctypes.c_int, ctypes.c_int]
    lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
    lib.dnnl_memory_desc_get_size.argtypes = [_P]
    lib.dnnl_memory_desc_equal.argtypes = [_P, _P]
    lib.dnnl_memory_set_data_handle.argtypes = [_P, _P]
    for kind in ("memory_desc", "memory", "primitive_desc", "primitive"):
        getattr(lib, f"dnnl_{kind}_destroy").argtypes = [_P]
    engine, stream = _P(), _P()
    _check(lib.dnnl_engine_create(ctypes.byref(engine), _CPU, ctypes.c_size_t(0)), "dnnl_engine_create")
    _check(lib.dnnl_stream_create(ctypes.byref(stream), engine, ctypes.c_uint(_IN_ORDER)), "dnnl_stream_create")
    return {"lib": lib, "gomp": gomp, "engine": engine, "stream": stream,
            "version": (found.major, found.minor, found.patch)}


def _lib():
    """The loaded library (loaded once); None where oneDNN is not installed or was refused."""
    if "lib" not in _state:
        with _load_lock:
            if "lib" not in _state:
                loaded = _load() or {"lib": None}
                _state.update(loaded)
    return _state["lib"]


def available():
    """Whether oneDNN is installed and loads (loading it, once), and this process may use it (see
    :func:`_after_fork_in_child`)."""
    return installed() and "forked" not in _state and _lib() is not None


def version():
    """The loaded oneDNN's (major, minor, patch), loading it; None where it is not available."""
    return _state["version"] if _lib() is not None else None


def _after_fork_in_child():
    """GNU OpenMP cannot run a parallel region in a child forked after its threads started: the
    child waits forever on threads that were not copied. A child of a process that loaded oneDNN
    therefore leaves it alone, and its convolutions take conv.py's routes (tests/minidl/kernels/
    test_conv_onednn.py forks one)."""
    if _state.get("lib") is not None:
        _state["forked"] = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def set_num_threads(n):
    """Runs oneDNN's primitives on ``n`` OpenMP threads from now on, from whichever thread calls
    them (minidl.set_num_threads calls this). Loads nothing: before oneDNN loads, ``n`` is kept for
    its first primitive. Until this is called, minidl's count in force holds (thread_count.py:
    MINIDL_NUM_THREADS, else the cores this process may use), not GNU OpenMP's default.

    The count is applied in the calling thread before each primitive runs, because
    ``omp_set_num_threads`` sets the calling thread's value only, and minidl_parallel's thread
    ranks each call primitives from their own thread.
    """
    _state["threads"] = thread_count.check(n, "onednn.set_num_threads")


def get_num_threads():
    """The OpenMP threads oneDNN's next primitive called from this thread runs on: GNU OpenMP's
    ``omp_get_max_threads`` where oneDNN is loaded, else the count it will take. Loads nothing."""
    if _state.get("lib") is None:
        return _count()
    _apply_threads()
    return _state["gomp"].omp_get_max_threads()


def _count():
    return thread_count.get() if _state["threads"] is None else _state["threads"]


def _apply_threads():
    _state["gomp"].omp_set_num_threads(_count())


def live_handles():
    """{kind: count} of the oneDNN handles made here that are not yet destroyed ('memory_desc',
    'memory', 'primitive_desc', 'primitive'); the engine and the stream are not counted."""
    counts = {}
    for kind, _ in list(_live):
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _own(owner, kind, handle):
    """Makes ``owner`` the owner of ``handle``: ``dnnl_<kind>_destroy`` runs on it exactly once,
    when ``owner`` is garbage collected (not at interpreter exit: module docstring)."""
    key = (kind, handle.value)
    _live.add(key)
    weakref.finalize(owner, _destroy, getattr(_state["lib"], f"dnnl_{kind}_destroy"), handle, key).atexit = False


def _destroy(destroy, handle, key):
    _live.discard(key)
    destroy(handle)


def _check(status, what):
    if status != 0:
        raise Error(f"oneDNN: {what} returned status {status}")


class Desc:
    """A memory descriptor: a float32 array's dims and layout (``TAG_PLAIN4`` as NumPy's C order of
    4-D, ``TAG_ANY`` for a primitive to choose), or one a primitive descriptor chose
    (:meth:`PrimitiveDesc.query_md`), which stays that descriptor's and keeps it alive."""

    def __init__(self, shape=None, tag=TAG_PLAIN4, *, handle=None, owner=None):
        if handle is not None:
            self.handle, self._owner = handle, owner
            return
        self.handle = _P()
        _check(_lib().dnnl_memory_desc_create_with_tag(ctypes.byref(self.handle), len(shape), _DIMS(*shape), F32, tag),
               "dnnl_memory_desc_create_with_tag")
        _own(self, "memory_desc", self.handle)

    def __eq__(self, other):
        return bool(_state["lib"].dnnl_memory_desc_equal(self.handle, other.handle))

    __hash__ = None

    @property
    def nbytes(self):
        return _state["lib"].dnnl_memory_desc_get_size(self.handle)


class PrimitiveDesc:
    """Owns a primitive descriptor handle; ``keep``: objects the handle's creation referred to (the
    forward primitive descriptor a backward one was made with), kept alive as long as it."""

    def __init__(self, handle, keep=()):
        self.handle, self._keep = handle, tuple(keep)
        _own(self, "primitive_desc", handle)

    def query_md(self, what):
        """The memory descriptor this chose for argument ``what`` (``*_MD``)."""
        return Desc(handle=_P(_state["lib"].dnnl_primitive_desc_query_md(self.handle, what, 0)), owner=self)

    @property
    def impl(self):
        """The implementation's name (``dnnl_query_impl_info_str``), e.g. 'brg:avx512_core'."""
        info = ctypes.c_char_p()
        _state["lib"].dnnl_primitive_desc_query(self.handle, IMPL_INFO, 0, ctypes.byref(info))
        return (info.value or b"").decode()


def primitive_desc(create, *args, keep=()):
    """A PrimitiveDesc from ``lib.<create>(&pd, engine, *args)``; Error when oneDNN has none."""
    handle = _P()
    _check(getattr(_lib(), create)(ctypes.byref(handle), _state["engine"], *args), create)
    return PrimitiveDesc(handle, keep)


def dims(values):
    return _DIMS(*values)


class Primitive:
    """A primitive made from a PrimitiveDesc, run with {arg slot: array}; ``descs``: {arg slot: Desc},
    the layouts its arrays have (:meth:`chosen`: those ``pd`` chose)."""

    def __init__(self, pd, descs):
        lib = _lib()
        self.pd, self.descs, self.handle = pd, descs, _P()
        _check(lib.dnnl_primitive_create(ctypes.byref(self.handle), pd.handle), "dnnl_primitive_create")
        _own(self, "primitive", self.handle)
        self.impl = pd.impl
        # One memory object per argument slot, no buffer of its own (DNNL_MEMORY_NONE): its data
        # pointer is set at each run.
        self.memories = {}
        for arg, desc in descs.items():
            memory = _P()
            _check(lib.dnnl_memory_create(ctypes.byref(memory), desc.handle, _state["engine"], _P(None)),
                   "dnnl_memory_create")
            _own(self, "memory", memory)
            self.memories[arg] = memory

    @classmethod
    def chosen(cls, pd, queries):
        """A primitive whose argument slots take the layouts ``pd`` chose: {arg slot: ``*_MD``}."""
        return cls(pd, {arg: pd.query_md(what) for arg, what in queries.items()})

    def __call__(self, arrays):
        """Runs on {arg slot: array} (arrays laid out as this primitive's descriptors say)."""
        lib = _state["lib"]
        args = (_Arg * len(arrays))()
        _apply_threads()
        with _run_lock:
            for i, (arg, array) in enumerate(arrays.items()):
                memory = self.memories[arg]
                _check(lib.dnnl_memory_set_data_handle(memory, _P(array.ctypes.data)), "dnnl_memory_set_data_handle")
                args[i] = _Arg(arg, memory)
            _check(lib.dnnl_primitive_execute(self.handle, _state["stream"], len(arrays), args),
                   "dnnl_primitive_execute")
            _check(lib.dnnl_stream_wait(_state["stream"]), "dnnl_stream_wait")


def buffer(desc):
    """A 64-byte aligned, uninitialised byte array of ``desc``'s size."""
    raw = numpy.empty(desc.nbytes + _ALIGN, dtype=numpy.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + desc.nbytes]


class Reorder:
    """Copies an array from one layout (Desc) into another: ``reorder(src, dst)``."""

    def __init__(self, src, dst):
        handle, engine = _P(), _state["engine"]
        _check(_state["lib"].dnnl_reorder_primitive_desc_create(ctypes.byref(handle), src.handle, engine, dst.handle,
                                                                engine, None), "dnnl_reorder_primitive_desc_create")
        self.primitive = Primitive(PrimitiveDesc(handle), {ARG_SRC: src, ARG_DST: dst})

    def __call__(self, src, dst):
        self.primitive({ARG_SRC: src, ARG_DST: dst})
        return dst
