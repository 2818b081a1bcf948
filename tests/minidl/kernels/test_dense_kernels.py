"""The Dense, DenseReLU and MatMul CPU kernels (minidl/kernels/cpu/dense.py, matmul.py) against their
references on hypothesis draws, DenseReLU's one-sweep backward against NumPy's bit for bit, and
blas.matmul on several of the library's threads (as these kernels call it) on each BLAS found."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import threads as intra_op
from minidl.kernels.cpu import blas, dense as dense_kernels
from minidl.kernels.cpu.dense import DenseBLAS, DenseReLUBLAS
from minidl.kernels.cpu.matmul import MatMulThreaded
from minidl.testing.gradcheck import check_kernels
from minidl.testing.strategies import arrays

pytestmark = [pytest.mark.cpu_only, pytest.mark.usefixtures("kernels_on")]

LIBRARIES = [name for name in ("openblas", "mkl") if blas.load(name)]
dims = st.integers(1, 40)


def names(used):
    return {k.name for k in used}


@pytest.fixture(params=LIBRARIES)
def library(request):
    previous = kernels.get_option("blas")
    kernels.set_option("blas", request.param)
    try:
        yield request.param
    finally:
        kernels.set_option("blas", previous)


@given(n=dims, k=dims, o=dims, bias=st.booleans(), relu=st.booleans(), f32=st.booleans(), data=st.data())
def test_dense_kernels_equal_their_references(n, k, o, bias, relu, f32, data):
    dtype = np.float32 if f32 else np.float64
    inputs = [data.draw(arrays((n, k))), data.draw(arrays((o, k)))] + ([data.draw(arrays((o,)))] if bias else [])
    op = ops.DenseReLU if relu else ops.Dense
    used = check_kernels(lambda *ts: op()(*ts), inputs, dtype)
    assert (DenseReLUBLAS if relu else DenseBLAS).__name__ in names(used)


@pytest.mark.parametrize("threads", [1, 2])
def test_dense_on_each_library_and_thread_count(library, threads):
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal(s).astype(np.float32) for s in ((256, 300), (200, 300), (200,))]
    before = intra_op.get_num_threads()
    intra_op.set_num_threads(threads)
    try:
        for op in (ops.Dense, ops.DenseReLU):
            assert check_kernels(lambda *ts: op()(*ts), inputs, np.float32)
    finally:
        intra_op.set_num_threads(before)


@pytest.mark.skipif(not MatMulThreaded.available, reason="MatMul's threaded kernel needs the mkl extra")
@given(m=dims, k=dims, n=dims, ta=st.booleans(), tb=st.booleans(), data=st.data())
def test_matmul_kernel_equals_its_reference(m, k, n, ta, tb, data):
    x = data.draw(arrays((k, m) if ta else (m, k)))
    w = data.draw(arrays((n, k) if tb else (k, n)))
    previous = kernels.get_option("blas")
    kernels.set_option("blas", "mkl")
    try:
        used = check_kernels(lambda x, w: ops.MatMul(ta, tb)(x, w), [x, w], np.float32)
    finally:
        kernels.set_option("blas", previous)
    assert "MatMulThreaded" in names(used)


def test_matmul_kernel_stands_aside_on_openblas():
    # NumPy's own matmul already runs OpenBLAS threaded: the kernel is for MKL only.
    previous = kernels.get_option("blas")
    kernels.set_option("blas", "openblas")
    try:
        with kernels.tracking() as used:
            ops.MatMul()(Tensor(np.ones((4, 4), np.float32)), Tensor(np.ones((4, 4), np.float32)))
    finally:
        kernels.set_option("blas", previous)
    assert "MatMulThreaded" not in names(used)


def relu_grad_inputs(rng, shape, dtype):
    y = rng.standard_normal(shape).astype(dtype)
    y[0, :2] = 0.0  # the kink: gradient 0
    gy = rng.standard_normal(shape).astype(dtype)
    gy[1, 0], gy[1, 1], gy[2 % shape[0], 2] = np.nan, np.inf, -np.inf  # NaN and inf times 0 are NaN, as gy * (y > 0)
    y[1, 0] = y[1, 1] = -1.0
    return gy, y


@pytest.mark.skipif(not dense_kernels._numba, reason="the one-sweep backward needs the numba extra")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 3), (256, 512), (7, 130)])
def test_relu_grad_sweep_is_numpys_bit_for_bit(dtype, shape):
    gy, y = relu_grad_inputs(np.random.default_rng(1), shape, dtype)
    with np.errstate(invalid="ignore"):
        g, gb = dense_kernels.relu_grad(gy, y, compiled=True)
        g_ref, gb_ref = dense_kernels.relu_grad(gy, y, compiled=False)
        expected = gy * (y > 0)
    np.testing.assert_array_equal(g, expected)
    np.testing.assert_array_equal(g, g_ref)
    np.testing.assert_array_equal(gb, gb_ref)  # rows added in order, as sum(axis=0)
    assert np.isnan(g[1, 0]) and np.isnan(g[1, 1]) and g.dtype == gb.dtype == dtype


def test_relu_grad_takes_numpys_passes_for_strided_arrays():
    gy, y = relu_grad_inputs(np.random.default_rng(2), (6, 8), np.float32)
    with np.errstate(invalid="ignore"):
        g, gb = dense_kernels.relu_grad(gy[:, ::2], y[:, ::2], compiled=True)
        expected = gy[:, ::2] * (y[:, ::2] > 0)
    np.testing.assert_array_equal(g, expected)
    np.testing.assert_array_equal(gb, expected.sum(axis=0))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_blas_matmul_on_threads(library, threads, dtype):
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((300, 200)).astype(dtype), rng.standard_normal((200, 250)).astype(dtype)
    c = rng.standard_normal((300, 250)).astype(dtype)
    out = c.copy()
    assert blas.matmul(a, b.T.copy().T, out, beta=1.0, threads=threads)
    tol = 1e-4 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, a.astype(np.float64) @ b + c, rtol=tol, atol=tol * 20)
    # the thread count was set for that call only: a one-thread call from here still works
    assert blas.matmul(a, b, out)
    np.testing.assert_allclose(out, a.astype(np.float64) @ b, rtol=tol, atol=tol * 20)


def test_an_op_run_by_an_intra_op_thread_uses_one_blas_thread():
    from minidl.kernels.cpu.matmul import _threads
    before = intra_op.get_num_threads()
    intra_op.set_num_threads(2)
    try:
        assert _threads() == 2
        assert intra_op.parallel_map(lambda i: _threads(), 2) == [2, 1]  # fn(0) runs on the caller
    finally:
        intra_op.set_num_threads(before)


def both_ways(fn, arrays, needs):
    """fn's output and its inputs' gradients (None where an input needs none), with the kernels on
    and on the reference bodies; and the kernels that ran."""
    results = []
    for reference in (False, True):
        ts = [Tensor(a, requires_grad=n) for a, n in zip(arrays, needs)]
        with kernels.reference_only(reference), kernels.tracking() as used:
            y = fn(*ts)
            if any(needs):
                y.backward(Tensor(np.linspace(-1, 1, y.size, dtype=y.dtype).reshape(y.shape)))
        results.append((y.asnumpy(), [t.grad.asnumpy() if t.grad is not None else None for t in ts], names(used)))
    (y, grads, used), (y_ref, grads_ref, _) = results
    return y, grads, y_ref, grads_ref, used


def assert_close(got, want, dtype):
    tol = (1e-5, 1e-4) if dtype == np.float32 else (1e-13, 1e-13)  # the kernels' stated bound
    assert got.dtype == want.dtype == dtype
    np.testing.assert_allclose(got, want, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("needs", [(True, False, False), (False, True, True)], ids=["x only", "w and b only"])
def test_dense_kernels_give_the_gradients_asked_for(needs, dtype):
    # Frozen weights (fine-tuning) or a constant input: only those inputs' gradients, each right.
    rng = np.random.default_rng(4)
    arrays = [rng.standard_normal(s).astype(dtype) for s in ((9, 6), (5, 6), (5,))]
    for op, kernel in ((ops.Dense, DenseBLAS), (ops.DenseReLU, DenseReLUBLAS)):
        y, grads, y_ref, grads_ref, used = both_ways(lambda *ts: op()(*ts), arrays, needs)
        assert kernel.__name__ in used
        assert_close(y, y_ref, dtype)
        for need, g, g_ref in zip(needs, grads, grads_ref):
            assert (g is None) == (g_ref is None) == (not need)
            if need:
                assert_close(g, g_ref, dtype)


@pytest.mark.skipif(not MatMulThreaded.available, reason="MatMul's threaded kernel needs the mkl extra")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("needs", [(True, False), (False, True)], ids=["x only", "w only"])
def test_matmul_kernel_gives_the_gradients_asked_for(needs, dtype):
    rng = np.random.default_rng(5)
    arrays = [rng.standard_normal((7, 4)).astype(dtype), rng.standard_normal((4, 3)).astype(dtype)]
    previous = kernels.get_option("blas")
    kernels.set_option("blas", "mkl")
    try:
        y, grads, y_ref, grads_ref, used = both_ways(lambda x, w: ops.MatMul()(x, w), arrays, needs)
    finally:
        kernels.set_option("blas", previous)
    assert "MatMulThreaded" in used
    assert_close(y, y_ref, dtype)
    for need, g, g_ref in zip(needs, grads, grads_ref):
        assert (g is None) == (g_ref is None) == (not need)
        if need:
            assert_close(g, g_ref, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_and_matmul_kernels_on_arrays_blas_cannot_take_as_they_lie(dtype):
    # A strided x and an empty inner dimension: blas.matmul declines them, NumPy's matmul computes.
    rng = np.random.default_rng(6)
    strided = rng.standard_normal((9, 12)).astype(dtype)[:, ::2]
    cases = [[strided, rng.standard_normal((5, 6)).astype(dtype), rng.standard_normal(5).astype(dtype)],
             [np.ones((4, 0), dtype), np.ones((3, 0), dtype), np.arange(3, dtype=dtype) - 1]]
    previous = kernels.get_option("blas")
    kernels.set_option("blas", "mkl" if "mkl" in LIBRARIES else None)
    try:
        for arrays in cases:
            for op, kernel in ((ops.Dense, DenseBLAS), (ops.DenseReLU, DenseReLUBLAS)):
                y, grads, y_ref, grads_ref, used = both_ways(lambda *ts: op()(*ts), arrays, (True, True, True))
                assert kernel.__name__ in used
                for got, want in zip([y] + grads, [y_ref] + grads_ref):
                    assert_close(got, want, dtype)
            if MatMulThreaded.available:
                y, grads, y_ref, grads_ref, used = both_ways(lambda x, w: ops.MatMul(False, True)(x, w), arrays[:2],
                                                             (True, True))
                assert "MatMulThreaded" in used
                for got, want in zip([y] + grads, [y_ref] + grads_ref):
                    assert_close(got, want, dtype)
    finally:
        kernels.set_option("blas", previous)


def test_dense_kernels_leave_float16_to_the_reference():
    # No BLAS has a float16 GEMM: the reference's NumPy products run.
    rng = np.random.default_rng(7)
    arrays = [rng.standard_normal(s).astype(np.float16) for s in ((6, 4), (3, 4), (3,))]
    for op in (ops.Dense, ops.DenseReLU):
        for inputs in (arrays, arrays[:2]):
            y, grads, y_ref, grads_ref, used = both_ways(lambda *ts: op()(*ts), inputs, [True] * len(inputs))
            assert not used & {"DenseBLAS", "DenseReLUBLAS"}
            for got, want in zip([y] + grads, [y_ref] + grads_ref):
                np.testing.assert_array_equal(got, want)
                assert got.dtype == np.float16


@pytest.mark.parametrize("op", [ops.Dense, ops.DenseReLU])
def test_dense_kernels_check_the_bias_as_the_reference_does(op):
    x, w = np.ones((2, 4), np.float32), np.ones((3, 4), np.float32)
    name = op.__name__
    before = minidl.get_context("mode")
    minidl.set_context(mode=minidl.PYNATIVE_MODE)  # (GRAPH_MODE defers the op and checks it itself)
    try:
        with kernels.tracking() as used:
            message = rf"^{name}: b of shape \(4,\) must be 1-D of length w.shape\[0\] = 3$"
            with pytest.raises(ValueError, match=message):
                op()(Tensor(x), Tensor(w), Tensor(np.ones(4, np.float32)))
    finally:
        minidl.set_context(mode=before)
    assert used  # the kernel was chosen, and checked


@pytest.mark.skipif(not MatMulThreaded.available, reason="MatMul's threaded kernel needs the mkl extra")
def test_matmul_kernel_names_the_op_in_its_errors():
    previous = kernels.get_option("blas")
    kernels.set_option("blas", "mkl")
    try:
        with kernels.tracking() as used:
            with pytest.raises(ValueError, match=r"^MatMul: x of shape \(3, 4\) and w of shape \(5, 2\): "
                                                 r"inner dimensions 4 and 5 differ$"):
                ops.MatMul()(Tensor(np.ones((3, 4), np.float32)), Tensor(np.ones((5, 2), np.float32)))
    finally:
        kernels.set_option("blas", previous)
    assert "MatMulThreaded" in names(used)


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_bias_relu_numpys_passes(relu, dtype):
    # compiled=False, and a strided y where Numba is installed: NumPy's passes, in y's memory.
    rng = np.random.default_rng(8)
    y, b = rng.standard_normal((5, 6)).astype(dtype), rng.standard_normal(6).astype(dtype)
    want = np.maximum(y + b, 0) if relu else y + b
    got = y.copy()
    assert dense_kernels.add_bias_relu(got, b, relu, compiled=False) is got
    np.testing.assert_array_equal(got, want)
    wide = np.zeros((5, 12), dtype)
    wide[:, ::2] = y
    assert dense_kernels.add_bias_relu(wide[:, ::2], b, relu) is not None
    np.testing.assert_array_equal(wide[:, ::2], want)
    np.testing.assert_array_equal(wide[:, 1::2], 0)
