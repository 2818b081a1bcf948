"""Run under mpirun with the strict CuPy double as ``cupy`` (a GPU this MPI cannot read).

``MODE=... python mpi_backend_on_device.py`` (default gpu), one line ``rank R: ...`` per rank:
- ``gpu``: device target GPU chosen, ``init("mpi")``: every collective on device arrays
  (staged through the host) equals NumPy and returns device arrays, and data-parallel
  Model.train on the device equals one process on the global batch;
- ``default``: nothing chosen: ``init("mpi")`` makes the default device the CPU;
- ``used-default``: the default (GPU) was used before ``init("mpi")``: it stays, with a warning.
"""
import os
import warnings

from minidl.testing import cupy_double

cupy_double.install()

import minidl  # noqa: E402  (after the double is installed as cupy)
import minidl_parallel as mp  # noqa: E402
from minidl_checks.parallel_workers import collectives_check, dp_equivalence  # noqa: E402


def main(mode):
    if mode == "gpu":
        minidl.set_context(device_target="GPU")
    elif mode == "used-default":
        minidl.Tensor([1.0])  # places a tensor on the default device: the GPU the double shows
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm = mp.init("mpi")
    warned = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    target = minidl.get_context("device_target")
    try:
        failures = collectives_check(comm) + dp_equivalence(comm) if mode == "gpu" else []
    finally:
        mp.release()
    print(f"rank {comm.rank}: target {target}, warnings {len(warned)}, failures {failures}", flush=True)
    if warned:
        print(f"rank {comm.rank}: warning: {warned[0]}", flush=True)


if __name__ == "__main__":
    main(os.environ.get("MODE", "gpu"))
