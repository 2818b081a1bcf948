"""Cell.recompute(): training with recomputed cells is the training without, bit for bit.

Each test trains the same network (same initial values, same seed) twice, once with some cells
recomputed, and compares every step's loss, input gradient and parameter gradients, the
parameters and BatchNorm moving statistics after the steps, and the framework generator's state
after them (so the Dropout masks were the same, and the next step's will be too). Both execution
modes run; the peak memory of a deep MLP's step shows what recompute is for.
"""
import contextlib
import copy
import tracemalloc

import numpy as np
import pytest

import minidl
from minidl import Tensor, backend, kernels, nn, ops
from minidl.models.resnet import BasicBlock
from minidl.nn.recompute import _Recomputation
from minidl.testing.modes import mode

MODES = {"pynative": minidl.PYNATIVE_MODE, "graph": minidl.GRAPH_MODE}


class DenseBlock(nn.Cell):
    def __init__(self, cin, cout, p=0.0):
        super().__init__()
        self.fc, self.relu = nn.Dense(cin, cout), nn.ReLU()
        self.drop = nn.Dropout(p=p) if p else nn.Identity()

    def construct(self, x):
        return self.drop(self.relu(self.fc(x)))


class ConvBlock(nn.Cell):
    def __init__(self, cin, cout, stride=1, relu=True):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, pad_mode="pad", padding=1, has_bias=False)
        self.bn, self.relu = nn.BatchNorm2d(cout, momentum=0.8), nn.ReLU() if relu else nn.Identity()

    def construct(self, x):
        return self.relu(self.bn(self.conv(x)))


class Stack(nn.Cell):
    """blocks, then a head that is never recomputed."""

    def __init__(self, blocks, head):
        super().__init__()
        self.blocks, self.head = nn.CellList(blocks), head

    def construct(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Pair(nn.Cell):
    """Two cells in one, to recompute both and the pair around them (nested recompute)."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b

    def construct(self, x):
        return self.b(self.a(x))


def mlp():
    return Stack([DenseBlock(6, 16, p=0.3), DenseBlock(16, 16, p=0.5), DenseBlock(16, 16)], nn.Dense(16, 3))


def convnet():
    return Stack([ConvBlock(3, 4), ConvBlock(4, 6, stride=2)], nn.SequentialCell(nn.Flatten(), nn.Dense(6 * 4 * 4, 3)))


def convnet_ending_in_batchnorm():
    """(GRAPH_MODE defers a BatchNorm until its output is used: here, after the block returns.)"""
    return Stack([ConvBlock(3, 4, relu=False), ConvBlock(4, 6, stride=2, relu=False)],
                 nn.SequentialCell(nn.ReLU(), nn.Flatten(), nn.Dense(6 * 4 * 4, 3)))


class ConvBatchNormOp(ConvBlock):
    """The BatchNorm primitive called in construct itself, the cell's last op (GRAPH_MODE defers it
    until the output is used, after the cell has returned)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__(cin, cout, stride)
        self.bn_op = ops.BatchNorm(is_training=True, momentum=0.2)

    def construct(self, x):
        bn = self.bn
        return self.bn_op(self.conv(x), bn.gamma, bn.beta, bn.moving_mean, bn.moving_variance)


def convnet_of_batchnorm_ops():
    return Stack([ConvBatchNormOp(3, 4), ConvBatchNormOp(4, 6, stride=2)],
                 nn.SequentialCell(nn.ReLU(), nn.Flatten(), nn.Dense(6 * 4 * 4, 3)))


def resnet_blocks():
    return Stack([BasicBlock(3, 4), BasicBlock(4, 8, stride=2)], nn.SequentialCell(nn.Flatten(), nn.Dense(8 * 4 * 4, 3)))


def nested():
    net = Stack([Pair(DenseBlock(6, 16, p=0.3), DenseBlock(16, 16, p=0.2)), DenseBlock(16, 8, p=0.1)], nn.Dense(8, 3))
    return net


def recompute_blocks(net):
    for block in net.blocks:
        block.recompute()


def recompute_nested(net):
    pair = net.blocks[0]
    pair.a.recompute()
    pair.b.recompute()
    pair.recompute()
    net.blocks[1].recompute()


