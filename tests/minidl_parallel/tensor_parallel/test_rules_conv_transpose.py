"""Sharding rules of Conv2DTranspose, and of pooling with padding / ceil_mode (rules/conv.py).

Layouts and refusals on their own; every rank's block by ``simulate`` (test_rules.py); and a
small upsampling network (Conv2dTranspose with bias, padded ceil-mode MaxPool, AvgPool that
does not count its padding, MaxPool's indices) run through the dispatcher on thread-ranks,
its gathered output and gradients compared with one device in float64.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Tensor, nn, ops
from minidl.ops import MaxPoolIndices
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel.dispatch import full_value, gather_like
from minidl_parallel.tensor_parallel.rules import StrategyError, get_rule

from test_rules import infer, layouts_of, simulate, spec

F64 = minidl.float64
DOUT, W = spec((4, 6, 3, 3)), spec((6, 4, 3, 3), True)
SIZE = (4, 4, 6, 6)  # stride 2, pad 1 (+1 output row/column): (3 - 1) * 2 - 2 + 3 + 1 = 6


def up(group=1, out_channel=6):
    return ops.Conv2DTranspose(out_channel, 3, pad_mode="pad", pad=1, stride=2, group=group)


def host(array):
    """A NumPy copy of a gathered value, from either array module (the suite also runs pinned to the GPU)."""
    return np.array(minidl.backend.to_numpy(array))


# ---- layouts, refusals, defaults -----------------------------------------------------------------

def test_conv_transpose_layouts_sum_over_the_cut_input_channels():
    sh = infer(up(), (DOUT, W, SIZE), ((2, 2, 1, 1), (2, 2, 1, 1)), 8)
    assert layouts_of(sh) == (["(a, b, -, -) on [2, 2, 2]", "(b, c, -, -) on [2, 2, 2]"],
                              "(a, c, -, -) on [2, 2, 2] +sum(b)", ())
    assert sh.local_attrs == {"out_channel": 3}
    d, w = np.zeros((2, 3, 3, 3)), np.zeros((3, 2, 3, 3))
    assert sh.localize((0, 1, 1), (d, w, SIZE)) == (d, w, (2, 2, 6, 6))
    sh = infer(up(), (DOUT, W, SIZE), ((1, 1, 1, 1), (1, 2, 1, 1)), 4)  # output channels only, repeated twice
    assert layouts_of(sh) == (["(-, -, -, -) on [2, 1, 1, 2]", "(-, d, -, -) on [2, 1, 1, 2]"],
                              "(-, d, -, -) on [2, 1, 1, 2]", (0,))
    assert sh.local_attrs is None


@pytest.mark.parametrize("prim, strategy, match", [
    (up(), ((1, 1, 3, 1), (1, 1, 1, 1)), "dout's strategy cuts H by 3 and W by 1"),
    (up(), ((1, 1, 1, 1), (1, 1, 3, 1)), r"w's strategy cuts the kernel \(3, 1\)"),
    (up(), ((1, 2, 1, 1), (3, 1, 1, 1)), "the summed channels are cut 2 in dout .* but 3 in w"),
    (up(group=2), ((1, 1, 1, 1), (1, 2, 1, 1)), r"channel cuts of a grouped transposed convolution \(group=2\)"),
])
def test_conv_transpose_refusals(prim, strategy, match):
    w = spec((6, 2, 3, 3), True) if prim.group == 2 else W
    with pytest.raises(StrategyError, match=match):
        infer(prim, (DOUT, w, SIZE), strategy, 6)


def test_conv_transpose_default_and_propagated_strategies():
    rule = get_rule(up())
    assert rule.data_parallel(up(), (DOUT, W, SIZE), 8) == ((4, 1, 1, 1), (1, 1, 1, 1))
    sh = infer(up(), (DOUT, W, SIZE), ((2, 2, 1, 1), (2, 1, 1, 1)), 4)
    assert rule.propagate(up(), (DOUT, W, SIZE), (sh.in_layouts[0], sh.in_layouts[1]), 4) == \
        ((2, 2, 1, 1), (2, 1, 1, 1))


def test_padded_pools_and_indices_keep_h_and_w_whole():
    for prim in (ops.MaxPool(3, 2, "pad", pad=1, ceil_mode=True), ops.AvgPool(3, 2, "pad", pad=1),
                 MaxPoolIndices(3, 2, "pad", pad=1)):
        sh = infer(prim, (spec((4, 6, 5, 5)),), ((2, 3, 1, 1),), 6)
        assert layouts_of(sh) == (["(a, b, -, -) on [2, 3]"], "(a, b, -, -) on [2, 3]", ())
        with pytest.raises(StrategyError, match="a cut on H or W is not supported"):
            infer(prim, (spec((4, 6, 6, 6)),), ((1, 1, 2, 1),), 2)


# ---- every rank's block, simulated -------------------------------------------------------------

def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@given(data=st.data(), device_num=st.sampled_from([1, 2, 4, 6, 8]))
def test_conv_transpose_and_padded_pool_blocks_reassemble(data, device_num):
    rng = np.random.default_rng(0)
    dout, w = rng.standard_normal((4, 6, 3, 3)), rng.standard_normal((6, 4, 3, 3))
    n = data.draw(st.sampled_from([c for c in divisors(device_num) if 4 % c == 0]))
    o = data.draw(st.sampled_from([c for c in divisors(device_num // n) if 6 % c == 0]))
    c = data.draw(st.sampled_from([c for c in divisors(device_num // (n * o)) if 4 % c == 0]))
    simulate(up(), [dout, w, SIZE], (0, 1), ((n, o, 1, 1), (o, c, 1, 1)), device_num)
    same = ops.Conv2DTranspose(6, 3, pad_mode="same", stride=2, group=2)
    simulate(same, [dout, rng.standard_normal((6, 2, 3, 3)), (4, 4, 6, 6)], (0, 1), ((n, 1, 1, 1), (1, 1, 1, 1)),
             device_num)
    x = rng.permutation(4 * 6 * 5 * 5).reshape(4, 6, 5, 5) / 10.0  # distinct: no ties for MaxPool
    s = ((n, o, 1, 1),)
    simulate(ops.MaxPool(3, 2, "pad", pad=1, dilation=(1, 2), ceil_mode=True), [x], (0,), s, device_num)
    simulate(ops.AvgPool(2, 2, "pad", pad=(1, 0, 1, 1), ceil_mode=True, count_include_pad=False), [x], (0,), s,
             device_num)
    simulate(MaxPoolIndices(3, 2, "pad", pad=1), [x], (0,), s, device_num, grad=False)


# ---- a network on thread-ranks -----------------------------------------------------------------

class UpNet(nn.Cell):
    """Conv2dTranspose (bias) -> padded ceil-mode MaxPool -> AvgPool not counting its padding."""

    def __init__(self, w, b, strategies):
        super().__init__()
        self.up = nn.Conv2dTranspose(4, 6, 3, stride=2, pad_mode="pad", padding=1, output_padding=1, has_bias=True,
                                     weight_init=Tensor(w), bias_init=Tensor(b), dtype=F64)
        self.max = ops.MaxPool(3, 2, "pad", pad=1, ceil_mode=True)
        self.avg = ops.AvgPool(3, 1, "pad", pad=1, count_include_pad=False)
        self.where = MaxPoolIndices(3, 2, "pad", pad=1, ceil_mode=True)
        up_s, pool_s = strategies
        if up_s is not None:
            self.up.shard(up_s)
        if pool_s is not None:
            for op in (self.max, self.avg, self.where):
                op.shard(pool_s)

    def construct(self, x, g):
        h = self.up(x)
        y = self.avg(self.max(h))
        return y, self.where(h), (y * g).sum()


def _run(n, strategies, mode):
    rng = np.random.default_rng(5)
    x, w, b = rng.standard_normal((4, 4, 3, 3)), rng.standard_normal((4, 6, 3, 3)), rng.standard_normal(6)
    g = rng.standard_normal((4, 6, 4, 4))  # up: 6x6; max, ceil_mode: ceil((6 + 2 - 3) / 2) + 1 = 4

    def run(strategies):
        net = UpNet(w, b, strategies)
        xt = Tensor(x, requires_grad=True)
        y, where, loss = net(xt, Tensor(g))
        loss.backward()
        return [host(full_value(y)), host(full_value(where)), host(gather_like(xt.grad, xt)),
                host(gather_like(net.up.weight.grad, net.up.weight)), host(gather_like(net.up.bias.grad, net.up.bias))]

    want = run((None, None))

    def body():
        import minidl_parallel as mp
        mp.set_auto_parallel_context(parallel_mode=mode, dataset_strategy="full_batch")
        try:
            return run(strategies)
        finally:
            mp.reset_auto_parallel_context()

    for got in run_threads(n, body, timeout=60):
        for a, b_, what in zip(got, want, ("output", "indices", "input gradient", "weight gradient",
                                           "bias gradient")):
            np.testing.assert_allclose(a, b_, rtol=1e-10, atol=1e-12, err_msg=what)


@pytest.mark.parametrize("n, strategies", [
    (4, (((2, 2, 1, 1), (2, 1, 1, 1)), ((2, 1, 1, 1),))),   # batch and summed channels; pools on the batch
    (4, (((1, 2, 1, 1), (2, 2, 1, 1)), ((1, 2, 1, 1),))),   # summed and output channels; pools on channels
    (4, (((1, 1, 1, 1), (1, 2, 1, 1)), ((2, 1, 1, 1),))),   # output channels, repeated; the pools re-cut
    (2, (((1, 1, 1, 1), (1, 2, 1, 1)), None)),              # SEMI_AUTO: the pools take a default
])
def test_upsampling_network_sharded_equals_one_device(n, strategies):
    _run(n, strategies, "semi_auto_parallel")


def test_upsampling_network_under_auto_parallel_equals_one_device():
    _run(4, (None, None), "auto_parallel")
