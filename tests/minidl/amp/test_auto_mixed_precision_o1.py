"""amp.auto_mixed_precision at the op-list levels O1 and "auto": each op casts as MindSpore 2.10's.

The expected dtypes are what MindSpore 2.10 (CPU, PyNative) gave for the same networks, printed
by returning every intermediate value from construct:

- O1 (its rewrite pass puts ``amp_cast`` pairs around the white-listed primitives and around
  every primitive inside nn.Dense / nn.Conv2d): each of those ops runs on float16 inputs and its
  output is cast back to float32, so every value the Python code sees is float32, the Dense's
  activation (a Sigmoid) included; an op on no list given float16 (Exp) stays float16; a MatMul
  given float64 comes out float32.
- "auto": a MatMul's output is float16 (not cast back); nn.Dense's output float32 (its MatMul
  is white-listed, its BiasAdd promotes to the bias's float32); Exp and BatchNorm (black list)
  float32, also from float16 or float64 inputs; Concat and BiasAdd (promote list) the widest
  input type; ReduceSum, ReLU, Add (on no list) their input type; ops.Dense called directly
  float16; Conv2D float16.

The check the op call pays for this when no O1/"auto" network runs is one thread-local read in
``Primitive.__call__``; no benchmark in the repository measures it on its own (an A/B of a
training step, ``benchmarks/bench_step_ab.py``, is where to look before making it dearer).
"""
import copy
import threading

import numpy as np
import pytest

import minidl
from minidl import Parameter, Tensor, amp, nn, ops
from minidl.models.resnet import BasicBlock
from minidl.runtime import Runtime
from minidl.testing.modes import mode

MODES = {"pynative": minidl.PYNATIVE_MODE, "graph": minidl.GRAPH_MODE}
_modes = pytest.mark.parametrize("m", MODES.values(), ids=MODES.keys())
F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


class Recording(Runtime):
    """A thread's runtime that runs each op as the local one does and notes (op, input dtypes,
    output dtype). (nn.Dense then runs MatMul and BiasAdd, as under any runtime but the local one.)"""

    def __init__(self):
        self.ops = []

    def call_op(self, prim, args):
        out = prim.apply(*args)
        self.ops.append((prim.name, tuple(a.dtype for a in args if isinstance(a, Tensor)), out.dtype))
        return out

    def without_casts(self):
        return [op for op in self.ops if op[0] != "Cast"]


