"""Conv2D's Winograd F(2x2, 3x3) path: values and gradients equal to the im2col path and to
finite differences, float32 accuracy, chunks and threads, and when it applies."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl
from minidl import ops
from minidl.ops import winograd
from minidl.testing import check_op
from minidl.testing.strategies import arrays

from test_conv import ref_conv  # noqa: E402  (pytest puts this folder on sys.path)

# Winograd is a NumPy kernel (winograd.applies() requires xp is numpy): on the GPU conv uses im2col.
pytestmark = pytest.mark.cpu_only


@pytest.fixture
def on(monkeypatch):
    """The Winograd path for every 3x3 stride-1 conv, whatever its channels."""
    monkeypatch.setattr(winograd, "ENABLED", True)
    monkeypatch.setattr(winograd, "MIN_CHANNELS", 1)


def conv_both_ways(x, w, pads, monkeypatch):
    """(y, gx, gw) by Winograd and by im2col for the same loss gradient."""
    gy = np.random.default_rng(1).standard_normal((x.shape[0], w.shape[0], x.shape[2] + pads[0] + pads[1] - 2,
                                                   x.shape[3] + pads[2] + pads[3] - 2)).astype(x.dtype)
    out = []
    for enabled in (True, False):
        monkeypatch.setattr(winograd, "ENABLED", enabled)
        op = ops.Conv2D(w.shape[0], 3, pad_mode="pad", pad=pads)
        op.needs_grad = (True, True)
        y = op.forward(x, w)
        assert (op.wino is not None) == enabled
        out.append((y,) + tuple(op.backward(gy)))
    return out


@st.composite
def cases(draw):
    pads = tuple(draw(st.integers(0, 2)) for _ in range(4))
    h = draw(st.integers(max(1, 3 - pads[0] - pads[1]), 7))
    w = draw(st.integers(max(1, 3 - pads[2] - pads[3]), 7))
    n, c, o = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return draw(arrays((n, c, h, w))), draw(arrays((o, c, 3, 3))), pads


@given(case=cases())
def test_equals_im2col_float64(case):
    """Odd and even sizes, every padding 0-2: values and both gradients as im2col's to rounding."""
    x, w, pads = case
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(winograd, "MIN_CHANNELS", 1)
        wino, ref = conv_both_ways(x, w, pads, mp)
    for a, b, what in zip(wino, ref, ("y", "gx", "gw")):
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * scale, err_msg=what)


@settings(max_examples=10)
@given(case=cases())
def test_reference_and_finite_differences(case):
    """Through the op harness: forward vs the loop reference, backward vs central differences."""
    x, w, pads = case
    op = ops.Conv2D(w.shape[0], 3, pad_mode="pad", pad=pads)
    calls = []
    forward = winograd.Winograd3x3.forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(winograd, "ENABLED", True)
        mp.setattr(winograd, "MIN_CHANNELS", 1)
        mp.setattr(winograd.Winograd3x3, "forward", lambda self, *a: calls.append(1) or forward(self, *a))
        check_op(op, [x, w], reference=lambda x, w: ref_conv(x, w, pads=pads))
    assert calls


def test_float32_as_accurate_as_im2col(monkeypatch):
    """The ResNet-20 32-channel shape in float32: error against float64 no worse than im2col's."""
    rng = np.random.default_rng(3)
    x, w = rng.standard_normal((4, 32, 16, 16)), rng.standard_normal((32, 32, 3, 3))
    monkeypatch.setattr(winograd, "MIN_CHANNELS", 1)
    exact = conv_both_ways(x, w, (1, 1, 1, 1), monkeypatch)[1]
    wino, im2col = conv_both_ways(x.astype(np.float32), w.astype(np.float32), (1, 1, 1, 1), monkeypatch)
    for a, b, e, what in zip(wino, im2col, exact, ("y", "gx", "gw")):
        assert a.dtype == np.float32
        err_wino, err_im2col = np.abs(a - e).max(), np.abs(b - e).max()
        assert err_wino <= 2 * err_im2col + 1e-6 * np.abs(e).max(), (what, err_wino, err_im2col)


