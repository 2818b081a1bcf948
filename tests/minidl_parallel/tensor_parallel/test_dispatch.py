"""The dispatcher's contract: errors before communication, sharded parameters, checkpoints, explain."""
import numpy as np
import pytest

import minidl
from minidl import nn, ops, Parameter, Tensor
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback, Model
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel import CommCounter, StrategyError, NoRuleError, explain, get_layout
from minidl_parallel.tensor_parallel.dispatch import full_value

F64 = minidl.float64


def host(array):
    """A NumPy copy of a gathered value, from either array module (the suite also runs pinned to the GPU)."""
    return np.array(minidl.backend.to_numpy(array))


class Dense(nn.Cell):
    def __init__(self, w, b):
        super().__init__()
        self.weight = Parameter(w)
        self.bias = Parameter(b)
        self.matmul = ops.MatMul()
        self.add = ops.Add()

    def construct(self, x):
        return self.add(self.matmul(x, self.weight), self.bias)


class FFN(nn.Cell):
    def __init__(self, seed=0):
        super().__init__()
        rng = np.random.default_rng(seed)
        self.dense1 = Dense(rng.standard_normal((32, 16)) / 6, rng.standard_normal(16))
        self.relu = ops.ReLU()
        self.dense2 = Dense(rng.standard_normal((16, 16)) / 4, rng.standard_normal(16))

    def construct(self, x):
        return self.dense2(self.relu(self.dense1(x)))


def _data(batch=16):
    rng = np.random.default_rng(7)
    return rng.standard_normal((batch, 32)), rng.standard_normal((batch, 16))


def _on_ranks(n, fn, mode="auto_parallel", **settings):
    """Runs fn() on n thread-ranks in ``mode``; returns each rank's result or exception."""
    def body():
        import minidl_parallel as mp
        mp.set_auto_parallel_context(parallel_mode=mode, **settings)
        try:
            return fn()
        except Exception as e:  # every rank must raise the same error, none may hang
            return e
        finally:
            mp.reset_auto_parallel_context()
    return run_threads(n, body, timeout=60)


def _local_x(x):
    import minidl_parallel as mp
    n, r = mp.get_group_size(), mp.get_rank()
    b = x.shape[0] // n
    return Tensor(x[r * b:(r + 1) * b])


# ---- bad input ------------------------------------------------------------------------------

def test_bad_strategy_names_operator_path_shapes_strategy_and_rule_on_every_rank():
    x, _ = _data()

    def fn():
        net = FFN()
        net.dense1.matmul.shard(((3, 1), (1, 1)))
        with CommCounter() as c:
            try:
                net(_local_x(x))
            finally:
                assert c.count() == 0  # validated before any communication
    errors = _on_ranks(8, fn)
    assert all(isinstance(e, StrategyError) for e in errors), errors
    msg = str(errors[0])
    for part in ("MatMul (dense1.matmul)", "(16, 32)", "(32, 16)", "((3, 1), (1, 1))", "device_num 8",
                 "not divisible"):
        assert part in msg, msg
    assert len({str(e) for e in errors}) == 1


class Swish(ops.Primitive):
    """A user's own primitive: minidl has no sharding rule for it."""

    def forward(self, x):
        self.x = x
        return x / (1 + np.exp(-x))


def test_operator_without_rule_says_so_by_name():
    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.swish = Swish()

        def construct(self, x):
            return self.swish(x)
    errors = _on_ranks(2, lambda: Net()(Tensor(np.ones((4, 4)))))
    assert all(isinstance(e, NoRuleError) for e in errors)
    assert "Swish (swish)" in str(errors[0]) and "no sharding rule" in str(errors[0])


