"""A ctypes binding to the part of oneDNN's C API that the convolution kernel uses.

oneDNN (Intel's deep-learning primitives library, what PyTorch's CPU convolutions run on) ships
on PyPI as ``onednn-cpu-gomp`` (the ``onednn`` extra): one ``libdnnl.so.3`` under sys.prefix/lib,
threaded by GNU OpenMP. This module loads it, keeps one CPU engine and one stream, and offers
what conv_onednn.py needs: memory descriptors, primitive descriptors, primitives, and running
them on NumPy arrays. Nothing here knows about convolutions' maths.

oneDNN chooses its own (blocked) layouts for the fast kernels when a descriptor says "any"; the
caller reorders NCHW arrays into them and back (``Reorder``). Every array handed to oneDNN
stays alive in the caller for the call's duration: oneDNN holds raw pointers only.
"""
import ctypes
import glob
import os
import sys
import threading

import numpy

__all__ = ["installed", "available", "threads", "primitive_desc", "dims", "Desc", "Primitive", "Reorder", "query_md", "buffer", "Error"]

_P = ctypes.c_void_p
_DIMS = ctypes.c_int64 * 12  # dnnl_dims_t: DNNL_MAX_NDIMS
F32, TAG_ANY, TAG_PLAIN4 = 3, 1, 5  # dnnl_f32, dnnl_format_tag_any, dnnl_abcd (NCHW / OIHW)
# dnnl_query_*_md: what a primitive descriptor chose for each argument
SRC_MD, DIFF_SRC_MD, WEIGHTS_MD, DIFF_WEIGHTS_MD, DST_MD, DIFF_DST_MD = 129, 130, 131, 132, 133, 134
IMPL_INFO = 8  # dnnl_query_impl_info_str
# DNNL_ARG_*: execution argument slots
ARG_SRC, ARG_DST, ARG_WEIGHTS, ARG_DIFF_SRC, ARG_DIFF_DST, ARG_DIFF_WEIGHTS = 1, 17, 33, 129, 145, 161
FORWARD_TRAINING, CONVOLUTION_DIRECT = 64, 1  # dnnl_forward_training, dnnl_convolution_direct
_ALIGN = 64  # bytes: oneDNN's kernels read whole cache lines
# GNU OpenMP's threads spin 300000 times (about 0.1-0.3 ms) after a parallel region by default,
# on the core the next op's intra-op thread needs: the user-written ResNet-20's step measured
# 1.09x and 1.11x faster in wall time, 1.4x in CPU time, with no spin (python
# benchmarks/bench_step_ab.py --model resnet20_user --mode graph --env GOMP_SPINCOUNT=300000,
# against 0). Set GOMP_SPINCOUNT to override.
_SPIN = "0"


class Error(RuntimeError):
    """A oneDNN call returned a status other than dnnl_success."""


class _Arg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _P)]


_state = {}
# One primitive runs at a time: its memory objects (their data pointers set per run), the one
# stream and oneDNN's default scratchpad (one per process in its default build) are shared. Only
# minidl_parallel's in-process thread ranks call convolutions from several threads at once.
_run_lock = threading.Lock()


def _paths():
    return sorted(glob.glob(os.path.join(sys.prefix, "lib", "libdnnl.so.3*")))


def _lib():
    """The loaded library, its engine and stream (loaded once); None when oneDNN is not installed."""
    if "lib" not in _state:
        _state["lib"] = None
        for path in _paths():
            # GNU OpenMP reads this once, when it loads: its threads sleep as soon as a primitive ends,
            # leaving the cores to the intra-op threads' BatchNorm and to MKL (see _SPIN's comment).
            os.environ.setdefault("GOMP_SPINCOUNT", _SPIN)
            try:
                lib = ctypes.CDLL(path)
                gomp = ctypes.CDLL("libgomp.so.1")
            except OSError:
                continue
            lib.dnnl_primitive_desc_query_md.restype = _P
            lib.dnnl_primitive_desc_query_md.argtypes = [_P, ctypes.c_int, ctypes.c_int]
            lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
            lib.dnnl_memory_desc_get_size.argtypes = [_P]
            lib.dnnl_memory_desc_equal.argtypes = [_P, _P]
            lib.dnnl_memory_set_data_handle.argtypes = [_P, _P]
            engine, stream = _P(), _P()
            _check(lib.dnnl_engine_create(ctypes.byref(engine), 1, ctypes.c_size_t(0)), "dnnl_engine_create")  # dnnl_cpu
            _check(lib.dnnl_stream_create(ctypes.byref(stream), engine, ctypes.c_uint(1)), "dnnl_stream_create")
            _state.update(lib=lib, gomp=gomp, engine=engine, stream=stream)
            break
    return _state["lib"]


def installed():
    """Whether oneDNN's library is there (``pip install 'minidl[onednn]'``), without loading it."""
    return bool(_paths())


