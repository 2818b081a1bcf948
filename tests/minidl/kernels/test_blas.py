"""blas.py's direct GEMM: finding and binding each library (afresh, not from the process's first
load), gemm's defaults, and which views matmul takes as they lie (the rest it leaves to NumPy)."""
import ctypes
import importlib.metadata
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from minidl import kernels
from minidl.kernels.cpu import blas
from minidl.kernels.cpu.load_settings import environment_during

pytestmark = pytest.mark.cpu_only


def wheel_installed(name):
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.fixture
def fresh_blas(monkeypatch):
    """blas.py as in a new process: no library loaded yet (the process's own loads are restored after)."""
    for cache in ("_found", "_set_local", "_counts", "_blocktime", "_refused"):
        monkeypatch.setattr(blas, cache, {})
    return blas


def test_the_thread_count_of_a_library_not_loaded_is_none(fresh_blas):
    assert fresh_blas.num_threads("openblas") is None and fresh_blas.num_threads("mkl") is None


def test_installed_says_whether_each_library_is_there():
    # MKL is the mkl wheel's libmkl_rt; OpenBLAS is the scipy-openblas64 wheel (never NumPy's own copy).
    assert blas.installed("mkl") == wheel_installed("mkl")
    assert blas.installed("openblas") == wheel_installed("scipy-openblas64")


@pytest.mark.skipif(not wheel_installed("scipy-openblas64"),
                    reason="needs the openblas extra: pip install -e '.[openblas]'")
def test_openblas_is_the_declared_wheels_library_found_through_its_documented_api():
    import scipy_openblas64
    path = blas._openblas_path()
    assert path == os.path.join(scipy_openblas64.get_lib_dir(), scipy_openblas64.get_library(fullname=True))
    assert "numpy.libs" not in path and os.path.exists(path)


def test_without_the_openblas_wheel_nothing_is_loaded_and_the_status_names_the_extras(fresh_blas, monkeypatch):
    real_find_spec = blas.importlib.util.find_spec
    monkeypatch.setattr(blas.importlib.util, "find_spec",
                        lambda name, *a: None if name == "scipy_openblas64" else real_find_spec(name, *a))
    monkeypatch.setattr(blas, "_mkl_paths", lambda: [])
    kernels.set_option("blas", None)
    assert blas.installed("openblas") is False and blas.load("openblas") == {}
    assert blas.library() is None and not blas.chunks_may_run_in_parallel()
    assert blas.status().startswith(
        "no BLAS minidl binds is installed (pip install scipy-openblas64, a dependency, or 'minidl[mkl]')")
    kernels.set_option("blas", "openblas")
    try:
        with pytest.raises(RuntimeError, match=r"kernels option blas='openblas', but it was not found: "
                                               r"pip install 'minidl\[openblas\]'"):
            blas.library()
    finally:
        kernels.set_option("blas", None)


def test_a_setting_for_a_load_is_in_the_environment_only_during_it(monkeypatch):
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    before = dict(os.environ)
    with environment_during({"KMP_BLOCKTIME": "1"}):
        assert os.environ["KMP_BLOCKTIME"] == "1"
    assert dict(os.environ) == before
    monkeypatch.setenv("KMP_BLOCKTIME", "50")  # the user's own value wins and stays
    with environment_during({"KMP_BLOCKTIME": "1"}):
        assert os.environ["KMP_BLOCKTIME"] == "50"
    assert os.environ["KMP_BLOCKTIME"] == "50"


def test_the_blocktime_is_whole_milliseconds_one_by_default_and_names_its_variable():
    assert blas.blocktime_ms({}) == 1
    assert blas.blocktime_ms({"MINIDL_OMP_BLOCKTIME_MS": "0"}) == 0
    assert blas.blocktime_ms({"MINIDL_OMP_BLOCKTIME_MS": "250"}) == 250
    for bad in ("soon", "-1", "1.5"):
        with pytest.raises(ValueError, match=f"MINIDL_OMP_BLOCKTIME_MS must be a whole number of milliseconds "
                                             f"\\(0 or more\\), got '{bad}'"):
            blas.blocktime_ms({"MINIDL_OMP_BLOCKTIME_MS": bad})


