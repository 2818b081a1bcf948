"""GRAPH_MODE (minidl/graph_mode/): a user's separate BatchNorm, Add and ReLU run as BatchNormReLU,
and every result (values, gradients, moving statistics, parameters after optimizer steps) equals
PYNATIVE_MODE's. Each test runs the same code in both modes and compares; with reference bodies
the two are bit for bit equal (the fused reference is BatchNorm's, the residual added, max(., 0)),
with the kernels within the fused CPU kernel's stated bound.
"""
import contextlib
import time
import os
import sys

import numpy as np
import pytest

import minidl
from minidl import Tensor, graph_mode, kernels, nn, ops
from minidl.ops.norm_relu import BatchNormReLU
from minidl.runtime import Runtime
from minidl.testing.modes import mode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import models_minidl  # noqa: E402  (the user-written BasicBlock and ResNet-20)

MODES = (minidl.PYNATIVE_MODE, minidl.GRAPH_MODE)


def both(fn, *args):
    """fn(*args) run in PYNATIVE_MODE then GRAPH_MODE, each from seed 0: (eager, graph)."""
    out = []
    for m in MODES:
        with mode(m):
            minidl.set_seed(0)
            out.append(fn(*args))
    return out


def assert_same(a, b, exact=True):
    """Nested results equal: bit for bit, or within the fused kernel's float32 bound over a few steps."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k], exact)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, exact)
    elif exact:
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def node_names(t):
    """The op classes of t's recorded graph (what ran, in the order a walk from t meets them)."""
    names, seen, stack = [], set(), [t]
    while stack:
        t = stack.pop()
        if id(t) in seen or t._node is None:
            continue
        seen.add(id(t))
        names.append(type(t._node).__name__)
        stack += [p for _, p in t._node.inputs]
    return names


def image(shape=(4, 3, 8, 8), seed=0):
    return Tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def state(net):
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


def small_resnet():
    """The user-written ResNet-20's blocks (separate cells, ``out + identity``), small."""
    return nn.SequentialCell([nn.Conv2d(3, 8, 3, pad_mode="pad", padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                              models_minidl.BasicBlock(8, 8), models_minidl.BasicBlock(8, 16, 2)])


def train_custom_loop(make, steps=3):
    net = make()
    net.set_train(True)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    head = nn.Dense(16, 10)
    opt = nn.Momentum(net.trainable_params() + head.trainable_params(), learning_rate=0.1, momentum=0.9)

    def forward(x, y):
        return loss_fn(head(net(x).mean((2, 3))), y)
    grad_fn = minidl.value_and_grad(forward, None, opt.parameters)
    x, y = image((4, 3, 8, 8)), Tensor(np.array([1, 3, 5, 7], np.int32))
    losses, grads = [], []
    for _ in range(steps):
        loss, g = grad_fn(x, y)
        opt(g)
        losses.append(loss.asnumpy())
        grads.append([t.asnumpy() for t in g])
    return losses, grads, state(net)


@pytest.mark.parametrize("make", [lambda: models_minidl.BasicBlock(3, 16, 2), small_resnet],
                         ids=["basic_block", "small_resnet"])
def test_custom_loop_equals_eager_bit_for_bit_on_reference_bodies(make):
    with kernels.reference_only():
        eager, graph = both(train_custom_loop, make)
    assert_same(eager, graph)


def test_custom_loop_equals_eager_within_the_kernel_bound(kernels_on):
    kernels.set_option("batchnorm_min_bytes", 0)  # the small activations take the CPU kernels too
    try:
        eager, graph = both(train_custom_loop, small_resnet)
    finally:
        kernels.set_option("batchnorm_min_bytes", None)
    assert_same(eager, graph, exact=False)


def test_the_fused_op_runs_in_graph_mode_only():
    def forward():
        block = models_minidl.BasicBlock(3, 8, 2)
        block.set_train(True)
        return node_names(block(image()))
    eager, graph = both(forward)
    assert "BatchNormReLU" not in eager and eager.count("BatchNorm") == 3
    # bn1 + ReLU and bn2 + identity + ReLU fused; the down-sample BatchNorm (the residual) runs alone
    assert graph.count("BatchNormReLU") == 2 and graph.count("BatchNorm") == 1
    assert "Add" not in graph and "ReLU" not in graph


@pytest.mark.cpu_only  # the fused op's CPU kernel
def test_kernels_tracking_shows_the_fused_kernel_in_graph_mode_only(kernels_on):
    if not any(k.backend == "numpy" for k in kernels.registered(BatchNormReLU)):
        pytest.skip("no CPU kernel registered for BatchNormReLU")
    kernels.set_option("batchnorm_min_bytes", 0)

    def forward():
        block = models_minidl.BasicBlock(8, 8)
        block.set_train(True)
        with kernels.tracking() as used:
            block(image((4, 8, 8, 8))).sum().backward()
        return {k.op.__name__ for k in used}
    try:
        eager, graph = both(forward)
    finally:
        kernels.set_option("batchnorm_min_bytes", None)
    assert "BatchNormReLU" in graph and "BatchNormReLU" not in eager


class Classifier(nn.Cell):
    def __init__(self):
        super().__init__()
        self.body, self.fc = small_resnet(), nn.Dense(16, 4)

    def construct(self, x):
        return self.fc(self.body(x).mean((2, 3)))


def train_model(steps=2):
    net = Classifier()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    rng = np.random.default_rng(1)
    data = {"image": rng.standard_normal((8, 3, 8, 8)).astype(np.float32),
            "label": rng.integers(0, 4, 8).astype(np.int32)}
    dataset = minidl.dataset.NumpySlicesDataset(data, shuffle=False).batch(4)
    minidl.Model(net, loss_fn, opt).train(steps, dataset)
    return state(net)


def test_model_train_equals_eager():
    with kernels.reference_only():
        eager, graph = both(train_model)
    assert_same(eager, graph)


def test_two_consumers_of_the_batchnorm_output():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)
            self.ran = []

        def construct(self, x):
            y = self.bn(x * 2.0)
            a = ops.relu(y)          # fused
            self.ran.append(type(a._node).__name__)
            return (a * 3 + y * 2).sum()   # y used again: computed without a second statistics update

    def forward():
        net = Net()
        net.set_train(True)
        x = image()
        loss, (gx, gw) = minidl.value_and_grad(net, 0, net.trainable_params())(x)
        return loss.asnumpy(), gx.asnumpy(), [g.asnumpy() for g in gw], state(net), net.ran
    with kernels.reference_only():
        eager, graph = both(forward)
    # Values and statistics bit for bit; gradients to rounding: eager sums y's two gradients before
    # one BatchNorm backward, graph mode runs the fused node's and y's own and sums their results.
    assert_same(eager[0], graph[0])
    assert_same(eager[3], graph[3])
    assert_same(eager[1:3], graph[1:3], exact=False)
    assert eager[-1] == ["ReLU"] and graph[-1] == ["BatchNormReLU"]


