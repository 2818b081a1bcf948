"""amp.auto_mixed_precision: O2 trains as float32 does (every step's loss within 5%), in float16
inside, with float32 master weights, BatchNorm in float32, and checkpoints a float32 net loads.

Each training test builds the same network twice from one seed: the float32 reference trains
with nn.TrainOneStepCell, the O2 copy with nn.TrainOneStepWithLossScaleCell (a fixed scale of
2^10, as float16 training needs), both with Momentum, in both execution modes.
"""
import copy

import numpy as np
import pytest

import minidl
from minidl import Tensor, amp, nn
from minidl.models.resnet import BasicBlock
from minidl.testing.modes import mode

MODES = {"pynative": minidl.PYNATIVE_MODE, "graph": minidl.GRAPH_MODE}
_modes = pytest.mark.parametrize("m", MODES.values(), ids=MODES.keys())


def mlp():
    return nn.SequentialCell(nn.Dense(8, 32), nn.ReLU(), nn.Dense(32, 32), nn.ReLU(), nn.Dense(32, 4))


class ConvNet(nn.Cell):
    """A conv + BatchNorm + ReLU stem, a ResNet BasicBlock (BatchNorm through with_relu), a Dense head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.block = BasicBlock(8, 8)
        self.flatten = nn.Flatten()
        self.fc = nn.Dense(8 * 8 * 8, 4)  # (Conv2d pads 'same', as MindSpore's)

    def construct(self, x):
        return self.fc(self.flatten(self.block(self.relu(self.bn(self.conv(x))))))


def train_both(make_net, x, y, steps, lr):
    """Losses of the float32 run and of the O2 run, step by step; the O2 network and optimizer."""
    minidl.set_seed(7)
    net32 = make_net()
    net16 = copy.deepcopy(net32)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    step32 = nn.TrainOneStepCell(nn.WithLossCell(net32, loss_fn),
                                 nn.Momentum(net32.trainable_params(), lr, 0.9)).set_train()
    net16 = amp.auto_mixed_precision(net16, "O2")
    opt16 = nn.Momentum(net16.trainable_params(), lr, 0.9)
    scale = amp.FixedLossScaleManager(2.0 ** 10, drop_overflow_update=True).get_update_cell()
    step16 = nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(net16, loss_fn), opt16, scale).set_train()
    losses32, losses16 = [], []
    for _ in range(steps):
        losses32.append(float(step32(x, y).asnumpy()))
        loss, overflow, _ = step16(x, y)
        assert not bool(np.asarray(overflow.asnumpy() if isinstance(overflow, Tensor) else overflow))
        losses16.append(float(loss.asnumpy()))
    return np.array(losses32), np.array(losses16), net16, opt16


def assert_close_every_step(losses32, losses16):
    relative = np.abs(losses16 - losses32) / np.abs(losses32)
    assert relative.max() < 0.05, f"worst step {relative.argmax()}: {losses16} vs {losses32}"
    assert losses32[-1] < 0.8 * losses32[0]  # (it trained: the comparison is not of two flat lines)


def assert_master_weights_float32(net, opt):
    assert all(p.dtype == np.float32 for p in net.get_parameters())
    assert all(p.asnumpy().dtype == np.float32 for p in opt.parameters)


@_modes
def test_o2_trains_an_mlp_within_5_percent_of_float32_at_every_step(m, rng):
    x = Tensor(rng.standard_normal((32, 8)).astype(np.float32))
    y = Tensor(rng.integers(0, 4, 32).astype(np.int32))
    with mode(m):
        losses32, losses16, net16, opt16 = train_both(mlp, x, y, steps=30, lr=0.1)
    assert_close_every_step(losses32, losses16)
    assert not np.array_equal(losses32, losses16)  # (float16 really ran: the losses are not float32's bit for bit)
    assert_master_weights_float32(net16, opt16)


@_modes
def test_o2_trains_a_conv_net_with_batchnorm_within_5_percent_of_float32_at_every_step(m, rng):
    x = Tensor(rng.standard_normal((8, 3, 8, 8)).astype(np.float32))
    y = Tensor(rng.integers(0, 4, 8).astype(np.int32))
    with mode(m):
        losses32, losses16, net16, opt16 = train_both(ConvNet, x, y, steps=20, lr=0.02)
    assert_close_every_step(losses32, losses16)
    assert_master_weights_float32(net16, opt16)
    assert net16.bn.moving_mean.dtype == np.float32 and net16.block.bn2.moving_variance.dtype == np.float32


# ResNet-20 whole (19 conv + BatchNorm layers, the Dense head), on 8 images. The CI size is 8x8:
# the architecture is the same (global average pooling), and float16 convolutions in NumPy have
# no BLAS, so 32x32 images take minutes: that size runs in the slow set. The learning rates keep
# the loss away from 0, where a relative comparison measures float16's rounding of a vanishing
# number rather than the training.
@pytest.mark.parametrize("size, lr", [(8, 0.001), pytest.param(32, 0.005, marks=pytest.mark.slow)])
def test_o2_trains_resnet20_within_5_percent_of_float32_at_every_step(size, lr, rng):
    from minidl.models import resnet20
    x = Tensor(rng.standard_normal((8, 3, size, size)).astype(np.float32))
    y = Tensor(rng.integers(0, 10, 8).astype(np.int32))
    losses32, losses16, net16, opt16 = train_both(lambda: resnet20(num_classes=10), x, y, steps=50, lr=lr)
    assert_close_every_step(losses32, losses16)
    assert not np.array_equal(losses32, losses16)
    assert_master_weights_float32(net16, opt16)


class ProbeDense(nn.Dense):
    """Records the dtypes its construct sees: the input and the weight it computes with."""

    def construct(self, x):
        self.seen = (x.dtype, self.weight.dtype)
        return super().construct(x)


class ProbeBatchNorm(nn.BatchNorm2d):
    def construct(self, x):
        self.seen = (x.dtype, self.gamma.dtype, self.moving_mean.dtype)
        return super().construct(x)


class ProbeNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = ProbeBatchNorm(4)
        self.flatten = nn.Flatten()
        self.fc = ProbeDense(4 * 8 * 8, 2)

    def construct(self, x):
        y = self.bn(self.conv(x))
        self.bn_out = y.dtype  # what the BatchNorm cell gives the next cell
        return self.fc(self.flatten(y))


@_modes
@pytest.mark.parametrize("level, bn_dtype", [("O2", np.float32), ("O3", np.float16)])
def test_inside_the_network_cells_compute_in_float16_but_o2s_batchnorm_in_float32(m, level, bn_dtype):
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32))
    with mode(m):
        net = amp.auto_mixed_precision(ProbeNet(), level).set_train()
        before = net.bn.moving_mean.asnumpy().copy()
        out = net(x)
        out.sum().backward()
    assert out.dtype == np.float32
    assert net.fc.seen == (np.float16, np.float16)
    assert net.bn.seen == (bn_dtype, bn_dtype, np.float32)  # (moving statistics are never cast: written in place)
    assert net.bn_out == np.float16  # O2: the black-listed cell's output goes back to float16
    assert not np.array_equal(net.bn.moving_mean.asnumpy(), before)  # updated once, in float32
    assert all(p.dtype == np.float32 and p.grad is not None and p.grad.dtype == np.float32
               for p in net.trainable_params())
    assert net.fc.weight is net.trainable_params()[-2]  # the attribute is the Parameter again after the call


@pytest.mark.cpu_only  # (reads the checkpoint file's host arrays)
def test_an_o2_runs_checkpoint_loads_into_a_float32_net(tmp_path, rng):
    x = Tensor(rng.standard_normal((8, 3, 8, 8)).astype(np.float32))
    y = Tensor(rng.integers(0, 4, 8).astype(np.int32))
    _, _, net16, _ = train_both(ConvNet, x, y, steps=3, lr=0.02)
    path = str(tmp_path / "amp.ckpt")
    minidl.save_checkpoint(net16, path)
    params = minidl.load_checkpoint(path)
    assert all(v.asnumpy().dtype == np.float32 for v in params.values())
    plain = ConvNet()
    not_loaded, _ = minidl.load_param_into_net(plain, params, strict_load=True)
    assert not not_loaded
    for (name16, p16), (name32, p32) in zip(net16.parameters_dict().items(), plain.parameters_dict().items()):
        assert name16 == name32 and np.array_equal(p16.asnumpy(), p32.asnumpy())
    plain.set_train(False)
    net16.set_train(False)
    np.testing.assert_allclose(net16(x).asnumpy(), plain(x).asnumpy(), rtol=0.05, atol=0.05)


def test_o0_returns_the_network_itself_unchanged():
    net = mlp()
    assert amp.auto_mixed_precision(net) is net and amp.auto_mixed_precision(net, "O0") is net
    assert all("construct" not in c.__dict__ for _, c in net.cells_and_names())


def test_o2_casts_the_network_in_place_and_returns_a_float32_output_wrapper():
    net = mlp()
    wrapped = amp.auto_mixed_precision(net, "O2")
    x = Tensor(np.ones((2, 8), np.float32))
    assert wrapped is not net and wrapped.__dict__.get("_cells") is not net._cells
    assert wrapped._backbone is net and wrapped.training is net.training
    assert net(x).dtype == np.float16 and wrapped(x).dtype == np.float32  # as MindSpore's _OutputTo32
    assert [p.name for p in wrapped.trainable_params()] == [p.name for p in net.trainable_params()]
    again = amp.auto_mixed_precision(wrapped, "O3")  # re-sets the cells: no cast on a cast
    assert again._backbone is net and np.array_equal(again(x).asnumpy(), wrapped(x).asnumpy())


class Hidden(nn.Cell):
    def __init__(self):
        super().__init__()
        self.fc, self.relu = nn.Dense(32, 32), nn.ReLU()

    def construct(self, x):
        return self.relu(self.fc(x))


@_modes
@pytest.mark.parametrize("recompute_first", [True, False])
def test_recompute_and_amp_give_amps_gradients_in_either_order(m, recompute_first):
    """The recomputed block's re-run in backward casts as its forward did, whichever was set first."""
    minidl.set_seed(3)
    reference = nn.SequentialCell(nn.Dense(8, 32), nn.ReLU(), Hidden(), nn.Dense(32, 4))
    backbone = copy.deepcopy(reference)
    x = Tensor(np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32))
    with mode(m):
        reference = amp.auto_mixed_precision(reference, "O2")
        if recompute_first:
            backbone[2].recompute()
        net = amp.auto_mixed_precision(backbone, "O2")
        if not recompute_first:
            backbone[2].recompute()
        grads = []
        for n in (reference, net):
            out = n(x)
            out.sum().backward()
            grads.append([p.grad.asnumpy() for p in n.trainable_params()])
    assert type(backbone[2].construct).__name__ == "_RecomputedConstruct"  # (recompute outermost either way)
    for g_ref, g in zip(*grads):
        assert g.dtype == np.float32 and np.array_equal(g, g_ref)


