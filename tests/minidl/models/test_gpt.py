"""minidl.models.gpt: shapes, causality, tied weights, gradients by finite differences, sampling."""
import numpy as np
import pytest

import minidl
from minidl import Tensor, nn
from minidl.models.gpt import GPT


def _gpt(**kw):
    minidl.set_seed(0)
    args = dict(vocab_size=11, block_size=6, n_layer=2, n_head=2, n_embd=8, dtype=minidl.float64)
    args.update(kw)
    return GPT(**args)


def _tokens(n=2, t=5, seed=0):
    return np.random.default_rng(seed).integers(0, 11, (n, t)).astype(np.int32)


def test_logits_shape_and_the_future_never_changes_the_past():
    net = _gpt()
    x = _tokens()
    logits = net(Tensor(x)).asnumpy()
    assert logits.shape == (2, 5, 11) and logits.dtype == np.float64
    changed = x.copy()
    changed[:, 3:] = (changed[:, 3:] + 1) % 11  # change positions 3 and 4 only
    other = net(Tensor(changed)).asnumpy()
    np.testing.assert_allclose(other[:, :3], logits[:, :3], rtol=1e-12, atol=1e-14)
    assert np.abs(other[:, 3:] - logits[:, 3:]).max() > 1e-6


def test_tied_head_shares_the_embedding_table():
    tied, untied = _gpt(), _gpt(tie_weights=False)
    names = [p.name for p in tied.trainable_params()]
    assert "wte.embedding_table" in names and not any("lm_head" in n for n in names)
    assert len(untied.trainable_params()) == len(tied.trainable_params()) + 1
    assert sum(p.size for p in untied.trainable_params()) - sum(p.size for p in tied.trainable_params()) == 11 * 8


@pytest.mark.parametrize("tie", [True, False])
def test_parameter_gradients_match_finite_differences(tie):
    net = _gpt(tie_weights=tie)
    x, y = Tensor(_tokens()), Tensor(_tokens(seed=1))
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")

    def loss():
        return loss_fn(net(x).reshape(-1, 11), y.reshape(-1))

    params = net.trainable_params()
    grads = minidl.value_and_grad(loss, None, params)()[1]
    rng = np.random.default_rng(2)
    for p, g in zip(params, grads):
        idx = tuple(rng.integers(0, s) for s in p.shape)
        w = p.data.copy()
        eps = 1e-6
        p.data[idx] = w[idx] + eps
        plus = float(loss().asnumpy())
        p.data[idx] = w[idx] - eps
        minus = float(loss().asnumpy())
        p.data[...] = w
        np.testing.assert_allclose(g.asnumpy()[idx], (plus - minus) / (2 * eps), rtol=1e-5, atol=1e-8,
                                   err_msg=p.name)


def test_a_few_adam_steps_lower_the_loss():
    net = _gpt(dtype=minidl.float32)
    loss_fn = nn.CrossEntropyLoss()
    opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    x, y = Tensor(_tokens()), Tensor(_tokens(seed=1))
    grad_fn = minidl.value_and_grad(lambda: loss_fn(net(x).reshape(-1, 11), y.reshape(-1)), None, opt.parameters)
    losses = []
    for _ in range(15):
        loss, grads = grad_fn()
        opt(grads)
        losses.append(float(loss.asnumpy()))
    assert losses[-1] < 0.5 * losses[0], losses


def test_generate_repeats_with_the_seed_and_respects_the_context():
    net = _gpt()
    prompt = _tokens(1, 3)
    minidl.set_seed(7)
    a = net.generate(Tensor(prompt), 8, top_k=3)
    minidl.set_seed(7)
    b = net.generate(Tensor(prompt), 8, top_k=3)
    assert a.shape == (1, 11) and (a == b).all() and (a[:, :3] == prompt).all()
    assert ((a >= 0) & (a < 11)).all()
    assert net.training is False


def test_errors_name_what_was_wrong():
    net = _gpt()
    with pytest.raises(ValueError, match="a sequence of 7 tokens is longer than block_size=6"):
        net(Tensor(_tokens(1, 7)))
    with pytest.raises(ValueError, match=r"tokens must be \(batch, time\), got shape \(5,\)"):
        net(Tensor(_tokens(1, 5)[0]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        net.generate(Tensor(_tokens(1, 2)), 1, temperature=0)