def batches(shape, steps=3, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((4,) + shape).astype(np.float32), rng.integers(0, 3, 4).astype(np.int32))
            for _ in range(steps)]


def train(build, mark, data, m):
    """Momentum steps on data; returns what a step produces, and what the steps leave."""
    with mode(m):
        minidl.set_seed(7)
        net = build()
        if mark is not None:
            mark(net)
        net.set_train()
        loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
        grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), 0, opt.parameters)
        minidl.set_seed(11)  # the masks' draws start here, from the same state in both runs
        steps = []
        for x, y in data:
            loss, (gx, grads) = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
            steps.append([loss.asnumpy(), gx.asnumpy()] + [g.asnumpy() for g in grads])
        state = {name: p.asnumpy() for name, p in net.parameters_and_names()}
        return steps, state, backend.rng().bit_generator.state


def assert_same_training(build, mark, shape, m):
    data = batches(shape)
    plain_steps, plain_state, plain_rng = train(build, None, data, m)
    steps, state, rng = train(build, mark, data, m)
    for i, (want, got) in enumerate(zip(plain_steps, steps)):
        for j, (a, b) in enumerate(zip(want, got)):
            np.testing.assert_array_equal(b, a, err_msg=f"step {i}, value {j} (loss, input grad, parameter grads)")
    assert state.keys() == plain_state.keys()
    for name in state:
        np.testing.assert_array_equal(state[name], plain_state[name], err_msg=name)
    assert rng == plain_rng, "the random state after the steps differs: the next step's masks would too"


@pytest.mark.parametrize("m", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("build, mark, shape", [
    (mlp, recompute_blocks, (6,)),
    (convnet, recompute_blocks, (3, 8, 8)),
    (convnet_ending_in_batchnorm, recompute_blocks, (3, 8, 8)),
    (convnet_of_batchnorm_ops, recompute_blocks, (3, 8, 8)),
    (resnet_blocks, recompute_blocks, (3, 8, 8)),
    (nested, recompute_nested, (6,)),
], ids=["mlp_dropout", "conv_batchnorm", "conv_ending_in_batchnorm", "batchnorm_op_last",
    "resnet20_blocks", "nested"])
def test_training_with_recompute_equals_training_without(build, mark, shape, m):
    assert_same_training(build, mark, shape, m)


def test_the_recomputed_cells_keep_only_their_inputs_and_run_again_in_backward():
    """Guards the equality above against passing vacuously: the block's output is the node of
    a recomputation, and backward runs the block's construct a second time."""
    calls = []

    class Counted(DenseBlock):
        def construct(self, x):
            calls.append(minidl.is_grad_enabled())
            return super().construct(x)

    minidl.set_seed(0)
    block = Counted(6, 4, p=0.5)
    block.set_train()
    block.recompute()
    x = Tensor(np.ones((2, 6), np.float32))
    out = block(x)
    assert isinstance(out.grad_fn, _Recomputation)
    assert out.grad_fn.inputs[0][1] is block.fc.weight  # (x does not need a gradient: the parameters do)
    assert calls == [False]  # the forward records nothing
    out.sum().backward()
    assert calls == [False, True]
    assert block.fc.weight.grad is not None and block.fc.bias.grad is not None


@pytest.mark.parametrize("m", [minidl.PYNATIVE_MODE, minidl.GRAPH_MODE], ids=MODES.keys())
def test_a_recomputed_sequential_cell_is_recomputed(m):
    with mode(m):
        seq = nn.SequentialCell(nn.Dense(3, 4), nn.ReLU(), nn.Dense(4, 2))
        seq.recompute()
        out = seq(Tensor(np.ones((2, 3), np.float32)))
    assert isinstance(out.grad_fn, _Recomputation)


@pytest.mark.parametrize("m", [minidl.PYNATIVE_MODE, minidl.GRAPH_MODE], ids=MODES.keys())
def test_a_recomputed_dense_before_a_relu_in_a_sequential_cell_is_recomputed(m):
    """GRAPH_MODE runs a SequentialCell's Dense and ReLU cells as one DenseReLU, but not a Dense
    whose construct recompute() replaced: its node is in the graph."""
    with mode(m):
        seq = nn.SequentialCell(nn.Dense(3, 4), nn.ReLU())
        seq[0].recompute()
        out = seq(Tensor(np.ones((2, 3), np.float32)))
        node, seen = out.grad_fn, []
        while node is not None:
            seen.append(type(node))
            tensors = [t for _, t in node.inputs if t.grad_fn is not None]
            node = tensors[0].grad_fn if tensors else None
    assert _Recomputation in seen


@pytest.mark.parametrize("m", [minidl.PYNATIVE_MODE, minidl.GRAPH_MODE], ids=MODES.keys())
def test_a_recomputed_cell_whose_last_op_graph_mode_defers_gives_the_same_gradients(m):
    """The last Dense of a SequentialCell is deferred by GRAPH_MODE (a ReLU could follow): the
    re-run's output is computed before backward walks it."""
    def grads(recompute):
        minidl.set_seed(4)
        with mode(m):
            seq = nn.SequentialCell(nn.Dense(8, 32), nn.ReLU(), nn.Dense(32, 4))
            if recompute:
                seq[2].recompute()
            x = Tensor(np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8), requires_grad=True)
            seq(x).sum().backward()
            return [x.grad.asnumpy()] + [p.grad.asnumpy() for p in seq.trainable_params()]
    for got, want in zip(grads(True), grads(False)):
        np.testing.assert_array_equal(got, want)


