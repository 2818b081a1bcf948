"""A ctypes binding to the part of oneDNN's C API that the convolution kernel uses.

oneDNN (Intel's deep-learning primitives library, what PyTorch's CPU convolutions run on) ships
on PyPI as ``onednn-cpu-gomp`` (the ``onednn`` extra): one ``libdnnl.so.3`` under sys.prefix/lib,
threaded by GNU OpenMP. This module loads it by that soname at the first convolution (never at
import), checks its version (:func:`check_version`), keeps one CPU engine and one stream, and
offers what conv_onednn.py needs: memory descriptors, primitive descriptors, primitives, and
running them on NumPy arrays. Nothing here knows about convolutions' maths.

Threads: a primitive runs on the OpenMP thread count that was in force in the calling thread when
it was made (oneDNN sizes its work split then); :func:`openmp_threads` sets that count for a block
and puts the caller's back after it. conv_onednn.py makes its primitives for one OpenMP thread and
runs them on minidl's intra-op threads, one chunk of the batch each, so GNU OpenMP starts no
team: no threads of its own spinning on the cores the next op needs. Every primitive is made with
a user-managed scratchpad (each run gets its own buffer) and runs in one of several slots (its own
memory objects and stream per slot, one run per slot at a time), so different threads run
primitives, the same one included, at once.

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
import contextlib
import ctypes
import os
import sys
import threading
import warnings
import weakref

import numpy

from . import buffers
from .load_settings import environment_during

__all__ = ["installed", "available", "version", "check_version", "openmp_threads", "live_handles", "primitive_desc", "dims", "Desc", "PrimitiveDesc", "Primitive", "Reorder", "buffer",
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
SCRATCHPAD_MD = 136  # dnnl_query_scratchpad_md
IMPL_INFO = 8  # dnnl_query_impl_info_str
# DNNL_ARG_*: execution argument slots
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS = 1, 17, 33, 129, 145, 161
ARG_SCRATCHPAD = 80
SCRATCHPAD_USER = 1  # dnnl_scratchpad_mode_user: each run passes its own scratch buffer
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


_state = {}
_load_lock = threading.Lock()  # two thread ranks' first convolutions load the library once
# Slot -> (lock, stream). A run in slot k sets the data pointers of the primitive's slot-k memory
# objects and runs on stream k, holding lock k: two runs at once use two slots (the intra-op
# threads run chunk k in slot k; minidl_parallel's thread ranks may run the same chunk number at
# once, and then take turns).
_slots = {}
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
    gomp.omp_get_max_threads.restype = ctypes.c_int
    gomp.omp_set_num_threads.argtypes = [ctypes.c_int]
    engine, attr = _P(), _P()
    _check(lib.dnnl_engine_create(ctypes.byref(engine), _CPU, ctypes.c_size_t(0)), "dnnl_engine_create")
    # One set of attributes for every primitive descriptor: a scratchpad the caller passes per run.
    _check(lib.dnnl_primitive_attr_create(ctypes.byref(attr)), "dnnl_primitive_attr_create")
    _check(lib.dnnl_primitive_attr_set_scratchpad_mode(attr, ctypes.c_int(SCRATCHPAD_USER)),
           "dnnl_primitive_attr_set_scratchpad_mode")
    return {"lib": lib, "gomp": gomp, "engine": engine, "attr": attr,
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


@contextlib.contextmanager
def openmp_threads(n):
    """The calling thread's OpenMP thread count (libgomp's ``omp_set_num_threads``, a per-thread
    value) is ``n`` for the block, then the caller's again: a primitive made or run inside runs on
    ``n`` OpenMP threads, and the count a user's thread had is left as it was."""
    _lib()  # (loads oneDNN, and with it libgomp, once)
    gomp = _state["gomp"]
    before = gomp.omp_get_max_threads()
    if before != n:
        gomp.omp_set_num_threads(n)
    try:
        yield
    finally:
        if before != n:
            gomp.omp_set_num_threads(before)


def _slot(k):
    """(lock, stream) of slot ``k``, made at its first use (module docstring; ``_slots``)."""
    try:
        return _slots[k]
    except KeyError:
        with _load_lock:
            if k not in _slots:
                stream = _P()
                _check(_state["lib"].dnnl_stream_create(ctypes.byref(stream), _state["engine"], ctypes.c_uint(_IN_ORDER)),
                       "dnnl_stream_create")
                _slots[k] = (threading.Lock(), stream)
            return _slots[k]


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
    """A PrimitiveDesc from ``lib.<create>(&pd, engine, *args, attr)``, with the attributes every
    primitive here is made with (a user-managed scratchpad); Error when oneDNN has none."""
    handle = _P()
    _check(getattr(_lib(), create)(ctypes.byref(handle), _state["engine"], *args, _state["attr"]), create)
    return PrimitiveDesc(handle, keep)


