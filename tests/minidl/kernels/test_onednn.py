"""The oneDNN binding (minidl/kernels/cpu/onednn.py): the version it accepts, a fresh load that
runs a convolution, the OpenMP thread count of a block and of a primitive, and what loading it
leaves in the process: os.environ as it was, GOMP_SPINCOUNT only as an opt-in (MINIDL_OMP_SPIN)
that still reaches GNU OpenMP. The tests that load oneDNN skip where the onednn extra is not
installed."""
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from minidl import kernels, ops, Tensor
from minidl.kernels.cpu import onednn

needs_onednn = pytest.mark.skipif(not onednn.installed(), reason="the onednn extra is not installed")


def test_another_major_version_is_refused_naming_it():
    onednn.check_version((3, 2, 0))
    onednn.check_version((3, 12, 7))
    for found in [(2, 7, 3), (4, 0, 0)]:
        with pytest.raises(onednn.Error, match=rf"is oneDNN {'.'.join(map(str, found))}, .*needs oneDNN 3\.x"):
            onednn.check_version(found)


@pytest.mark.parametrize("value", ["fast", "-1", "1.5", ""])
def test_a_spin_count_that_is_not_a_count_is_refused_naming_it(monkeypatch, value):
    monkeypatch.setenv("MINIDL_OMP_SPIN", value)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    with pytest.raises(ValueError, match=rf"MINIDL_OMP_SPIN must be a non-negative int.*got '{value}'"):
        with onednn._environ_for_load():
            pass


def test_the_users_own_spin_count_wins_over_a_bad_opt_in(monkeypatch):
    """GOMP_SPINCOUNT set by the user: MINIDL_OMP_SPIN is not used, so its value is not judged."""
    monkeypatch.setenv("MINIDL_OMP_SPIN", "fast")
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")
    with onednn._environ_for_load():
        assert os.environ["GOMP_SPINCOUNT"] == "7"


def test_the_spin_count_is_in_the_environment_only_while_libgomp_loads(monkeypatch):
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("MINIDL_OMP_SPIN", raising=False)
    before = dict(os.environ)
    with onednn._environ_for_load():
        assert dict(os.environ) == before  # not asked: nothing set
    monkeypatch.setenv("MINIDL_OMP_SPIN", "0")
    before = dict(os.environ)
    with onednn._environ_for_load():
        assert os.environ["GOMP_SPINCOUNT"] == "0"
    assert dict(os.environ) == before
    monkeypatch.setenv("GOMP_SPINCOUNT", "7")  # the user's own GNU OpenMP setting holds
    with onednn._environ_for_load():
        assert os.environ["GOMP_SPINCOUNT"] == "7"
    assert os.environ["GOMP_SPINCOUNT"] == "7"


@pytest.mark.cpu_only
@needs_onednn
def test_the_loaded_library_is_oneDNN_3():
    assert onednn.available()
    assert onednn.version()[0] == onednn.MAJOR == 3


@pytest.mark.cpu_only
@needs_onednn
def test_a_library_of_another_major_is_not_loaded(monkeypatch):
    """The real library against a binding that would want oneDNN 2: refused with a warning that
    names both, and nothing made with it."""
    monkeypatch.setattr(onednn, "MAJOR", 2)
    found = ".".join(map(str, onednn.version()))
    with pytest.warns(UserWarning, match=rf"is oneDNN {found}, .*needs oneDNN 2\.x"):
        assert onednn._load() is None


@pytest.mark.cpu_only
@needs_onednn
def test_a_fresh_load_runs_a_convolution_forward_and_backward(monkeypatch):
    """The process loads oneDNN once; here a second load (its own library object, engine, attributes
    and libgomp binding) becomes the binding's state, and a convolution made and run through it,
    on two threads, equals the reference: every call _load prepares is one the kernel makes."""
    from minidl.kernels.cpu import conv_onednn
    assert onednn.available()
    loaded = onednn._load()
    assert loaded["version"][0] == onednn.MAJOR and loaded["gomp"].omp_get_max_threads() >= 1
    monkeypatch.setattr(onednn, "_state", dict(loaded))
    monkeypatch.setattr(onednn, "_slots", {})
    monkeypatch.setattr(conv_onednn, "_plans", conv_onednn._Plans(4))
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((4, 16, 8, 8)).astype(np.float32), rng.standard_normal((8, 16, 3, 3)).astype(np.float32)
    gy = rng.standard_normal((4, 8, 8, 8)).astype(np.float32)

    def conv_and_grads():
        a, b = Tensor(x, requires_grad=True), Tensor(w, requires_grad=True)
        with kernels.tracking() as used:
            y = ops.Conv2D(8, 3, pad_mode="pad", pad=1)(a, b)
            y.backward(Tensor(gy))
        return [y.asnumpy(), a.grad.asnumpy(), b.grad.asnumpy()], {k.name for k in used}
    got, used = conv_and_grads()
    with kernels.reference_only():
        want, _ = conv_and_grads()
    assert used == {"Conv2DOneDNN"} and len(conv_onednn._plans) == 1
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
    # Its primitives take their scratchpad from each run (oneDNN's user mode: the library's own
    # would be shared between threads), as the attributes every primitive is made with say.
    import ctypes
    mode = ctypes.c_int(-1)
    assert loaded["lib"].dnnl_primitive_attr_get_scratchpad_mode(loaded["attr"], ctypes.byref(mode)) == 0
    assert mode.value == onednn.SCRATCHPAD_USER