def test_bad_arguments_raise_naming_them():
    with pytest.raises(ValueError, match=r"amp_level must be one of .*got 'O4'"):
        amp.auto_mixed_precision(mlp(), "O4")
    with pytest.raises(ValueError, match=r"dtype must be minidl.float16, got .*float32"):
        amp.auto_mixed_precision(mlp(), "O2", minidl.float32)
    with pytest.raises(ValueError, match=r"dtype must be minidl.float16, got 'half precision'"):
        amp.auto_mixed_precision(mlp(), "O2", "half precision")  # (not a dtype at all: the same message)
    with pytest.raises(TypeError, match=r"network must be a Cell, got function"):
        amp.auto_mixed_precision(lambda x: x, "O2")


def test_bfloat16_is_refused_naming_why():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with pytest.raises(ValueError) as raised:
        amp.auto_mixed_precision(mlp(), "O2", ml_dtypes.bfloat16)
    assert str(raised.value) == ("auto_mixed_precision: dtype bfloat16 is not supported by minidl (NumPy has no "
                                 "bfloat16, ml_dtypes' is not a float kind to minidl's ops, CuPy has none); use "
                                 "minidl.float16")


class ProbeBatchNormReLU(nn.BatchNorm2d):
    """Records the dtypes its fused with_relu (what the ResNet blocks call) computes in."""

    def with_relu(self, x, residual=None):
        self.seen = (x.dtype, self.gamma.dtype)
        return super().with_relu(x, residual)


class FusedNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3), ProbeBatchNormReLU(4)

    def construct(self, x):
        return self.bn.with_relu(self.conv(x))


@pytest.mark.parametrize("levels, bn_dtype", [(["O2"], np.float32), (["O3"], np.float16), (["O2", "O3"], np.float16),
                                              (["O3", "O2"], np.float32), (["O2", "O2"], np.float32)])
def test_a_batchnorms_with_relu_casts_as_its_construct_also_after_a_change_of_level(levels, bn_dtype):
    minidl.set_seed(0)
    backbone = FusedNet()
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 5, 5)).astype(np.float32))
    net = backbone
    for level in levels:
        net = amp.auto_mixed_precision(net, level)
    assert net(x).dtype == np.float32
    assert backbone.bn.seen == (bn_dtype, bn_dtype)
    assert backbone(x).dtype == np.float16  # (O2's black-listed cell gives its output back in float16)


class KeywordProbe(nn.Cell):
    """A Dense, then a scale given by keyword; records the dtype the keyword argument arrives in."""

    def __init__(self, dense):
        super().__init__()
        self.fc = dense

    def construct(self, x, scale=None):
        self.seen_scale = None if scale is None else scale.dtype
        return self.fc(x) * scale


class DoubledDense(nn.Dense):
    def construct(self, x):
        return super().construct(x) * 2


