"""Sharding rules of Pad, Tile and BroadcastTo (rules/shape.py), and split / Split as StridedSlices
(rules/indexing.py): layouts, refusals, and real runs through the dispatcher on thread-ranks whose
gathered outputs and input gradients must equal one device's (float64).
"""
import numpy as np
import pytest

from minidl import Tensor, nn, ops
from minidl_parallel.tensor_parallel.dispatch import full_value, gather_like
from minidl_parallel.tensor_parallel.layout import Layout
from minidl_parallel.tensor_parallel.rules import StrategyError, get_rule
from rule_helpers import host, infer, layouts_of, spec, on_ranks

F64 = np.dtype(np.float64)










# ---- layouts and refusals -----------------------------------------------------------------------

def test_pad_keeps_the_cuts_of_unpadded_dimensions():
    p = ops.Pad(((0, 0), (1, 2), (0, 0)))
    sh = infer(p, (spec((8, 6, 4)),), ((2, 1, 2),), 4)
    assert layouts_of(sh) == (["(a, -, c) on [2, 1, 2]"], "(a, -, c) on [2, 1, 2]", ())
    assert sh.local_attrs is None  # cut dimensions have pads (0, 0): the local op is the same op
    with pytest.raises(StrategyError, match=r"dimension 1 of x is cut 2 but padded by \(1, 2\); it must be whole"):
        infer(p, (spec((8, 6, 4)),), ((1, 2, 1),), 2)
    crop = ops.Pad._constant(((0, 0), (-1, 0)), 0.0)  # what ops.pad(x, (-1, 0)) runs
    with pytest.raises(StrategyError, match=r"dimension 1 of x is cut 3 but padded by \(-1, 0\)"):
        infer(crop, (spec((8, 6)),), ((1, 3),), 3)
    with pytest.raises(ValueError, match=r"Pad: paddings has 3 pair\(s\) but x has 2 dimension\(s\)"):
        infer(p, (spec((8, 6)),), ((1, 1),), 2)


def test_tile_keeps_the_cuts_of_untiled_dimensions_and_adds_whole_leading_ones():
    sh = infer(ops.Tile(), (spec((8, 6)), (3, 1, 2)), ((4, 1),), 4)
    assert layouts_of(sh) == (["(a, -) on [4, 1]"], "(-, a, -) on [4, 1]", ())
    sh = infer(ops.Tile(), (spec((8, 6)), (2,)), ((2, 1),), 4)  # dims shorter than x: (1, 2)
    assert str(sh.out_layout) == "(b, -) on [2, 2, 1]"
    with pytest.raises(StrategyError, match="dimension 0 of x is cut 2 but tiled 3 times; it must be whole"):
        infer(ops.Tile(), (spec((8, 6)), (3, 1)), ((2, 1),), 2)
    with pytest.raises(StrategyError, match="dimension 1 of x is cut 2 but tiled 0 times"):
        infer(ops.Tile(), (spec((8, 6)), (1, 0)), ((1, 2),), 2)
    with pytest.raises(ValueError, match=r"Tile: every entry of dims must be >= 0"):
        infer(ops.Tile(), (spec((8, 6)), (-1, 1)), ((1, 1),), 2)


def test_broadcast_to_keeps_the_cuts_and_localizes_the_target_shape():
    b = ops.BroadcastTo((5, 8, -1, 6))
    sh = infer(b, (spec((8, 1, 6)),), ((2, 1, 3),), 6)
    assert layouts_of(sh) == (["(a, -, c) on [2, 1, 3]"], "(-, a, -, c) on [2, 1, 3]", ())
    assert sh.local_attrs == {"shape": (5, 4, 1, 2)}
    assert infer(b, (spec((8, 1, 6)),), ((1, 1, 1),), 2).local_attrs is None
    # A broadcast dimension has size 1: it cannot be cut (the cut must divide the size).
    with pytest.raises(StrategyError, match="dimension 1 of input 0 has size 1, not divisible by its cut 2"):
        infer(ops.BroadcastTo((8, 4, 6)), (spec((8, 1, 6)),), ((1, 2, 1),), 2)
    with pytest.raises(ValueError, match=r"BroadcastTo: cannot broadcast x of shape \(8, 1, 6\) to \(8, 4, 5\)"):
        infer(ops.BroadcastTo((8, 4, 5)), (spec((8, 1, 6)),), ((1, 1, 1),), 2)