# A fresh process (Intel OpenMP starts once): loading MKL and the OpenBLAS wheel and a threaded
# GEMM big enough for MKL's team; then the calling thread's own blocktime, whether os.environ is
# as before, and the CPU time the process spent while its main thread slept: the team spinning.
_LOAD_AND_REPORT = """
import ctypes, json, os, sys, time, numpy as np
before = dict(os.environ)
from minidl.kernels.cpu import blas
from minidl.kernels.cpu.load_settings import environment_during
from minidl import kernels
assert blas.load("mkl")
blas.load("openblas")
a = np.ones((512, 512), np.float32)
out = np.empty_like(a)
time.sleep(0.3)  # the load's check against numpy.matmul leaves NumPy's OpenBLAS thread spinning ~0.1 s
# MKL may run a GEMM on fewer threads than asked when the machine is busy (MKL_DYNAMIC): no team,
# nothing to see. This test process turns that off for itself.
ctypes.CDLL(os.path.basename(blas._mkl_paths()[0]), mode=os.RTLD_NOLOAD).MKL_Set_Dynamic(0)
assert blas.matmul(a, a, out, threads=2)
cpu = time.process_time()
time.sleep(0.5)
cpu = time.process_time() - cpu
iomp = ctypes.CDLL("libiomp5.so", mode=os.RTLD_NOLOAD)  # the OpenMP runtime MKL loaded
print(json.dumps({"own_blocktime": iomp.kmp_get_blocktime(), "environ_unchanged": dict(os.environ) == before,
                  "cpu_while_asleep": cpu}))
"""


@pytest.mark.skipif(not wheel_installed("mkl"), reason="needs the mkl extra: pip install -e '.[mkl]'")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="MKL's team needs 2 cores")
def test_a_threaded_gemm_has_its_team_wait_briefly_and_leaves_the_thread_and_environment_as_they_were():
    """MKL's OpenMP team waits 1 ms after minidl's GEMM (by default), not the 200 ms of Intel OpenMP's
    default, yet the calling thread's own blocktime stays 200 and os.environ unchanged; with
    MINIDL_OMP_BLOCKTIME_MS=2000 the team spins through half a second's sleep (what the check sees)."""
    def report(**environ):
        env = {k: v for k, v in os.environ.items() if k not in ("KMP_BLOCKTIME", "MINIDL_OMP_BLOCKTIME_MS")}
        done = subprocess.run([sys.executable, "-c", _LOAD_AND_REPORT], capture_output=True, text=True,
                              timeout=120, env={**env, **environ})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.splitlines()[-1])
    brief = report()
    assert brief == {**brief, "own_blocktime": 200, "environ_unchanged": True}
    # On a loaded 2-core host the spinning thread gets a share of a core; idle, all of it.
    assert brief["cpu_while_asleep"] < 0.03, brief
    spinning = report(MINIDL_OMP_BLOCKTIME_MS="2000")
    assert spinning == {**spinning, "own_blocktime": 200, "environ_unchanged": True}
    assert spinning["cpu_while_asleep"] > 0.05, spinning