def test_a_discarded_output_still_updates_the_moving_statistics():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.bn, self.other = nn.BatchNorm2d(3), nn.BatchNorm2d(3)

        def construct(self, x):
            _ = self.bn(x * 1.0)
            self.other(x * 2.0)     # not even bound; nothing touches their inputs again
            return x * 2
    def forward():
        net = Net()
        net.set_train(True)
        net(image())
        return state(net)
    eager, graph = both(forward)
    assert_same(eager, graph)
    assert not np.array_equal(graph["bn.moving_mean"], np.zeros(3))


def test_an_output_only_returned_from_the_network_is_computed():
    def forward():
        bn = nn.BatchNorm2d(3)
        bn.set_train(True)
        out = nn.SequentialCell([nn.Conv2d(3, 3, 1), bn])(image())
        assert not graph_mode.is_deferred(out)   # the outermost cell returned: nothing waits
        return out.asnumpy(), state(bn)
    assert_same(*both(forward))


def test_moving_statistics_read_between_batchnorm_and_relu():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU()
            self.seen = []

        def construct(self, x):
            y = self.bn(self.conv(x))
            self.seen.append(self.bn.moving_mean.asnumpy().copy())   # eager: already updated
            return self.relu(y)
    def forward():
        net = Net()
        net.set_train(True)
        out = net(image())
        return net.seen, out.asnumpy(), node_names(out)
    (seen_e, out_e, _), (seen_g, out_g, names) = both(forward)
    assert_same(seen_e, seen_g)
    assert_same(out_e, out_g)
    assert not np.array_equal(seen_g[0], np.zeros(3))
    assert "BatchNormReLU" not in names   # the read computed the BatchNorm: nothing left to fuse


def test_in_place_write_into_the_input_between_batchnorm_and_relu():
    def forward():
        bn = nn.BatchNorm2d(3)
        bn.set_train(True)

        class Net(nn.Cell):
            def construct(self, x):
                h = x * 1.0
                y = bn(h)
                h.data[...] = 0         # eager's y was computed before this write
                return ops.relu(y) + h
        return Net()(image()).asnumpy(), state(bn)
    assert_same(*both(forward))


def test_output_kept_across_an_optimizer_step_and_read_after():
    def forward():
        conv, bn, relu = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.ReLU()
        cells = nn.SequentialCell([conv, bn])
        cells.set_train(True)
        kept = {}

        class Net(nn.Cell):
            def __init__(self):
                super().__init__()
                self.cells = cells

            def construct(self, x):
                y = cells(x)
                kept["y"] = y           # outlives the step
                a = relu(y)
                kept["ran"] = type(a._node).__name__
                return a.sum()
        net = Net()
        opt = nn.SGD(net.trainable_params(), learning_rate=0.5)
        loss, grads = minidl.value_and_grad(net, None, opt.parameters)(image())
        opt(grads)                      # gamma and beta change in place
        return kept["y"].asnumpy(), loss.asnumpy(), state(net), kept["ran"]
    eager, graph = both(forward)
    assert_same(eager[:-1], graph[:-1])
    assert eager[-1] == "ReLU" and graph[-1] == "BatchNormReLU"


def test_inside_a_block_the_kept_output_sees_its_fusion_time_parameters():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

        def construct(self, x):
            y = self.bn(self.conv(x))
            a = ops.relu(y)
            self.bn.gamma.set_data(np.full(3, 5.0, np.float32))   # after the fusion, before y's use
            return a + y

    def forward():
        net = Net()
        net.set_train(True)
        out = net(image())
        return out.asnumpy(), node_names(out), state(net)
    (out_e, _, st_e), (out_g, names, st_g) = both(forward)
    assert_same(out_e, out_g)
    assert_same(st_e, st_g)
    assert "BatchNormReLU" in names and "BatchNorm" in names   # fused, then y computed again for "+ y"