class Net(nn.Cell):
    """The network run in MindSpore (see the module doc): Dense with an activation, an nn.ReLU
    cell, Dense, a MatMul and an Exp, and a conv + BatchNorm branch; returns its intermediates."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Dense(4, 8, activation="sigmoid")
        self.relu = nn.ReLU()
        self.fc2 = nn.Dense(8, 3)
        self.matmul = ops.MatMul()
        self.exp = ops.Exp()
        self.conv = nn.Conv2d(1, 2, 3, has_bias=True)
        self.bn = nn.BatchNorm2d(2)
        self.w = Parameter(Tensor(np.linspace(-1, 1, 9).reshape(3, 3).astype(np.float32)), name="w")

    def construct(self, x, img):
        h1 = self.fc1(x)
        h2 = self.relu(h1)
        h3 = self.fc2(h2)
        m = self.matmul(h3, self.w)
        e = self.exp(m)
        b = self.bn(self.conv(img))
        return h1, h2, h3, m, e, b


def inputs(rng):
    return (Tensor(rng.standard_normal((2, 4)).astype(np.float32)),
            Tensor(rng.standard_normal((2, 1, 4, 4)).astype(np.float32)))


def run_recorded(net, *args):
    with mode(minidl.PYNATIVE_MODE), Recording() as recording:
        outs = net(*args)
    return outs, recording


def test_o1_runs_the_white_listed_ops_and_every_op_of_dense_and_conv_in_float16_and_returns_float32(rng):
    net = amp.auto_mixed_precision(Net(), "O1")
    outs, recording = run_recorded(net, *inputs(rng))
    assert [o.dtype for o in outs] == [F32] * 6  # (MindSpore: h1 h2 h3 m e b all Float32)
    assert recording.without_casts() == [
        ("MatMul", (F16, F16), F16), ("BiasAdd", (F16, F16), F16), ("Sigmoid", (F16,), F16),  # fc1: all of it
        ("ReLU", (F16,), F16),  # an op on the white list, in a cell that is not
        ("MatMul", (F16, F16), F16), ("BiasAdd", (F16, F16), F16),  # fc2
        ("MatMul", (F16, F16), F16),
        ("Exp", (F32,), F32),  # on no list: as given
        ("Conv2D", (F16, F16), F16), ("BiasAdd", (F16, F16), F16),
        ("BatchNorm", (F32,) * 5, F32)]


def test_o1_leaves_ops_on_no_list_in_their_input_type_and_casts_any_float_for_a_white_listed_op(rng):
    a = rng.standard_normal((3, 3))

    class Few(nn.Cell):
        def construct(self, x16, x64):
            return ops.exp(x16), ops.matmul(x64, x64), ops.dense(x64, x64)

    outs, _ = run_recorded(amp.auto_mixed_precision(Few(), "O1"), Tensor(a.astype(np.float16)), Tensor(a))
    assert [o.dtype for o in outs] == [F16, F32, F64]  # (MindSpore: e16 Float16, m64 Float32; ops.Dense not listed)
    np.testing.assert_array_equal(outs[1].asnumpy(), (a.astype(np.float16) @ a.astype(np.float16)).astype(np.float32))


def test_auto_runs_white_in_float16_black_in_float32_promotes_and_leaves_the_rest(rng):
    net = amp.auto_mixed_precision(Net(), "auto")
    outs, recording = run_recorded(net, *inputs(rng))
    assert [o.dtype for o in outs] == [F32, F32, F32, F16, F32, F32]  # (MindSpore: h1 h2 h3 Float32, m Float16, ...)
    assert recording.without_casts() == [
        ("MatMul", (F16, F16), F16), ("BiasAdd", (F32, F32), F32), ("Sigmoid", (F32,), F32),  # fc1
        ("ReLU", (F32,), F32),
        ("MatMul", (F16, F16), F16), ("BiasAdd", (F32, F32), F32),  # fc2
        ("MatMul", (F16, F16), F16),
        ("Exp", (F32,), F32),  # black: its float16 input cast up
        ("Conv2D", (F16, F16), F16), ("BiasAdd", (F32, F32), F32),
        ("BatchNorm", (F32,) * 5, F32)]


def test_auto_per_op_as_mindspore_printed_it(rng):
    a = rng.standard_normal((3, 3))

    class Few(nn.Cell):
        def construct(self, x64, x16, x32):
            return (ops.matmul(x64, x64), ops.exp(x64), ops.exp(x16), ops.BiasAdd()(x16, x64[0]),
                    ops.BiasAdd()(x16, x32[0]), ops.add(x16, x16), ops.relu(x16), ops.concat((x16, x64)),
                    ops.dense(x32, x32, x32[0]), ops.MatMul()(x16, x32), ops.ReduceSum()(x16))

    outs, _ = run_recorded(amp.auto_mixed_precision(Few(), "auto"), Tensor(a), Tensor(a.astype(np.float16)),
                           Tensor(a.astype(np.float32)))
    # MindSpore 2.10: matmul64 Float16, exp64 Float32, exp16 Float32, biasadd16_64 Float64, biasadd16_32
    # Float32, add16 Float16, relu16 Float16, concat16_64 Float64, dense32 Float16, matmul16_32 Float16,
    # a ReduceSum of a float16 MatMul output Float16
    assert [o.dtype for o in outs] == [F16, F32, F32, F64, F32, F16, F16, F64, F16, F16, F16]


@pytest.mark.parametrize("level", ["O1", "auto"])
def test_dense_as_one_op_gives_the_values_of_its_matmul_and_biasadd(level, rng):
    """nn.Dense runs one ops.Dense on the local runtime and MatMul + BiasAdd under any other: under
    the policy both are cast as MindSpore's layer (two ops) is."""
    net = amp.auto_mixed_precision(nn.SequentialCell(nn.Dense(4, 8, activation="relu"), nn.Dense(8, 3)), level)
    x = Tensor(rng.standard_normal((5, 4)).astype(np.float32))
    with mode(minidl.PYNATIVE_MODE):
        one_op = net(x)
    two_ops, _ = run_recorded(net, x)
    assert one_op.dtype == two_ops.dtype == F32
    np.testing.assert_array_equal(one_op.asnumpy(), two_ops.asnumpy())


