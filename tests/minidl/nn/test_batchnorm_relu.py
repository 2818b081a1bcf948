"""BatchNorm2d.with_relu: the fused op where it applies, the separate ops elsewhere, the same results."""
import numpy as np
import pytest

import minidl
from minidl import nn, ops, Tensor
from minidl.runtime import Runtime


def _run(bn, x, residual, fused_call):
    tx = Tensor(x, requires_grad=True)
    tr = None if residual is None else Tensor(residual, requires_grad=True)
    y = bn.with_relu(tx, tr) if fused_call else ops.relu(bn(tx) if tr is None else bn(tx) + tr)
    y.backward(Tensor(np.cos(np.arange(y.data.size)).reshape(y.shape)))
    grads = [tx.grad.asnumpy(), bn.gamma.grad.asnumpy(), bn.beta.grad.asnumpy()]
    if tr is not None:
        grads.append(tr.grad.asnumpy())
    return y, grads


@pytest.mark.parametrize("layer, shape", [(nn.BatchNorm2d, (4, 3, 5, 5)), (nn.BatchNorm1d, (6, 3))])
@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("with_residual", [True, False])
def test_with_relu_equals_batchnorm_then_relu(layer, shape, train, with_residual):
    rng = np.random.default_rng(0)
    x, residual = rng.standard_normal(shape), rng.standard_normal(shape)
    residual = residual if with_residual else None
    results = []
    for fused_call in (True, False):
        bn = layer(3, moving_mean_init="ones", dtype=np.float64).set_train(train)
        bn.gamma.data[...] = minidl.backend.to_device(np.array([0.5, -1.0, 2.0]))  # to the tensors' device
        bn.beta.data[...] = minidl.backend.to_device(np.array([0.1, 0.0, -0.3]))
        y, grads = _run(bn, x, residual, fused_call)
        results.append((y, grads, bn.moving_mean.asnumpy(), bn.moving_variance.asnumpy()))
    (y_f, g_f, m_f, v_f), (y_s, g_s, m_s, v_s) = results
    assert isinstance(y_f._node, ops.BatchNormReLU)  # the fused op ran
    np.testing.assert_allclose(y_f.asnumpy(), y_s.asnumpy(), rtol=1e-12, atol=1e-12)
    for a, b in zip(g_f, g_s):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(m_f, m_s, rtol=1e-12)
    np.testing.assert_allclose(v_f, v_s, rtol=1e-12)


class _OwnOp(ops.BatchNorm):
    """A BatchNorm subclass, as SyncBatchNorm's op is: with_relu must not bypass it."""

    calls = 0

    def forward(self, *args):
        _OwnOp.calls += 1
        return super().forward(*args)


def test_a_layer_with_its_own_op_gets_the_separate_ops():
    bn = nn.BatchNorm2d(2).set_train(True)
    bn.bn_train = _OwnOp(True, bn.eps, 1.0 - bn.momentum)
    x = Tensor(np.random.default_rng(1).standard_normal((2, 2, 3, 3)).astype(np.float32), requires_grad=True)
    y = bn.with_relu(x)
    assert _OwnOp.calls == 1 and isinstance(y._node, ops.ReLU)


def test_an_active_runtime_sees_the_fused_op_as_one_call():
    seen = []

    class Seeing(Runtime):
        def call_op(self, primitive, args):
            seen.append(type(primitive).__name__)
            return primitive.apply(*args)

    bn = nn.BatchNorm2d(2).set_train(True)
    x = Tensor(np.ones((2, 2, 3, 3), np.float32))
    with Seeing():
        bn.with_relu(x, x)
    assert seen == ["BatchNormReLU"]  # a parallel runtime's sharding rule decides how to run it


def test_with_relu_checks_the_input_as_construct_does():
    with pytest.raises(ValueError, match=r"BatchNorm2d: input of shape \(2, 4, 3, 3\) must be \(N, C, H, W\) with "
                                         r"C = num_features = 3"):
        nn.BatchNorm2d(3).with_relu(Tensor(np.ones((2, 4, 3, 3), np.float32)))