def test_set_train_switching_and_no_grad():
    def forward():
        net = small_resnet()
        outs = []
        for training in (True, False, True):
            net.set_train(training)
            outs.append(net(image()).asnumpy())
            with minidl.no_grad():
                out = net(image(seed=1))
                assert out._node is None
                outs.append(out.asnumpy())
        net.set_train(False)
        out = net(image())
        outs.append(node_names(out))
        return outs, state(net)
    with kernels.reference_only():
        (outs_e, state_e), (outs_g, state_g) = both(forward)
    assert_same(outs_e[:-1], outs_g[:-1])
    assert_same(state_e, state_g)
    assert "BatchNormReLU" in outs_g[-1]   # inference fuses too


def test_grad_mode_changed_in_the_window_runs_eagerly():
    def forward():
        bn = nn.BatchNorm2d(3)
        bn.set_train(True)

        class Net(nn.Cell):
            def construct(self, x):
                y = bn(x * 1.0)
                with minidl.no_grad():
                    return ops.relu(y)
        x = image()
        x.requires_grad = True
        out = Net()(x)
        return out.asnumpy(), out._node is None, state(bn)
    assert_same(*both(forward))


def test_a_batchnorm_under_no_grad_then_a_relu_outside_it_equals_eager():
    """The BatchNorm's output records no graph; the ReLU after the no_grad block must not give it
    one (output, requires_grad and every gradient as eager's)."""
    def forward():
        bn = nn.BatchNorm2d(3)
        bn.set_train(True)
        w = minidl.Parameter(np.linspace(0.5, 1.5, 3, dtype=np.float32).reshape(1, 3, 1, 1), name="w")

        class Net(nn.Cell):
            def construct(self, x):
                with minidl.no_grad():
                    y = bn(x * 1.0)
                return ops.relu(y), ops.relu(x * w)

        net = Net()
        x = image()
        frozen, live = net(x)
        params = [bn.gamma, bn.beta, w]
        grad_fn = minidl.value_and_grad(lambda a: (ops.relu(a) * net(a)[0]).sum() + net(a)[1].sum(), None, params)
        loss, grads = grad_fn(x)
        return ([frozen.asnumpy(), live.asnumpy(), loss.asnumpy()], [frozen.requires_grad, live.requires_grad],
                [np.zeros(p.shape, np.float32) if g is None else g.asnumpy() for p, g in zip(params, grads)],
                state(bn))
    with kernels.reference_only():
        eager, graph = both(forward)
    assert eager[1] == [False, True]
    assert not eager[2][0].any() and not eager[2][1].any() and eager[2][2].any()  # only w is reached
    assert_same(eager, graph)


@pytest.mark.parametrize("shape", [(4, 5, 6, 3), (4, 3, 5, 3)], ids=["channels_last", "three_either_way"])
def test_an_nhwc_batchnorm_and_relu_equal_eager(shape):
    """The fused op is NCHW only: an NHWC BatchNorm (the op's data_format) and its ReLU, with and
    without a residual, give eager's values, gradients and moving statistics."""
    def forward():
        c = shape[-1]
        gamma = minidl.Parameter(np.linspace(0.5, 2.0, c, dtype=np.float32), name="gamma")
        beta = minidl.Parameter(np.linspace(-1.0, 1.0, c, dtype=np.float32), name="beta")
        mean = minidl.Parameter(np.zeros(c, np.float32), name="mean", requires_grad=False)
        var = minidl.Parameter(np.ones(c, np.float32), name="var", requires_grad=False)
        bn = ops.BatchNorm(is_training=True, momentum=0.1, data_format="NHWC")

        class Net(nn.Cell):
            def construct(self, x, r):
                return ops.relu(bn(x, gamma, beta, mean, var)) + ops.relu(bn(x * 2.0, gamma, beta, mean, var) + r)

        net = Net()
        grad_fn = minidl.value_and_grad(lambda x, r: net(x, r).sum(), None, [gamma, beta])
        x, r = image(shape), image(shape, seed=1)
        outs = [net(x, r).asnumpy()]
        loss, grads = grad_fn(x, r)
        return outs + [loss.asnumpy()], [g.asnumpy() for g in grads], [mean.asnumpy(), var.asnumpy()]
    with kernels.reference_only():
        eager, graph = both(forward)
    assert_same(eager, graph)


def test_a_non_relu_use_and_a_broadcast_residual_do_not_fuse():
    def forward():
        bn = nn.BatchNorm2d(3)
        bn.set_train(True)

        class Net(nn.Cell):
            def construct(self, x):
                a = ops.relu(bn(x * 1.0) * 2)              # Mul first: the BatchNorm runs as eager
                b = ops.relu(bn(x * 1.0) + Tensor(np.ones((1, 3, 1, 1), np.float32)))  # broadcasts
                c = ops.relu(bn(x * 1.0) + 1.0)            # a Python number
                return a, b, c
        outs = Net()(image())
        return [o.asnumpy() for o in outs], [node_names(o) for o in outs], state(bn)
    (vals_e, _, st_e), (vals_g, names_g, st_g) = both(forward)
    assert_same(vals_e, vals_g)
    assert_same(st_e, st_g)
    for names in names_g:
        assert "BatchNormReLU" not in names and "BatchNorm" in names


def test_dropout_between_draws_fresh_masks_equal_to_eager():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.drop, self.relu = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3), nn.Dropout(p=0.5), nn.ReLU()

        def construct(self, x):
            return self.relu(self.drop(self.bn(self.conv(x))))

    def forward():
        net = Net()
        net.set_train(True)
        return [net(image()).asnumpy() for _ in range(3)]
    eager, graph = both(forward)
    assert_same(eager, graph)
    assert not np.array_equal(graph[0] == 0, graph[1] == 0)   # a fresh mask each step


