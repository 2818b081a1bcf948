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
    try:
        for m in (minidl.PYNATIVE_MODE, minidl.GRAPH_MODE):   # each set explicitly: as the caller left it
            minidl.set_context(mode=m)
            rows_of(block, image())
            assert minidl.get_context("mode") == m
    finally:
        minidl.set_context(mode=mode)
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


def mat(shape, seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


class _Refused(nn.Cell):
    """Calls of the heads whose guards refuse them (each tried: eager raises for some)."""

    def __init__(self):
        super().__init__()
        self.w, self.b = minidl.Parameter(mat((3, 5), 1).data, name="w"), minidl.Parameter(mat((3,), 2).data, name="b")
        self.g, self.beta = minidl.Parameter(np.ones(3, np.float32)), minidl.Parameter(np.zeros(3, np.float32))

    def construct(self, x, img):
        from test_graph_mode import sharded
        bn = ops.BatchNorm(is_training=True)
        for call in (lambda: bn(img, self.g, self.beta, None),                       # eager: 5 inputs expected
                     lambda: bn(img.asnumpy(), self.g, self.beta, None, None),
                     lambda: bn(img[:1, :, :1, :1], self.g, self.beta, None, None),   # eager raises at the run
                     lambda: ops.MatMul(transpose_a=True)(x, self.w),
                     lambda: ops.MatMul(transpose_b=True)(x, ops.cast(self.w, minidl.float64)),
                     lambda: ops.MatMul(transpose_b=True)(x, sharded(self.w * 1.0)),
                     lambda: ops.Dense()(x.asnumpy(), self.w, self.b)):
            try:
                call()
            except (TypeError, ValueError):
                pass
        return x


def test_each_refusing_head_guard_is_named_where_the_op_was_called():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.refused = _Refused()

        def construct(self, x, img):
            return self.refused(x, img)
    rows = rows_of(Net(), mat((4, 5)), image())
    assert {(r["what"], r["where"]) for r in rows} == {("not deferred", "refused")}
    assert [(r["ops"], r["why"]) for r in rows] == [
        ("BatchNorm", "not 5 arguments"),
        ("BatchNorm", "an argument is not a Tensor (a raw array could change unwatched)"),
        ("BatchNorm", "one value per channel (eager raises)"),
        ("MatMul", "not x @ w.T of two Tensors"),
        ("MatMul", "operands of two dtypes or devices (eager's call, and its error)"),
        ("MatMul", "a sharded argument on the local runtime (eager raises for it)"),
        ("Dense", "not 2 or 3 Tensor arguments")]


def test_a_dense_op_on_two_devices_is_named(on_the_double):
    class Net(nn.Cell):
        def construct(self, x, w):
            try:
                ops.Dense()(x, w)
            except TypeError:   # eager's error: inputs on two devices
                pass
            return x
    minidl.set_context(device_target="CPU")
    w = mat((3, 5), 1)   # on the host
    minidl.set_context(device_target="GPU")
    (row,) = rows_of(Net(), mat((4, 5)), w)
    assert row == {"what": "not deferred", "ops": "Dense", "where": "Net",
                   "why": "arguments on two devices (eager's call, and its error)"}


class _Broken(nn.Cell):
    """Patterns that start and break, each for its own reason."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(3)
        self.w, self.b = minidl.Parameter(mat((3, 5), 1).data, name="w"), minidl.Parameter(mat((3,), 2).data, name="b")

    def construct(self, x, img):
        h = img * 1.0
        y = self.bn(h)
        a = ops.relu(h * 2.0) + ops.relu(y)              # the BatchNorm's input used first
        z = ops.bias_add(ops.MatMul(transpose_b=True)(x, self.w), self.b)
        c = z * 2.0                                        # no rule continues MatMul + BiasAdd with Mul
        r = ops.relu(self.bn(img) + Tensor(np.ones((1, 3, 1, 1), np.float32)))   # a residual that broadcasts
        d = ops.relu(ops.bias_add(ops.MatMul(transpose_b=True)(x, self.w), ops.cast(self.b, minidl.float64)))
        m = ops.MatMul(transpose_b=True)(x, self.w)
        e = ops.MatMul(transpose_a=True)(m, x)             # a head its guard refuses takes m
        y2 = self.bn(img * 3.0)
        y2.asnumpy()
        return a, c, r, d, e, ops.relu(y2)


def test_each_broken_pattern_says_why_and_where():
    net = _Broken()
    net.set_train(True)
    rows = rows_of(net, mat((4, 5)), image())
    assert {r["where"] for r in rows} == {"bn", "_Broken"}
    broken = [(r["what"], r["ops"], r["why"]) for r in rows if r["what"] != "not deferred"]
    assert broken == [
        ("not fused", "BatchNorm", "Mul used it"),
        ("fused", "MatMul + BiasAdd -> Dense (when its ops must run)",
         "Mul used its output (no rule continues MatMul + BiasAdd with Mul)"),
        ("not fused", "BatchNorm", "the residual's shape (1, 3, 1, 1) / dtype float32 differs from the output's "
                                   "(4, 3, 8, 8) / float32 (the fused op adds without broadcasting)"),
        ("not fused", "MatMul", "the bias's shape (3,) / dtype float64 is not the product's columns (3,) / "
                                "dtype float32"),
        ("not fused", "MatMul", "MatMul used it"),
        ("not fused", "BatchNorm", "its value was read")]
    assert [r for r in rows if r["what"] == "not deferred"] == [
        {"what": "not deferred", "ops": "MatMul", "where": "_Broken", "why": "not x @ w.T of two Tensors"}]


def test_what_a_cell_leaves_or_an_error_cuts_short_is_explained():
    class Inner(nn.Cell):
        def __init__(self, fail):
            super().__init__()
            self.bn, self.fail = nn.BatchNorm2d(3), fail

        def construct(self, x):
            self.bn(x * 1.0)               # unused: it runs when the cell returns (or raises)
            if self.fail:
                raise KeyError("inner")
            return x * 2.0

    class Outer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.left, self.failed = Inner(False), Inner(True)

        def construct(self, x):
            try:
                self.failed(x)
            except KeyError:
                pass
            return self.left(x)
    net = Outer()
    net.set_train(True)
    rows = rows_of(net, image())
    assert rows == [
        {"what": "not fused", "ops": "BatchNorm", "where": "failed.bn", "why": "an error left its Cell"},
        {"what": "not fused", "ops": "BatchNorm", "where": "left.bn", "why": "its Cell returned without using it"}]


def test_the_sequential_route_and_the_deferred_one_are_told_apart():
    """In a SequentialCell an nn.Dense cell and the nn.ReLU cell after it run as one DenseReLU at
    once (with or without a bias); a Dense that runs two ops (sharded) is deferred and fused."""
    sharded = nn.Dense(5, 4)
    sharded.shard(((1, 1), (1, 1)))
    x = mat((3, 5))
    seen = []
    for dense in (nn.Dense(5, 4), nn.Dense(5, 4, has_bias=False), sharded):
        rows = rows_of(nn.SequentialCell([dense, nn.ReLU()]), x)
        seen.append([(r["what"], r["ops"], r["where"], r["why"]) for r in rows])
    sequence = [("fused", "Dense + ReLU -> DenseReLU", "0",
                 "an nn.Dense cell then an nn.ReLU cell in a SequentialCell")]
    assert seen == [sequence, sequence,
                    [("fused", "MatMul + BiasAdd + ReLU -> DenseReLU", "0", "its guards held")]]


def test_the_printed_table_to_a_file(capsys):
    import io
    out = io.StringIO()
    net = nn.SequentialCell(nn.Dense(5, 4), nn.ReLU(), nn.Dense(4, 4), nn.ReLU(), nn.Dense(4, 2))
    graph_mode.explain(net, mat((3, 5)), file=out)
    graph_mode.explain(nn.Dense(5, 2), mat((3, 5)), file=out)
    assert capsys.readouterr().out == ""
    rules = "rules:\n" + "".join(f"  {rule.describe()}\n" for rule in graph_mode.RULES)
    row = ("  fused         Dense + ReLU -> DenseReLU  at {}: "
           "an nn.Dense cell then an nn.ReLU cell in a SequentialCell\n")
    assert out.getvalue() == (
        "GRAPH_MODE over one call of SequentialCell: 2 fused, 1 not fused\n" + row.format(0) + row.format(2)
        + "  not fused     Dense                      at 4: the network returned\n" + rules
        + "GRAPH_MODE over one call of Dense: 0 fused, 1 not fused\n"
        + "  not fused     Dense       at Dense: the network returned\n" + rules)
    assert "  MatMul + BiasAdd -> Dense (when its ops must run)\n" in rules


def test_explain_inside_a_running_network_keeps_each_journal_apart():
    """explain called in a Cell's construct (during another explain): the inner copy's output,
    returned pending, runs at its end ("the step ended"); the outer journal goes on after it."""
    inner_rows = []

    class Outer(nn.Cell):
        def __init__(self):
            super().__init__()
            self.bn, self.inner = nn.BatchNorm2d(3), nn.BatchNorm2d(3)

        def construct(self, x):
            inner_rows.extend(graph_mode.explain(self.inner, x, file=False))
            return ops.relu(self.bn(x))
    net = Outer()
    net.set_train(True)
    rows = rows_of(net, image())
    assert inner_rows == [{"what": "not fused", "ops": "BatchNorm", "where": "BatchNorm2d", "why": "the step ended"}]
    assert rows == [{"what": "fused", "ops": "BatchNorm + ReLU -> BatchNormReLU", "where": "bn",
                     "why": "its guards held"}]