def test_default_and_propagated_strategies():
    x = spec((8, 6))
    pad0, pad1 = ops.Pad(((1, 0), (0, 0))), ops.Pad(((0, 0), (0, 1)))
    assert get_rule(pad0).data_parallel(pad0, (x,), 4) == ((1, 1),)
    assert get_rule(pad1).data_parallel(pad1, (x,), 4) == ((4, 1),)
    tile = ops.Tile()
    assert get_rule(tile).data_parallel(tile, (x, (2, 2, 1)), 4) == ((1, 1),)
    assert get_rule(tile).data_parallel(tile, (x, (2, 1, 3)), 4) == ((4, 1),)
    b = ops.BroadcastTo((3, 8, 6))
    assert get_rule(b).data_parallel(b, (x,), 4) == ((4, 1),)
    cut_both = Layout((2, 2), ((0,), (1,)))
    assert get_rule(pad1).propagate(pad1, (x,), (cut_both,), 4) == ((2, 1),)  # the padded dim gives up its cut
    assert get_rule(tile).propagate(tile, (x, (2, 1)), (cut_both,), 4) == ((1, 2),)
    assert get_rule(b).propagate(b, (x,), (cut_both,), 4) == ((2, 2),)
    partial = Layout((4,), ((), ()), ((0, "sum"),))  # the partial axis moves onto an unpadded dimension
    pad_rows = ops.Pad(((0, 0), (2, 2)))
    assert get_rule(pad_rows).propagate(pad_rows, (x,), (partial,), 4) == ((4, 1),)


def test_split_axis_refused_by_the_slice_rule():
    # split / Split are StridedSlices of x: the rule that judges them is StridedSlice's.
    ss = ops.StridedSlice(begin_mask=0b1, end_mask=0b1)  # what Split(1) makes: x[:, start:stop]
    with pytest.raises(StrategyError, match="dimension 1 of x is cut 2 but sliced; a cut dimension must be taken whole"):
        infer(ss, (spec((8, 6)), (0, 0), (0, 3), (1, 1)), ((1, 2),), 2)
    sh = infer(ss, (spec((8, 6)), (0, 0), (0, 3), (1, 1)), ((2, 1),), 2)
    assert str(sh.out_layout) == "(a, -) on [2, 1]"


# ---- real runs on thread-ranks ----------------------------------------------------------------



class _Loss(nn.Cell):
    """sum(net(x) * g): its gradient with respect to the output is g, its value whole on every rank.

    g is held, not passed: an input of the outermost Cell would be tagged as a batch slice.
    """

    def __init__(self, net, g):
        super().__init__()
        self.net, self.g, self.mul, self.sum = net, Tensor(g), ops.Mul(), ops.ReduceSum()

    def construct(self, x):
        y = self.net(x)
        return y, self.sum(self.mul(y, self.g))


class ManipulationNet(nn.Cell):
    """x (8, 6) -> Tanh -> Pad -> Tile -> BroadcastTo (via a size-1 slice) -> Split -> Concat."""

    def __init__(self, strategies):
        super().__init__()
        self.tanh = ops.Tanh()
        self.pad = ops.Pad(((0, 0), (1, 1)))                  # (8, 8)
        self.tile = ops.Tile()                                # (2, 8, 8)
        self.split = ops.Split(2, 2)                          # two (2, 8, 4)
        self.concat = ops.Concat(2)
        self.expand = ops.ExpandDims()
        self.broadcast = ops.BroadcastTo((2, -1, 3, 4))       # (2, 8, 1, 4) -> (2, 8, 3, 4)
        for op, s in zip((self.tanh, self.pad, self.tile, self.split, self.broadcast), strategies):
            if s is not None:
                op.shard(s)

    def construct(self, x):
        h = self.tile(self.pad(self.tanh(x)), (2, 1, 1))
        a, b = self.split(h)
        h = self.concat((b, a))                               # (2, 8, 8): parts swapped
        pieces = ops.split(h, [4, 0, 4], 2)                   # the function form, a zero-length section
        return self.broadcast(self.expand(pieces[2], 2))      # (2, 8, 3, 4); pieces[0] gets no gradient