def test_a_batchnorm_subclass_is_not_fused():
    from minidl_parallel.sync_batchnorm import SyncBatchNorm

    def forward():
        bn = SyncBatchNorm(3)   # its op is a subclass of ops.BatchNorm (the world of one here)
        bn.set_train(True)
        out = nn.ReLU()(bn(image()))
        return out.asnumpy(), node_names(out), state(bn)
    (out_e, _, st_e), (out_g, names, st_g) = both(forward)
    assert_same(out_e, out_g)
    assert_same(st_e, st_g)
    assert "BatchNormReLU" not in names and "SyncBatchNormOp" in names


def test_under_another_runtime_graph_mode_fuses_through_it_with_eagers_results():
    """GRAPH_MODE's layer wraps the runtime that places the work: the fused ops go to it."""
    class Counting(Runtime):
        calls = 0

        def call_op(self, prim, args):
            Counting.calls += 1
            return prim.apply(*args)

    def forward():
        block = models_minidl.BasicBlock(3, 8, 2)
        block.set_train(True)
        with Counting():
            out = block(image())
        return out.asnumpy(), node_names(out), state(block)
    (out_e, _, st_e), (out_g, names, st_g) = both(forward)
    assert_same(out_e, out_g)
    assert_same(st_e, st_g)
    assert "BatchNormReLU" in names and "BatchNorm" in names  # the block's second BatchNorm ends it


def test_errors_come_at_the_call_with_eager_messages():
    x = image()
    bn_op = ops.BatchNorm(is_training=True)
    ones, zeros = Tensor(np.ones(4, np.float32)), Tensor(np.zeros(4, np.float32))
    messages = []
    for m in MODES:
        with mode(m):
            with pytest.raises(ValueError) as err:
                bn_op(x, ones, zeros, zeros, ones)      # 4 channels of parameters for 3 of x
            messages.append(str(err.value))
            with pytest.raises(ValueError, match="more than 1 value per channel"):
                ops.BatchNorm(is_training=True)(image((1, 3, 1, 1)), *(Tensor(np.ones(3, np.float32)),) * 4)
    assert messages[0] == messages[1] and "one per channel" in messages[0]


def test_top_level_ops_wait_until_use_or_a_mode_change():
    with mode(minidl.GRAPH_MODE):
        mean, var = Tensor(np.zeros(3, np.float32)), Tensor(np.ones(3, np.float32))
        y = ops.BatchNorm(is_training=True)(image(), Tensor(np.ones(3, np.float32)),
                                            Tensor(np.zeros(3, np.float32)), mean, var)
        assert graph_mode.is_deferred(y) and y.shape == (4, 3, 8, 8) and y.dtype == np.float32
        assert graph_mode.is_deferred(y)    # shape and dtype are known without running
        minidl.set_context(mode=minidl.PYNATIVE_MODE)
        assert not graph_mode.is_deferred(y)
        assert not np.array_equal(mean.asnumpy(), np.zeros(3))
    assert type(mean) is Tensor and type(y) is Tensor   # watches removed, classes restored


def test_graph_mode_is_a_layer_over_the_active_runtime_and_pynative_mode_has_none():
    from minidl.runtime import LOCAL, get_runtime
    with mode(minidl.PYNATIVE_MODE):
        assert get_runtime() is LOCAL  # PYNATIVE_MODE: the local runtime itself, nothing between
    with mode(minidl.GRAPH_MODE):
        layer = get_runtime()
        assert isinstance(layer, graph_mode.GraphLayer) and layer.inner is LOCAL and layer.placing is LOCAL
        assert get_runtime() is layer  # one layer per inner runtime, not one per call
        other = Runtime()
        with other:
            assert get_runtime().inner is other and get_runtime() is not layer
        assert get_runtime() is layer


def bn_parts(c=3, seed=0):
    """gamma, beta, moving mean and variance of c channels, as a user passes them to ops.BatchNorm."""
    rng = np.random.default_rng(seed)
    return (minidl.Parameter(rng.uniform(0.5, 1.5, c).astype(np.float32), name="gamma"),
            minidl.Parameter(rng.uniform(-0.5, 0.5, c).astype(np.float32), name="beta"),
            minidl.Parameter(np.zeros(c, np.float32), name="mean", requires_grad=False),
            minidl.Parameter(np.ones(c, np.float32), name="var", requires_grad=False))


def pending_dense(x2d, channels):
    """A pending Dense output (x2d @ w.T + b) of ``channels`` columns."""
    rng = np.random.default_rng(5)
    w = Tensor(rng.standard_normal((channels, x2d.shape[1])).astype(np.float32))
    return ops.Dense()(x2d, w, Tensor(rng.standard_normal(channels).astype(np.float32)))


RESIDUALS = {  # form: (relu or not of bn(h) and a residual r, whether graph mode fuses it)
    "bn_plus_r": (lambda d, h, r: ops.relu(d + r), True),
    "r_plus_bn": (lambda d, h, r: ops.relu(r + d), True),
    "bn_plus_its_own_input": (lambda d, h, r: ops.relu(d + h), False),   # reading h computes d first
    "no_relu_after_the_add": (lambda d, h, r: (d + r) * 2.0, False),
    # (N, C) inputs; the residual a Dense output still pending at the Add
    "pending_dense_plus_bn": (lambda d, h, r: ops.relu(pending_dense(r, 3) + d), True),
}


