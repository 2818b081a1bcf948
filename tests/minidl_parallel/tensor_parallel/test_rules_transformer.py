"""Sharding rules of the Transformer operators: GeLU / LeakyReLU / SiLU, LayerNorm, GroupNorm, Gather
(Embedding, with the vocabulary-parallel table) and NLLLoss.

Layouts and refusals are checked on their own; real runs go through the dispatcher on thread-ranks
and compare the gathered outputs, losses and gradients with one device (float64).
"""
import numpy as np
import pytest

import minidl
from minidl import Parameter, Tensor, nn, ops
from minidl_parallel.tensor_parallel.dispatch import full_value, gather_like
from minidl_parallel.tensor_parallel.layout import Layout
from minidl_parallel.tensor_parallel.rules import Decomposed, OpSharding, Site, StrategyError, get_rule
from rule_helpers import host, infer, layouts_of, spec, on_ranks

F64, I32 = np.dtype(np.float64), np.dtype(np.int32)










# ---- layouts ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("prim", [ops.GeLU(), ops.GeLU("none"), ops.LeakyReLU(0.1), ops.SiLU()])
def test_unary_activations_keep_their_input_cuts(prim):
    sh = infer(prim, (spec((8, 6)),), ((2, 2),), 4)
    assert layouts_of(sh) == (["(a, b) on [2, 2]"], "(a, b) on [2, 2]", ())


def test_layer_norm_keeps_batch_and_sequence_cuts():
    x, p = spec((4, 6, 8)), spec((8,), True)
    sh = infer(ops.LayerNorm(-1, -1), (x, p, p), ((2, 2, 1), (1,), (1,)), 4)
    assert layouts_of(sh) == (["(a, b, -) on [2, 2, 1]", "(-,) on [2, 2, 1]", "(-,) on [2, 2, 1]"],
                              "(a, b, -) on [2, 2, 1]", ())
    # gamma covering a cut dimension that is not normalised is cut with it
    p2 = spec((6, 8), True)
    sh = infer(ops.LayerNorm(2, 1), (x, p2, p2), ((2, 2, 1), (2, 1), (2, 1)), 4)
    assert [str(lay) for lay in sh.in_layouts][1] == "(b, -) on [2, 2, 1]"
    rule, prim = get_rule(ops.LayerNorm(-1, -1)), ops.LayerNorm(-1, -1)
    assert rule.data_parallel(prim, (x, p, p), 4) == ((4, 1, 1), (1,), (1,))
    whole = Layout.replicated(1, 4)
    # a cut of the normalised dimension is not followed; a partial axis moves onto the sequence
    assert rule.propagate(prim, (x, p, p), (Layout((2, 2), ((0,), (), (1,))), whole, whole), 4) == \
        ((2, 1, 1), (1,), (1,))
    assert rule.propagate(prim, (x, p, p), (Layout((2, 2), ((0,), (), ()), ((1, "sum"),)), whole, whole), 4) == \
        ((2, 2, 1), (1,), (1,))


def test_layer_norm_refusals():
    x, p = spec((4, 6, 8)), spec((8,), True)
    with pytest.raises(StrategyError, match=r"cuts dimension\(s\) \[2\], which LayerNorm normalises \(begin_norm_axis"
                                            r"=-1\); normalised dimensions must be whole"):
        infer(ops.LayerNorm(-1, -1), (x, p, p), ((1, 1, 2), (2,), (2,)), 2)
    p2 = spec((6, 8), True)
    with pytest.raises(StrategyError, match=r"input 1 \(gamma\) has strategy \(1, 1\); it must be \(2, 1\)"):
        infer(ops.LayerNorm(2, 1), (x, p2, p2), ((1, 2, 1), (1, 1), (2, 1)), 2)
    with pytest.raises(ValueError, match=r"LayerNorm: gamma of shape \(6, 8\) must be "
                                         r"x.shape\[begin_params_axis=-1:\]"):
        infer(ops.LayerNorm(-1, -1), (x, p2, p2), ((1, 1, 1), (1, 1), (1, 1)), 2)


