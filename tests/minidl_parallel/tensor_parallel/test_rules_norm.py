"""Sharding rules of BatchNorm, SyncBatchNormOp and BatchNormReLU (rules/norm.py).

Layouts and decompositions are checked on their own; the blocks the fused op computes are
checked by ``simulate`` (every rank in one process, test_rules.py); and a small network with
BatchNormReLU, with and without its residual, trained under SEMI_AUTO_PARALLEL on thread-ranks
must equal the single-device run.
"""
import numpy as np
import pytest

import minidl
import minidl_parallel
from minidl import Tensor, nn, ops
from minidl_parallel import run_threads
from minidl_parallel.sync_batchnorm import SyncBatchNorm, SyncBatchNormOp
from minidl_parallel.tensor_parallel.rules import Decomposed, OpSharding, Site, StrategyError, get_rule

from momentum_steps import momentum_steps
from test_rules import infer, layouts_of, simulate, spec

X = spec((8, 4, 3, 3))
VEC = spec((4,), True)
STATS = spec((4,), False)


def host(array):
    """A NumPy copy of a gathered value, from either array module (the suite also runs pinned to the GPU)."""
    return np.array(minidl.backend.to_numpy(array))


def bnr_args(residual=True, stats=True):
    return (X, VEC, VEC) + ((STATS, STATS) if stats else (None, None)) + ((X,) if residual else ())


def bnr_strategy(n, c, residual=True, stats=True):
    return ((n, c, 1, 1),) + ((c,),) * (4 if stats else 2) + (((n, c, 1, 1),) if residual else ())


# ---- layouts and decompositions ------------------------------------------------------------------

@pytest.mark.parametrize("residual", [True, False])
def test_fused_op_runs_on_blocks_where_batchnorm_does(residual):
    # Channels cut in training: each rank has its channels' whole batch.
    sh = infer(ops.BatchNormReLU(True), bnr_args(residual), bnr_strategy(1, 2, residual), 4)
    assert isinstance(sh, OpSharding)
    x_lay = "(-, c, -, -) on [2, 1, 2]"
    assert layouts_of(sh) == ([x_lay] + ["(c,) on [2, 1, 2]"] * 4 + [x_lay] * residual, x_lay, (0,))
    # Inference: the batch may be cut too (running statistics, nothing to synchronise).
    sh = infer(ops.BatchNormReLU(False), bnr_args(residual), bnr_strategy(2, 2, residual), 4)
    assert isinstance(sh, OpSharding) and str(sh.out_layout) == "(a, b, -, -) on [2, 2]"
    assert [str(lay) for lay in sh.in_layouts][-1] == ("(a, b, -, -) on [2, 2]" if residual else "(b,) on [2, 2]")


@pytest.mark.parametrize("residual, stats", [(True, True), (False, True), (True, False)])
def test_fused_op_with_the_batch_cut_in_training_runs_as_the_separate_ops(residual, stats):
    sh = infer(ops.BatchNormReLU(True), bnr_args(residual, stats), bnr_strategy(2, 1, residual, stats), 2)
    assert isinstance(sh, Decomposed)
    assert "BatchNorm (synchronised), Add and ReLU" in sh.description


def test_residual_must_be_cut_as_x():
    strategy = bnr_strategy(1, 2)[:-1] + ((2, 2, 1, 1),)
    with pytest.raises(StrategyError, match=r"input 5 \(the residual\) has strategy \(2, 2, 1, 1\); it must be cut "
                                            r"as x, \(1, 2, 1, 1\)"):
        infer(ops.BatchNormReLU(True), bnr_args(), strategy, 4)
    with pytest.raises(ValueError, match=r"BatchNormReLU: residual of shape \(8, 4, 3\) must have x's shape"):
        infer(ops.BatchNormReLU(True), bnr_args()[:5] + (spec((8, 4, 3)),), bnr_strategy(1, 2)[:5] + ((1, 2, 1),), 4)