@pytest.mark.parametrize("form", RESIDUALS)
def test_a_residual_added_on_either_side_fuses_as_eager(form):
    """The residual Add of a pending BatchNorm output and a tensor of its shape, in either order,
    fuses at the ReLU; an Add not followed by a ReLU, or of the BatchNorm's own input, runs as
    eager. Values, gradients and moving statistics are eager's in every case."""
    body, fuses = RESIDUALS[form]

    def forward():
        gamma, beta, mean, var = bn_parts()
        bn = ops.BatchNorm(is_training=True, momentum=0.3)
        seen = {}

        def loss(x, r):
            h = x * 1.0
            out = body(bn(h, gamma, beta, mean, var), h, r)
            seen["names"] = node_names(out)
            return (out * image(out.shape, seed=3)).sum()
        shape = (4, 3) if form == "pending_dense_plus_bn" else (4, 3, 8, 8)
        x, r = image(shape), image(shape, seed=1)
        x.requires_grad = r.requires_grad = True
        value, ((gx, gr), (gg, gb)) = minidl.value_and_grad(loss, (0, 1), [gamma, beta])(x, r)
        return [value.asnumpy(), gx.asnumpy(), gr.asnumpy(), gg.asnumpy(), gb.asnumpy(), mean.asnumpy(),
                var.asnumpy()], seen["names"]
    with kernels.reference_only():
        (eager, _), (graph, names) = both(forward)
    assert_same(eager, graph)
    assert ("BatchNormReLU" in names and "Add" not in names) == fuses, names


@pytest.mark.parametrize("case", ["momentum", "no_moving_statistics", "two_values_per_channel",
                                  pytest.param("raw_arrays", marks=pytest.mark.cpu_only)])  # (NumPy gamma: host)
def test_the_batchnorm_call_reaches_the_fused_op_as_given(case):
    """What the BatchNorm call holds (its momentum, moving statistics left out, the smallest
    training batch, a NumPy array for gamma) gives eager's values and moving statistics; each
    fuses with its ReLU but the one with a raw array (graph mode cannot watch it): eager's ops."""
    def forward():
        c = 1 if case == "two_values_per_channel" else 3
        x = image((2, 1, 1, 1) if c == 1 else (4, 3, 8, 8))
        gamma, beta, mean, var = bn_parts(c)
        bn = ops.BatchNorm(is_training=True, momentum=0.3 if case == "momentum" else 0.1)
        args = [gamma, beta, mean, var]
        if case == "no_moving_statistics":
            args[2:] = [None, None]
        elif case == "raw_arrays":
            args[0] = gamma.asnumpy()
        out = ops.relu(bn(x, *args))
        return [out.asnumpy(), mean.asnumpy(), var.asnumpy()], node_names(out)
    with kernels.reference_only():
        (eager, _), (graph, names) = both(forward)
    assert_same(eager, graph)
    if case == "no_moving_statistics":
        assert_same(graph[1:], [np.zeros(3), np.ones(3)])
    else:
        assert not np.array_equal(graph[1], np.zeros_like(graph[1]))
    assert names == (["ReLU", "BatchNorm"] if case == "raw_arrays" else ["BatchNormReLU"])


def test_other_uses_of_a_pending_output_compute_it_as_eager():
    """Known without running it: shape, dtype, ndim, size. Copying or pickling computes it
    first, as any other use of its value (a copy is a plain Tensor)."""
    import copy
    import pickle

    def forward():
        gamma, beta, mean, var = bn_parts()
        outs = []
        for use in ("copy", "deepcopy", "pickle"):
            y = ops.BatchNorm(is_training=True)(image(), gamma, beta, mean, var)
            known = (y.shape, y.dtype, y.ndim, y.size)
            if use == "copy":
                other = copy.copy(y)
            elif use == "deepcopy":
                other = copy.deepcopy([y, y])[1]
            else:
                other = pickle.loads(pickle.dumps(y))
            outs.append((known, graph_mode.is_deferred(y), type(other).__name__, other.asnumpy()))
        return outs, mean.asnumpy()
    eager, graph = both(forward)
    assert_same(eager, graph)
    assert graph[0][0][0] == ((4, 3, 8, 8), np.float32, 4, 4 * 3 * 8 * 8)


def test_inputs_of_a_tensor_subclass_keep_their_class_and_eagers_order():
    """Inputs of a user's own Tensor subclass: whatever is done to them while the op is pending
    (a write into the array, a new array, an attribute deleted, a copy) sees what eager would,
    and they and their copies keep their class."""
    def forward():
        class Mine(Tensor):   # a new class each run: graph mode meets it for the first time
            __slots__ = ()
        gamma, beta, mean, var = bn_parts()
        bn = ops.BatchNorm(is_training=True)
        outs, kept = [], []
        for use in ("write", "set", "del", "copy"):
            h = Mine(image().data.copy())
            y = bn(h, gamma, beta, mean, var)
            if use == "write":
                h.data[...] = 0       # the first access reads h.data, then writes into the array
            elif use == "set":
                h.data = np.zeros((4, 3, 8, 8), np.float32)   # the first access sets h.data
            elif use == "del":
                del h.grad
            else:
                kept.append(copy_of(h))
            outs.append(ops.relu(y).asnumpy())
            kept.append(h)
        return outs, [t.asnumpy() for t in kept], mean.asnumpy(), [type(t) is Mine for t in kept]
    eager, graph = both(forward)
    assert_same(eager, graph)
    assert graph[-1] == [True] * 5


def copy_of(t):
    import copy
    return copy.copy(t)


@pytest.mark.parametrize("container", [tuple, list, lambda outs: {"out": outs[0], "aux": outs[1]}],
                         ids=["tuple", "list", "dict"])