@pytest.mark.parametrize("name", ["openblas", "mkl"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_fresh_load_binds_both_gemms_that_compute_the_product(fresh_blas, name, dtype):
    if not blas.installed(name):
        pytest.skip(f"{name} is not installed: pip install -e '.[{name}]'")
    fns = fresh_blas.load(name)
    assert sorted(fns) == ["d", "f"]
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((5, 7)).astype(dtype), rng.standard_normal((6, 7)).astype(dtype)
    c = np.full((5, 6), 3.0, dtype)
    previous = kernels.get_option("blas")
    kernels.set_option("blas", name)
    try:
        assert fresh_blas.library() == name and fresh_blas.available(dtype)
        # trans_b: C = A @ B.T; beta = 1 adds onto C
        fresh_blas.gemm(dtype, 5, 6, 7, blas.address(a), 7, blas.address(b), 7, blas.address(c), 6, beta=1.0,
                        trans_b=True)
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(c, a.astype(np.float64) @ b.T + 3.0, rtol=tol, atol=tol)
        out = np.full((5, 6), 3.0, dtype)
        assert fresh_blas.matmul(a, b.T, out, threads=2)
        np.testing.assert_allclose(out, a.astype(np.float64) @ b.T, rtol=tol, atol=tol)
    finally:
        kernels.set_option("blas", previous)


@pytest.mark.skipif(not wheel_installed("mkl"), reason="needs the mkl extra: pip install -e '.[mkl]'")
def test_a_fresh_mkl_load_keeps_its_global_count_one_and_sets_threads_and_blocktime_per_call(
        fresh_blas, monkeypatch):
    """MKL's global count stays 1 (a call from an intra-op thread starts no team); a threaded call
    runs with its thread count and the wanted blocktime set in the calling thread, both given
    back after it."""
    if not fresh_blas.load("mkl"):
        pytest.skip(f"MKL refused here: {fresh_blas._refused.get('mkl')}")
    assert fresh_blas.num_threads("mkl") == 1
    get, _, wanted = fresh_blas._blocktime["mkl"]
    assert wanted == fresh_blas.blocktime_ms()
    seen = {}
    real = fresh_blas._found["mkl"]["f"]

    def spy(*args):
        seen.update(threads=fresh_blas.num_threads("mkl"), blocktime=get())
        return real(*args)
    monkeypatch.setitem(fresh_blas._found["mkl"], "f", spy)
    previous = kernels.get_option("blas")
    kernels.set_option("blas", "mkl")
    try:
        own = get()
        a = np.ones((8, 8), np.float32)
        out = np.empty_like(a)
        assert fresh_blas.matmul(a, a, out, threads=2) and np.all(out == 8.0)
        assert seen == {"threads": 2, "blocktime": wanted} and wanted != own
        assert get() == own and fresh_blas.num_threads("mkl") == 1
        assert fresh_blas.matmul(a, a, out, threads=1)  # one thread: neither is touched
        assert seen == {"threads": 1, "blocktime": own}
    finally:
        kernels.set_option("blas", previous)


@pytest.mark.skipif(not wheel_installed("scipy-openblas64"), reason="needs the scipy-openblas64 wheel")
def test_a_fresh_openblas_load_takes_minidls_count_or_one_inside_a_one_thread_block(fresh_blas):
    from minidl.kernels.cpu import thread_count
    if thread_count.get() == 1:
        pytest.skip("one thread: the count and the one-thread block's 1 cannot be told apart")
    assert fresh_blas.load("openblas")
    assert fresh_blas.num_threads("openblas") == thread_count.get()
    for cache in ("_found", "_counts"):
        getattr(fresh_blas, cache).clear()
    with fresh_blas.one_thread():
        assert fresh_blas.load("openblas")  # loaded while intra-op threads run chunks: 1 until they end
        assert fresh_blas.num_threads("openblas") == 1
    assert fresh_blas.num_threads("openblas") == thread_count.get()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_overwrites_c_by_default_and_takes_b_as_it_lies(dtype):
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 3)).astype(dtype), rng.standard_normal((3, 5)).astype(dtype)
    want = a.astype(np.float64) @ b
    tol = 1e-5 if dtype == np.float32 else 1e-12
    c = np.full((4, 5), 7.0, dtype)  # beta defaults to 0: C's old values do not count
    blas.gemm(dtype, 4, 5, 3, blas.address(a), 3, blas.address(b), 5, blas.address(c), 5)
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol)
    c = np.full((4, 5), 7.0, dtype)
    blas.gemm_for(dtype)(4, 5, 3, blas.address(a), 3, blas.address(b), 5, blas.address(c), 5)
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol)


