"""Gradient compression (fp16, bf16) and Horovod's gradient_predivide_factor in
DistributedGradReducer, against the float64 reduction of the same gradients, on the threads
backend (mpirun: tests/minidl_parallel/comm/test_mpi.py runs the same over MPI)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import Parameter, Tensor, backend
from minidl_parallel import CommCounter, run_threads
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel.compression import Compression
from minidl_parallel.grad_reducer import DistributedGradReducer

ml_dtypes = pytest.importorskip("ml_dtypes")

# Unit roundoff of each wire type (half an ulp at 1): every rounding is within u relative.
UNIT = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}
# The smallest positive subnormal of each (the absolute error of a rounding near zero is half of it).
TINY = {"fp16": 2.0 ** -24, "bf16": float(ml_dtypes.finfo(ml_dtypes.bfloat16).smallest_subnormal)}

# CuPy has no bfloat16: on the device-pinned suite (MINIDL_TEST_DEVICE) bf16 is tested as an error only.
ON_GPU = backend.get_device_target() == "GPU"
WIRES = ["fp16"] if ON_GPU else ["fp16", "bf16"]

SHAPES = st.lists(st.lists(st.integers(1, 5), min_size=0, max_size=2).map(tuple), min_size=1, max_size=4)


def _params(shapes, dtype=np.float32):
    return [Parameter(np.zeros(s, dtype), name=f"p{i}") for i, s in enumerate(shapes)]


def _grads(shapes, rank, seed, scale, dtype=np.float32):
    rng = np.random.default_rng([seed, rank])
    return tuple(Tensor((rng.standard_normal(s) * scale).astype(dtype)) for s in shapes)


def _reduce(n, shapes, seed, scale, **kwargs):
    def body():
        reducer = DistributedGradReducer(_params(shapes), fusion_bytes=64, **kwargs)
        with CommCounter() as counter:
            out = reducer(_grads(shapes, resolve_communicator("test", None).rank, seed, scale))
        return [g.asnumpy() for g in out], reducer.overflowed(), counter.bytes("allreduce", "gradients")
    return run_threads(n, body)


@given(shapes=SHAPES, n=st.integers(1, 8), which=st.sampled_from(WIRES), mean=st.booleans(),
       predivide=st.sampled_from([1.0, 2.0, None]), scale=st.sampled_from([1e-3, 1.0, 100.0]),
       seed=st.integers(0, 1000))
def test_a_compressed_reduction_is_the_exact_one_within_the_rounding_bound(shapes, n, which, mean, predivide, scale,
                                                                           seed):
    """Each of the n values is rounded once to 16 bits and each of the n - 1 additions once more:
    |got - exact| <= n * u * sum_i |g_i| (+ n subnormal steps), divided as the result is."""
    f = float(n) if predivide is None else predivide  # None: f = world size, Horovod's usual choice
    f = f if mean else 1.0
    results = _reduce(n, shapes, seed, scale, compression=which, mean=mean, gradient_predivide_factor=f)
    every = [[g.asnumpy().astype(np.float64) for g in _grads(shapes, r, seed, scale)] for r in range(n)]
    divisor = n if mean else 1
    for out, overflowed, _ in results:
        assert not overflowed
        for i, g in enumerate(out):
            assert g.dtype == np.float32 and g.shape == shapes[i]  # updates happen in the parameter's dtype
            exact = sum(e[i] for e in every) / divisor
            magnitude = sum(np.abs(e[i]) for e in every) / divisor
            # the 16-bit error, then float32's own roundings of the two scalings (a few 2**-24)
            bound = n * UNIT[which] * magnitude * 1.001 + n * TINY[which] / f + 4 * 2.0 ** -24 * np.abs(exact)
            assert np.all(np.abs(g - exact) <= bound), (which, n, np.max(np.abs(g - exact) - bound))


def test_fp16_sends_half_the_bytes_of_float32_and_bf16_too():
    shapes = [(64, 3), (10,)]
    plain = _reduce(2, shapes, 0, 1.0)[0][2]
    assert plain == 4 * (64 * 3 + 10)  # float32; a ring all-reduce sends 2(n-1)/n of the buffer: n = 2
    for which in WIRES:
        assert _reduce(2, shapes, 0, 1.0, compression=which)[0][2] * 2 == plain


def test_compression_is_coarser_than_float32_so_the_tests_can_see_it():
    """The bound above is not vacuous: fp16 really changes values float32 keeps."""
    shapes = [(200,)]
    plain = _reduce(2, shapes, 3, 1.0)[0][0][0]
    half = _reduce(2, shapes, 3, 1.0, compression=Compression.fp16)[0][0][0]
    assert 0 < np.max(np.abs(half - plain)) < 1e-2


def _reduce_values(values, **kwargs):
    """Each rank's gradient of one (3,) parameter is ``values[rank]``."""
    def body():
        reducer = DistributedGradReducer(_params([(3,)]), **kwargs)
        g = np.asarray(values[resolve_communicator("test", None).rank], np.float32)
        return reducer((Tensor(g),))[0].asnumpy(), reducer.overflowed()
    return run_threads(len(values), body)