@pytest.mark.cpu_only
@needs_onednn
def test_openmp_threads_sets_the_count_for_the_block_and_gives_the_callers_back():
    """libgomp's count is per thread: inside the block it is n in this thread only; after it (also
    when the block raises) the caller's own count is back."""
    assert onednn.available()
    gomp = onednn._state["gomp"]
    own = gomp.omp_get_max_threads()
    seen = {}
    with onednn.openmp_threads(own + 2):
        other = threading.Thread(target=lambda: seen.update(other=gomp.omp_get_max_threads()))
        other.start()
        other.join()
        assert gomp.omp_get_max_threads() == own + 2
    assert gomp.omp_get_max_threads() == own and seen["other"] != own + 2
    with pytest.raises(KeyError):
        with onednn.openmp_threads(1):
            raise KeyError
    assert gomp.omp_get_max_threads() == own


@pytest.mark.cpu_only
@needs_onednn
def test_a_primitive_runs_on_the_openmp_count_it_was_made_for():
    """Made under one count, run under another: it records the count it was made for."""
    assert onednn.available()
    with onednn.openmp_threads(1):
        one = onednn.Reorder(onednn.Desc((1, 16, 2, 2)), onednn.Desc((1, 16, 2, 2)))
    with onednn.openmp_threads(3):
        three = onednn.Reorder(onednn.Desc((1, 16, 2, 2)), onednn.Desc((1, 16, 2, 2)))
    assert (one.primitive.threads, three.primitive.threads) == (1, 3)


# A fresh process (GNU OpenMP reads its environment once, when oneDNN's load brings it in): it
# says whether anything loaded oneDNN before its first convolution, whether os.environ and the C
# environment are as before, and how much CPU time the process spent while its main thread slept
# after the convolution: GNU OpenMP's idle threads spinning.
LOAD_AND_SLEEP = """
import ctypes, json, os, time
import numpy as np
import minidl
from minidl import ops, Tensor
from minidl.kernels.cpu import onednn
before = dict(os.environ)
minidl.set_num_threads(2)
maps = lambda: open("/proc/self/maps").read()
loaded_early = "libdnnl" in maps()
# One image on two threads: one chunk, on two OpenMP threads (GNU OpenMP's team, which spins)
x, w = Tensor(np.ones((1, 16, 16, 16), np.float32)), Tensor(np.ones((16, 16, 3, 3), np.float32))
with minidl.no_grad():
    ops.Conv2D(16, 3)(x, w).asnumpy()
assert "libdnnl" in maps()
cpu = time.process_time()
time.sleep(1.0)
cpu = time.process_time() - cpu
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
print(json.dumps({"loaded_early": loaded_early, "environ_unchanged": dict(os.environ) == before,
                  "c_getenv": (libc.getenv(b"GOMP_SPINCOUNT") or b"").decode(), "cpu_while_asleep": cpu}))
"""


def load_and_sleep(**environ):
    unset = ("GOMP_SPINCOUNT", "MINIDL_OMP_SPIN", "OMP_WAIT_POLICY")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    done = subprocess.run([sys.executable, "-c", LOAD_AND_SLEEP], env={**env, **environ}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.cpu_only
@needs_onednn
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="GNU OpenMP spins less with more threads than cores")
def test_loading_leaves_the_environment_and_the_spin_count_is_an_opt_in_that_holds():
    """By default nothing is written and GNU OpenMP's own spin count holds (300,000 spins, well under
    a millisecond); MINIDL_OMP_SPIN=n is GOMP_SPINCOUNT=n for the load only, and still governs
    libgomp after os.environ is restored: with 10^11 spins its idle thread spins through the sleep."""
    default = load_and_sleep()
    assert default == {**default, "loaded_early": False, "environ_unchanged": True, "c_getenv": ""}
    # 0.003 s and 0.07 s of CPU time in half a second's sleep on 2 cores with a load average of 7
    # (the spinning thread gets a share of a core; on an idle machine all of it): 1 s, 0.03 s apart.
    assert default["cpu_while_asleep"] < 0.03, default
    spinning = load_and_sleep(MINIDL_OMP_SPIN=str(10**11))
    assert spinning == {**spinning, "loaded_early": False, "environ_unchanged": True, "c_getenv": ""}
    assert spinning["cpu_while_asleep"] > 0.03, spinning