def test_an_output_returned_in_a_container_fuses_with_the_callers_relu(container):
    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)

        def construct(self, x):
            return container([self.bn(self.conv(x)), x * 2.0])

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def construct(self, x):
            outs = self.block(x)
            y, aux = (outs["out"], outs["aux"]) if isinstance(outs, dict) else outs
            return ops.relu(y) + aux

    def forward():
        net = Net()
        net.set_train(True)
        out = net(image())
        return out.asnumpy(), state(net), node_names(out)
    with kernels.reference_only():
        (out_e, st_e, _), (out_g, st_g, names) = both(forward)
    assert_same(out_e, out_g)
    assert_same(st_e, st_g)
    assert "BatchNormReLU" in names and "BatchNorm" not in names


def test_a_cell_is_called_with_eagers_arguments():
    """Keyword arguments reach construct; a SequentialCell called with two inputs or a keyword
    raises eager's error."""
    class Scaled(nn.Cell):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm2d(3)

        def construct(self, x, scale=1.0):
            return ops.relu(self.bn(x)) * scale

    results = []
    for m in MODES:
        with mode(m):
            minidl.set_seed(0)
            net = Scaled()
            net.set_train(True)
            outs = [net(image(), scale=3.0).asnumpy(), net(image()).asnumpy()]
            seq, errors = nn.SequentialCell([nn.Dense(4, 4), nn.ReLU()]), []
            for call in (lambda: seq(image((2, 4)), image((2, 4))), lambda: seq(image((2, 4)), scale=2.0)):
                with pytest.raises(TypeError) as err:
                    call()
                errors.append(str(err.value))
            results.append((outs, state(net), errors))
    assert_same(results[0][:2], results[1][:2])
    assert results[0][2] == results[1][2]
    np.testing.assert_allclose(results[1][0][0], 3 * results[1][0][1], rtol=1e-6)   # the keyword reached it


def test_graph_mode_in_another_thread_equals_eager():
    """A thread that runs the model (a server's worker, say) starts with nothing pending."""
    import threading

    def forward():
        block = models_minidl.BasicBlock(3, 8, 2)
        block.set_train(True)
        result = {}

        def work():
            try:
                out = block(image())
                result["out"] = (out.asnumpy(), node_names(out), state(block))
            except Exception as exc:  # noqa: BLE001 - reported in the main thread
                result["error"] = exc
        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        if "error" in result:
            raise result["error"]
        return result["out"]
    (out_e, _, st_e), (out_g, names, st_g) = both(forward)
    assert_same(out_e, out_g)
    assert_same(st_e, st_g)
    assert names.count("BatchNormReLU") == 2


def test_the_moving_statistics_read_after_the_fused_op_run_nothing_more(monkeypatch):
    """The fused op updated them: reading them (its output still alive) runs no BatchNorm."""
    from minidl.ops.primitive import Primitive
    ran, original = [], Primitive.apply

    def apply(prim, *args):
        ran.append(type(prim).__name__)
        return original(prim, *args)
    monkeypatch.setattr(Primitive, "apply", apply)

    def forward():
        bn = nn.BatchNorm2d(3)
        bn.set_train(True)
        seen = []

        class Net(nn.Cell):
            def construct(self, x):
                y = bn(x)
                a = ops.relu(y)
                seen.append((bn.moving_mean.asnumpy().copy(), bn.moving_variance.asnumpy().copy()))
                return a
        ran.clear()
        out = Net()(image())
        return out.asnumpy(), seen, [n for n in ran if "BatchNorm" in n or n == "ReLU"]
    eager, graph = both(forward)
    assert_same(eager[:2], graph[:2])
    assert eager[2] == ["BatchNorm", "ReLU"] and graph[2] == ["BatchNormReLU"]


def test_value_and_grad_computes_what_its_function_left_pending():
    """A function (no Cell) whose BatchNorm output it keeps aside: value_and_grad returns with it
    computed and the moving statistics updated, as eager."""
    def forward():
        gamma, beta, mean, var = bn_parts()
        w, kept = minidl.Parameter(np.full((1, 3, 1, 1), 2.0, np.float32), name="w"), {}

        def loss(x):
            kept["y"] = ops.BatchNorm(is_training=True)(x * 1.0, gamma, beta, mean, var)
            return (x * w).sum()
        minidl.value_and_grad(loss, None, [w])(image())
        return graph_mode.is_deferred(kept["y"]), kept["y"].asnumpy(), mean.asnumpy()
    eager, graph = both(forward)
    assert_same(eager, graph)
    assert graph[0] is False


def sharded(t):
    """t marked as a whole-tensor block of a world of one (what tensor parallelism leaves on a
    Parameter): the local runtime computes it as any tensor."""
    from minidl_parallel.tensor_parallel.layout import Layout
    from minidl_parallel.tensor_parallel.tensors import set_layout
    set_layout(t, Layout.replicated(len(t.shape), 1), t.shape)
    return t


def test_a_sharded_input_is_not_deferred():
    def forward():
        gamma, beta, mean, var = bn_parts()
        out = ops.relu(ops.BatchNorm(is_training=True)(image(), sharded(gamma), beta, mean, var))
        return [out.asnumpy(), mean.asnumpy()], node_names(out)
    (eager, _), (graph, names) = both(forward)
    assert_same(eager, graph)
    assert names == ["ReLU", "BatchNorm"]