def test_fused_op_default_and_propagated_strategies_cut_the_residual_as_x():
    from minidl_parallel.tensor_parallel.layout import Layout
    prim = ops.BatchNormReLU(True)
    rule = get_rule(prim)
    assert rule.data_parallel(prim, bnr_args(), 4) == bnr_strategy(4, 1)
    assert rule.data_parallel(prim, bnr_args(False, False), 4) == bnr_strategy(4, 1, False, False)
    x_cut = Layout((2, 2), ((0,), (1,), (), ()))
    layouts = (x_cut,) + (Layout.replicated(1, 4),) * 4 + (x_cut,)
    assert rule.propagate(prim, bnr_args(), layouts, 4) == bnr_strategy(2, 2)


@pytest.mark.parametrize("training, n, c", [(False, 2, 2), (True, 1, 2), (True, 1, 4)])
@pytest.mark.parametrize("residual", [True, False])
def test_each_rank_computes_its_block_of_the_fused_op(training, n, c, residual):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 4, 3, 3))
    args = [x, rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(4), rng.random(4) + 0.5]
    if residual:
        args.append(rng.standard_normal(x.shape))
    simulate(ops.BatchNormReLU(training), args, list(range(len(args))), bnr_strategy(n, c, residual), 4)


def test_batchnorm_with_the_batch_cut_in_training_runs_as_syncbatchnorm():
    bn = ops.BatchNorm(True, 1e-3, 0.2)
    strategy = ((2, 2, 1, 1),) + ((2,),) * 4
    sh = infer(bn, (X, VEC, VEC, STATS, STATS), strategy, 4)
    assert isinstance(sh, Decomposed) and isinstance(sh.fn, SyncBatchNormOp)
    assert (sh.fn.epsilon, sh.fn.momentum, sh.fn.in_strategy) == (1e-3, 0.2, strategy)
    assert isinstance(infer(bn, (X, VEC, VEC, STATS, STATS), ((1, 2, 1, 1),) + ((2,),) * 4, 4), OpSharding)


def test_syncbatchnorm_op_takes_its_group_from_the_site():
    strategy = ((2, 2, 1, 1),) + ((2,),) * 4
    sh = infer(SyncBatchNormOp(), (X, VEC, VEC, STATS, STATS), strategy, 4)
    assert isinstance(sh, OpSharding) and callable(sh.local_attrs)
    asked = []

    def group(layout, axes):
        asked.append((str(layout), axes))
        return "the group"
    assert sh.local_attrs(Site((1, 0), group)) == {"group": "the group"}
    assert asked == [("(a, b, -, -) on [2, 2]", (0,))]  # the ranks of the other batch blocks
    # The batch whole: nothing to synchronise, plain BatchNorm on each block.
    sh = infer(SyncBatchNormOp(), (X, VEC, VEC, STATS, STATS), ((1, 4, 1, 1),) + ((4,),) * 4, 4)
    assert isinstance(sh, Decomposed) and type(sh.fn) is ops.BatchNorm


# ---- against one device -------------------------------------------------------------------------

F64 = minidl.float64


class _Net(nn.Cell):
    """conv, BatchNorm-ReLU (BatchNorm2d.with_relu), conv, BatchNormReLU (optional residual), dense."""

    def __init__(self, residual, strategy):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, pad_mode="pad", padding=1, has_bias=True, dtype=F64)
        self.bn1 = nn.BatchNorm2d(4, momentum=0.7, dtype=F64)
        self.conv2 = nn.Conv2d(4, 4, 1, has_bias=True, dtype=F64)
        self.bn2 = nn.BatchNorm2d(4, momentum=0.7, dtype=F64)
        self.fused = ops.BatchNormReLU(True, self.bn2.eps, 1.0 - self.bn2.momentum)
        if strategy is not None:
            self.fused.shard(strategy + ((strategy[0],) if residual else ()))
        self.residual = residual
        self.flatten = nn.Flatten()
        self.dense = nn.Dense(4 * 4 * 4, 3, dtype=F64)

    def construct(self, x):
        h = self.bn1.with_relu(self.conv1(x))
        args = (self.conv2(h), self.bn2.gamma, self.bn2.beta, self.bn2.moving_mean, self.bn2.moving_variance)
        y = self.fused(*args, h) if self.residual else self.fused(*args)
        return self.dense(self.flatten(y))


