"""Sharding rules of Select, Clamp, FloorDiv (broadcasting), Argmax / Argmin / CumSum (a whole axis),
and ops.matmul with vectors (a composite): layouts, refusals, and real runs.

Real runs go through the dispatcher on thread-ranks and compare the gathered forward output and
input gradients with one device (float64).
"""
import numpy as np
import pytest

import minidl
from minidl import Tensor, nn, ops
from minidl_parallel.tensor_parallel.dispatch import full_value, gather_like
from minidl_parallel.tensor_parallel.layout import Layout
from minidl_parallel.tensor_parallel.rules import StrategyError, get_rule
from rule_helpers import host, infer, layouts_of, spec, on_ranks

F64, B = np.dtype(np.float64), np.dtype(bool)










# ---- layouts and refusals ---------------------------------------------------------------------

def test_select_broadcasts_its_three_operands_like_a_binary_op():
    sh = infer(ops.Select(), (spec((8, 6), dtype=B), spec((8, 6)), spec((6,))), ((2, 2), (2, 2), (2,)), 4)
    assert layouts_of(sh) == (["(a, b) on [2, 2]", "(a, b) on [2, 2]", "(b,) on [2, 2]"], "(a, b) on [2, 2]", ())
    sh = infer(ops.Select(), (spec((8, 1), dtype=B), spec((8, 6)), 0.0), ((4, 1), (4, 1), ()), 4)  # a number: no cut
    assert layouts_of(sh) == (["(a, -) on [4, 1]", "(a, -) on [4, 1]"], "(a, -) on [4, 1]", ())
    with pytest.raises(StrategyError, match=r"dimension 1 of the output \(size 6\) is cut 2 in input 0 but 1 in input 2"):
        infer(ops.Select(), (spec((8, 6), dtype=B), spec((8, 6)), spec((6,))), ((1, 2), (1, 2), (1,)), 4)
    with pytest.raises(StrategyError, match="dimension 1 of input 0 has size 1 and is broadcast against size 6"):
        infer(ops.Select(), (spec((8, 1), dtype=B), spec((8, 6)), spec((8, 6))), ((1, 2), (1, 2), (1, 2)), 2)


def test_clamp_with_number_bounds_is_unary_and_floor_div_is_binary():
    sh = infer(ops.Clamp(), (spec((8, 6)), None, 1.0), ((2, 2),), 4)
    assert layouts_of(sh) == (["(a, b) on [2, 2]"], "(a, b) on [2, 2]", ())
    sh = infer(ops.Clamp(), (spec((8, 6)), spec((1, 6)), 1.0), ((2, 1), (1, 1)), 4)
    assert layouts_of(sh) == (["(b, -) on [2, 2, 1]", "(-, -) on [2, 2, 1]"], "(b, -) on [2, 2, 1]", (0,))
    sh = infer(ops.FloorDiv(), (spec((8, 6)), spec((6,))), ((4, 1), (1,)), 4)
    assert layouts_of(sh) == (["(a, -) on [4, 1]", "(-,) on [4, 1]"], "(a, -) on [4, 1]", ())


def test_arg_extremes_and_cumsum_keep_their_axis_whole():
    sh = infer(ops.Argmax(axis=1), (spec((8, 6, 4)),), ((2, 1, 2),), 4)
    assert layouts_of(sh) == (["(a, -, c) on [2, 1, 2]"], "(a, c) on [2, 1, 2]", ())
    sh = infer(ops.Argmin(axis=-1), (spec((8, 6)),), ((2, 1),), 4)
    assert layouts_of(sh) == (["(b, -) on [2, 2, 1]"], "(b,) on [2, 2, 1]", (0,))
    sh = infer(ops.CumSum(), (spec((8, 6)), 0), ((1, 2),), 2)
    assert layouts_of(sh) == (["(-, b) on [1, 2]"], "(-, b) on [1, 2]", ())
    with pytest.raises(StrategyError, match="dimension 1 of input 0 is the Argmax axis and is cut 2; it must be whole"):
        infer(ops.Argmax(axis=1), (spec((8, 6)),), ((2, 2),), 4)
    with pytest.raises(StrategyError, match="dimension 0 of input 0 is the CumSum axis and is cut 4"):
        infer(ops.CumSum(True), (spec((8, 6)), -2), ((4, 1),), 4)


def test_default_and_propagated_strategies_leave_the_axis_whole():
    am = ops.Argmax(axis=0)
    assert get_rule(am).data_parallel(am, (spec((8, 6)),), 4) == ((1, 1),)
    am = ops.Argmax(axis=1)
    assert get_rule(am).data_parallel(am, (spec((8, 6)),), 4) == ((4, 1),)
    cut_both = Layout((2, 2), ((0,), (1,)))
    assert get_rule(am).propagate(am, (spec((8, 6)),), (cut_both,), 4) == ((2, 1),)
    cs = ops.CumSum()
    assert get_rule(cs).propagate(cs, (spec((8, 6)), 0), (cut_both,), 4) == ((1, 2),)
    partial = Layout((2, 2), ((), ()), ((1, "sum"),))  # the partial axis becomes a cut, not on the axis
    assert get_rule(cs).propagate(cs, (spec((8, 6)), 1), (partial,), 4) == ((2, 1),)
    assert get_rule(cs).propagate(cs, (spec((8, 6)), 0), (partial,), 4) == ((1, 2),)
    sel = ops.Select()
    args = (spec((8, 6), dtype=B), spec((8, 6)), spec((6,), param=True))
    assert get_rule(sel).data_parallel(sel, args, 4) == ((4, 1), (4, 1), (1,))
    assert get_rule(sel).propagate(sel, args, (cut_both, cut_both, Layout.replicated(1, 4)), 4) == \
        ((2, 2), (2, 2), (2,))