def test_graph_mode_keeps_no_reference_to_a_steps_tensors():
    """Once a step is over, its activations (here the BatchNorms' inputs) can be freed."""
    import gc
    import weakref
    refs = []

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.bn, self.bn2 = nn.BatchNorm2d(3), nn.BatchNorm2d(3)

        def construct(self, x):
            h, h2 = x * 1.0, x * 2.0
            refs.extend([weakref.ref(h), weakref.ref(h2)])
            self.bn2(h2)              # discarded: run at the cell's end
            return ops.relu(self.bn(h))
    with mode(minidl.GRAPH_MODE):
        net = Net()
        net.set_train(True)
        out = net(image())
        refs.append(weakref.ref(out))
        del out
        gc.collect()
    assert [r() for r in refs] == [None] * 3


def test_in_inference_the_kept_output_sees_its_fusion_time_moving_statistics():
    def forward():
        bn = nn.BatchNorm2d(3)
        bn.set_train(False)

        class Net(nn.Cell):
            def construct(self, x):
                y = bn(x * 1.0)
                a = ops.relu(y)
                bn.moving_mean.data[...] = 0.5     # after the fusion, before y's use (a checkpoint load)
                return a + y
        out = Net()(image())
        return out.asnumpy(), node_names(out)
    (out_e, _), (out_g, names) = both(forward)
    assert_same(out_e, out_g)
    assert "BatchNormReLU" in names


def test_waiting_for_another_threads_run_of_a_pending_op_is_bounded_and_names_it(monkeypatch):
    """A pending op another thread is running (RUNNING) is waited for, in seconds, not wake-ups:
    other runs ending meanwhile do not shorten the wait, and a run that never ends raises."""
    import threading
    from minidl.graph_mode import pending
    monkeypatch.setattr(pending, "WAIT_S", 0.5)
    with mode(minidl.GRAPH_MODE):
        y = ops.BatchNorm(is_training=True)(image(), *bn_parts())
        record = y._pending
        record.state = pending.RUNNING  # as while another thread runs it
        stop = threading.Event()

        def other_runs_ending():  # wake-ups that are not this record's
            while not stop.is_set():
                with pending.lock:
                    pending._ran.notify_all()
                stop.wait(0.01)
        noise = threading.Thread(target=other_runs_ending)
        noise.start()
        started = time.monotonic()
        try:
            with pytest.raises(RuntimeError, match="GRAPH_MODE: waited 0 s for another thread to compute a "
                                                   "pending BatchNorm; is that thread stopped"):
                y.asnumpy()
        finally:
            stop.set()
            noise.join()
        assert time.monotonic() - started >= 0.5
        record.state = pending.PENDING  # the other thread gave up: the next use runs it here
        assert y.asnumpy().shape == (4, 3, 8, 8)


def test_a_pending_outputs_requires_grad_and_grad_are_eagers_before_it_runs():
    """``requires_grad`` of a pending output (a head's, or the Add or BiasAdd after one) is known
    before it is computed: the grad mode on, a float output, an argument that requires grad."""
    def forward():
        seen = []
        for grad_on in (True, False):
            for needs_grad in (True, False):
                gamma, beta, mean, var = bn_parts()
                x, w, b = image((4, 5)), image((3, 5), seed=1), image((3,), seed=2)
                w2, b2 = image((3, 5), seed=4), image((3,), seed=5)
                for t in (gamma, beta, w, b, w2, b2):
                    t.requires_grad = needs_grad
                with contextlib.nullcontext() if grad_on else minidl.no_grad():
                    y = ops.BatchNorm(is_training=True)(image(), gamma, beta, mean, var)
                    m = ops.MatMul(transpose_b=True)(x, w)
                    outs = [y, y + image(seed=3), m, ops.bias_add(m, b), ops.Dense()(image((4, 5), seed=6), w2, b2)]
                seen.append([(t.requires_grad, t.grad, graph_mode.is_deferred(t)) for t in outs])
                seen.append([(t.requires_grad, t.grad) for t in outs if t.asnumpy() is not None])
        return seen
    eager, graph = both(forward)
    assert [[s[:2] for s in step] for step in graph] == [[s[:2] for s in step] for step in eager]
    assert eager[0][0] == (True, None, False) and eager[2][0] == eager[4][0] == (False, None, False)
    assert all(s[2] for s in graph[0])   # none computed yet when requires_grad was read


class Intercepting(Runtime):
    """A runtime that runs every op itself, as a tensor-parallel one does (``intercepts_ops``):
    GRAPH_MODE must send it each op, the fused ones included, and take no shortcut around it."""

    intercepts_ops = True

    def __init__(self):
        self.ran = []

    def call_op(self, prim, args):
        self.ran.append(type(prim).__name__)
        return prim.apply(*args)


def test_under_a_runtime_that_runs_the_ops_graph_mode_fuses_and_sends_it_every_op():
    def forward():
        block = models_minidl.BasicBlock(3, 8, 2)
        block.set_train(True)
        seq = nn.SequentialCell([nn.Dense(8, 4), nn.ReLU()])
        with Intercepting() as runtime:
            out = seq(block(image()).mean((2, 3)))
        return out.asnumpy(), state(block), sorted(set(runtime.ran))
    with kernels.reference_only():
        (out_e, st_e, ran_e), (out_g, st_g, ran_g) = both(forward)
    assert_same([out_e, st_e], [out_g, st_g])
    # bn1 + relu cell and bn2 + identity + relu cell fused; the Dense cell and relu cell fused by deferral
    assert {"BatchNormReLU", "DenseReLU"} <= set(ran_g) and not {"ReLU", "Add"} & set(ran_g)
    assert "BatchNormReLU" not in ran_e and "ReLU" in ran_e