def dims(values):
    return _DIMS(*values)


class Primitive:
    """A primitive made from a PrimitiveDesc, run with {arg slot: array}; ``descs``: {arg slot: Desc},
    the layouts its arrays have (:meth:`chosen`: those ``pd`` chose). It runs on the OpenMP thread
    count in force in the calling thread when it was made (``threads``: oneDNN split its work for
    that many), whichever thread runs it."""

    def __init__(self, pd, descs):
        lib = _lib()
        self.pd, self.descs, self.handle = pd, descs, _P()
        self.threads = _state["gomp"].omp_get_max_threads()
        _check(lib.dnnl_primitive_create(ctypes.byref(self.handle), pd.handle), "dnnl_primitive_create")
        _own(self, "primitive", self.handle)
        self.impl = pd.impl
        scratchpad = pd.query_md(SCRATCHPAD_MD)
        self._scratchpad = scratchpad if scratchpad.nbytes else None
        self._memories = {}  # run slot -> {arg slot: memory object}, made at the slot's first run

    @classmethod
    def chosen(cls, pd, queries):
        """A primitive whose argument slots take the layouts ``pd`` chose: {arg slot: ``*_MD``}."""
        return cls(pd, {arg: pd.query_md(what) for arg, what in queries.items()})

    def _memories_of(self, slot):
        """One memory object per argument (and the scratchpad) for runs in ``slot``, with no buffer
        of its own (DNNL_MEMORY_NONE): its data pointer is set at each run. Called holding the
        slot's lock."""
        if slot not in self._memories:
            descs = dict(self.descs)
            if self._scratchpad is not None:
                descs[ARG_SCRATCHPAD] = self._scratchpad
            memories = {}
            for arg, desc in descs.items():
                memory = _P()
                _check(_state["lib"].dnnl_memory_create(ctypes.byref(memory), desc.handle, _state["engine"], _P(None)),
                       "dnnl_memory_create")
                _own(self, "memory", memory)
                memories[arg] = memory
            self._memories[slot] = memories
        return self._memories[slot]

    def __call__(self, arrays, slot=0):
        """Runs on {arg slot: array} (arrays laid out as this primitive's descriptors say), in run
        slot ``slot`` (module docstring), on the OpenMP threads it was made for."""
        lib = _state["lib"]
        if self._scratchpad is not None:
            arrays = {**arrays, ARG_SCRATCHPAD: buffer(self._scratchpad)}
        args = (_Arg * len(arrays))()
        lock, stream = _slot(slot)
        with lock, openmp_threads(self.threads):
            memories = self._memories_of(slot)
            for i, (arg, array) in enumerate(arrays.items()):
                memory = memories[arg]
                _check(lib.dnnl_memory_set_data_handle(memory, _P(array.ctypes.data)), "dnnl_memory_set_data_handle")
                args[i] = _Arg(arg, memory)
            _check(lib.dnnl_primitive_execute(self.handle, stream, len(arrays), args), "dnnl_primitive_execute")
            _check(lib.dnnl_stream_wait(stream), "dnnl_stream_wait")


def buffer(desc):
    """A 64-byte aligned, uninitialised byte array of ``desc``'s size (from buffers.py's pool where
    it is large)."""
    if buffers.takes(desc.nbytes):
        return buffers.empty(desc.nbytes, numpy.uint8)  # aligned to _ALIGN already
    raw = numpy.empty(desc.nbytes + _ALIGN, dtype=numpy.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + desc.nbytes]


class Reorder:
    """Copies an array from one layout (Desc) into another: ``reorder(src, dst)``."""

    def __init__(self, src, dst):
        handle, engine = _P(), _state["engine"]
        _check(_state["lib"].dnnl_reorder_primitive_desc_create(ctypes.byref(handle), src.handle, engine, dst.handle,
                                                                engine, _state["attr"]),
               "dnnl_reorder_primitive_desc_create")
        self.primitive = Primitive(PrimitiveDesc(handle), {ARG_SRC: src, ARG_DST: dst})

    def __call__(self, src, dst, slot=0):
        self.primitive({ARG_SRC: src, ARG_DST: dst}, slot)
        return dst