def _batch(a, n, dataset):
    if dataset == "full_batch":
        return a
    import minidl_parallel as mp
    b = a.shape[0] // n
    return a[mp.get_rank() * b:(mp.get_rank() + 1) * b]


def _manipulation_run(n, strategies, mode, dataset="full_batch"):
    rng = np.random.default_rng(3)
    x, g = rng.standard_normal((8, 6)), rng.standard_normal((2, 8, 3, 4))

    def run(n, dataset, strategies):
        xt = Tensor(_batch(x, n, dataset), requires_grad=True)
        y, loss = _Loss(ManipulationNet(strategies), g)(xt)
        loss.backward()
        return host(full_value(y)), host(gather_like(xt.grad, xt)), ops.shape(y), tuple(y.data.shape)

    want = run(1, "full_batch", [None] * 5)
    # x's columns 3..5 reach only pieces[0], which the output leaves out: zero gradient there.
    assert np.all(want[1][:, :3] != 0) and not np.count_nonzero(want[1][:, 3:])
    for got in on_ranks(n, lambda: run(n, dataset, strategies), mode, dataset):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-10, atol=1e-12, err_msg="output")
        np.testing.assert_allclose(got[1], want[1], rtol=1e-10, atol=1e-12, err_msg="input gradient")
        assert got[2] == want[2] == (2, 8, 3, 4)  # ops.shape: the global shape on every rank
        if strategies[4] is not None:  # BroadcastTo's cut of dimension 1 stays on its output: ran on blocks
            assert got[3] == (2, 8 // strategies[4][0][1], 3, 4)


@pytest.mark.parametrize("n, strategies", [
    (2, [((2, 1),), ((2, 1),), ((2, 1),), ((1, 2, 1),), ((1, 2, 1, 1),)]),
    (4, [((2, 2),), ((4, 1),), ((2, 2),), ((1, 2, 1),), ((1, 4, 1, 1),)]),
    (4, [((4, 1),), ((1, 1),), None, ((1, 4, 1),), None]),   # repeat axes; defaults for the rest
])
@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
def test_manipulation_ops_sharded_equal_one_device(n, strategies, mode):
    _manipulation_run(n, strategies, mode)


def test_manipulation_ops_with_default_strategies_on_a_data_parallel_batch():
    _manipulation_run(4, [None] * 5, "semi_auto_parallel", "data_parallel")


def test_shape_is_the_global_shape_of_a_sharded_tensor():
    def rank():
        y = ops.Pad(((0, 0), (1, 0))).shard(((2, 1),))(Tensor(np.ones((8, 6))))
        return ops.shape(y), ops.Shape()(y), tuple(y.data.shape)
    for got in on_ranks(2, rank, "semi_auto_parallel"):
        assert got == ((8, 7), (8, 7), (4, 7))


class TileNet(nn.Cell):
    def __init__(self, strategy):
        super().__init__()
        self.tile = ops.Tile().shard(strategy)

    def construct(self, x):
        return self.tile(x, (1, 2))


def test_refusals_through_the_dispatcher_name_the_operator_and_the_rule():
    def rank(make):
        try:
            make()(Tensor(np.ones((8, 6))))
        except StrategyError as e:
            return str(e)
    msgs = on_ranks(2, lambda: rank(lambda: ManipulationNet([None, ((1, 2),), None, None, None])),
                     "semi_auto_parallel")
    assert len(set(msgs)) == 1
    assert "Pad (pad)" in msgs[0] and "dimension 1 of x is cut 2 but padded by (1, 1)" in msgs[0], msgs[0]
    msgs = on_ranks(2, lambda: rank(lambda: TileNet(((1, 2),))), "semi_auto_parallel")
    assert "Tile (tile)" in msgs[0] and "dimension 1 of x is cut 2 but tiled 2 times" in msgs[0], msgs[0]
    with pytest.raises(ValueError, match=r"Split.shard: in_strategy \(\(1, 1, 2\),\) cuts the split axis 2"):
        ManipulationNet([None, None, None, ((1, 1, 2),), None])