def views(dtype):
    """2-D views of several layouts: (name, array, whether BLAS can take it as it lies)."""
    base = np.arange(1.0, 1 + 6 * 30, dtype=dtype).reshape(6, 30) / 50
    flat = np.arange(1.0, 41.0, dtype=dtype) / 40
    window = np.lib.stride_tricks.sliding_window_view(flat, 8)  # (33, 8), rows overlap: strides (1, 1) elements
    return [("C", base[:, :8].copy(), True), ("F", np.asfortranarray(base[:, :8]), True),
            ("row pitch", base[:, :8], True), ("column (6, 1)", base[:, :1].copy(), True),
            ("row (1, 6), strides (1, 1)", base[:6, :1].copy().T, True),
            ("transposed pitch", base[:, :6].T, True),
            ("every other column", base[:, :16:2], False), ("both strided", base[::2, ::10], False),
            ("overlapping rows", window[:6], False), ("overlapping columns", window[:6].T, False)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_takes_the_views_blas_can_and_leaves_the_rest(dtype):
    # Either out = a @ b (the call reports True) or out untouched (False, for NumPy to do): never a
    # view read with the wrong strides.
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for name, a, takes in views(dtype):
        for b_name, b in (("C", np.linspace(-1, 1, a.shape[1] * 3, dtype=dtype).reshape(a.shape[1], 3)),
                          ("sliding", np.lib.stride_tricks.sliding_window_view(
                              np.linspace(-1, 1, a.shape[1] + 2, dtype=dtype), 3))):
            if b_name == "sliding" and a.shape[1] == 1:
                continue  # one row of b: any row stride will do
            out = np.full((a.shape[0], 3), 9.0, dtype)
            done = blas.matmul(a, b, out)
            assert done == (takes and b_name == "C"), (name, b_name)
            want = a.astype(np.float64) @ b if done else np.full(out.shape, 9.0)
            np.testing.assert_allclose(out, want, rtol=tol, atol=tol, err_msg=f"a {name}, b {b_name}")


@pytest.mark.parametrize("wrong_when", ["two threads", "B transposed", "B as it is"])
def test_a_gemm_that_disagrees_with_numpy_is_found_on_one_thread_and_on_two(wrong_when):
    """MKL loaded after PyTorch's copy computed wrong products on two threads only: the load-time
    check compares each bound GEMM with NumPy's at one thread and at two, B transposed or not."""
    if not blas.load("openblas"):
        pytest.skip("needs the openblas extra: pip install -e '.[openblas]'")
    good = blas.load("openblas")
    counts = []

    def set_threads(n):
        counts.append(n)
        return 7

    assert blas._products_agree(good, set_threads) and counts == [1, 7, 2, 7]  # each count given back

    def wrong(char):
        def gemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
            good[char](order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
            if {"two threads": counts[-1] == 2, "B transposed": tb == blas._TRANS,
                    "B as it is": tb == blas._NO_TRANS}[wrong_when]:
                ctypes.cast(c, ctypes.POINTER(ctypes.c_float))[0] += 0.01  # C[0, 0] off by 100 times the bound
        return gemm

    counts.clear()
    assert not blas._products_agree({"f": wrong("f"), "d": good["d"]}, set_threads)
    assert counts[-1] == 7  # the count is given back also when a product disagrees


@pytest.mark.skipif(not wheel_installed("mkl"), reason="needs the mkl extra: pip install -e '.[mkl]'")
def test_with_pytorch_imported_first_the_kernels_still_compute_right():
    pytest.importorskip("torch", reason="the check needs PyTorch: pip install -e '.[bench]'")
    script = """
import warnings, numpy as np, torch
(torch.randn(64, 64) @ torch.randn(64, 64)).sum()  # PyTorch's MKL and OpenMP in the process first
from minidl import kernels, nn, Tensor
from minidl.kernels.cpu import blas
from minidl.kernels.cpu.load_settings import environment_during
x, w = (np.random.default_rng(i).standard_normal(s).astype(np.float32) for i, s in ((0, (8, 20)), (1, (32, 20))))
d = nn.Dense(20, 32)
d.weight.set_data(Tensor(w))
with warnings.catch_warnings(record=True) as caught, kernels.reference_only(False):
    warnings.simplefilter("always")
    y = d(Tensor(x)).asnumpy()
np.testing.assert_allclose(y, x @ w.T + d.bias.asnumpy(), rtol=1e-5, atol=1e-5)
print(blas.library(), [str(c.message) for c in caught])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MINIDL_NUM_THREADS="2"))
    assert done.returncode == 0, done.stderr[-3000:]
    library, said = done.stdout.split(" ", 1)
    # where MKL's GEMMs go wrong after PyTorch's it is refused with a warning (then the OpenBLAS wheel
    # where installed, else NumPy's routes); where they agree it stays
    assert library in ("openblas", "None") and "was loaded after another copy of MKL" in said or library == "mkl"