def test_dropout_masks_equal_and_the_next_step_draws_as_without():
    def masks(recompute):
        minidl.set_seed(3)
        block = DenseBlock(5, 64, p=0.5)
        block.set_train()
        if recompute:
            block.recompute()
        x = Tensor(np.ones((8, 5), np.float32), requires_grad=True)
        minidl.set_seed(5)
        out = block(x)
        out.sum().backward()
        after = block(x)  # the next step's mask
        return (out.asnumpy() == 0), x.grad.asnumpy(), (after.asnumpy() == 0)

    (m1, gx1, n1), (m2, gx2, n2) = masks(False), masks(True)
    assert m1.any() and not m1.all()  # (zeros and non-zeros: the comparison means something)
    np.testing.assert_array_equal(m2, m1)
    np.testing.assert_array_equal(gx2, gx1)
    np.testing.assert_array_equal(n2, n1)
    assert not np.array_equal(n1, m1)


@pytest.mark.parametrize("seed0, seed1", [(1, 2), (1, 0), (0, 2)])
def test_a_seeded_dropout_primitive_draws_the_same_masks(seed0, seed1):
    class Seeded(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(4, 32)
            self.dropout = ops.Dropout(keep_prob=0.5, seed0=seed0, seed1=seed1)

        def construct(self, x):
            return self.dropout(self.fc(x))

    def run(recompute):
        minidl.set_seed(0)
        cell = Seeded()
        if recompute:
            cell.recompute()
        x = Tensor(np.ones((4, 4), np.float32))
        grads = []
        for _ in range(2):  # the second step continues the primitive's own stream
            cell.zero_grad()
            cell(x).sum().backward()
            grads.append(cell.fc.weight.grad.asnumpy())
        return grads

    plain, recomputed = run(False), run(True)
    assert not np.array_equal(plain[0], plain[1])
    for a, b in zip(plain, recomputed):
        np.testing.assert_array_equal(b, a)


def test_a_second_backward_through_the_same_graph_redraws_the_forwards_masks():
    """backward(retain_graph=True) twice: each re-run starts from the seeded Dropout's state at the
    forward (a copy of it, which the first re-run does not advance), so both give the gradient of
    the forward's mask."""
    minidl.set_seed(0)
    fc = nn.Dense(4, 32)
    dropout = ops.Dropout(keep_prob=0.5, seed0=3, seed1=4)

    class Seeded(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc, self.dropout = fc, dropout

        def construct(self, x):
            return self.dropout(self.fc(x))

    cell = Seeded()
    cell.recompute()
    cell(Tensor(np.ones((4, 4), np.float32))).sum().backward()  # (a step before: the primitive's stream is under way)
    fc.weight.grad = None
    out = cell(Tensor(np.ones((4, 4), np.float32)))
    out.sum().backward(retain_graph=True)
    first = fc.weight.grad.asnumpy().copy()
    fc.weight.grad = None
    out.sum().backward()
    np.testing.assert_array_equal(fc.weight.grad.asnumpy(), first)
    assert np.any(first == 0) and np.any(first != 0)


def test_tensor_backward_fills_the_same_grad():
    def grads(recompute):
        minidl.set_seed(1)
        net = convnet()
        if recompute:
            recompute_blocks(net)
        net.set_train()
        x = Tensor(batches((3, 8, 8), steps=1)[0][0], requires_grad=True)
        (net(x) ** 2).sum().backward()
        return [x.grad.asnumpy()] + [p.grad.asnumpy() for p in net.trainable_params()]

    for a, b in zip(grads(False), grads(True)):
        np.testing.assert_array_equal(b, a)


def test_outside_training_it_runs_as_the_plain_cell():
    minidl.set_seed(0)
    net = convnet()
    recompute_blocks(net)
    x = Tensor(batches((3, 8, 8), steps=1)[0][0])
    with minidl.no_grad():
        out = net.blocks[0](x)
    assert out.grad_fn is None
    moving = net.blocks[0].bn.moving_mean.asnumpy().copy()
    net.set_train(False)
    plain = copy.deepcopy(net)
    plain.blocks[0].__dict__.pop("construct")  # the copy, as it was before recompute()
    plain.blocks[1].__dict__.pop("construct")
    np.testing.assert_array_equal(net(x).asnumpy(), plain(x).asnumpy())
    np.testing.assert_array_equal(net.blocks[0].bn.moving_mean.asnumpy(), moving)


def test_a_copy_of_a_recomputed_network_recomputes_its_own_cells():
    minidl.set_seed(0)
    net = mlp()
    recompute_blocks(net)
    twin = copy.deepcopy(net)
    twin.set_train()
    x = Tensor(np.ones((2, 6), np.float32))
    twin(x).sum().backward()
    assert all(p.grad is not None for p in twin.trainable_params())
    assert all(p.grad is None for p in net.trainable_params())


def test_calling_recompute_again_replaces_the_settings():
    entered = []

    @contextlib.contextmanager
    def note(what):
        entered.append(what)
        yield

    minidl.set_seed(0)
    block = DenseBlock(3, 4)
    block.recompute(use_reentrant=False, context_fn=lambda: (note("forward"), note("recompute")))
    block.recompute(use_reentrant=False, context_fn=lambda: (note("forward 2"), note("recompute 2")))
    block(Tensor(np.ones((2, 3), np.float32))).sum().backward()
    assert entered == ["forward 2", "recompute 2"]
    assert block.fc.weight.grad is not None


def test_every_keyword_mindspore_accepts_is_accepted():
    block = DenseBlock(3, 4)
    block.recompute(use_reentrant=True, output_recompute=True, early_stop=False, mp_comm_recompute=False,
                    parallel_optimizer_comm_recompute=True, recompute_slice_activation=True)
    block.recompute(mp_comm_recompute=None)  # (MindSpore's type check lets None through)
    block(Tensor(np.ones((2, 3), np.float32))).sum().backward()
    assert block.fc.weight.grad is not None


@pytest.mark.parametrize("kwargs, error, message", [
    ({"mp_comm_recompute_x": True}, ValueError, "keyword 'mp_comm_recompute_x' is not recognized"),
    ({"mp_comm_recompute": 1}, TypeError, "mp_comm_recompute must be a bool, got 1 (int)"),
    ({"parallel_optimizer_comm_recompute": "yes"}, TypeError, "parallel_optimizer_comm_recompute must be a bool"),
    ({"use_reentrant": None}, TypeError, "use_reentrant must be a bool, got None"),
    ({"output_recompute": 0}, TypeError, "output_recompute must be a bool, got 0"),
    ({"context_fn": contextlib.nullcontext}, ValueError, "context_fn is only supported when use_reentrant=False"),
    ({"context_fn": 3, "use_reentrant": False}, TypeError, "context_fn must be a callable returning two context "
                                                           "managers (forward, recomputation), got int"),
    ({"early_stop": 1}, TypeError, "early_stop must be a bool, got 1 (int)"),
])
def test_bad_arguments_raise_naming_the_value_and_change_nothing(kwargs, error, message):
    block = DenseBlock(3, 4)
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")) as raised:
        block.recompute(**kwargs)
    assert str(raised.value).startswith(("recompute: ", "For 'recompute', keyword"))
    assert "construct" not in block.__dict__


def test_output_recompute_takes_the_non_reentrant_path_where_context_fn_is_allowed():
    entered = []

    @contextlib.contextmanager
    def note(what):
        entered.append(what)
        yield

    block = DenseBlock(3, 4)
    block.recompute(output_recompute=True, context_fn=lambda: (note("forward"), note("recompute")))
    block(Tensor(np.ones((2, 3), np.float32))).sum().backward()
    assert entered == ["forward", "recompute"]


def test_a_cell_that_returns_a_tuple_is_refused_at_its_call():
    class Two(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(3, 3)

        def construct(self, x):
            y = self.fc(x)
            return y, y

    cell = Two()
    cell.recompute()
    with pytest.raises(TypeError, match="Two returned tuple; a recomputed cell must return one Tensor"):
        cell(Tensor(np.ones((1, 3), np.float32)))


def test_a_parameter_from_outside_the_cell_is_named_not_dropped():
    shared = nn.Dense(3, 3)

    class UsesAnother(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(3, 3)

        def construct(self, x):
            return self.fc(x) * shared.weight.sum()  # a parameter of another cell, through a closure

    cell = UsesAnother()
    cell.recompute()
    with pytest.raises(RuntimeError, match="UsesAnother used parameter 'weight', which needs a gradient but is "
                                           "neither an argument of the cell nor one of its trainable_params"):
        cell(Tensor(np.ones((1, 3), np.float32))).sum().backward()


def test_a_tensor_from_outside_the_cell_is_named_by_its_shape():
    outside = Tensor(np.ones(3, np.float32), requires_grad=True)  # (a Tensor, not a Parameter: no name)

    class UsesATensor(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(3, 3)

        def construct(self, x):
            return self.fc(x) * outside

    cell = UsesATensor()
    cell.recompute()
    with pytest.raises(RuntimeError, match=r"UsesATensor used a tensor of shape \(3,\), which needs a gradient"):
        cell(Tensor(np.ones((1, 3), np.float32))).sum().backward()


def test_the_messages_name_a_nested_cell_by_its_path():
    class Two(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(3, 3)

        def construct(self, x):
            return x, self.fc(x)

    net = nn.SequentialCell(nn.Dense(3, 3), Two())
    net[1].recompute()
    with pytest.raises(TypeError, match=r"^recompute: Two '1' returned tuple; a recomputed cell must return one "
                                         r"Tensor"):
        net(Tensor(np.ones((1, 3), np.float32)))


class Scaled(nn.Cell):
    """No parameters: it multiplies by an int factor, and by a keyword tensor when given one."""

    def construct(self, x, factor, scale=None):
        y = x * factor
        return y if scale is None else y * scale


def test_a_cell_without_parameters_is_recomputed_only_for_an_input_that_needs_a_gradient():
    cell = Scaled()
    cell.recompute()
    plain = cell(Tensor(np.ones((2, 3), np.float32)), 2, scale=Tensor(np.float32(3)))
    assert plain.grad_fn is None and np.all(plain.asnumpy() == 6)
    x = Tensor(np.ones((2, 3), np.float32), requires_grad=True)
    scale = Tensor(np.float32(3), requires_grad=True)
    out = cell(x, 2, scale=scale)
    assert isinstance(out.grad_fn, _Recomputation)
    out.sum().backward()
    np.testing.assert_array_equal(x.grad.asnumpy(), np.full((2, 3), 6, np.float32))
    assert float(scale.grad.asnumpy()) == 12


def test_keyword_arguments_and_a_construct_set_on_the_instance_are_recomputed_as_given():
    """A cell's own construct (an instance attribute, as amp's casts set) is what recompute runs,
    also when recompute is called again; keyword arguments reach it in both runs."""
    def grads(recompute):
        minidl.set_seed(6)
        fc = nn.Dense(3, 2)
        fc.construct = lambda x, scale: nn.Dense.construct(fc, x) * scale * 2
        if recompute:
            fc.recompute()
            fc.recompute()
        x = Tensor(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3), requires_grad=True)
        scale = Tensor(np.float32(3), requires_grad=True)
        out = fc(x, scale=scale)
        out.sum().backward()
        return ([out.asnumpy(), x.grad.asnumpy(), scale.grad.asnumpy()]
                + [p.grad.asnumpy() for p in fc.trainable_params()])

    plain, recomputed = grads(False), grads(True)
    for a, b in zip(plain, recomputed):
        np.testing.assert_array_equal(b, a)
    minidl.set_seed(6)
    fc = nn.Dense(3, 2)
    x = Tensor(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))
    np.testing.assert_array_equal(plain[0], (fc(x) * 6).asnumpy())  # (the instance's construct ran)


def test_run_recomputed_runs_the_cell_once_as_recompute_would_and_leaves_it_unchanged():
    """minidl.nn.recompute.run_recomputed (a runtime's call_cell uses it for one call): the forward
    in the first context, the re-run in the second, which closes before the re-run's ops run backward,
    as Cell.recompute(context_fn=...) does; the cell keeps its construct."""
    from minidl.nn.recompute import run_recomputed
    from minidl.ops.primitive import Primitive

    events = []

    class Mark(Primitive):
        def forward(self, x):
            return x * 1

        def backward(self, gy):
            events.append("op backward")
            return (gy,)

    class Marked(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc, self.mark = nn.Dense(3, 2), Mark()

        def construct(self, x, scale):
            return self.mark(self.fc(x)) * scale

    @contextlib.contextmanager
    def note(what):
        events.append(f"{what} enter")
        yield
        events.append(f"{what} exit")

    x, scale = Tensor(np.ones((1, 3), np.float32)), Tensor(np.float32(2))
    order = ["recompute exit", "op backward"]
    for through in (None, "recompute()"):
        events.clear()
        cell = Marked()
        contexts = lambda: (note("forward"), note("recompute"))  # noqa: E731
        if through == "recompute()":
            cell.recompute(use_reentrant=False, context_fn=contexts)  # (Cell.recompute's own: never through)
            out = cell(x, scale=scale)
        else:
            out = run_recomputed(cell, (x,), {"scale": scale}, contexts)
        assert events == ["forward enter", "forward exit"] and isinstance(out.grad_fn, _Recomputation)
        out.sum().backward()
        assert events[2:] == ["recompute enter"] + order, through
        # (run_recomputed leaves the cell as it was)
        assert ("construct" in cell.__dict__) == (through == "recompute()")
        np.testing.assert_array_equal(cell.fc.weight.grad.asnumpy(), np.full((2, 3), 2, np.float32))
    fc = nn.Dense(3, 2)
    fc.construct = lambda x: nn.Dense.construct(fc, x) * 2  # (an instance's own construct: the one that runs)
    out = run_recomputed(fc, (x,), {}, contexts)
    np.testing.assert_array_equal(out.asnumpy(), (nn.Dense.construct(fc, x) * 2).asnumpy())


# ---- memory ----------------------------------------------------------------------------------

DEPTH, SEGMENTS, WIDTH, BATCH = 20, 4, 256, 256  # one hidden activation: 256 KiB in float32


def deep_mlp():
    """20 Dense + ReLU layers in 4 segments of 5 (each segment is what gets recomputed), then a head."""
    per = DEPTH // SEGMENTS
    return Stack([Stack([DenseBlock(WIDTH, WIDTH) for _ in range(per)], nn.Identity()) for _ in range(SEGMENTS)],
                 nn.Dense(WIDTH, 10))


def peak_step_bytes(recompute):
    """The peak NumPy memory of one training step above what was held before it (NumPy reports
    its allocations to tracemalloc); the first step (the optimizer's state) runs untraced. The
    kernels' pool of reused blocks is off: every array is NumPy's, allocated when made."""
    minidl.set_seed(0)
    net = deep_mlp()
    if recompute:
        recompute_blocks(net)
    net.set_train()
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.01, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    x = Tensor(np.random.default_rng(0).standard_normal((BATCH, WIDTH)).astype(np.float32))
    y = Tensor(np.zeros(BATCH, np.int32))

    def step():
        _, grads = grad_fn(x, y)
        opt(grads)

    with kernels.option("buffer_pool", False):
        step()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            step()
            return tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()


@pytest.mark.cpu_only  # (tracemalloc sees NumPy's allocations, not a device's)
@pytest.mark.parametrize("m, kept_per_layer", [(minidl.PYNATIVE_MODE, 2), (minidl.GRAPH_MODE, 1)],
                         ids=["pynative", "graph"])
def test_recompute_lowers_the_peak_memory_of_a_deep_mlp_step(m, kept_per_layer):
    """Without recompute, backward starts with every layer's activations alive: the input its
    Dense keeps and its ReLU's output (PYNATIVE_MODE), or DenseReLU's output alone (GRAPH_MODE
    fuses them). With recompute, the segments' inputs, then one segment's activations at a time."""
    activation = BATCH * WIDTH * 4
    with mode(m):
        plain, recomputed = peak_step_bytes(False), peak_step_bytes(True)
    per = DEPTH // SEGMENTS
    saved = ((DEPTH - per) * kept_per_layer - SEGMENTS) * activation
    assert plain > DEPTH * kept_per_layer * activation, plain
    assert plain - recomputed > 0.8 * saved, (plain, recomputed, saved)


# ---- data parallel ---------------------------------------------------------------------------

def test_data_parallel_training_with_recompute_equals_it_without():
    """Two thread-ranks, each on its half of every batch, SyncBatchNorm (collectives in forward and
    backward, so also in the recomputation) and the gradient reducer: after the steps every rank's
    parameters and moving statistics are those of the same run without recompute."""
    from minidl_parallel import run_threads
    from minidl_parallel.collectives import resolve_communicator
    from minidl_parallel.grad_reducer import DistributedGradReducer
    from minidl_parallel.sync_batchnorm import SyncBatchNorm

    class SyncBlock(ConvBlock):
        def __init__(self, cin, cout, stride=1):
            super().__init__(cin, cout, stride)
            self.bn = SyncBatchNorm(cout, momentum=0.8)

    class DropoutHead(nn.Cell):
        def __init__(self):
            super().__init__()
            self.flatten, self.drop, self.fc = nn.Flatten(), nn.Dropout(p=0.25), nn.Dense(6 * 4 * 4, 3)

        def construct(self, x):
            return self.fc(self.drop(self.flatten(x)))

    data = batches((3, 8, 8))
    minidl.set_seed(2)
    init = {name: p.asnumpy() for name, p in
            Stack([SyncBlock(3, 4), SyncBlock(4, 6, stride=2)], DropoutHead()).parameters_and_names()}

    def rank_body(recompute):
        rank = resolve_communicator("test", None).rank
        net = Stack([SyncBlock(3, 4), SyncBlock(4, 6, stride=2)], DropoutHead())
        for name, p in net.parameters_and_names():
            p.set_data(init[name].copy())
        if recompute:
            recompute_blocks(net)
            net.head.recompute()
        net.set_train()
        loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
        opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
        reducer = DistributedGradReducer(opt.parameters)
        grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
        minidl.set_seed(20 + rank)
        for x, y in data:
            _, grads = grad_fn(Tensor(x[2 * rank:2 * rank + 2]), Tensor(y[2 * rank:2 * rank + 2]))
            opt(reducer(grads))
        return {name: p.asnumpy() for name, p in net.parameters_and_names()}

    plain = run_threads(2, rank_body, False)
    recomputed = run_threads(2, rank_body, True)
    assert not np.array_equal(plain[0]["blocks.0.conv.weight"], init["blocks.0.conv.weight"])
    for rank in range(2):
        for name, value in plain[rank].items():
            np.testing.assert_array_equal(recomputed[rank][name], value, err_msg=f"rank {rank}: {name}")
