"""graph_mode.explain(net, *inputs): what fused in one call, what did not, and why; the rule table."""
import os
import sys

import numpy as np

import minidl
from minidl import Tensor, graph_mode, nn, ops

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "benchmarks"))
import models_minidl  # noqa: E402  (the user-written BasicBlock)


def image(shape=(4, 3, 8, 8), seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def rows_of(net, *inputs, **kw):
    return graph_mode.explain(net, *inputs, file=False, **kw)


def test_a_residual_block_fuses_both_patterns_and_the_downsample_batchnorm_runs_at_the_add():
    block = models_minidl.BasicBlock(3, 8, 2)
    block.set_train(True)
    rows = rows_of(block, image())
    fused = sorted(r["ops"] for r in rows if r["what"] == "fused")
    assert fused == ["BatchNorm + Add + ReLU -> BatchNormReLU", "BatchNorm + ReLU -> BatchNormReLU"]
    where = {r["ops"]: r["where"] for r in rows if r["what"] == "fused"}
    assert where["BatchNorm + ReLU -> BatchNormReLU"] == "bn1"
    assert where["BatchNorm + Add + ReLU -> BatchNormReLU"] == "bn2"
    # the down-sample's BatchNorm is the residual: the Add computes it (as eager's order)
    (other,) = [r for r in rows if r["what"] != "fused"]
    assert other["ops"] == "BatchNorm" and other["where"] == "down_sample.1"
    assert "Add" in other["why"]


def test_explain_leaves_the_network_as_it_was_and_the_mode_as_set():
    block = models_minidl.BasicBlock(3, 8, 2)
    block.set_train(True)
    before = {name: p.asnumpy().copy() for name, p in block.parameters_and_names()}
    mode = minidl.get_context("mode")
    rows_of(block, image())
    assert minidl.get_context("mode") == mode
    for name, p in block.parameters_and_names():
        np.testing.assert_array_equal(p.asnumpy(), before[name], err_msg=name)


class _UsedTwice(nn.Cell):
    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)

    def construct(self, x):
        y = self.bn(x)
        return ops.relu(y * 2.0)


class _Nhwc(nn.Cell):
    def __init__(self):
        super().__init__()
        self.bn = ops.BatchNorm(is_training=True, data_format="NHWC")
        self.gamma, self.beta = minidl.Parameter(np.ones(3, np.float32)), minidl.Parameter(np.zeros(3, np.float32))

    def construct(self, x):
        return ops.relu(self.bn(x, self.gamma, self.beta, None, None))


def test_a_use_no_rule_continues_names_the_op_and_the_pattern():
    net = _UsedTwice()
    net.set_train(True)
    (row,) = rows_of(net, image())
    assert row["what"] == "not fused" and row["ops"] == "BatchNorm" and row["where"] == "bn"
    assert row["why"] == "Mul used its output (no rule continues BatchNorm with Mul)"


def test_a_failed_head_guard_says_which():
    net = _Nhwc()
    net.set_train(True)
    (row,) = rows_of(net, image((4, 8, 8, 3)))
    assert row == {"what": "not deferred", "ops": "BatchNorm", "where": "_Nhwc",  # the root Cell: its class
                   "why": "data_format NHWC (the fused kernel takes NCHW)"}


def test_a_grad_mode_change_and_inference_are_explained():
    class GradOff(nn.Cell):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def construct(self, x):
            y = self.bn(x)
            with minidl.no_grad():
                return ops.relu(y)
    net = GradOff()
    net.set_train(True)
    (row,) = rows_of(net, image())
    assert row["what"] == "not fused" and row["why"] == "the grad mode changed since the head was called"
    (row,) = rows_of(net, image(), grad=False)  # all under no_grad: nothing changes in the window
    assert row["what"] == "fused"


def test_a_sequential_dense_relu_and_the_printed_table(capsys):
    net = nn.SequentialCell(nn.Dense(5, 4), nn.ReLU(), nn.Dense(4, 2))
    x = Tensor(np.ones((3, 5), np.float32))
    rows = graph_mode.explain(net, x)
    printed = capsys.readouterr().out
    assert [r["what"] for r in rows] == ["fused", "not fused"]
    assert rows[0]["ops"] == "Dense + ReLU -> DenseReLU" and rows[0]["where"] == "0"
    assert rows[1]["ops"] == "Dense" and rows[1]["why"] == "the network returned"
    assert printed.startswith("GRAPH_MODE over one call of SequentialCell: 1 fused, 1 not fused\n")
    for rule in graph_mode.RULES:  # the table: one line per rule
        assert f"  {rule.describe()}\n" in printed + "\n"