def mlp():
    return nn.SequentialCell(nn.Dense(8, 32), nn.ReLU(), nn.Dense(32, 32), nn.ReLU(), nn.Dense(32, 4))


@_modes
@pytest.mark.parametrize("level", ["O1", "auto"])
def test_training_an_mlp_stays_within_5_percent_of_float32_with_float32_master_weights(m, level, rng):
    x = Tensor(rng.standard_normal((32, 8)).astype(np.float32))
    y = Tensor(rng.integers(0, 4, 32).astype(np.int32))
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    minidl.set_seed(7)
    net32 = mlp()
    net16 = amp.auto_mixed_precision(copy.deepcopy(net32), level)
    losses = {}
    with mode(m):
        for name, net in (("32", net32), ("16", net16)):
            opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
            step = nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), opt).set_train()
            losses[name] = np.array([float(step(x, y).asnumpy()) for _ in range(20)])
    relative = np.abs(losses["16"] - losses["32"]) / np.abs(losses["32"])
    assert relative.max() < 0.05, f"worst step {relative.argmax()}: {losses['16']} vs {losses['32']}"
    assert losses["32"][-1] < 0.8 * losses["32"][0]  # (it trained: the comparison is not of two flat lines)
    assert not np.array_equal(losses["16"], losses["32"])  # (float16 really ran)
    assert all(p.dtype == F32 for p in net16.get_parameters())
    assert all(p.asnumpy().dtype == F32 for p in opt.parameters)


@pytest.mark.parametrize("level", ["O1", "auto"])
def test_another_network_in_the_process_is_not_cast_on_this_thread_or_another(level, rng):
    x = Tensor(rng.standard_normal((16, 8)).astype(np.float32))
    minidl.set_seed(1)
    plain, cast = mlp(), amp.auto_mixed_precision(mlp(), level)
    before = plain(x).asnumpy()
    results, errors = [], []

    def run_plain():
        try:
            for _ in range(20):
                results.append(plain(x).asnumpy())
        except BaseException as exc:  # (reported below: an assertion in a thread would be lost)
            errors.append(exc)

    thread = threading.Thread(target=run_plain)
    thread.start()
    for _ in range(20):
        cast(x)  # (meanwhile, on this thread)
    thread.join()
    cast_out = cast(x)
    after = plain(x)  # (and on this thread after the cast network's call)
    assert not errors
    assert after.dtype == F32 and all(r.dtype == F32 for r in results)
    assert all(np.array_equal(r, before) for r in results + [after.asnumpy()])
    assert not np.array_equal(cast_out.astype(minidl.float32).asnumpy(), before)  # (the cast one did cast)


