"""Elementwise passes on the OpenMP team that MKL's GEMMs run on.

Why. On the MLP, a training step is GEMMs on MKL's threads with a few memory-bound passes
between them (the bias and ReLU, the ReLU's masked gradient, the optimizer's update). Those
passes ran on one core. MKL's OpenMP team is still spinning on the other cores then (for
``KMP_BLOCKTIME`` after each GEMM: blas.py's opt-in ``MINIDL_OMP_BLOCKTIME_MS``), so waking
minidl's own intra-op pool for them
only made its threads fight the spinning team for the cores (a slower step). Handing the pass
to that team instead costs one OpenMP fork/join on threads already awake, and a second
core adds memory bandwidth to these memory-bound passes: ``python benchmarks/bench_step_ab.py --model mlp
--mode graph --option team=False`` measures what it buys.

How. A job (team_jobs.py) is a Numba ``cfunc`` taking one pointer: a small int64 array, the
*header*, that holds the arrays' addresses, sizes and scalars. :func:`run` calls the OpenMP
runtime's ``GOMP_parallel(job, header, threads)`` through ctypes (which releases the GIL); each
team thread claims chunks of the pass from the header and runs the serial kernel's own compiled
loop on them, so a pass gives the same bits on the team or not (team_jobs.py says why).

The runtime is Intel OpenMP (libiomp5, which also speaks GCC's ``GOMP_*`` entry points), the
copy MKL loaded (blas.py) and no other. Without MKL and Numba (the ``mkl`` and ``numba`` extras) there is no
team: :func:`available` is false and the kernels run their passes on the calling thread. Also
serial: a call from an intra-op pool thread (it is already one of several), and, through
:func:`threads`, passes below ``team_min_bytes``.
"""
import ctypes
import importlib.util
import os

from . import threads as intra_op
from .. import declare_option, get_option
from . import blas

__all__ = ["available", "threads", "run", "jobs"]

declare_option("team", True, "run the dense and optimizer kernels' elementwise passes on MKL's OpenMP "
               "team (needs the mkl and numba extras); False: on the calling thread")
# A pass whose arrays fit in one core's L2 runs from that cache: a second core would fetch its
# part from L3 first, and the fork/join costs more than the split saves (the MLP's 512 KiB
# activations on a 2 MiB L2 gained nothing; its momentum over 1 and 1.6 MiB weights, three arrays
# each, did). So from half the L2 (sysfs) on; an option, to measure another threshold.
declare_option("team_min_bytes", intra_op.l2_bytes() // 2,
               "the smallest pass (bytes of its largest array) handed to the OpenMP team "
               "(default: half this machine's L2, from sysfs)")

_state = {}  # "runtime": (GOMP_parallel,), or None when absent


def _loaded_iomp():
    """The Intel OpenMP runtime MKL loaded (blas.py starts it when it loads MKL), as a ctypes library:
    asked for by its soname with RTLD_NOLOAD, so it is that very copy or nothing, never another file."""
    try:
        return ctypes.CDLL("libiomp5.so", mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def _runtime():
    if "runtime" not in _state:
        found = None
        lib = _loaded_iomp() if importlib.util.find_spec("numba") is not None and blas.load("mkl") else None
        if lib is not None:
            fork_join = lib.GOMP_parallel
            fork_join.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            fork_join.restype = None
            found = (fork_join,)
        _state["runtime"] = found
    return _state["runtime"]


def available():
    """Whether passes can run on the team: the ``team`` option on, MKL, its OpenMP and Numba found."""
    return bool(get_option("team")) and _runtime() is not None


def threads(nbytes):
    """How many team threads a pass over ``nbytes`` (its largest array) should use; 1 means run it
    on the calling thread, without the team."""
    if nbytes < get_option("team_min_bytes") or not available() or intra_op.in_worker():
        return 1
    return intra_op.get_num_threads()


def jobs():
    """team_jobs.py (imported at the first compiled pass: it imports Numba)."""
    module = _state.get("jobs")
    if module is None:
        from . import team_jobs as module
        _state["jobs"] = module
    return module


def run(job, head, n_threads):
    """Runs team job ``job`` (a cfunc of team_jobs.py) on ``n_threads`` threads of the team (the
    caller is one of them) over ``n_threads`` chunks, with the header ``head`` (team_jobs.py's
    ``*_header`` filled it); returns when every chunk is done."""
    head[0], head[1] = 0, n_threads
    _runtime()[0](job.address, jobs().address(head), n_threads, 0)
