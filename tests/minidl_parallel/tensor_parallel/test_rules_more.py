"""Sharding rules of Dropout, Concat, StridedSlice and GetItem: layouts, refusals, real runs.

Real runs go through the dispatcher on thread-ranks and compare the gathered forward output
and gradients with one device (float64, exact for Dropout: the same mask, block by block).
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Parameter, Tensor, nn, ops
from minidl_parallel.tensor_parallel.dispatch import full_value, gather_like
from minidl_parallel.tensor_parallel.layout import Layout
from minidl_parallel.tensor_parallel.rules import Site, StrategyError, get_rule
from minidl_parallel.tensor_parallel.rules.indexing import index_dims
from rule_helpers import host, infer, layouts_of, on_ranks, spec

F64 = np.dtype(np.float64)










def at(coords):
    """The Site of a rank at ``coords`` (no communicator: Dropout's rule asks for none)."""
    return Site(coords, group=None)


def replicated(shape, n):
    return Layout.replicated(len(shape), n)


# ---- Dropout: layouts -------------------------------------------------------------------------

def test_dropout_keeps_the_layout_and_gives_each_rank_its_window_of_the_mask():
    sh = infer(ops.Dropout(0.5), (spec((8, 6)),), ((2, 2),), 4)
    assert layouts_of(sh) == (["(a, b) on [2, 2]"], "(a, b) on [2, 2]", ())
    assert sh.local_attrs(at((1, 0))) == {"mask_window": ((8, 6), (slice(4, 8), slice(0, 3)))}
    assert sh.local_attrs(at((0, 1))) == {"mask_window": ((8, 6), (slice(0, 4), slice(3, 6)))}
    # Fewer devices: replicas along the repeat axis keep the same window.
    sh = infer(ops.Dropout(0.5), (spec((8, 6)),), ((1, 2),), 4)
    assert layouts_of(sh) == (["(-, c) on [2, 1, 2]"], "(-, c) on [2, 1, 2]", (0,))
    assert sh.local_attrs(at((0, 0, 1))) == sh.local_attrs(at((1, 0, 1))) == {
        "mask_window": ((8, 6), (slice(0, 8), slice(3, 6)))}


def test_dropout_needs_no_window_when_nothing_is_drawn_or_nothing_is_cut():
    assert infer(ops.Dropout(1.0), (spec((8, 6)),), ((2, 2),), 4).local_attrs is None
    assert infer(ops.Dropout(0.5), (spec((8, 6)),), ((1, 1),), 4).local_attrs is None


def test_dropout_default_and_propagated_strategies():
    rule, d = get_rule(ops.Dropout(0.5)), ops.Dropout(0.5)
    assert rule.data_parallel(d, (spec((8, 6)),), 4) == ((4, 1),)
    assert rule.data_parallel(d, (spec((6, 6)),), 4) == ((2, 1),)
    cur = Layout((2, 2), ((0,), (1,)))
    assert rule.propagate(d, (spec((8, 6)),), (cur,), 4) == ((2, 2),)
    partial = Layout((2, 2), ((0,), ()), ((1, "sum"),))  # the partial axis becomes a cut
    assert rule.propagate(d, (spec((8, 6)),), (partial,), 4) == ((2, 2),)


def test_dropout_refuses_a_cut_that_does_not_divide():
    with pytest.raises(StrategyError, match="dimension 1 of input 0 has size 6, not divisible by its cut 4"):
        infer(ops.Dropout(0.5), (spec((8, 6)),), ((1, 4),), 4)


def test_dropout_mask_window_is_the_block_of_the_whole_mask():
    x = np.ones((4, 6))
    minidl.set_seed(5)
    whole = ops.Dropout(0.5)(Tensor(x)).asnumpy()
    minidl.set_seed(5)
    d = ops.Dropout(0.5)
    d.mask_window = ((4, 6), (slice(2, 4), slice(0, 3)))
    np.testing.assert_array_equal(d(Tensor(x[2:4, :3])).asnumpy(), whole[2:4, :3])
    seeded = [ops.Dropout(0.5, 3, 4) for _ in range(2)]
    seeded[1].mask_window = ((4, 6), (slice(0, 4), slice(3, 6)))
    np.testing.assert_array_equal(seeded[1](Tensor(x[:, 3:])).asnumpy(), seeded[0](Tensor(x)).asnumpy()[:, 3:])
    d.mask_window = ((4, 6), (slice(0, 2), slice(0, 3)))
    with pytest.raises(ValueError, match=r"Dropout: mask_window .* has shape \(2, 3\), but x has shape \(4, 3\)"):
        d(Tensor(x[:, :3]))


# ---- Concat: layouts and refusals ----------------------------------------------------------------

def test_concat_keeps_the_common_layout_with_the_axis_whole():
    c = ops.Concat(1)
    sh = infer(c, (spec((8, 4)), spec((8, 6))), ((2, 1), (2, 1)), 4)
    assert layouts_of(sh) == (["(b, -) on [2, 2, 1]"] * 2, "(b, -) on [2, 2, 1]", (0,))
    sh = infer(ops.Concat(-1), (spec((8, 4, 2)), spec((8, 4, 6)), spec((8, 4, 2))), ((2, 2, 1),) * 3, 4)
    assert layouts_of(sh) == (["(a, b, -) on [2, 2, 1]"] * 3, "(a, b, -) on [2, 2, 1]", ())


def test_concat_refuses_a_cut_axis_and_unequal_cuts():
    with pytest.raises(StrategyError, match=r"the concatenation axis 1 is cut 2 in input 0; it must be whole"):
        infer(ops.Concat(1), (spec((8, 4)), spec((8, 6))), ((1, 2), (1, 2)), 4)
    with pytest.raises(StrategyError, match=r"dimension 0 is cut 2 in input 0 but 4 in input 1"):
        infer(ops.Concat(1), (spec((8, 4)), spec((8, 6))), ((2, 1), (4, 1)), 4)
    with pytest.raises(ValueError, match=r"Concat: input 1 of shape \(6, 6\) and input 0 of shape \(8, 4\)"):
        infer(ops.Concat(1), (spec((8, 4)), spec((6, 6))), ((1, 1), (1, 1)), 4)


def test_concat_default_and_propagated_strategies():
    rule, args = get_rule(ops.Concat(1)), (spec((8, 4)), spec((8, 6)))
    assert rule.data_parallel(ops.Concat(1), args, 4) == ((4, 1), (4, 1))
    assert rule.data_parallel(ops.Concat(0), args[:1] * 2, 4) == ((1, 1), (1, 1))
    cut_both = Layout((2, 2), ((0,), (1,)))
    assert rule.propagate(ops.Concat(1), args, (cut_both, cut_both), 4) == ((2, 1), (2, 1))
    # The partial axis moves onto a dimension other than the axis.
    partial = Layout((2, 2), ((), ()), ((1, "sum"),))
    assert rule.propagate(ops.Concat(0), (spec((8, 4)), spec((8, 4))), (partial, partial), 4) == ((1, 2), (1, 2))


# ---- StridedSlice and GetItem: layouts and refusals ---------------------------------------------

def test_getitem_moves_the_cuts_with_the_whole_dimensions():
    g = ops.GetItem()
    sh = infer(g, (spec((8, 6, 5)), (slice(None), None, slice(None), slice(1, 4))), ((2, 2, 1),), 4)
    assert layouts_of(sh) == (["(a, b, -) on [2, 2, 1]"], "(a, -, b, -) on [2, 2, 1]", ())
    sh = infer(g, (spec((8, 6, 5)), (Ellipsis, 0)), ((2, 2, 1),), 4)
    assert str(sh.out_layout) == "(a, b) on [2, 2, 1]"
    sh = infer(g, (spec((8, 6, 5)), (slice(-100, 100), 2)), ((4, 1, 1),), 4)  # covers all of dim 0
    assert str(sh.out_layout) == "(a, -) on [4, 1, 1]"
    # Index arrays on whole dimensions: adjacent ones stay in place, separated ones go first.
    sh = infer(g, (spec((8, 6, 5)), (slice(None), [0, 2, 2], 1)), ((4, 1, 1),), 4)
    assert str(sh.out_layout) == "(a, -) on [4, 1, 1]"
    sh = infer(g, (spec((8, 6, 5)), (np.array([[1], [2]]), slice(None), np.array([0, 4]))), ((1, 2, 1),), 4)
    assert str(sh.out_layout) == "(-, -, c) on [2, 1, 2, 1]"
    sh = infer(g, (spec((8, 6, 5)), spec((8,), dtype=np.dtype(bool))), ((1, 2, 1),), 4)  # a Tensor mask
    assert layouts_of(sh) == (["(-, c, -) on [2, 1, 2, 1]", "(-,) on [2, 1, 2, 1]"], "(-, c, -) on [2, 1, 2, 1]",
                              (0,))


def test_strided_slice_shrinks_and_inserts_around_the_cut():
    ss = ops.StridedSlice(new_axis_mask=0b010, shrink_axis_mask=0b100, end_mask=0b1)
    sh = infer(ss, (spec((8, 6, 4)), (0, 0, 1, 0), (0, 0, 2, 6), (1, 1, 1, 1)), ((2, 1, 2),), 4)
    assert layouts_of(sh) == (["(a, -, c) on [2, 1, 2]"], "(a, -, c) on [2, 1, 2]", ())  # x[0:, None, 1, 0:6]
    sh = infer(ops.StridedSlice(), (spec((8, 6)), (0, 1), (8, 6), (1, 2)), ((4, 1),), 4)
    assert str(sh.out_layout) == "(a, -) on [4, 1]"


@pytest.mark.parametrize("index, how", [
    ((slice(1, 5),), "dimension 0 of x is cut 2 but sliced"),
    ((slice(None, None, -1),), "dimension 0 of x is cut 2 but sliced"),
    ((slice(None), 3), "dimension 1 of x is cut 2 but indexed by an int"),
    (([0, 1],), "dimension 0 of x is cut 2 but indexed by an array"),
    ((Ellipsis, np.zeros((6, 5), bool)), "dimension 1 of x is cut 2 but indexed by an array"),
])
def test_getitem_refuses_to_index_a_cut_dimension(index, how):
    with pytest.raises(StrategyError, match=how + r".*must be taken whole"):
        infer(ops.GetItem(), (spec((8, 6, 5)), index), ((2, 2, 1),), 4)


def test_strided_slice_and_getitem_refusals_and_errors():
    with pytest.raises(StrategyError, match="dimension 1 of x is cut 2 but indexed by an int"):
        infer(ops.StridedSlice(shrink_axis_mask=0b10), (spec((8, 6)), (0, 1), (8, 2), (1, 1)), ((1, 2),), 2)
    with pytest.raises(StrategyError, match=r"input 1 \(the index\) has strategy \(2,\)"):
        infer(ops.GetItem(), (spec((8, 6)), spec((8,), dtype=np.dtype(np.int64))), ((1, 1), (2,)), 2)
    with pytest.raises(IndexError, match=r"GetItem: the index .* indexes 3 dimensions but x has shape \(8, 6\)"):
        infer(ops.GetItem(), (spec((8, 6)), (0, 0, 0)), ((1, 1),), 2)
    with pytest.raises(IndexError, match="GetItem: index arrays must hold integers or bools"):
        infer(ops.GetItem(), (spec((8, 6)), (np.zeros(2),)), ((1, 1),), 2)


def test_indexing_default_and_propagated_strategies():
    g = ops.GetItem()
    rule = get_rule(g)
    assert rule.data_parallel(g, (spec((8, 6)), (slice(None), 1)), 4) == ((4, 1),)
    assert rule.data_parallel(g, (spec((8, 6)), (slice(2, 6),)), 4) == ((1, 1),)
    assert rule.data_parallel(g, (spec((8, 6)), spec((3,), dtype=np.dtype(np.int64))), 4) == ((1, 1), (1,))
    cur = Layout((2, 2), ((0,), (1,)))
    assert rule.propagate(g, (spec((8, 6)), (slice(None), slice(0, 4))), (cur,), 4) == ((2, 1),)
    assert rule.propagate(g, (spec((8, 6)), (slice(1, 3),)), (cur,), 4) == ((1, 2),)
    ss = ops.StridedSlice()
    assert get_rule(ss).data_parallel(ss, (spec((8, 6)), (0, 0), (8, 3), (1, 1)), 4) == ((4, 1),)


def _index_items(shape):
    """Index tuples of ints, slices, None, Ellipsis, integer arrays and bool masks for a tensor of shape."""
    item = st.one_of(
        st.none(), st.just(Ellipsis), st.integers(-2, 1),
        st.builds(slice, st.sampled_from([None, 0, 1, -3, -100]), st.sampled_from([None, 2, -1, 100]),
                  st.sampled_from([None, 1, 2, -1])),
        st.sampled_from([(3,), (2, 1), (1, 3), ()]).map(lambda s: np.zeros(s, dtype=np.int64)),
        st.sampled_from([(4,), (4, 5), ()]).map(lambda s: np.ones(s, dtype=bool)))
    return st.lists(item, max_size=4).map(tuple)


@given(nd=st.integers(1, 4), data=st.data())
def test_index_dims_places_whole_dimensions_where_numpy_does(nd, data):
    shape = (4, 5, 6, 7)[:nd]
    index = data.draw(_index_items(shape))
    x = np.arange(np.prod(shape)).reshape(shape)
    try:
        y = x[index]
    except (IndexError, TypeError):
        return
    kinds, out = index_dims("GetItem", shape, index)
    assert len(kinds) == nd and len(out) == y.ndim
    for j, d in enumerate(out):
        if d is None:
            continue
        assert kinds[d] == "whole" and y.shape[j] == shape[d]
        # Stepping along output dimension j steps along x's dimension d.
        if y.size and shape[d] > 1:
            at = [0] * y.ndim
            first = y[tuple(at)]
            at[j] = 1
            assert y[tuple(at)] - first == x.strides[d] // x.itemsize
    assert sorted(d for d in out if d is not None) == [d for d, k in enumerate(kinds) if k == "whole"]


# ---- real runs on thread-ranks -----------------------------------------------------------------


class _Loss(nn.Cell):
    """sum(net(x) * g): its gradient with respect to the output is g, its value whole on every rank.

    (``y.backward(block)`` on a cut output is refused: autograd checks the gradient against
    the logical shape; a scalar loss avoids it.)
    """

    def __init__(self, net):
        super().__init__()
        self.net, self.mul, self.sum = net, ops.Mul(), ops.ReduceSum()

    def construct(self, x, g):
        y = self.net(x)
        return y, self.sum(self.mul(y, g))


def _batch(a, n, dataset):
    """This rank's input: the whole batch, or its slice of it."""
    if dataset == "full_batch":
        return a
    import minidl_parallel as mp
    b = a.shape[0] // n
    return a[mp.get_rank() * b:(mp.get_rank() + 1) * b]


class TwoDropouts(nn.Cell):
    """Two draws in a row (the stream advances), with different cuts (a redistribution between)."""

    def __init__(self, first, second, seeds=(0, 0)):
        super().__init__()
        self.d1 = ops.Dropout(0.6, *seeds)
        self.d2 = ops.Dropout(0.7, *seeds)
        if first is not None:
            self.d1.shard(first)
        if second is not None:
            self.d2.shard(second)

    def construct(self, x):
        return self.d2(self.d1(x))


def _dropout_run(n, first, second, seeds, mode, dataset):
    rng = np.random.default_rng(1)
    x, g = rng.standard_normal((8, 12)), rng.standard_normal((8, 12))

    def run(n, dataset):
        minidl.set_seed(11)  # every rank (and the single device) starts from the same generator state
        net = _Loss(TwoDropouts(first, second, seeds))
        xt = Tensor(_batch(x, n, dataset), requires_grad=True)
        y, loss = net(xt, Tensor(_batch(g, n, dataset)))
        loss.backward()
        return host(full_value(y)), host(gather_like(xt.grad, xt))

    want = run(1, "full_batch")
    assert 0 < np.count_nonzero(want[0]) < x.size  # something dropped, something kept
    for got in on_ranks(n, lambda: run(n, dataset), mode, dataset):
        for a, b, what in zip(got, want, ("output", "input gradient")):
            np.testing.assert_array_equal(a, b, err_msg=what)


@pytest.mark.parametrize("seeds", [(0, 0), (3, 4)], ids=["global-seed", "own-generator"])
@pytest.mark.parametrize("n, first, second", [
    (2, ((2, 1),), ((1, 2),)),
    (4, ((2, 2),), ((4, 1),)),
    (4, ((1, 2),), ((1, 1),)),   # a repeat axis: replicas keep the same window
    (4, ((1, 4),), None),        # SEMI_AUTO: the second op takes the batch cut
])
def test_dropout_sharded_equals_one_device_exactly(n, first, second, seeds):
    _dropout_run(n, first, second, seeds, "semi_auto_parallel", "full_batch")


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
def test_dropout_default_strategies_on_a_data_parallel_batch_equal_one_device(mode):
    _dropout_run(4, None, None, (0, 0), mode, "data_parallel")


class ConcatSliceNet(nn.Cell):
    """x -> two MatMuls -> Concat on the features -> StridedSlice -> GetItem with repeated indexes."""

    def __init__(self, w1, w2, strategies):
        super().__init__()
        self.w1 = Parameter(w1, name="w1")
        self.w2 = Parameter(w2, name="w2")
        self.mm1, self.mm2 = ops.MatMul(), ops.MatMul()
        self.concat = ops.Concat(1)
        self.slice = ops.StridedSlice(end_mask=0b1, new_axis_mask=0b100)
        self.getitem = ops.GetItem()
        for op, s in zip((self.mm1, self.mm2, self.concat, self.slice, self.getitem), strategies):
            if s is not None:
                op.shard(s)

    def construct(self, x):
        h = self.concat((self.mm1(x, self.w1), self.mm2(x, self.w2)))        # (8, 12)
        h = self.slice(h, (0, 1, 0), (0, 12, 1), (1, 2, 1))                  # h[:, 1:12:2, None]: (8, 6, 1)
        return self.getitem(h, (slice(None), [0, 2, 2, 5]))                  # (8, 4, 1)


def _concat_run(n, strategies, mode, dataset):
    rng = np.random.default_rng(2)
    x, w1, w2 = rng.standard_normal((8, 6)), rng.standard_normal((6, 4)), rng.standard_normal((6, 8))
    g = rng.standard_normal((8, 4, 1))

    def run(n, dataset, strategies):
        inner = ConcatSliceNet(w1, w2, strategies)
        xt = Tensor(_batch(x, n, dataset), requires_grad=True)
        y, loss = _Loss(inner)(xt, Tensor(_batch(g, n, dataset)))
        loss.backward()
        return [host(a) for a in (full_value(y), gather_like(xt.grad, xt), gather_like(inner.w1.grad, inner.w1),
                                      gather_like(inner.w2.grad, inner.w2))]

    want = run(1, "full_batch", [None] * 5)
    for got in on_ranks(n, lambda: run(n, dataset, strategies), mode, dataset):
        for a, b, what in zip(got, want, ("output", "input gradient", "w1 gradient", "w2 gradient")):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=what)