def test_a_pending_value_passed_into_a_cell_fuses_there():
    """A BatchNorm called outside any Cell, its output given to a ReLU cell: fused there (on the
    local runtime the network's inputs are not computed at its call)."""
    def forward():
        y = ops.BatchNorm(is_training=True)(image(), *bn_parts())
        out = nn.ReLU()(y)
        return out.asnumpy(), node_names(out)
    (out_e, names_e), (out_g, names_g) = both(forward)
    assert_same(out_e, out_g)
    assert names_e == ["ReLU", "BatchNorm"] and names_g == ["BatchNormReLU"]


def test_the_input_of_a_pending_batchnorm_is_not_its_output():
    """relu(x) of a BatchNorm's input x, while the BatchNorm waits: x's own ReLU, eager's value
    (the BatchNorm runs first, as eager's order), never the BatchNorm's fused output."""
    def forward():
        x = image()
        x.requires_grad = True
        x = x * 1.0
        y = ops.BatchNorm(is_training=True)(x, *bn_parts())
        watched = graph_mode.is_deferred(x)
        r = ops.relu(x)
        return r.asnumpy(), node_names(r), y.asnumpy(), watched
    (r_e, names_e, y_e, _), (r_g, names_g, y_g, watched) = both(forward)
    assert_same([r_e, y_e], [r_g, y_g])
    assert names_g == names_e == ["ReLU", "Mul"] and watched is False


class FailingOnce(Runtime):
    """Its first run of an op of class ``cls`` raises (as a collective that timed out); ``ran``:
    the ops it ran."""

    def __init__(self, cls):
        self.cls, self.failed, self.ran = cls, False, []

    def call_op(self, prim, args):
        if type(prim) is self.cls and not self.failed:
            self.failed = True
            raise RuntimeError(f"{self.cls.__name__} failed once")
        self.ran.append(type(prim).__name__)
        return prim.apply(*args)


@pytest.mark.parametrize("fails", ["BatchNorm", "BatchNormReLU", "Dense"])
def test_an_op_that_fails_stays_pending_and_its_next_use_runs_it_as_before(fails, monkeypatch):
    """A pending op (or the fused op of its pattern) whose run raises stays pending: the error is
    the runtime's, and the next use runs it again, fusing as it would have."""
    from minidl.graph_mode import pending
    from minidl.ops.dense import Dense
    from minidl.ops.norm import BatchNorm
    monkeypatch.setattr(pending, "WAIT_S", 5.0)  # (a record left RUNNING would make the retry wait)
    with kernels.reference_only():
        x, w, b = image((4, 5)), image((3, 5), seed=1), image((3,), seed=2)
        with mode(minidl.PYNATIVE_MODE):
            expected_bn = ops.relu(ops.BatchNorm(is_training=True)(image(), *bn_parts())).asnumpy()
            expected_dense = ops.bias_add(ops.MatMul(transpose_b=True)(x, w), b).asnumpy()
        with mode(minidl.GRAPH_MODE), FailingOnce({"BatchNorm": BatchNorm, "BatchNormReLU": BatchNormReLU,
                                                   "Dense": Dense}[fails]) as runtime:
            if fails == "Dense":    # MatMul + BiasAdd, run as one Dense when read
                out = ops.bias_add(ops.MatMul(transpose_b=True)(x, w), b)
                use, expected, fused = out.asnumpy, expected_dense, "Dense"
            else:
                y = ops.BatchNorm(is_training=True)(image(), *bn_parts())
                use = y.asnumpy if fails == "BatchNorm" else lambda: ops.relu(y)
                expected, fused = expected_bn, "BatchNormReLU"
            with pytest.raises(RuntimeError, match=f"^{fails} failed once$"):
                use()
            if fails != "Dense":
                out = ops.relu(y)
            np.testing.assert_array_equal(out.asnumpy(), expected)
        assert runtime.ran == [fused]


def test_with_no_wake_up_at_all_the_wait_still_ends(monkeypatch):
    """A thread waiting for a pending op another thread runs, and no run ever ends: it still gives
    up after WAIT_S (each wait is bounded; nothing needs to wake it)."""
    import threading
    from minidl.graph_mode import pending
    monkeypatch.setattr(pending, "WAIT_S", 0.3)
    with mode(minidl.GRAPH_MODE):
        y = ops.BatchNorm(is_training=True)(image(), *bn_parts())
        record = y._pending
        record.state = pending.RUNNING  # as while another thread runs it
        errors = []

        def use():
            try:
                y.asnumpy()
            except RuntimeError as err:
                errors.append(str(err))
        waiter = threading.Thread(target=use, daemon=True)
        waiter.start()
        waiter.join(10.0)
        ended = not waiter.is_alive()
        with pending.lock:  # (free a waiter that would not end by itself)
            record.state = pending.PENDING
            pending._ran.notify_all()
        waiter.join()
    assert ended and errors and errors[0].startswith("GRAPH_MODE: waited 0 s for another thread")


def test_a_computed_output_takes_the_placement_the_runtime_gave_its_value():
    """Under a runtime that places op outputs (tensor parallelism), a pending output, once
    computed, carries the placement the runtime gave (a whole-tensor block of a world of one here)."""
    class Placing(Intercepting):
        def call_op(self, prim, args):
            return sharded(super().call_op(prim, args))

    def forward():
        with Placing():
            y = ops.BatchNorm(is_training=True)(image(), *bn_parts())
            value = y.asnumpy()
        return value, str(y.placement)
    (value_e, placement_e), (value_g, placement_g) = both(forward)
    assert_same(value_e, value_g)
    assert placement_g == placement_e != "None"
