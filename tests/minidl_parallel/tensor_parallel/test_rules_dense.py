"""Dense and DenseReLU under a strategy (rules/linalg.py's DenseRule): they run as MatMul(transpose_b),
BiasAdd and ReLU, each sharded from the Dense strategy; a network calling them under SEMI_AUTO and
AUTO on thread-ranks equals the single-device run."""
import numpy as np
import pytest

import minidl
import minidl_parallel
from minidl import nn, ops
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel.rules import Decomposed, StrategyError, get_rule

from momentum_steps import momentum_steps
from rule_helpers import infer, spec

X, W, B = spec((8, 6)), spec((4, 6), True), spec((4,), True)


@pytest.mark.parametrize("prim, parts", [(ops.Dense(), "BiasAdd"), (ops.DenseReLU(), "BiasAdd and ReLU")])
def test_dense_runs_as_the_ops_it_fuses(prim, parts):
    sh = infer(prim, (X, W, B), ((2, 2), (2, 2), (2,)), 8)
    assert isinstance(sh, Decomposed) and sh.description.endswith(f"as MatMul(transpose_b), {parts}")


def test_the_bias_is_cut_as_the_weights_rows():
    with pytest.raises(StrategyError, match=r"the bias's cut 1 must equal the cut 2 of w's rows"):
        infer(ops.Dense(), (X, W, B), ((1, 1), (2, 1), (1,)), 2)
    with pytest.raises(StrategyError, match=r"input 1 has rank 2 \(shape \(4, 6\)\) but its strategy \(2,\)"):
        infer(ops.Dense(), (X, W, B), ((1, 1), (2,), (2,)), 2)


def test_default_and_propagated_strategies():
    from minidl_parallel.tensor_parallel.layout import Layout
    for prim in (ops.Dense(), ops.DenseReLU()):
        rule = get_rule(prim)
        assert rule.data_parallel(prim, (X, W, B), 4) == ((4, 1), (1, 1), (1,))
        assert rule.data_parallel(prim, (X, W), 4) == ((4, 1), (1, 1))
        rows_cut = Layout((2,), ((0,), ()))
        strategy = rule.propagate(prim, (X, W, B), (rows_cut, Layout.replicated(2, 2), Layout.replicated(1, 2)), 2)
        assert strategy[0] == (2, 1) and strategy[2] == (strategy[1][0],)
        assert isinstance(infer(prim, (X, W, B), strategy, 2), Decomposed)


F64 = minidl.float64


class _Net(nn.Cell):
    """DenseReLU (bias), DenseReLU (no bias), Dense: explicit fused ops, optionally sharded."""

    def __init__(self, strategies):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Dense(6, 8, dtype=F64), nn.Dense(8, 4, has_bias=False, dtype=F64), \
            nn.Dense(4, 3, dtype=F64)
        self.op1, self.op2, self.op3 = ops.DenseReLU(), ops.DenseReLU(), ops.Dense()
        for op, s in zip((self.op1, self.op2, self.op3), strategies or ()):
            op.shard(s)

    def construct(self, x):
        h = self.op1(x, self.fc1.weight, self.fc1.bias)
        h = self.op2(h, self.fc2.weight)
        return self.op3(h, self.fc3.weight, self.fc3.bias)


def _train(strategies, x, y, init):
    net = _Net(strategies)
    minidl.load_param_into_net(net, {k: v.copy() for k, v in init.items()})
    return momentum_steps(net, x, y, 2)


@pytest.mark.parametrize("mode, strategies", [
    ("semi_auto_parallel", None),                                                   # the batch cut
    ("semi_auto_parallel", [((1, 2), (2, 2), (2,)), ((2, 2), (1, 2)), ((1, 1), (1, 1), (1,))]),  # K cut: partial sums
    ("semi_auto_parallel", [((2, 1), (2, 1), (2,)), ((1, 4), (1, 4)), ((4, 1), (1, 1), (1,))]),  # rows and columns
    ("auto_parallel", [((1, 1), (4, 1), (4,))]),                                   # the rest propagated
])
def test_network_of_dense_ops_under_a_strategy_equals_single_device(mode, strategies):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 6)), rng.standard_normal((8, 3))
    minidl.set_seed(0)
    init = {name: p.asnumpy().copy() for name, p in _Net(None).parameters_and_names()}
    ref = _train(None, x, y, init)

    def rank():
        minidl_parallel.set_auto_parallel_context(parallel_mode=mode, dataset_strategy="full_batch")
        try:
            return _train(strategies, x, y, init)
        finally:
            minidl_parallel.reset_auto_parallel_context()
    for losses, out, state in run_threads(4, rank, timeout=60):
        np.testing.assert_allclose(losses, ref[0], rtol=1e-10)
        np.testing.assert_allclose(out, ref[1], rtol=1e-10, atol=1e-12)
        for name, value in ref[2].items():
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)