def test_group_norm_cuts_whole_groups():
    x, p = spec((4, 8, 3)), spec((8,), True)
    sh = infer(ops.GroupNorm(4), (x, p, p), ((2, 2, 1), (2,), (2,)), 4)
    assert layouts_of(sh) == (["(a, b, -) on [2, 2, 1]", "(b,) on [2, 2, 1]", "(b,) on [2, 2, 1]"],
                              "(a, b, -) on [2, 2, 1]", ())
    assert sh.local_attrs == {"num_groups": 2}
    assert infer(ops.GroupNorm(4), (x, p, p), ((4, 1, 1), (1,), (1,)), 4).local_attrs is None
    with pytest.raises(StrategyError, match=r"the channels are cut 4, which does not divide num_groups=2"):
        infer(ops.GroupNorm(2), (x, p, p), ((1, 4, 1), (4,), (4,)), 4)
    with pytest.raises(StrategyError, match=r"cuts dimension\(s\) \[2\]: the group statistics span the spatial"):
        infer(ops.GroupNorm(2), (x, p, p), ((1, 1, 3), (1,), (1,)), 3)
    with pytest.raises(StrategyError, match=r"input 2 \(beta\) has strategy \(1,\); it must be \(2,\)"):
        infer(ops.GroupNorm(2), (x, p, p), ((1, 2, 1), (2,), (1,)), 2)
    rule, prim = get_rule(ops.GroupNorm(2)), ops.GroupNorm(2)
    assert rule.data_parallel(prim, (x, p, p), 4) == ((4, 1, 1), (1,), (1,))
    channels = Layout((2, 4), ((0,), (1,), ()))  # 4 does not divide the 2 groups: the channels come back whole
    assert rule.propagate(prim, (x, p, p), (channels, Layout.replicated(1, 8), Layout.replicated(1, 8)), 8) == \
        ((2, 1, 1), (1,), (1,))


def test_gather_layouts_replicated_and_vocabulary_parallel():
    table, ids = spec((16, 8), True), spec((4, 6), dtype=I32)
    sh = infer(ops.Gather(), (table, ids, 0), ((1, 1), (2, 2)), 4)
    assert layouts_of(sh) == (["(-, -) on [1, 1, 2, 2]", "(c, d) on [1, 1, 2, 2]"], "(c, d, -) on [1, 1, 2, 2]", ())
    assert sh.local_attrs is None
    sh = infer(ops.Gather(), (table, ids, 0), ((4, 1), (2, 1)), 8)
    assert layouts_of(sh) == (["(a, -) on [4, 1, 2, 1]", "(c, -) on [4, 1, 2, 1]"],
                              "(c, -, -) on [4, 1, 2, 1] +sum(a)", ())
    assert sh.local_attrs(Site((3, 0, 1, 0), None)) == {"row_block": (12, 16)}
    # the embedding dimension cut (column-parallel): the output's last dimension is cut
    sh = infer(ops.Gather(), (table, ids, -2), ((1, 2), (1, 1)), 2)
    assert str(sh.out_layout) == "(-, -, b) on [1, 2, 1, 1]"
    # gather along axis 1 of a (4, 16) table
    sh = infer(ops.Gather(), (spec((4, 16)), spec((3,), dtype=I32), 1), ((2, 2), (1,)), 4)
    assert str(sh.out_layout) == "(a, -) on [2, 2, 1] +sum(b)"
    rule, prim = get_rule(ops.Gather()), ops.Gather()
    assert rule.data_parallel(prim, (table, ids, 0), 4) == ((1, 1), (4, 1))
    assert rule.propagate(prim, (table, ids, 0), (Layout.replicated(2, 4), Layout((2, 2), ((0,), (1,)))), 4) == \
        ((1, 1), (2, 2))
    with pytest.raises(StrategyError, match=r"dimension 0 of input 0 has size 16, not divisible by its cut 3"):
        infer(ops.Gather(), (table, ids, 0), ((3, 1), (1, 1)), 3)
    with pytest.raises(StrategyError, match=r"the axis must be a Python int"):
        infer(ops.Gather(), (table, ids, spec(())), ((1, 1), (1, 1), ()), 1)


