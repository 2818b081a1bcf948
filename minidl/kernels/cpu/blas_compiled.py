"""blas.matmul's call compiled by Numba: the same cblas_?gemm call, made without ctypes.

Why. Through ctypes each GEMM call pays Python for every operand's address (``__array_interface__``
builds a new dict per array), the strides checked in Python, 14 arguments converted, and the
thread count set and put back through ctypes twice; the MLP's step makes 8 such calls. Here one
compiled function checks the strides, reads the addresses from the arrays and calls the library's
gemm and thread-count setter through their addresses, for the cost of one Numba dispatch. The
MLP's step: docs/performance.md (``bench_step_ab.py --option blas_compiled=False``).

The call is the ctypes route's argument for argument (same function, same transposes, leading
dimensions and beta), so its results are the same bits (tests/minidl/kernels/test_taps.py checks
both routes on every layout). Imported at blas.matmul's first call where Numba is installed
(``minidl[numba]``), never with minidl.

The library's functions are called through their addresses, passed in as integers:
:func:`_gemm` and :func:`_set_threads` build the calls in LLVM IR (``inttoptr``). The BLAS
integer (int32 for MKL's LP64 interface, int64 for the OpenBLAS wheel) is the type of the
``blas_int`` argument, so each width compiles once.

Why not Numba's documented route (ctypes function objects passed in as arguments, "Calling C code"
in Numba's docs)? It works and caches (the compiled function is keyed by the C signatures), but
Numba types a ctypes object on every call in Python: with the gemm alone as such an argument a
call took 1.4-3 us longer (8x8 float32, 20,000 calls, AMD EPYC, 2 cores shared), and with the
thread-count setter as a second one 150-330 us instead of 3.6 us (the dispatch, not the library:
the same calls in a compiled loop took 1 us). An integer argument is typed at C speed. So the
address route stays; the IR is the two calls above and nothing else.
"""
import numba
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


@intrinsic
def _gemm(typingctx, fn, blas_int, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc):
    """``fn(RowMajor, trans_a, trans_b, m, n, k, 1, a, lda, b, ldb, beta, c, ldc)``: fn the address of
    a cblas_?gemm for c's dtype, its integers of ``blas_int``'s type; a, b, c arrays (their data)."""
    sig = types.void(fn, blas_int, trans_a, trans_b, m, n, k, a, lda, b, ldb, beta, c, ldc)

    def codegen(context, builder, signature, args):
        tys = signature.args
        int_t, real_t = context.get_value_type(tys[1]), context.get_value_type(tys[12].dtype)
        enum_t, ptr_t = ir.IntType(32), cgutils.voidptr_t
        fn_t = ir.FunctionType(ir.VoidType(), [enum_t] * 3 + [int_t] * 3 + [real_t, ptr_t, int_t, ptr_t, int_t,
                                                                            real_t, ptr_t, int_t])

        def cast(i, to):
            return context.cast(builder, args[i], tys[i], to)

        def data(i):
            array = context.make_array(tys[i])(context, builder, args[i])
            return builder.bitcast(array.data, ptr_t)
        blas = tys[1]
        real = tys[12].dtype
        call_args = [ir.Constant(enum_t, _ROW_MAJOR), cast(2, types.int32), cast(3, types.int32),
                     cast(4, blas), cast(5, blas), cast(6, blas), ir.Constant(real_t, 1.0),
                     data(7), cast(8, blas), data(9), cast(10, blas), cast(11, real), data(12), cast(13, blas)]
        callee = builder.inttoptr(args[0], fn_t.as_pointer())
        builder.call(callee, call_args)
        return context.get_dummy_value()
    return sig, codegen


@intrinsic
def _set_threads(typingctx, fn, n):
    """``fn(n)``: fn the address of the library's ``int (int)`` thread-local thread-count setter;
    returns what it returns (the previous setting)."""
    sig = types.int32(fn, n)

    def codegen(context, builder, signature, args):
        fn_t = ir.FunctionType(ir.IntType(32), [ir.IntType(32)])
        callee = builder.inttoptr(args[0], fn_t.as_pointer())
        return builder.call(callee, [context.cast(builder, args[1], signature.args[1], types.int32)])
    return sig, codegen


@numba.njit(nogil=True, cache=True)
def _rows(x):
    """(row stride in elements, transposed) of a 2-D view BLAS can take as it lies, else (0, False);
    as blas.py's ``_rows``."""
    it = x.itemsize
    s0, s1 = x.strides
    if s1 == it and s0 % it == 0 and s0 >= max(1, x.shape[1]) * it:
        return s0 // it, False
    if s0 == it and s1 % it == 0 and s1 >= max(1, x.shape[0]) * it:
        return s1 // it, True
    return 0, False


@numba.njit(nogil=True, cache=True)
def matmul(gemm, set_threads, blas_int, a, b, out, beta, threads):
    """blas.matmul's call for arrays of one dtype (the caller checked), ``gemm`` and ``set_threads``
    the addresses of the library's functions (set_threads 0: none, or ``threads`` is 1); False
    (nothing done) where BLAS cannot take the views as they lie."""
    if a.size == 0 or b.size == 0:
        return False
    lda, ta = _rows(a)
    ldb, tb = _rows(b)
    ldc, tc = _rows(out)
    if lda == 0 or ldb == 0 or ldc == 0 or tc:
        return False
    previous = _set_threads(set_threads, threads) if set_threads != 0 else 0
    _gemm(gemm, blas_int, _TRANS if ta else _NO_TRANS, _TRANS if tb else _NO_TRANS,
          a.shape[0], b.shape[1], a.shape[1], a, lda, b, ldb, beta, out, ldc)
    if set_threads != 0:
        _set_threads(set_threads, previous)
    return True
