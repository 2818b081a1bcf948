"""The libs stage's worker: loads each CUDA library minidl uses and checks a result against NumPy."""
import os
import time

import numpy

from .probe import nccl_version
from .stages import emit_result


def worker_libs(args):
    import cupy
    rng = numpy.random.default_rng(0)
    lines, data = [], {}
    a = rng.standard_normal((96, 64)).astype(numpy.float32)
    b = rng.standard_normal((64, 80)).astype(numpy.float32)
    got = cupy.asnumpy(cupy.asarray(a) @ cupy.asarray(b))
    want = a.astype(numpy.float64) @ b.astype(numpy.float64)
    err = float(numpy.max(numpy.abs(got - want)) / numpy.max(numpy.abs(want)))
    # 64-term float32 dot products: rounding stays near 1e-6; TF32 (CUPY_TF32=1) reaches ~1e-3.
    assert err < 1e-4, (f"cuBLAS matmul differs from NumPy by {err:.3g} (relative); "
                        f"CUPY_TF32={os.environ.get('CUPY_TF32')}")
    try:
        data["cublas"] = str(cupy.cuda.cublas.getVersion(cupy.cuda.device.get_cublas_handle()))
    except Exception:  # the version is a nicety; the matmul above is the check
        data["cublas"] = "loaded"
    lines.append(f"cuBLAS: float32 matmul max rel diff {err:.2g} vs NumPy")

    cupy.random.seed(1)
    x = cupy.asnumpy(cupy.random.standard_normal(200_000, dtype=cupy.float32))
    mean, std = float(x.mean()), float(x.std())
    # 200,000 draws: the mean's standard error is 0.0022, the std's 0.0016; 0.02 is ~9 sigma.
    assert numpy.isfinite(x).all() and abs(mean) < 0.02 and abs(std - 1) < 0.02, \
        f"cuRAND normal draw: mean {mean}, std {std}"
    lines.append(f"cuRAND: 200000 normal draws, mean {mean:+.4f}, std {std:.4f}")

    salt = (os.getpid() * 7919 + time.time_ns()) % 1_000_003  # a kernel no cache holds: NVRTC must compile it
    kernel = cupy.ElementwiseKernel("float32 x", "float32 y", f"y = x * x + {salt}.0f", f"minidl_gpu_check_{salt}")
    v = numpy.arange(10, dtype=numpy.float32)
    got = cupy.asnumpy(kernel(cupy.asarray(v)))
    assert numpy.array_equal(got, v * v + numpy.float32(salt)), f"NVRTC-compiled kernel gave {got}"
    lines.append("NVRTC: an elementwise kernel compiled and ran")

    try:
        from cupy.cuda import nccl
        data["nccl"] = nccl_version(nccl.get_version())
        lines.append(f"NCCL {data['nccl']} loaded")
    except Exception as exc:  # CuPy without NCCL: the nccl backend cannot work
        raise AssertionError(f"NCCL did not load: {type(exc).__name__}: {exc} (install nvidia-nccl-cu12/-cu13: "
                             "the gpu-cuda12 / gpu-cuda13 extra)") from exc
    print("\n".join(lines), flush=True)
    emit_result("passed", "; ".join(lines), **data)