@pytest.mark.parametrize("n, strategies", [
    (2, [((2, 1), (1, 1)), ((1, 1), (1, 2)), ((2, 1), (2, 1)), ((2, 1),), ((2, 1, 1),)]),
    (4, [((2, 1), (1, 2)), ((2, 2), (2, 1)), ((2, 1), (2, 1)), ((4, 1),), ((1, 1, 1),)]),
    (4, [((1, 2), (2, 2)), None, ((4, 1), (4, 1)), None, None]),
])
@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
def test_concat_and_slices_sharded_equal_one_device(n, strategies, mode):
    _concat_run(n, strategies, mode, "full_batch")


def test_concat_and_slices_with_default_strategies_on_a_data_parallel_batch():
    _concat_run(4, [None] * 5, "semi_auto_parallel", "data_parallel")


def test_refusal_through_the_dispatcher_names_the_operator_and_the_rule():
    def rank():
        net = ConcatSliceNet(np.ones((6, 4)), np.ones((6, 8)), [None, None, ((1, 2), (1, 2)), None, None])
        try:
            net(Tensor(np.ones((8, 6))))
        except StrategyError as e:
            return str(e)
    msgs = on_ranks(2, rank, "semi_auto_parallel")
    assert len(set(msgs)) == 1
    assert "Concat (concat)" in msgs[0] and "the concatenation axis 1 is cut 2 in input 0" in msgs[0], msgs[0]


class TensorIndexNet(nn.Cell):
    """x[index] with the index a Tensor (integer rows with repeats, or a bool mask), then Tanh."""

    def __init__(self, index, strategy):
        super().__init__()
        self.index = Tensor(index)
        self.getitem = ops.GetItem()
        if strategy is not None:
            self.getitem.shard(strategy)

    def construct(self, x):
        return ops.tanh(self.getitem(x, self.index))


@pytest.mark.parametrize("index", [np.array([0, 3, 3, 7]), np.arange(8) % 3 == 0], ids=["rows", "mask"])
@pytest.mark.parametrize("strategy, mode", [(((1, 2),), "semi_auto_parallel"), (None, "auto_parallel")])
def test_getitem_with_a_tensor_index_equals_one_device(index, strategy, mode):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 6))
    g = rng.standard_normal(x[index].shape)

    def run(strategy):
        xt = Tensor(x, requires_grad=True)
        y, loss = _Loss(TensorIndexNet(index, strategy))(xt, Tensor(g))
        loss.backward()
        return host(full_value(y)), host(gather_like(xt.grad, xt))

    want = run(None)
    for got in on_ranks(2, lambda: run(strategy), mode):
        for a, b, what in zip(got, want, ("output", "input gradient")):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=what)
