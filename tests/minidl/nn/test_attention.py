"""nn.MultiheadAttention: against a NumPy reference (and PyTorch's module when installed), masks,
layouts, finite-difference gradients, errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Tensor, nn
from minidl.testing import check_backward

rng = np.random.default_rng(0)


def _attention(E=8, H=2, **kw):
    minidl.set_seed(1)
    m = nn.MultiheadAttention(E, H, dtype=minidl.float64, **kw)
    # non-zero biases, so that a bias in the wrong place shows
    for proj in (m.q_proj, m.k_proj, m.v_proj):
        proj.bias.set_data(Tensor(np.random.default_rng(2).standard_normal(E)))
    return m


def _np_reference(m, q, k, v, mask=None, batch_first=False):
    """Multi-head attention written out in NumPy: (L, N, E) inputs unless batch_first; ``mask`` additive
    (N, H, L, S)."""
    if not batch_first:
        q, k, v = (a.transpose(1, 0, 2) for a in (q, k, v))
    H, D = m.num_heads, m.head_dim

    def proj(dense, x):
        return x @ dense.weight.asnumpy().T + dense.bias.asnumpy()

    def heads(x):
        n, length, _ = x.shape
        return x.reshape(n, length, H, D).transpose(0, 2, 1, 3)

    qh, kh, vh = heads(proj(m.q_proj, q)), heads(proj(m.k_proj, k)), heads(proj(m.v_proj, v))
    s = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(D)
    if mask is not None:
        s = s + mask
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = (p @ vh).transpose(0, 2, 1, 3).reshape(q.shape[0], q.shape[1], -1)
    o = proj(m.out_proj, o)
    return (o if batch_first else o.transpose(1, 0, 2)), p


@given(n=st.integers(1, 3), tgt=st.integers(1, 4), src=st.integers(1, 4), heads=st.sampled_from([1, 2, 4]),
       batch_first=st.booleans(), causal=st.booleans())
def test_matches_the_numpy_reference(n, tgt, src, heads, batch_first, causal):
    m = _attention(8, heads, batch_first=batch_first)
    shape = (n, tgt, 8) if batch_first else (tgt, n, 8)
    kv_shape = (n, src, 8) if batch_first else (src, n, 8)
    q, k, v = rng.standard_normal(shape), rng.standard_normal(kv_shape), rng.standard_normal(kv_shape)
    bool_mask = np.triu(np.ones((tgt, src), bool), 1) if causal else np.zeros((tgt, src), bool)
    out, weights = m(Tensor(q), Tensor(k), Tensor(v), attn_mask=Tensor(bool_mask))
    ref, p = _np_reference(m, q, k, v, np.where(bool_mask, -np.inf, 0.0), batch_first)
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(weights.asnumpy(), p.mean(axis=1), rtol=1e-10, atol=1e-12)
    assert out.shape == shape and weights.shape == (n, tgt, src)


def test_padding_float_and_per_head_masks_combine():
    m = _attention(8, 2, batch_first=True)
    x, kv = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 4, 8))
    padding = np.array([[False, False, True, True], [False, False, False, True]])
    per_head = rng.standard_normal((2 * 2, 3, 4))
    out, w = m(Tensor(x), Tensor(kv), Tensor(kv), key_padding_mask=Tensor(padding), attn_mask=Tensor(per_head),
               average_attn_weights=False)
    mask = per_head.reshape(2, 2, 3, 4) + np.where(padding, -np.inf, 0.0)[:, None, None, :]
    ref, p = _np_reference(m, x, kv, kv, mask, batch_first=True)
    np.testing.assert_allclose(out.asnumpy(), ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w.asnumpy(), p, rtol=1e-10, atol=1e-12)
    assert (w.asnumpy()[0, :, :, 2:] == 0).all()  # padded keys get no weight


def test_need_weights_false_returns_a_one_tuple_and_unbatched_inputs_work():
    m = _attention(8, 2)
    x = rng.standard_normal((5, 8))
    res = m(Tensor(x), Tensor(x), Tensor(x), need_weights=False)
    assert isinstance(res, tuple) and len(res) == 1  # MindSpore's convention (PyTorch: (out, None))
    batched = m(Tensor(x[:, None]), Tensor(x[:, None]), Tensor(x[:, None]))
    out, w = m(Tensor(x), Tensor(x), Tensor(x))
    np.testing.assert_allclose(res[0].asnumpy(), batched[0].asnumpy()[:, 0], rtol=1e-12)
    np.testing.assert_allclose(out.asnumpy(), batched[0].asnumpy()[:, 0], rtol=1e-12)
    np.testing.assert_allclose(w.asnumpy(), batched[1].asnumpy()[0], rtol=1e-12)


def test_gradients_match_finite_differences():
    m = _attention(4, 2, batch_first=True)
    causal = Tensor(np.triu(np.ones((3, 3), bool), 1))

    def f(q, k, v):
        return m(q, k, v, attn_mask=causal, need_weights=False)[0]

    check_backward(f, [rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4)),
                       rng.standard_normal((2, 3, 4))])
    x = Tensor(rng.standard_normal((2, 3, 4)))
    f(x, x, x).sum().backward()
    for p in m.trainable_params():
        assert p.grad is not None and np.isfinite(p.grad.asnumpy()).all(), p.name


def test_kdim_vdim_and_float32():
    minidl.set_seed(0)
    m = nn.MultiheadAttention(8, 4, kdim=6, vdim=5, batch_first=True)
    q = Tensor(rng.standard_normal((2, 3, 8)).astype(np.float32))
    k = Tensor(rng.standard_normal((2, 7, 6)).astype(np.float32))
    v = Tensor(rng.standard_normal((2, 7, 5)).astype(np.float32))
    out, w = m(q, k, v)
    assert out.dtype == np.float32 and out.shape == (2, 3, 8) and w.shape == (2, 3, 7)
    np.testing.assert_allclose(w.asnumpy().sum(-1), 1.0, rtol=1e-5)


def test_dropout_applies_in_training_only():
    minidl.set_seed(3)
    m = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True, dtype=minidl.float64)
    x = Tensor(rng.standard_normal((2, 6, 8)))
    eval_w = m(x, x, x, average_attn_weights=False)[1].asnumpy()
    m.set_train(True)
    train_w = m(x, x, x, average_attn_weights=False)[1].asnumpy()
    kept = train_w != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(train_w[kept], 2 * eval_w[kept], rtol=1e-12)


@pytest.mark.parametrize("make, match", [
    (lambda: nn.MultiheadAttention(10, 4), r"embed_dim \(10\) must be divisible by num_heads \(4\)"),
    (lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True), "add_bias_kv and add_zero_attn are not supported"),
])
def test_bad_configurations(make, match):
    with pytest.raises((ValueError, NotImplementedError), match=match):
        make()


def test_bad_inputs_name_what_was_wrong():
    m = _attention(8, 2, batch_first=True)
    x = Tensor(rng.standard_normal((2, 3, 8)))
    with pytest.raises(ValueError, match=r"key has 6 features, expected 8"):
        m(x, Tensor(np.ones((2, 3, 6))), x)
    with pytest.raises(ValueError, match=r"attn_mask must have shape \(3, 3\) or \(4, 3, 3\), got \(3, 4\)"):
        m(x, x, x, attn_mask=Tensor(np.zeros((3, 4), bool)))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(2, 3\), got \(3,\)"):
        m(x, x, x, key_padding_mask=Tensor(np.zeros(3, bool)))
    with pytest.raises(TypeError, match="attn_mask must be bool or float, got dtype int64"):
        m(x, x, x, attn_mask=Tensor(np.zeros((3, 3), np.int64)))


@pytest.mark.cpu_only
def test_equals_pytorch_with_the_same_weights():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    m = _attention(8, 2)
    t = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64)
    with torch.no_grad():  # PyTorch's fused in_proj holds minidl's q, k, v projections stacked
        t.in_proj_weight.copy_(torch.tensor(np.concatenate([p.weight.asnumpy() for p in (m.q_proj, m.k_proj, m.v_proj)])))
        t.in_proj_bias.copy_(torch.tensor(np.concatenate([p.bias.asnumpy() for p in (m.q_proj, m.k_proj, m.v_proj)])))
        t.out_proj.weight.copy_(torch.tensor(m.out_proj.weight.asnumpy()))
        t.out_proj.bias.copy_(torch.tensor(m.out_proj.bias.asnumpy()))
    x = rng.standard_normal((5, 3, 8))
    padding = np.zeros((3, 5), bool)
    padding[1, 3:] = True
    causal = np.triu(np.ones((5, 5), bool), 1)
    out, w = m(Tensor(x), Tensor(x), Tensor(x), attn_mask=Tensor(causal), key_padding_mask=Tensor(padding))
    to, tw = t(*(torch.tensor(x),) * 3, attn_mask=torch.tensor(causal), key_padding_mask=torch.tensor(padding))
    np.testing.assert_allclose(out.asnumpy(), to.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w.asnumpy(), tw.detach().numpy(), rtol=1e-10, atol=1e-12)
