"""Transformer layers: GELU, LeakyReLU, SiLU, LayerNorm, GroupNorm, Embedding (MindSpore's arguments and
defaults, parameters, gradients, errors)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Tensor, nn, ops
from minidl.nn.layers.activation import get_activation
from minidl.testing import check_op
from minidl.testing.strategies import arrays


def test_activation_cells_use_mindspore_defaults():
    x = Tensor(np.array([-2.0, -0.5, 1.0]))
    np.testing.assert_allclose(nn.GELU()(x).asnumpy(), ops.gelu(x, "tanh").asnumpy())  # approximate=True
    np.testing.assert_allclose(nn.GELU(approximate=False)(x).asnumpy(), ops.gelu(x).asnumpy())
    np.testing.assert_allclose(nn.LeakyReLU()(x).asnumpy(), [-0.4, -0.1, 1.0])       # alpha=0.2
    np.testing.assert_allclose(nn.LeakyReLU(alpha=0.01)(x).asnumpy(), [-0.02, -0.005, 1.0])
    np.testing.assert_allclose(nn.SiLU()(x).asnumpy(), x.asnumpy() / (1 + np.exp(-x.asnumpy())), rtol=1e-12)
    assert repr(nn.GELU()) == "GELU(approximate=True)" and repr(nn.LeakyReLU()) == "LeakyReLU(alpha=0.2)"
    for name, cls in (("gelu", nn.GELU), ("leakyrelu", nn.LeakyReLU), ("SiLU", nn.SiLU)):
        assert type(get_activation(name)) is cls
    assert isinstance(nn.Dense(3, 2, activation="gelu").activation, nn.GELU)
    with pytest.raises(TypeError, match=r"GELU: approximate must be a bool, got 'tanh'"):
        nn.GELU("tanh")


@given(shape=st.sampled_from([(2, 5), (2, 3, 4)]), seed=st.integers(0, 2**16))
def test_layer_norm_cell(shape, seed):
    rng = np.random.default_rng(seed)
    ln = nn.LayerNorm((shape[-1],), dtype=minidl.float64)
    ln.gamma.set_data(rng.random(shape[-1]) + 0.5)
    ln.beta.set_data(rng.standard_normal(shape[-1]))
    x = rng.standard_normal(shape)

    def ref(x):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-7) * ln.gamma.asnumpy() + ln.beta.asnumpy()
    check_op(ln, [x], reference=ref, fwd_rtol=1e-9, fwd_atol=1e-10, rtol=1e-4)
    xt = Tensor(x)
    (ln(xt) * Tensor(rng.standard_normal(shape))).sum().backward()
    assert ln.gamma.grad.shape == ln.beta.grad.shape == (shape[-1],)


def test_layer_norm_cell_arguments():
    ln = nn.LayerNorm((4,))
    assert [p.name for p in ln.trainable_params()] == ["gamma", "beta"]  # MindSpore's names
    assert ln.epsilon == 1e-7 and ln.gamma.dtype == np.float32  # MindSpore's epsilon (PyTorch: 1e-5)
    np.testing.assert_array_equal(ln.gamma.asnumpy(), 1.0)
    np.testing.assert_array_equal(ln.beta.asnumpy(), 0.0)
    ln = nn.LayerNorm((3, 4), begin_norm_axis=1, begin_params_axis=1, epsilon=1e-5, dtype=minidl.float64)
    x = np.random.default_rng(0).standard_normal((2, 3, 4))
    want = (x - x.mean((1, 2), keepdims=True)) / np.sqrt(x.var((1, 2), keepdims=True) + 1e-5)
    np.testing.assert_allclose(ln(Tensor(x)).asnumpy(), want, rtol=1e-10)
    assert "normalized_shape=(3, 4), begin_norm_axis=1" in repr(ln)
    with pytest.raises(ValueError, match=r"LayerNorm: gamma of shape \(3, 4\) must be \(4,\)"):
        nn.LayerNorm((3, 4))(Tensor(x))
    with pytest.raises(TypeError, match=r"LayerNorm: normalized_shape must be a non-empty tuple or list"):
        nn.LayerNorm(None)
    with pytest.raises(ValueError, match=r"LayerNorm: every entry of normalized_shape must be a positive int"):
        nn.LayerNorm((0,))


@pytest.mark.cpu_only
def test_layer_norm_cell_matches_torch():
    torch = pytest.importorskip("torch", reason="the cross-check needs PyTorch: pip install -e '.[bench]'")
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((2, 3, 6)), rng.standard_normal(6), rng.standard_normal(6)
    ln = nn.LayerNorm((6,), gamma_init=Tensor(w), beta_init=Tensor(b), epsilon=1e-5, dtype=minidl.float64)
    tl = torch.nn.LayerNorm(6, eps=1e-5, dtype=torch.float64)
    with torch.no_grad():
        tl.weight.copy_(torch.tensor(w))
        tl.bias.copy_(torch.tensor(b))
    xt, tx = Tensor(x, requires_grad=True), torch.tensor(x, requires_grad=True)
    g = rng.standard_normal(x.shape)
    y, ty = ln(xt), tl(tx)
    np.testing.assert_allclose(y.asnumpy(), ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    (y * Tensor(g)).sum().backward()
    (ty * torch.tensor(g)).sum().backward()
    for mine, ref in ((xt.grad, tx.grad), (ln.gamma.grad, tl.weight.grad), (ln.beta.grad, tl.bias.grad)):
        np.testing.assert_allclose(mine.asnumpy(), ref.numpy(), rtol=1e-9, atol=1e-12)


def test_group_norm_cell():
    rng = np.random.default_rng(2)
    gn = nn.GroupNorm(2, 4, dtype=minidl.float64)
    assert [p.name for p in gn.trainable_params()] == ["gamma", "beta"] and gn.eps == 1e-5
    x = rng.standard_normal((3, 4, 2, 2))
    check_op(gn, [x], reference=lambda x: ops.group_norm(Tensor(x), 2).asnumpy(), rtol=1e-4)
    frozen = nn.GroupNorm(1, 2, affine=False)
    assert frozen.trainable_params() == [] and "affine=False" in repr(frozen)
    with pytest.raises(ValueError, match=r"GroupNorm: num_channels=6 must be divisible by num_groups=4"):
        nn.GroupNorm(4, 6)
    with pytest.raises(ValueError, match=r"GroupNorm: input of shape \(3, 2\) must be \(N, C, ...\) with C = "
                                         r"num_channels = 4"):
        gn(Tensor(np.ones((3, 2))))


def test_embedding_defaults_follow_mindspore():
    minidl.set_seed(0)
    emb = nn.Embedding(2000, 32)
    table = emb.embedding_table
    assert table.name == "embedding_table" and table.shape == (2000, 32) and table.dtype == np.float32
    assert abs(table.asnumpy().std() - 0.01) < 5e-4  # 'normal': N(0, 0.01^2), MindSpore's (PyTorch: N(0, 1))
    assert (emb.use_one_hot, emb.padding_idx) == (False, None)
    ids = np.array([[3, 1999, 3], [0, 5, -1]], np.int32)
    y = emb(Tensor(ids))
    assert y.shape == (2, 3, 32) and y.dtype == np.float32
    np.testing.assert_array_equal(y.asnumpy(), table.asnumpy()[ids])


@given(use_one_hot=st.booleans(), ids=arrays((2, 3), 0, 5).map(lambda a: a.astype(np.int64)))
def test_embedding_gradient_adds_up_repeated_ids(use_one_hot, ids):
    emb = nn.Embedding(6, 4, use_one_hot=use_one_hot, dtype=minidl.float64)
    g = np.random.default_rng(0).standard_normal((2, 3, 4))
    y = emb(Tensor(ids))
    np.testing.assert_allclose(y.asnumpy(), emb.embedding_table.asnumpy()[ids], rtol=1e-15)
    (y * Tensor(g)).sum().backward()
    want = np.zeros((6, 4))
    np.add.at(want, ids, g)
    np.testing.assert_allclose(emb.embedding_table.grad.asnumpy(), want, rtol=1e-12)


@pytest.mark.parametrize("use_one_hot", [False, True])
def test_embedding_padding_idx_row_is_zero_and_gets_no_gradient(use_one_hot):
    emb = nn.Embedding(5, 3, use_one_hot=use_one_hot, padding_idx=2)
    np.testing.assert_array_equal(emb.embedding_table.asnumpy()[2], 0.0)
    assert emb.embedding_table.asnumpy()[[0, 1, 3, 4]].any()
    y = emb(Tensor(np.array([[2, 1, 2, 4]])))
    np.testing.assert_array_equal(y.asnumpy()[0, [0, 2]], 0.0)
    y.sum().backward()
    grad = emb.embedding_table.grad.asnumpy()
    np.testing.assert_array_equal(grad[[2, 0, 3]], 0.0)
    np.testing.assert_array_equal(grad[[1, 4]], 1.0)
    assert "padding_idx=2" in repr(emb)


def test_embedding_errors(monkeypatch):
    monkeypatch.setenv("MINIDL_CHECK_LABELS", "1")  # the device-pinned suite checks on the host too
    with pytest.raises(ValueError, match=r"Embedding: padding_idx must be None or an int in \[0, 5\), got 5"):
        nn.Embedding(5, 3, padding_idx=5)
    with pytest.raises(ValueError, match=r"Embedding: vocab_size must be a positive int, got 0"):
        nn.Embedding(0, 3)
    with pytest.raises(TypeError, match=r"Embedding: use_one_hot must be a bool, got 1"):
        nn.Embedding(5, 3, use_one_hot=1)
    with pytest.raises(ValueError, match=r"Embedding: embedding_table has shape \(4, 3\), expected \(5, 3\)"):
        nn.Embedding(5, 3, embedding_table=Tensor(np.zeros((4, 3))))
    emb = nn.Embedding(5, 3)
    with pytest.raises(TypeError, match=r"Embedding: ids must be integers, got dtype float64"):
        emb(Tensor(np.array([1.0])))
    with pytest.raises(ValueError, match=r"Gather: index 5 is out of range"):
        emb(Tensor(np.array([5])))