def test_nll_loss_layouts_by_reduction():
    x, t, w = spec((8, 5, 4)), spec((8, 4), dtype=I32), spec((5,))
    sh = infer(ops.NLLLoss("none"), (x, t, w), ((2, 1, 2), (2, 2), (1,)), 4)
    assert layouts_of(sh) == (["(a, -, c) on [2, 1, 2]", "(a, c) on [2, 1, 2]", "(-,) on [2, 1, 2]"],
                              "(a, c) on [2, 1, 2]", ())
    sh = infer(ops.NLLLoss("sum"), (x, t), ((2, 1, 2), (2, 2)), 4)
    assert sh.out_layout.tensor_map == () and sh.out_layout.partial == ((0, "sum"), (2, "sum"))
    assert isinstance(infer(ops.NLLLoss("mean"), (x, t), ((2, 1, 1), (2, 1)), 2), Decomposed)
    assert isinstance(infer(ops.NLLLoss("mean"), (x, t), ((1, 1, 1), (1, 1)), 2), OpSharding)
    rule, prim = get_rule(ops.NLLLoss()), ops.NLLLoss()
    assert rule.data_parallel(prim, (x, t, w), 4) == ((4, 1, 1), (4, 1), (1,))
    whole = Layout.replicated(2, 4)
    assert rule.propagate(prim, (x, t), (Layout((2, 2), ((0,), (1,), ())), whole), 4) == ((2, 1, 1), (2, 1))
    assert rule.propagate(prim, (x, t), (Layout((2, 2), ((0,), (), ()), ((1, "sum"),)), whole), 4) == \
        ((2, 1, 2), (2, 2))
    with pytest.raises(StrategyError, match=r"the class dimension 1 of the log-probabilities is cut 5; NLLLoss needs "
                                            r"whole classes"):
        infer(ops.NLLLoss(), (x, t), ((1, 5, 1), (1, 1)), 5)
    with pytest.raises(StrategyError, match=r"the target's strategy \(1, 1\) must be \(2, 1\)"):
        infer(ops.NLLLoss(), (x, t), ((2, 1, 1), (1, 1)), 2)
    with pytest.raises(StrategyError, match=r"the weight's strategy \(5,\) must be \(1,\)"):
        infer(ops.NLLLoss(), (x, t, w), ((1, 1, 1), (1, 1), (5,)), 5)


# ---- against one device, on thread-ranks ------------------------------------------------------------



V, E, C = 8, 4, 6
# repeated ids, ids on the row blocks' boundaries (2 | 2 | 2 | 2 rows on 4 ranks), and -1 (row 7)
IDS = np.array([[0, 1, 2, 1], [3, 4, 4, -1], [7, 6, 5, 0], [2, 2, 3, 7]], np.int32)
TARGET = np.array([[0, 5, 2, -100], [1, 1, 4, 3], [5, 0, -100, 2], [3, 3, 1, 0]])


class TinyLM(nn.Cell):
    """ids -> Embedding -> LayerNorm -> activation -> Dense -> LogSoftmax (classes on axis 1) -> NLLLoss."""

    def __init__(self, init, act, strategies):
        super().__init__()
        self.emb = nn.Embedding(V, E, embedding_table=Tensor(init["table"]), dtype=minidl.float64)
        self.ln = nn.LayerNorm((E,), gamma_init=Tensor(init["gamma"]), beta_init=Tensor(init["beta"]),
                               dtype=minidl.float64)
        self.act = act
        self.w = Parameter(init["w"], name="w")
        self.matmul = ops.BatchMatMul()
        self.transpose = ops.Transpose()
        self.log_softmax = ops.LogSoftmax(axis=1)
        self.nll = ops.NLLLoss("mean", label_smoothing=0.1)
        self.weight = Tensor(init["class_weight"])
        s_emb, s_ln, s_act, s_nll = strategies
        if s_emb is not None:
            self.emb.shard(s_emb)
        if s_ln is not None:
            self.ln.shard(s_ln)
        if s_act is not None:
            self.act.shard(s_act)
        if s_nll is not None:
            self.nll.shard(s_nll)

    def construct(self, ids, target):
        h = self.act(self.ln(self.emb(ids)))                         # (N, T, E)
        logits = self.transpose(self.matmul(h, self.w), (0, 2, 1))    # (N, C, T)
        return self.nll(self.log_softmax(logits), target, self.weight), h


def _init():
    rng = np.random.default_rng(7)
    return {"table": rng.standard_normal((V, E)), "gamma": rng.random(E) + 0.5, "beta": rng.standard_normal(E),
            "w": rng.standard_normal((E, C)), "class_weight": rng.random(C) + 0.5}


def _lm_run(n, act, strategies):
    init = _init()

    def run(strategies):
        net = TinyLM(init, act(), strategies)
        loss, h = net(Tensor(IDS), Tensor(TARGET))
        loss.backward()
        grads = [host(gather_like(p.grad, p)) for p in (net.emb.embedding_table, net.ln.gamma, net.ln.beta, net.w)]
        return [host(full_value(loss)), host(full_value(h))] + grads

    want = run([None] * 4)
    names = ("loss", "hidden", "table gradient", "gamma gradient", "beta gradient", "w gradient")
    for got in on_ranks(n, lambda: run(strategies)):
        for a, b, what in zip(got, want, names):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=what)