def test_an_fp16_overflow_is_flagged_never_silent():
    big = [[4e4, 1.0, -4e4], [4e4, 2.0, -4e4]]  # each fits fp16 (max 65504); the sums do not
    for out, overflowed in _reduce_values(big, compression="fp16", mean=True):
        assert overflowed and np.isinf(out[0]) and out[1] == 1.5
    # dividing first (f = world size, Horovod's advice for fp16) keeps the same sums in range
    for out, overflowed in _reduce_values(big, compression="fp16", mean=True, gradient_predivide_factor=2.0):
        assert not overflowed and np.allclose(out, [4e4, 1.5, -4e4], rtol=1e-3)
    if "bf16" in WIRES:
        for out, overflowed in _reduce_values(big, compression="bf16", mean=True):  # float32's range
            assert not overflowed and np.allclose(out, [4e4, 1.5, -4e4], rtol=1e-2)
    # a NaN gradient on one rank is flagged too, and without compression nothing is computed
    for out, overflowed in _reduce_values([[np.nan, 0, 0], [1, 1, 1]], compression="fp16"):
        assert overflowed
    assert not any(o for _, o in _reduce_values([[np.nan, 0, 0], [1, 1, 1]]))


def test_bad_settings_are_clear_errors():
    with pytest.raises(TypeError, match=r"Compression.fp16 compresses floating-point gradients, got a bucket of int64"):
        DistributedGradReducer([Parameter(np.zeros(3, np.int64), name="steps")], compression="fp16")
    with pytest.raises(ValueError, match="compression must be Compression.none, .fp16 or .bf16"):
        DistributedGradReducer(_params([(2,)]), compression="int8")
    with pytest.raises(ValueError, match="gradient_predivide_factor must be a finite number > 0, got 0"):
        DistributedGradReducer(_params([(2,)]), gradient_predivide_factor=0)
    with pytest.raises(ValueError, match="it needs mean=True"):
        DistributedGradReducer(_params([(2,)]), mean=False, gradient_predivide_factor=2.0)


def test_bf16_on_the_device_is_a_clear_error():
    from minidl.testing import cupy_double
    xp = cupy_double.cupy_module()
    with pytest.raises(TypeError, match="DistributedGradReducer: Compression.bf16 needs NumPy arrays: CuPy has no "
                                        "bfloat16 dtype; use Compression.fp16 on the GPU"):
        Compression.bf16.compress(xp, xp.zeros(3, dtype=xp.float32), "DistributedGradReducer")


def test_bf16_without_ml_dtypes_names_the_package(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # as if not installed: import raises ImportError
    with pytest.raises(ImportError, match=r"DistributedGradReducer: Compression.bf16 needs the ml_dtypes package .*"
                                          r"pip install ml_dtypes"):
        DistributedGradReducer(_params([(2,)]), compression="bf16")


def test_compressions_by_name_and_their_wire_types():
    """Horovod's names in any case; the wire keeps the gradient's dtype without compression."""
    for name, want in [(None, Compression.none), ("none", Compression.none), ("None", Compression.none),
                       ("fp16", Compression.fp16), ("FP16", Compression.fp16), ("bf16", Compression.bf16)]:
        assert Compression.resolve(name, "test") is want, name
    for dtype in (np.float32, np.float64):
        assert Compression.none.wire_dtype(dtype, "test") == dtype
        assert Compression.fp16.wire_dtype(dtype, "test") == np.float16
    # no compression: the wire is the bucket itself, and a separate wire array is copied back whole
    buf = np.zeros(3, np.float32)
    assert Compression.none.compress(np, buf, "test") is buf
    Compression.none.decompress(np, np.array([1.0, 2.0, 3.0], np.float32), buf)
    assert buf.tolist() == [1.0, 2.0, 3.0]