@pytest.mark.parametrize("level", ["O1", "auto"])
def test_the_policy_is_taken_away_when_the_network_raises(level, rng):
    a = Tensor(rng.standard_normal((4, 4)).astype(np.float32))
    reference = ops.matmul(a, a).asnumpy()

    class Fails(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(4, 4)

        def construct(self, x):
            y = self.fc(ops.matmul(x, x))
            raise RuntimeError(f"failed after computing {y.dtype}")

    net = amp.auto_mixed_precision(Fails(), level)
    with pytest.raises(RuntimeError, match="failed after computing"):
        net(a)
    after = ops.matmul(a, a)
    assert after.dtype == F32 and np.array_equal(after.asnumpy(), reference)


class ConvNet(nn.Cell):
    """Conv + BatchNorm + ReLU, a ResNet BasicBlock (BatchNorm + residual + ReLU through with_relu),
    a Dense head: GRAPH_MODE's BatchNorm rows have something to fuse (under "auto" they do)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.block = BasicBlock(8, 8)
        self.flatten = nn.Flatten()
        self.fc = nn.Dense(8 * 6 * 6, 4)

    def construct(self, x):
        return self.fc(self.flatten(self.block(self.relu(self.bn(self.conv(x))))))


@pytest.mark.parametrize("level", ["O1", "auto"])
@pytest.mark.parametrize("make, shape", [(mlp, (8, 8)), (ConvNet, (4, 3, 6, 6))], ids=["mlp", "convnet"])
def test_graph_mode_gives_pynatives_outputs_and_gradients(level, make, shape, rng):
    x = Tensor(rng.standard_normal(shape).astype(np.float32))
    minidl.set_seed(5)
    base = make()
    results = {}
    for name, m in MODES.items():
        net = amp.auto_mixed_precision(copy.deepcopy(base), level).set_train()
        with mode(m):
            grad_fn = minidl.value_and_grad(lambda t: net(t).astype(minidl.float32).sum(), None, net.trainable_params())
            out, grads = grad_fn(x)
        results[name] = [out.asnumpy()] + [g.asnumpy() for g in grads] + [p.asnumpy() for p in net.get_parameters()]
    for a, b in zip(results["pynative"], results["graph"]):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("recompute_first", [True, False])
def test_a_recomputed_cells_rerun_in_backward_casts_as_its_forward(recompute_first, rng):
    x = Tensor(rng.standard_normal((4, 8)).astype(np.float32))
    minidl.set_seed(3)
    base = mlp()
    grads = []
    for recompute in (False, True):
        backbone = copy.deepcopy(base)
        if recompute and recompute_first:
            backbone[2].recompute()
        net = amp.auto_mixed_precision(backbone, "O1")
        if recompute and not recompute_first:
            backbone[2].recompute()
        grad_fn = minidl.value_and_grad(lambda t: net(t).sum(), None, net.trainable_params())
        grads.append([g.asnumpy() for g in grad_fn(x)[1]])
    for g_plain, g_recomputed in zip(*grads):
        assert g_recomputed.dtype == F32
        np.testing.assert_array_equal(g_recomputed, g_plain)


def test_changing_level_re_sets_every_cell(rng):
    x = Tensor(rng.standard_normal((4, 8)).astype(np.float32))
    minidl.set_seed(2)
    base = mlp()
    expected = {level: amp.auto_mixed_precision(copy.deepcopy(base), level)(x).asnumpy()
                for level in ("O1", "O2", "auto")}
    net = amp.auto_mixed_precision(base, "O2")
    for level in ("O1", "auto", "O2", "O1"):
        net = amp.auto_mixed_precision(net, level)
        assert net._backbone is base
        np.testing.assert_array_equal(net(x).asnumpy(), expected[level])


@pytest.mark.parametrize("level", ["O1", "auto"])
def test_a_per_op_level_after_o2_runs_the_ops_of_that_level_on_a_fresh_network(level, rng):
    """O2's casts of the BatchNorms' fused with_relu (float32 inside, float16 out) are gone: the
    ops, their dtypes and the values are those of the level set on a fresh copy."""
    x = Tensor(rng.standard_normal((2, 3, 6, 6)).astype(np.float32))
    minidl.set_seed(2)
    base = ConvNet()
    fresh = amp.auto_mixed_precision(copy.deepcopy(base), level)
    net = amp.auto_mixed_precision(amp.auto_mixed_precision(base, "O2"), level)
    want, want_ops = run_recorded(fresh, x)
    got, got_ops = run_recorded(net, x)
    assert got_ops.ops == want_ops.ops
    np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())


def test_auto_leaves_integer_inputs_and_arguments_that_are_not_tensors_alone(rng):
    """CumSum (black list) takes its axis as an int argument; a Concat (promote list) of integer
    tensors has no float type to promote to; a bias-free Dense (white list, run as its MatMul)."""
    a = rng.standard_normal((3, 4))

    class Mixed(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(4, 2, has_bias=False)

        def construct(self, x16, i32):
            return ops.CumSum()(x16, 1), ops.concat((i32, i32)), self.fc(x16)

    x16 = Tensor(a.astype(np.float16))
    i32 = Tensor(np.arange(12, dtype=np.int32).reshape(3, 4))
    outs, _ = run_recorded(amp.auto_mixed_precision(Mixed(), "auto"), x16, i32)
    assert [o.dtype for o in outs] == [F32, np.dtype(np.int32), F16]
    np.testing.assert_array_equal(outs[0].asnumpy(), np.cumsum(a.astype(np.float16).astype(np.float32), axis=1))
    np.testing.assert_array_equal(outs[1].asnumpy(), np.concatenate([np.arange(12).reshape(3, 4)] * 2))


@pytest.mark.parametrize("level", ["O1", "auto"])
def test_a_residual_block_gives_the_float32_values_within_float16_rounding(level, rng):
    """BasicBlock's BatchNorm + residual + ReLU (with_relu) runs as its parts: the residual counts."""
    x = Tensor(rng.standard_normal((2, 3, 6, 6)).astype(np.float32))
    minidl.set_seed(4)
    net32 = ConvNet()
    net = amp.auto_mixed_precision(copy.deepcopy(net32), level)
    np.testing.assert_allclose(net(x).asnumpy().astype(np.float32), net32(x).asnumpy(), rtol=0.02, atol=0.02)


def test_a_network_of_another_level_called_inside_casts_by_its_own_level(rng):
    """An "auto" network called from an O1 network's construct (not one of its cells) keeps its
    own rules: a MatMul's output stays float16, where O1 would cast it back to float32."""
    a = Tensor(rng.standard_normal((3, 3)).astype(np.float32))

    class Inner(nn.Cell):
        def construct(self, x):
            return ops.matmul(x, x)

    inner = amp.auto_mixed_precision(Inner(), "auto")
    called = [inner]  # (in a list: not a cell of Outer, so O1 does not re-set it)

    class Outer(nn.Cell):
        def construct(self, x):
            return called[0](x), ops.matmul(x, x)

    from_auto, from_o1 = amp.auto_mixed_precision(Outer(), "O1")(a)
    assert (from_auto.dtype, from_o1.dtype) == (F16, F32)
    assert inner(a).dtype == F16


@pytest.mark.parametrize("level", ["O1", "auto"])
def test_batchnorm_relu_runs_as_its_parts_where_their_rules_differ(level, rng):
    """BatchNormReLU is BatchNorm, Add and ReLU: O1 runs ReLU in float16 and the other two as
    given, "auto" runs BatchNorm in float32: neither casts the three alike, so the parts run."""
    x = Tensor(rng.standard_normal((2, 8, 4, 4)).astype(np.float32))
    minidl.set_seed(1)
    _, recording = run_recorded(amp.auto_mixed_precision(BasicBlock(8, 8), level), x)
    names = [name for name, _, _ in recording.without_casts()]
    assert "BatchNormReLU" not in names
    assert names.count("BatchNorm") == 2 and names.count("Add") == 1 and names.count("ReLU") == 2