# ---- real runs on thread-ranks -----------------------------------------------------------------



class _Loss(nn.Cell):
    """sum(net(*xs) * g): the gradient with respect to the output is g; the value whole on every rank."""

    def __init__(self, net):
        super().__init__()
        self.net, self.mul, self.sum = net, ops.Mul(), ops.ReduceSum()

    def construct(self, g, *xs):
        y = self.net(*xs)
        return y, self.sum(self.mul(y, g))


class OneOp(nn.Cell):
    """One primitive (sharded with ``strategy`` unless None) called on the inputs and ``extra`` arguments."""

    def __init__(self, prim, strategy, extra=()):
        super().__init__()
        self.op, self.extra = prim, extra
        if strategy is not None:
            self.op.shard(strategy)

    def construct(self, *xs):
        return self.op(*xs, *self.extra)


class WhereNet(nn.Cell):
    """where(x > 0, x, y) with the mask made on the ranks (Greater) and Select sharded."""

    def __init__(self, strategies):
        super().__init__()
        self.greater, self.select = ops.Greater(), ops.Select()
        for op, s in zip((self.greater, self.select), strategies or (None, None)):
            if s is not None:
                op.shard(s)

    def construct(self, x, y):
        return self.select(self.greater(x, 0.0), x, y)


class MatVecNet(nn.Cell):
    """ops.matmul with a vector on either side: (x @ v) and (v @ x^T ...) through the composite."""

    def construct(self, x, v, u):
        return ops.matmul(u, ops.matmul(x, v) * 1.0 + x[:, 0])


def _compare(make_net, inputs, n, strategies, mode):
    """Runs the net on one device and on n thread-ranks; output and float inputs' gradients must agree."""
    with minidl.no_grad():
        shape = make_net(None)(*[Tensor(a) for a in inputs]).shape
    g = np.random.default_rng(7).standard_normal(shape)

    def run(strategies):
        ts = [Tensor(a, requires_grad=a.dtype.kind == "f") for a in inputs]
        y, loss = _Loss(make_net(strategies))(Tensor(g), *ts)
        if loss.requires_grad:  # Argmax's integer output has no gradient
            loss.backward()
        return [host(full_value(y))] + [host(gather_like(t.grad, t)) for t in ts if t.grad is not None]

    want = run(None)
    for got in on_ranks(n, lambda: run(strategies), mode):
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want)):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg="output" if i == 0 else f"gradient {i - 1}")


RNG = np.random.default_rng(3)
X = RNG.standard_normal((8, 6))
Y6 = RNG.standard_normal(6)


@pytest.mark.parametrize("n, strategies", [
    (4, (((2, 2), ()), ((2, 2), (2, 2), (2,)))),
    (4, (((4, 1), ()), ((4, 1), (4, 1), (1,)))),
    (2, (None, ((1, 2), (1, 2), (2,)))),
])
@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
def test_where_sharded_equals_one_device(n, strategies, mode):
    _compare(lambda s: WhereNet(s), [X, Y6], n, strategies, mode)


@pytest.mark.parametrize("n, strategy, extra", [
    (4, ((2, 2),), (-0.3, 0.4)),               # number bounds: unary in x
    (4, ((4, 1), (1, 1)), (0.5,)),             # a (1, 6) tensor lower bound, max a number
    (2, None, (None, 0.2)),                    # SEMI_AUTO default
])
def test_clamp_sharded_equals_one_device(n, strategy, extra):
    inputs = [X] if len(extra) == 2 else [X, np.full((1, 6), -0.2) + 0.1 * np.arange(6)]
    _compare(lambda s: OneOp(ops.Clamp(), s, extra), inputs, n, strategy, "semi_auto_parallel")


@pytest.mark.parametrize("n, strategy", [(4, ((2, 2), (2,))), (2, ((2, 1), (1,))), (4, None)])
def test_floor_div_sharded_equals_one_device(n, strategy):
    _compare(lambda s: OneOp(ops.FloorDiv(), s), [X * 5, np.abs(Y6) + 0.5], n, strategy, "semi_auto_parallel")


@pytest.mark.parametrize("prim, n, strategy", [
    (lambda: ops.Argmax(axis=1, output_type=np.int64), 4, ((4, 1),)),
    (lambda: ops.Argmin(axis=0), 2, ((1, 2),)),
    (lambda: ops.Argmax(), 4, None),
])
@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
def test_arg_extremes_sharded_equal_one_device(prim, n, strategy, mode):
    _compare(lambda s: OneOp(prim(), s), [X], n, strategy, mode)


@pytest.mark.parametrize("exclusive, reverse, axis, n, strategy", [
    (False, False, 1, 4, ((4, 1),)),
    (True, False, 0, 2, ((1, 2),)),
    (False, True, -1, 4, ((2, 1),)),
    (True, True, 1, 4, None),
])
@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
def test_cumsum_sharded_equals_one_device(exclusive, reverse, axis, n, strategy, mode):
    _compare(lambda s: OneOp(ops.CumSum(exclusive, reverse), s, (axis,)), [X], n, strategy, mode)


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
def test_matmul_with_vectors_runs_as_its_composite(mode):
    _compare(lambda s: MatVecNet(), [X, Y6, RNG.standard_normal(8)], 4, None, mode)


def test_a_cut_axis_is_refused_through_the_dispatcher():
    def rank():
        try:
            OneOp(ops.Argmax(axis=1), ((1, 2),))(Tensor(X))
        except StrategyError as e:
            return str(e)
    msgs = on_ranks(2, rank, "semi_auto_parallel")
    assert len(set(msgs)) == 1 and msgs[0] is not None
    assert "Argmax" in msgs[0] and "dimension 1 of input 0 is the Argmax axis and is cut 2" in msgs[0], msgs[0]