def _train(residual, strategy, x, y, init, steps=2):
    """Momentum steps of _Net; (losses, output of step 1, every parameter and statistic), gathered."""
    net = _Net(residual, strategy)
    net.set_train(True)
    minidl.load_param_into_net(net, {k: v.copy() for k, v in init.items()})
    return momentum_steps(net, x, y, steps)


@pytest.mark.parametrize("residual", [True, False])
@pytest.mark.parametrize("n, strategy, dataset", [
    (2, None, "data_parallel"),                                    # SEMI_AUTO's default: the batch cut
    (4, None, "data_parallel"),
    (4, ((1, 2, 1, 1),) + ((2,),) * 4, "full_batch"),              # channels cut: fused on each block
    (4, ((2, 2, 1, 1),) + ((2,),) * 4, "full_batch"),              # both: synchronised over the batch blocks
])
def test_network_with_batchnorm_relu_under_semi_auto_equals_single_device(residual, n, strategy, dataset):
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((8, 3, 4, 4)), rng.standard_normal((8, 3))
    minidl.set_seed(0)
    init = {name: p.asnumpy().copy() for name, p in _Net(residual, None).parameters_and_names()}
    ref = _train(residual, None, x, y, init)

    def rank():
        minidl_parallel.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy=dataset)
        try:
            if dataset == "full_batch":
                return _train(residual, strategy, x, y, init)
            r, b = minidl_parallel.get_rank(), len(x) // n
            return _train(residual, strategy, x[r * b:(r + 1) * b], y[r * b:(r + 1) * b], init)
        finally:
            minidl_parallel.reset_auto_parallel_context()
    for losses, out, state in run_threads(n, rank):
        np.testing.assert_allclose(losses, ref[0], rtol=1e-10)
        np.testing.assert_allclose(out, ref[1], rtol=1e-10, atol=1e-12)
        assert state.keys() == ref[2].keys()
        for name, value in ref[2].items():  # weights, gamma, beta and the moving statistics
            np.testing.assert_allclose(state[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_syncbatchnorm_cell_under_semi_auto_synchronises_over_the_batch_blocks_only():
    """Channels cut in 2 and the batch in 2 on 4 ranks: the statistics of a channel block are
    summed over the 2 ranks holding its batch blocks, not over the world (which would add the
    other channel block's sums)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 4, 2, 2)) * 2 + 1
    w = rng.standard_normal(x.shape)

    def run(bn):
        from minidl_parallel.tensor_parallel.dispatch import full_value, gather_like
        bn.set_train(True)
        xt = Tensor(x)
        gx, (gg, gb) = minidl.grad(lambda t: (bn(t) * Tensor(w)).sum(), 0, [bn.gamma, bn.beta])(xt)
        return [host(full_value(bn(xt)))] + [host(gather_like(g, like)) for g, like in
                                                  ((gx, xt), (gg, bn.gamma), (gb, bn.beta))] + \
            [host(full_value(bn.moving_mean)), host(full_value(bn.moving_variance))]

    ref = run(nn.BatchNorm2d(4, dtype=F64))

    def rank():
        minidl_parallel.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
        try:
            bn = SyncBatchNorm(4, dtype=F64)
            bn.bn_train.shard(((2, 2, 1, 1),) + ((2,),) * 4)
            return run(bn)
        finally:
            minidl_parallel.reset_auto_parallel_context()
    for got in run_threads(4, rank):
        for name, a, b in zip(["y", "gx", "ggamma", "gbeta", "moving_mean", "moving_variance"], got, ref):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)