@pytest.mark.parametrize("levels", [["O1"], ["O2"], ["O3"], ["auto"], ["O2", "O1", "O3", "auto", "O2"]])
def test_keyword_arguments_and_a_construct_set_on_the_instance_are_kept_at_every_level(levels, rng):
    """A cell's own construct (set on the instance, not the class) is what every level casts
    around, also when the level changes; keyword arguments reach the cell, cast as positional ones."""
    x = Tensor(rng.standard_normal((2, 4)).astype(np.float32))
    scale = Tensor(np.float32(3.0))
    minidl.set_seed(5)
    own = KeywordProbe(nn.Dense(4, 3))
    fc = own.fc
    fc.construct = lambda x: nn.Dense.construct(fc, x) * 2  # (the instance's own construct)
    minidl.set_seed(5)
    twin = KeywordProbe(DoubledDense(4, 3))  # the same computation from the class
    for level in levels:
        own, twin = amp.auto_mixed_precision(own, level), amp.auto_mixed_precision(twin, level)
        got, want = own(x, scale=scale), twin(x, scale=scale)
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
        assert own.seen_scale == (np.float16 if level in ("O2", "O3") else np.float32)
    plain = minidl.Tensor(np.asarray(nn.Dense.construct(fc, x).asnumpy()))
    assert not np.array_equal(got.asnumpy(), (plain * scale).asnumpy())  # (the doubling counted)


def test_the_black_list_is_mindspores_for_the_cells_minidl_has():
    assert amp.get_black_list() == [nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm]


def test_o2_casts_every_float_output_in_tuples_and_lists_and_leaves_the_rest():
    class Several(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(4, 2)

        def construct(self, x, labels):
            y = self.fc(x)
            return y, [y * 2, labels], 3

    x = Tensor(np.ones((2, 4), np.float32))
    labels = Tensor(np.arange(2, dtype=np.int32))
    net = Several()
    y, (y2, same_labels), three = amp.auto_mixed_precision(net, "O2")(x, labels)
    assert (y.dtype, y2.dtype, same_labels.dtype, three) == (np.float32, np.float32, np.int32, 3)
    inside, _, _ = net(x, labels)
    assert inside.dtype == np.float16
    np.testing.assert_array_equal(y.asnumpy(), inside.asnumpy().astype(np.float32))
    np.testing.assert_array_equal(y2.asnumpy(), (inside * 2).asnumpy().astype(np.float32))


@pytest.mark.parametrize("level", ["O1", "O2", "auto"])
def test_a_copy_of_a_cast_network_casts_its_own_cells(level):
    """copy.deepcopy of the returned network: the copy's cells cast as the original's, and run
    with the copy's parameters (each cast construct holds its own cell)."""
    minidl.set_seed(1)
    x = Tensor(np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32))
    net = amp.auto_mixed_precision(mlp(), level)
    twin = copy.deepcopy(net)
    np.testing.assert_array_equal(twin(x).asnumpy(), net(x).asnumpy())
    for p in twin.trainable_params():
        p.set_data(np.zeros(p.shape, np.float32))
    assert not np.any(twin(x).asnumpy()) and np.any(net(x).asnumpy())
    assert twin._backbone[0](x).dtype == (np.float16 if level == "O2" else np.float32)  # ("auto": BiasAdd promotes)


def test_the_wrapper_has_the_backbones_parameters_under_a_prefix_and_none_of_its_own():
    backbone = nn.Dense(4, 2)
    net = amp.auto_mixed_precision(backbone, "O2")
    assert [n for n, _ in net.parameters_and_names("net")] == [n for n, _ in backbone.parameters_and_names("net")]
    assert [n for n, _ in net.parameters_and_names("net")] != [n for n, _ in backbone.parameters_and_names()]
    assert list(net.parameters_and_names(expand=False)) == []
    assert net.in_channels == 4  # (read from the backbone)
    with pytest.raises(AttributeError, match="__not_there__"):
        getattr(net, "__not_there__")