ACTS = {"gelu": lambda: ops.GeLU("none"), "silu": ops.SiLU, "leaky_relu": lambda: ops.LeakyReLU(0.1)}


@pytest.mark.parametrize("n, strategies", [
    (2, [((2, 1), (1, 1)), None, None, None]),                                   # vocabulary-parallel on 2
    (4, [((4, 1), (1, 1)), ((2, 2, 1),), ((2, 2, 1),), ((2, 1, 2), (2, 2), (1,))]),  # vocabulary-parallel on 4
    (4, [((2, 1), (2, 1)), ((4, 1, 1),), ((1, 1, 4),), ((4, 1, 1), (4, 1), (1,))]),  # vocabulary x batch
    (4, [((1, 1), (2, 2)), ((2, 2, 1),), ((2, 2, 1),), None]),                   # table whole, ids cut
    (4, [((1, 2), (2, 1)), ((2, 1, 1),), None, ((1, 1, 4), (1, 4), (1,))]),      # embedding dim cut, sum over T
], ids=["vocab2", "vocab4", "vocab2-batch2", "ids-cut", "columns"])
@pytest.mark.parametrize("act", sorted(ACTS))
def test_tiny_language_model_sharded_equals_one_device(n, strategies, act):
    _lm_run(n, ACTS[act], strategies)


def test_tiny_language_model_with_default_strategies():
    _lm_run(4, ACTS["gelu"], [None] * 4)


def test_vocabulary_parallel_embedding_cell_with_padding_on_four_ranks():
    """nn.Embedding cut by rows on 4 ranks: boundary, repeated and padding ids; the table's gradient."""
    rng = np.random.default_rng(3)
    table, g = rng.standard_normal((V, E)), rng.standard_normal(IDS.shape + (E,))

    def run(strategy):
        emb = nn.Embedding(V, E, embedding_table=Tensor(table), dtype=minidl.float64, padding_idx=2)
        if strategy is not None:
            emb.shard(strategy)
        y = emb(Tensor(IDS))
        ops.ReduceSum()(ops.Mul()(y, Tensor(g)), ()).backward()
        return host(full_value(y)), host(gather_like(emb.embedding_table.grad, emb.embedding_table))

    want = run(None)
    assert np.all(want[1][2] == 0) and np.all(want[0][IDS == 2] == 0)
    for got in on_ranks(4, lambda: run(((4, 1), (1, 1)))):
        for a, b, what in zip(got, want, ("output", "table gradient")):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=what)


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_nll_loss_none_and_sum_on_a_cut_batch(reduction):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, C, 4))

    def run(strategy):
        xt = Tensor(x, requires_grad=True)
        nll = ops.NLLLoss(reduction)
        if strategy is not None:
            nll.shard(strategy)
        loss = nll(ops.log_softmax(xt, 1), Tensor(TARGET))
        ops.ReduceSum()(loss, ()).backward()
        return host(full_value(loss)), host(gather_like(xt.grad, xt))

    want = run(None)
    for got in on_ranks(4, lambda: run(((2, 1, 2), (2, 2)))):
        for a, b, what in zip(got, want, ("loss", "gradient")):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=what)


@pytest.mark.parametrize("strategy", [((2, 2, 1), (2,), (2,)), ((4, 1, 1), (1,), (1,)), ((1, 4, 1), (4,), (4,))])
def test_group_norm_sharded_equals_one_device(strategy):
    rng = np.random.default_rng(6)
    x, g = rng.standard_normal((4, 8, 3)), rng.standard_normal((4, 8, 3))
    gamma, beta = rng.random(8) + 0.5, rng.standard_normal(8)

    def run(strategy):
        gn = nn.GroupNorm(4, 8, gamma_init=Tensor(gamma), beta_init=Tensor(beta), dtype=minidl.float64)
        if strategy is not None:
            gn.group_norm.shard(strategy)
        xt = Tensor(x, requires_grad=True)
        y = gn(xt)
        ops.ReduceSum()(ops.Mul()(y, Tensor(g)), ()).backward()
        return [host(full_value(y)), host(gather_like(xt.grad, xt))] + [
            host(gather_like(p.grad, p)) for p in (gn.gamma, gn.beta)]

    want = run(None)
    for got in on_ranks(4, lambda: run(strategy)):
        for a, b, what in zip(got, want, ("output", "x gradient", "gamma gradient", "beta gradient")):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=what)