def test_parameter_shared_by_two_operators_with_different_strategies_is_an_error():
    class Tied(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(np.ones((8, 8)), name="w")
            self.mm1 = ops.MatMul().shard(((1, 2), (2, 1)))
            self.mm2 = ops.MatMul().shard(((1, 1), (1, 2)))

        def construct(self, x):
            return self.mm2(self.mm1(x, self.w), self.w)
    errors = _on_ranks(2, lambda: Tied()(Tensor(np.ones((4, 8)))), dataset_strategy="full_batch")
    assert all(isinstance(e, StrategyError) for e in errors), errors
    msg = str(errors[0])
    assert "'w'" in msg and "MatMul (mm1)" in msg and "MatMul (mm2)" in msg and "same strategy" in msg


def test_device_num_must_equal_world_size():
    errors = _on_ranks(2, lambda: FFN()(Tensor(np.ones((4, 32)))), device_num=4)
    assert all(isinstance(e, ValueError) and "device_num is 4" in str(e) for e in errors), errors


# ---- parameters, optimizer state, checkpoints -------------------------------------------------

class Losses(Callback):
    def __init__(self):
        self.values = []

    def on_train_step_end(self, run_context):
        self.values.append(float(run_context.original_args().net_outputs.asnumpy()))


def _train(net, x, y, steps, batch, **shards):
    losses = Losses()
    ds = NumpySlicesDataset({"data": x, "label": y}, shuffle=False, **shards).batch(batch)
    opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
    Model(net, nn.MSELoss(), opt).train(1, ds.take(steps) if hasattr(ds, "take") else ds, callbacks=[losses])
    return losses.values, opt


def test_model_train_losses_parameters_and_optimizer_state_equal_single_device(tmp_path):
    x, y = _data(32)
    ref_net = FFN()
    ref_losses, ref_opt = _train(ref_net, x, y, 2, 16)
    ref_moments = {k: v.asnumpy() for k, v in ref_opt.parameters_and_names() if k.startswith("moments")}

    def fn():
        import minidl_parallel as mp
        net = FFN()
        net.dense1.matmul.shard(((2, 2), (2, 1)))
        # dataset_strategy "data_parallel": each rank reads its slice of every global batch.
        losses, opt = _train(net, x, y, 2, 16 // mp.get_group_size(), num_shards=mp.get_group_size(),
                             shard_id=mp.get_rank())
        assert net.dense1.weight.data.shape == (16, 16)  # its block of (32, 16): K cut in 2
        assert opt.state_dict()["moments.dense1.weight"].data.shape == (16, 16)  # the state follows the block
        path = tmp_path / f"rank{mp.get_rank()}.ckpt"
        minidl.save_checkpoint(net, str(path), integrated_save=True)
        opt_path = tmp_path / f"opt{mp.get_rank()}.ckpt"
        minidl.save_checkpoint(opt, str(opt_path), integrated_save=True)
        return losses, {p.name: host(full_value(p)) for p in net.trainable_params()}, str(path), str(opt_path)
    for losses, params, path, opt_path in _on_ranks(4, fn):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10)
        saved = minidl.load_checkpoint(path)
        for p in ref_net.trainable_params():
            np.testing.assert_allclose(params[p.name], p.asnumpy(), rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(saved[p.name].asnumpy(), p.asnumpy(), rtol=1e-10, atol=1e-12)
        meta = minidl.load_checkpoint_metadata(path)
        assert meta["layout.dense1.weight"] == "(b, -) on [2, 2, 1]"
        opt_saved = minidl.load_checkpoint(opt_path)
        for k, v in ref_moments.items():
            np.testing.assert_allclose(opt_saved[k].asnumpy(), v, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("load_before_first_use", [True, False])
def test_checkpoint_loads_into_another_strategy_and_world_size(tmp_path, load_before_first_use):
    x, _ = _data()
    trained = FFN(seed=5)  # the values to carry over
    path = str(tmp_path / "full.ckpt")
    minidl.save_checkpoint(trained, path)
    expected = trained(Tensor(x)).asnumpy()

    def fn():
        net = FFN(seed=9)
        net.dense2.matmul.shard(((1, 2), (2, 1)))
        if not load_before_first_use:
            net(_local_x(x))  # parameters become blocks first
        minidl.load_param_into_net(net, minidl.load_checkpoint(path))
        return host(full_value(net(_local_x(x))))
    for out in _on_ranks(2, fn):
        np.testing.assert_allclose(out, expected, rtol=1e-10)


# ---- explain ----------------------------------------------------------------------------------

def test_explain_prints_strategies_layouts_and_steps():
    x, _ = _data()

    def fn():
        net = FFN()
        net.dense1.matmul.shard(((2, 4), (4, 1)))
        text = explain(net, _local_x(x), rank0_only=False)
        return text, get_layout(net.dense1.weight)[0]
    results = _on_ranks(8, fn)
    text, layout = results[0]
    assert all(r[0] == text for r in results)
    assert "MatMul (dense1.matmul)  strategy ((2, 4), (4, 1)) [shard]" in text
    assert "parameter placed as (b, -) on [2, 4, 1]: block (8, 16)" in text
    assert "ReLU (relu)" in text and "[propagated]" in text
    assert "alltoall" in text and "reduce_scatter" in text
    assert str(layout) == "(b, -) on [2, 4, 1]"


def test_model_checkpoint_and_resume_under_tensor_parallel_equal_an_uninterrupted_run(tmp_path):
    from minidl.train import CheckpointConfig, ModelCheckpoint, latest_checkpoint
    x, y = _data(32)

    def run(epochs, directory=None, resume=None):
        import minidl_parallel as mp
        net = FFN()
        net.dense1.matmul.shard(((2, 2), (2, 1)))
        ds = NumpySlicesDataset({"data": x, "label": y}, shuffle=True, num_shards=mp.get_group_size(),
                                shard_id=mp.get_rank()).batch(16 // mp.get_group_size())
        model = Model(net, nn.MSELoss(), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        steps = Losses()
        callbacks = [steps]
        if directory is not None:
            callbacks.append(ModelCheckpoint(prefix="ffn", directory=str(directory / f"rank{mp.get_rank()}"),
                                             config=CheckpointConfig(save_checkpoint_steps=2)))
        model.train(epochs, ds, callbacks=callbacks, resume_from=resume)
        return {p.name: host(full_value(p)) for p in net.trainable_params()}, len(steps.values)

    uninterrupted = _on_ranks(4, lambda: run(2))
    _on_ranks(4, lambda: run(1, tmp_path))

    def resumed():
        import minidl_parallel as mp
        path = latest_checkpoint(str(tmp_path / f"rank{mp.get_rank()}"), "ffn")
        assert path is not None and path.endswith("ffn-1_2.ckpt"), path
        return run(2, resume=path)
    for result, (ref, ref_steps) in zip(_on_ranks(4, resumed), uninterrupted):
        assert not isinstance(result, Exception), result
        got, steps = result
        assert (steps, ref_steps) == (2, 4)  # the resumed run trained only the second epoch
        for name, value in ref.items():
            np.testing.assert_array_equal(got[name], value, err_msg=name)


def test_cross_entropy_loss_refuses_blocks_instead_of_a_silently_wrong_loss():
    x, _ = _data()

    def fn():
        net = FFN()
        labels = Tensor(np.zeros(x.shape[0] // 2, np.int32))
        return nn.CrossEntropyLoss()(net(_local_x(x)), labels)
    errors = _on_ranks(2, fn, mode="semi_auto_parallel")
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "cut across ranks" in str(errors[0]) and "SoftmaxCrossEntropyWithLogits" in str(errors[0])


# ---- the public redistribute and sharded tensors ----------------------------------------------

def test_public_redistribute_relabels_device_axes_of_a_sharded_tensor():
    """[2, 2, 1] -> [2, 2] moves no data; the alias must keep the block's (local) shape."""
    from minidl_parallel import Layout, redistribute
    x = np.arange(32.0).reshape(8, 4)

    def fn():
        t = Tensor(x.copy(), requires_grad=True)
        cut = redistribute(t, Layout((2, 2, 1), ((0,), (1,))))
        relabelled = redistribute(cut, Layout((2, 2), ((0,), (1,))))
        assert relabelled.shape == (8, 4) and relabelled.data.shape == (4, 2)
        (relabelled * relabelled).sum().backward()
        return host(full_value(relabelled)), str(relabelled.placement), np.array(t.grad.asnumpy())
    for whole, layout, grad in _on_ranks(4, fn):
        np.testing.assert_array_equal(whole, x)
        assert layout == "(a, b) on [2, 2]"
        np.testing.assert_array_equal(grad, 2 * x)


def test_a_sharded_tensor_carries_its_global_shape_and_layout():
    def fn():
        net = FFN()
        net.dense1.matmul.shard(((2, 2), (2, 1)))
        out = net(_local_x(_data()[0]))
        w = net.dense1.weight
        return w.shape, w.data.shape, w.is_sharded, str(w.placement), w.detach().shape, out.is_sharded
    for shape, local, sharded, layout, detached, out_sharded in _on_ranks(4, fn):
        assert (shape, local, sharded, detached) == ((32, 16), (16, 16), True, (32, 16))
        assert layout == "(b, -) on [2, 2, 1]"


class _TakesWeight(nn.Cell):
    """An outermost cell handed a weight as an argument (a tied table passed in): x @ w."""

    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul()

    def construct(self, x, w):
        return self.matmul(x, w)


def test_a_parameter_passed_to_the_outermost_cell_stays_whole_not_a_batch_block():
    # Only the data inputs are the dataset's batch blocks: a weight argument is tagged by its own use.
    x, _ = _data(16)
    w = np.random.default_rng(3).standard_normal((32, 8))

    def fn():
        weight = Parameter(Tensor(w.copy()), name="w")
        return host(full_value(_TakesWeight()(_local_x(x), w=weight))), weight.data.shape  # (as a keyword too)
    for out, shape in _on_ranks(2, fn, mode="semi_auto_parallel"):
        np.testing.assert_allclose(out, x @ w, rtol=1e-12)
        assert shape == (32, 8)
