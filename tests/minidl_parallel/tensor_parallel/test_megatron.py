"""A Megatron-style MLP block: column-parallel MatMul, ReLU, row-parallel MatMul.

Exactly one all-reduce in forward (the row-parallel partial sums) and one in backward (the
input gradient of the column-parallel MatMul), counted by CommCounter, and the results equal
one device's.
"""
import numpy as np
import pytest

import minidl
from minidl import nn, ops, Parameter, Tensor
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel import CommCounter
from minidl_parallel.tensor_parallel.dispatch import full_value, gather_like

B, D, H = 4, 8, 16


class MegatronMLP(nn.Cell):
    def __init__(self, w1, w2, t):
        super().__init__()
        self.w1 = Parameter(w1, name="w1")
        self.w2 = Parameter(w2, name="w2")
        self.column = ops.MatMul().shard(((1, 1), (1, t)))
        self.relu = ops.ReLU().shard(((1, t),))
        self.row = ops.MatMul().shard(((1, t), (t, 1)))

    def construct(self, x):
        return self.row(self.relu(self.column(x, self.w1)), self.w2)


def _arrays():
    rng = np.random.default_rng(3)
    return (rng.standard_normal((B, D)), rng.standard_normal((D, H)), rng.standard_normal((H, D)),
            rng.standard_normal((B, D)))


def _single():
    x, w1, w2, g = _arrays()
    net = MegatronMLP(w1, w2, 1)
    xt = Tensor(x, requires_grad=True)
    y = net(xt)
    y.backward(Tensor(g))
    return y.asnumpy(), xt.grad.asnumpy(), net.w1.grad.asnumpy(), net.w2.grad.asnumpy()


def _rank(mode):
    import minidl_parallel as mp
    x, w1, w2, g = _arrays()
    mp.set_auto_parallel_context(parallel_mode=mode, dataset_strategy="full_batch")
    net = MegatronMLP(w1, w2, mp.get_group_size())
    xt = Tensor(x, requires_grad=True)
    with CommCounter() as forward:
        y = net(xt)
    with CommCounter() as backward:
        y.backward(Tensor(g))
    out = (full_value(y), gather_like(xt.grad, xt), full_value_grad(net.w1), full_value_grad(net.w2))
    mp.reset_auto_parallel_context()
    return forward, backward, [np.array(minidl.backend.to_numpy(a)) for a in out], tuple(net.w1.data.shape)


def full_value_grad(param):
    return gather_like(param.grad, param)


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_megatron_block_one_allreduce_each_way_and_single_device_result(n, mode):
    ref = _single()
    for forward, backward, got, w1_block in run_threads(n, _rank, mode):
        assert forward.count() == 1 and forward.count("allreduce") == 1, forward.summary()
        assert backward.count() == 1 and backward.count("allreduce") == 1, backward.summary()
        # Analytical minimum: the block's output (B, D) in forward, the input gradient (B, D) in backward.
        ring = 2 * (n - 1) / n * B * D * 8
        assert forward.bytes() == int(ring) and backward.bytes() == int(ring)
        assert w1_block == (D, H // n)  # each rank holds its column block only
        for a, b, what in zip(got, ref, ("output", "input gradient", "w1 gradient", "w2 gradient")):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=what)


def test_megatron_without_input_gradient_needs_no_backward_collective():
    def body():
        import minidl_parallel as mp
        x, w1, w2, g = _arrays()
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
        net = MegatronMLP(w1, w2, mp.get_group_size())
        y = net(Tensor(x))
        with CommCounter() as backward:
            y.backward(Tensor(g))
        mp.reset_auto_parallel_context()
        return backward.count()
    assert run_threads(4, body) == [0, 0, 0, 0]