def available():
    """Whether oneDNN is installed and loads (loading it, once), and this process may use it (see
    :func:`_after_fork_in_child`)."""
    return installed() and "forked" not in _state and _lib() is not None


def _after_fork_in_child():
    """GNU OpenMP cannot run a parallel region in a child forked after its threads started: the
    child waits forever on threads that were not copied. A child of a process that loaded oneDNN
    therefore leaves it alone, and its convolutions take conv.py's routes (tests/minidl/kernels/
    test_conv_onednn.py forks one)."""
    if _state.get("lib") is not None:
        _state["forked"] = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def threads(n):
    """Sets the OpenMP threads oneDNN's primitives called from this thread use."""
    _lib()
    _state["gomp"].omp_set_num_threads(int(n))


def _check(status, what):
    if status != 0:
        raise Error(f"oneDNN: {what} returned status {status}")


class Desc:
    """A memory descriptor: a float32 array's dims and layout (``TAG_PLAIN4`` as NumPy's C order of
    4-D, ``TAG_ANY`` for a primitive to choose), or one a primitive descriptor returned."""

    def __init__(self, shape=None, tag=TAG_PLAIN4, handle=None):
        if handle is not None:
            self.handle, self.owned = handle, False  # belongs to its primitive descriptor
            return
        self.handle, self.owned = _P(), True
        _check(_lib().dnnl_memory_desc_create_with_tag(ctypes.byref(self.handle), len(shape), _DIMS(*shape), F32, tag),
               "dnnl_memory_desc_create_with_tag")

    def __eq__(self, other):
        return bool(_lib().dnnl_memory_desc_equal(self.handle, other.handle))

    __hash__ = None

    @property
    def nbytes(self):
        return _lib().dnnl_memory_desc_get_size(self.handle)

    def __del__(self):
        if self.owned and _state.get("lib") is not None:
            _state["lib"].dnnl_memory_desc_destroy(self.handle)


def query_md(pd, what):
    """The memory descriptor primitive descriptor ``pd`` chose for argument ``what`` (``*_MD``)."""
    return Desc(handle=_P(_lib().dnnl_primitive_desc_query_md(pd, what, 0)))


def buffer(desc):
    """A 64-byte aligned, uninitialised byte array of ``desc``'s size."""
    raw = numpy.empty(desc.nbytes + _ALIGN, dtype=numpy.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start:start + desc.nbytes]


class Primitive:
    """A primitive made from a primitive descriptor, run with {arg slot: (Desc, array)}."""

    def __init__(self, pd, descs):
        lib = _lib()
        self.pd, self.handle = pd, _P()
        _check(lib.dnnl_primitive_create(ctypes.byref(self.handle), pd), "dnnl_primitive_create")
        info = ctypes.c_char_p()
        lib.dnnl_primitive_desc_query(pd, IMPL_INFO, 0, ctypes.byref(info))
        self.impl = (info.value or b"").decode()
        # One memory object per argument slot, its data pointer set at each run.
        self.memories = {}
        for arg, desc in descs.items():
            memory = _P()
            _check(lib.dnnl_memory_create(ctypes.byref(memory), desc.handle, _state["engine"], _P(None)),
                   "dnnl_memory_create")
            self.memories[arg] = memory
        self.descs = descs

    def __call__(self, arrays):
        """Runs on {arg slot: array} (arrays laid out as this primitive's descriptors say)."""
        lib = _lib()
        args = (_Arg * len(arrays))()
        with _run_lock:
            for i, (arg, array) in enumerate(arrays.items()):
                memory = self.memories[arg]
                _check(lib.dnnl_memory_set_data_handle(memory, _P(array.ctypes.data)), "dnnl_memory_set_data_handle")
                args[i] = _Arg(arg, memory)
            _check(lib.dnnl_primitive_execute(self.handle, _state["stream"], len(arrays), args),
                   "dnnl_primitive_execute")
            _check(lib.dnnl_stream_wait(_state["stream"]), "dnnl_stream_wait")


def primitive_desc(create, *args):
    """A primitive descriptor from ``lib.<create>(&pd, engine, *args)``; Error when oneDNN has none."""
    pd = _P()
    _check(getattr(_lib(), create)(ctypes.byref(pd), _state["engine"], *args), create)
    return pd


def dims(values):
    return _DIMS(*values)


class Reorder:
    """Copies an array from one layout (Desc) into another: ``reorder(src, dst)``."""

    def __init__(self, src, dst):
        pd = _P()
        _lib()
        engine = _state["engine"]
        _check(_state["lib"].dnnl_reorder_primitive_desc_create(ctypes.byref(pd), src.handle, engine, dst.handle,
                                                                engine, None), "dnnl_reorder_primitive_desc_create")
        self.primitive = Primitive(pd, {ARG_SRC: src, ARG_DST: dst})

    def __call__(self, src, dst):
        self.primitive({ARG_SRC: src, ARG_DST: dst})
        return dst