@pytest.mark.parametrize("threads, chunk_bytes", [(1, 1), (3, 1), (2, 1 << 30)])
def test_chunks_and_threads_equal_one_chunk(threads, chunk_bytes, on, monkeypatch):
    """One tile row per chunk on 1 or 3 threads (uneven rounds), or one chunk per thread: the
    same values and gradients as one chunk on one thread, to rounding."""
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal((3, 4, 11, 6)), rng.standard_normal((5, 4, 3, 3))
    gy = rng.standard_normal((3, 5, 11, 6))

    def run():
        op = ops.Conv2D(5, 3, pad_mode="same")
        op.needs_grad = (True, True)
        return (op.forward(x, w),) + op.backward(gy)
    before = minidl.get_num_threads()
    try:
        minidl.set_num_threads(1)
        monkeypatch.setattr(winograd, "_CHUNK_BYTES", 1 << 30)
        expected = run()
        minidl.set_num_threads(threads)
        monkeypatch.setattr(winograd, "_CHUNK_BYTES", chunk_bytes)
        got = run()
    finally:
        minidl.set_num_threads(before)
    for a, b in zip(got, expected):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * np.abs(b).max())


def test_only_one_gradient(on):
    """A first layer needs no input gradient, a frozen weight no weight gradient."""
    rng = np.random.default_rng(2)
    x, w, gy = rng.standard_normal((2, 3, 5, 5)), rng.standard_normal((2, 3, 3, 3)), rng.standard_normal((2, 2, 5, 5))
    full = ops.Conv2D(2, 3, pad_mode="same")
    full.needs_grad = (True, True)
    full.forward(x, w)
    gx, gw = full.backward(gy)
    for needs, want in (((False, True), (None, gw)), ((True, False), (gx, None))):
        op = ops.Conv2D(2, 3, pad_mode="same")
        op.needs_grad = needs
        op.forward(x, w)
        for a, b in zip(op.backward(gy), want):
            assert (a is None) == (b is None)
            if b is not None:
                np.testing.assert_array_equal(a, b)


def test_resnet_block_trains_the_same(on):
    """A ResNet-20 basic block, float64: the loss and every parameter gradient equal im2col's."""
    from minidl.models.resnet import BasicBlock
    from minidl import Tensor, nn
    rng = np.random.default_rng(4)
    x = Tensor(rng.standard_normal((2, 4, 6, 6)))

    def grads():
        minidl.set_seed(0)
        block = BasicBlock(4, 4)
        for p in block.trainable_params():
            p.data = p.data.astype(np.float64)
        fn = minidl.value_and_grad(lambda x: (block(x) ** 2).sum(), None, block.trainable_params())
        loss, gs = fn(x)
        return [loss.asnumpy()] + [g.asnumpy() for g in gs]
    wino = grads()
    winograd.ENABLED = False
    ref = grads()
    assert len(wino) == len(ref) > 1
    for a, b in zip(wino, ref):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-11)


@pytest.mark.parametrize("kwargs, x_shape, dtype", [
    (dict(stride=2), (1, 2, 6, 6), np.float64),
    (dict(dilation=2), (1, 2, 6, 6), np.float64),
    (dict(group=2), (1, 2, 6, 6), np.float64),
    (dict(pad_mode="pad", pad=3), (1, 2, 6, 6), np.float64),
    (dict(), (1, 2, 6, 6), np.float16),
])
def test_other_convs_stay_on_im2col(kwargs, x_shape, dtype, on):
    op = ops.Conv2D(2, 3, **kwargs)
    x = np.ones(x_shape, dtype)
    op.forward(x, np.ones((2, 2 // kwargs.get("group", 1), 3, 3), dtype))
    assert op.wino is None


@pytest.mark.parametrize("env, expected", [(None, "False"), ("0", "False"), ("1", "True")])
def test_off_unless_asked(env, expected):
    """MINIDL_WINOGRAD=1 turns the path on at import; unset or anything else leaves it off."""
    import os
    import subprocess
    import sys
    environ = {k: v for k, v in os.environ.items() if k != "MINIDL_WINOGRAD"}
    if env is not None:
        environ["MINIDL_WINOGRAD"] = env
    out = subprocess.run([sys.executable, "-c", "from minidl.ops import winograd; print(winograd.ENABLED)"],
                         env=environ, capture_output=True, text=True, check=True).stdout.strip()
    assert out == expected


def test_channel_floor(monkeypatch):
    """When on, convs with fewer than MIN_CHANNELS channels in or out stay on im2col."""
    monkeypatch.setattr(winograd, "ENABLED", True)
    assert winograd.applies(np, np.float32, (3, 3), (1, 1), (1, 1), 1, (1,) * 4, (32, 64))
    assert not winograd.applies(np, np.float32, (3, 3), (1, 1), (1, 1), 1, (1,) * 4, (16, 64))
    assert not winograd.applies(np, np.float32, (3, 3), (1, 1), (1, 1), 1, (1,) * 4, (64, 16))
