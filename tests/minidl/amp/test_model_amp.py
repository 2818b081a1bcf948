"""Model(..., amp_level=..., loss_scale_manager=...): the run MindSpore's Model builds, checked
against the same run built by hand (amp.auto_mixed_precision + nn.WithLossCell + the step cell +
Model(step)) bit for bit, and against one device with the ranks' gradients averaged.

The network is a small MLP with a BatchNorm1d (O2 keeps it in float32), built from one seed for
each run, so every run starts from the same parameters.
"""
import numpy as np
import pytest

import minidl
from minidl import Tensor, amp, nn
from minidl.dataset import NumpySlicesDataset
from minidl.testing.modes import mode
from minidl.train import Model

MODES = {"pynative": minidl.PYNATIVE_MODE, "graph": minidl.GRAPH_MODE}


class ProbeBatchNorm(nn.BatchNorm1d):
    """Records the dtype its construct computes in (what amp's cast gives it)."""

    def construct(self, x):
        self.seen = x.dtype
        return super().construct(x)


def mlp(seed=3):
    minidl.set_seed(seed)
    return nn.SequentialCell([nn.Dense(4, 16), ProbeBatchNorm(16), nn.ReLU(), nn.Dense(16, 3)])


def ce_loss():
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def momentum(net, **kwargs):
    return nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9, **kwargs)


def blobs(n, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = 3.0 * rng.standard_normal((3, 4))[y] + 0.5 * rng.standard_normal((n, 4))
    return x.astype(np.float32), y.astype(np.int32)


def dataset(x, y, batch):
    return NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False).batch(batch)


def params(net):
    """Every parameter (BatchNorm's moving statistics too) by name, copied."""
    return {p.name: p.asnumpy().copy() for p in net.get_parameters()}


def assert_same(got, want):
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def by_hand(manager, optimizer=momentum):
    """MindSpore's build_train_network at O2 written out: (network, step cell)."""
    net = mlp()
    cast = amp.auto_mixed_precision(net, "O2")
    opt = optimizer(cast)
    update_cell = manager.get_update_cell()
    if update_cell is None:
        step = nn.TrainOneStepCell(nn.WithLossCell(cast, ce_loss()), opt, sens=manager.get_loss_scale())
    else:
        step = nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(cast, ce_loss()), opt, scale_sense=update_cell)
    return net, step


@pytest.mark.parametrize("m", MODES.values(), ids=MODES.keys())
def test_o2_with_a_dynamic_manager_equals_the_step_cell_built_by_hand_bit_for_bit(m):
    x, y = blobs(24)
    with mode(m):
        net = mlp()
        model = Model(net, ce_loss(), momentum(net), amp_level="O2",
                      loss_scale_manager=amp.DynamicLossScaleManager(2 ** 10, 2, 2))
        model.train(2, dataset(x, y, 8))
        hand_net, step = by_hand(amp.DynamicLossScaleManager(2 ** 10, 2, 2))
        Model(step).train(2, dataset(x, y, 8))
    assert type(model.train_network) is nn.TrainOneStepWithLossScaleCell
    assert_same(params(net), params(hand_net))
    assert_same(params(model.train_network), params(step))  # the scale and the rule's step counters too
    assert float(model.train_network.scale_sense.asnumpy()) == 2 ** 13  # doubled after steps 2, 4 and 6
    assert any(not np.array_equal(v, params(mlp())[k]) for k, v in params(net).items())  # it trained
    # float32 master weights, float32 optimizer state; the black-listed BatchNorm ran in float32
    assert all(p.dtype == np.float32 for p in net.get_parameters())
    assert all(v.asnumpy().dtype == np.float32 for v in model.train_network.optimizer.state_dict().values()
               if v.asnumpy().dtype.kind == "f")
    assert net[1].seen == np.float32


@pytest.mark.parametrize("drop", [True, False])
def test_a_fixed_manager_equals_its_step_cell_built_by_hand(drop):
    """drop_overflow_update=True: the loss-scale step with a scale that never changes;
    False: TrainOneStepCell with sens=loss_scale, and the optimizer (built with the same
    loss_scale, as MindSpore's documentation asks) divides it back."""
    x, y = blobs(24)
    optimizer = momentum if drop else (lambda n: momentum(n, loss_scale=2.0 ** 10))
    net = mlp()
    model = Model(net, ce_loss(), optimizer(net), amp_level="O2",
                  loss_scale_manager=amp.FixedLossScaleManager(2.0 ** 10, drop_overflow_update=drop))
    model.train(1, dataset(x, y, 8))
    hand_net, step = by_hand(amp.FixedLossScaleManager(2.0 ** 10, drop_overflow_update=drop), optimizer)
    Model(step).train(1, dataset(x, y, 8))
    assert type(model.train_network) is type(step)
    assert_same(params(net), params(hand_net))
    if drop:
        assert float(model.train_network.scale_sense.asnumpy()) == 2.0 ** 10
    else:
        assert model.train_network.sens == 2.0 ** 10
    assert any(not np.array_equal(v, params(mlp())[k]) for k, v in params(net).items())


def test_an_overflow_skips_every_step_and_leaves_the_parameters_and_the_momentum_unchanged():
    """A scale of 2^100 overflows float16's backward (max 65504) at once: each step is skipped and
    halves the scale (MindSpore's rule), so after 3 steps nothing trained and the scale is 2^97."""
    x, y = blobs(24)
    net = mlp()
    before = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
    model = Model(net, ce_loss(), momentum(net), amp_level="O2",
                  loss_scale_manager=amp.DynamicLossScaleManager(2.0 ** 100, 2, 2))
    with np.errstate(over="ignore", invalid="ignore"):
        model.train(1, dataset(x, y, 8))
    for p in net.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), before[p.name], err_msg=p.name)
    moments = {n: v.asnumpy() for n, v in model.train_network.optimizer.state_dict().items() if n.startswith("moments.")}
    assert moments and not any(np.any(v) for v in moments.values())
    assert float(model.train_network.scale_sense.asnumpy()) == 2.0 ** 97


def test_o2s_default_is_mindsporess_dynamic_manager_and_a_level_without_one_trains_with_models_own_step():
    net = mlp()
    default = Model(net, ce_loss(), momentum(net), amp_level="O2")
    assert type(default.train_network) is nn.TrainOneStepWithLossScaleCell
    assert float(default.train_network.scale_sense.asnumpy()) == 2.0 ** 24
    # O3 (no default manager) and O2 with loss_scale_manager=None: the cast network, trained by
    # Model's own step, equals TrainOneStepCell on the network cast by hand (MindSpore's build).
    x, y = blobs(24)
    for level, kwargs in (("O3", {}), ("O2", {"loss_scale_manager": None})):
        net = mlp()
        model = Model(net, ce_loss(), momentum(net), amp_level=level, **kwargs)
        model.train(1, dataset(x, y, 8))
        assert not isinstance(model.train_network, nn.TrainOneStepCell)
        hand_net = mlp()
        cast = amp.auto_mixed_precision(hand_net, level)
        Model(nn.TrainOneStepCell(nn.WithLossCell(cast, ce_loss()), momentum(cast))).train(1, dataset(x, y, 8))
        assert_same(params(net), params(hand_net))
        assert net[1].seen == (np.float16 if level == "O3" else np.float32)


@pytest.mark.parametrize("level, keep, bn_dtype", [("O2", False, np.float16), ("O3", True, np.float32),
                                                   ("O2", True, np.float32), ("O3", False, np.float16)])
def test_keep_batchnorm_fp32_overrides_the_levels_batchnorm_dtype_as_mindspore(level, keep, bn_dtype):
    net = mlp()
    model = Model(net, ce_loss(), momentum(net), amp_level=level, keep_batchnorm_fp32=keep, loss_scale_manager=None)
    x, y = blobs(8)
    model.train(1, dataset(x, y, 8))
    assert net[1].seen == bn_dtype
    assert all(p.dtype == np.float32 for p in net.get_parameters())


def test_eval_and_predict_run_the_cast_network_with_float32_outputs():
    x, y = blobs(16)
    net = mlp()
    model = Model(net, ce_loss(), momentum(net), amp_level="O3", metrics={"loss"})
    hand = amp.auto_mixed_precision(mlp(), "O3")
    got = model.predict(Tensor(x))
    net[1].seen = None
    with minidl.no_grad():
        want = hand(Tensor(x))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    loss = model.eval(dataset(x, y, 16))["loss"]
    assert net[1].seen == np.float16  # eval ran the cast network too
    np.testing.assert_allclose(loss, float(ce_loss()(want, Tensor(y)).asnumpy()), rtol=1e-6)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"boost_level": "O1"}, NotImplementedError, "boost_level 'O1'"),
    ({"acc_level": "O2"}, NotImplementedError, "boost_level 'O2'"),
    ({"boost_level": "O3"}, ValueError, r"boost_level must be one of \['O0', 'O1', 'O2'\], got 'O3'"),
    ({"foo": 1}, ValueError, "should be 'loss_scale_manager' or 'keep_batchnorm_fp32' or 'boost_config_dict' or "
                             "'acc_level', but got 'foo'"),
    ({"amp_level": "O4"}, ValueError, r"amp_level must be one of \['O0', 'O1', 'O2', 'O3', 'auto'\], got 'O4'"),
    ({"amp_level": 2}, TypeError, "amp_level must be a string .* got int 2"),
    ({"amp_level": "O2", "keep_batchnorm_fp32": 1}, TypeError, "keep_batchnorm_fp32 must be a bool, got 1"),
    ({"loss_scale_manager": 1024.0}, TypeError, "loss_scale_manager must be an amp.LossScaleManager .* got float"),
    ({"loss_scale_manager": amp.DynamicLossScaleManager(), "loss_scale": 8.0}, ValueError,
     "optimizer's loss_scale must be 1.0 with DynamicLossScaleManager .* got 8.0"),
    ({"loss_scale_manager": amp.FixedLossScaleManager(64.0, False)}, ValueError,
     r"^Model: with FixedLossScaleManager\(loss_scale=64.0, drop_overflow_update=False\) the optimizer must divide "
     r"the gradients by the same scale: build it with loss_scale=64.0, got loss_scale=1.0$"),
])
def test_bad_arguments_raise_naming_them(kwargs, error, message):
    kwargs = dict(kwargs)  # (a copy: the parameter's dict is shared by every run of the test in this process)
    net = mlp()
    opt = momentum(net, loss_scale=kwargs.pop("loss_scale", 1.0))
    with pytest.raises(error, match=message):
        Model(net, ce_loss(), opt, **kwargs)


class OwnOptimizer:
    """An optimizer of the user's own (Model takes any callable with parameters): no loss_scale attribute."""

    def __init__(self, inner):
        self._inner, self.parameters = inner, inner.parameters

    def parameters_and_names(self, *args, **kwargs):
        return self._inner.parameters_and_names(*args, **kwargs)

    def __call__(self, grads):
        return self._inner(grads)


def test_o2_trains_a_network_with_its_loss_inside_and_an_optimizer_without_loss_scale_as_by_hand():
    """Model(nn.WithLossCell(net, loss), None, optimizer, amp_level="O2") casts the whole loss
    network and steps it (no second WithLossCell); an optimizer without a loss_scale attribute
    counts as one of scale 1.0, as MindSpore's check reads it."""
    x, y = blobs(24)
    net = mlp()
    model = Model(nn.WithLossCell(net, ce_loss()), None, OwnOptimizer(momentum(net)), amp_level="O2",
                  loss_scale_manager=amp.DynamicLossScaleManager(2 ** 10, 2, 2))
    model.train(1, dataset(x, y, 8))
    hand_net = mlp()
    cast = amp.auto_mixed_precision(nn.WithLossCell(hand_net, ce_loss()), "O2")
    update_cell = amp.DynamicLossScaleManager(2 ** 10, 2, 2).get_update_cell()
    step = nn.TrainOneStepWithLossScaleCell(cast, momentum(hand_net), scale_sense=update_cell)
    Model(step).train(1, dataset(x, y, 8))
    assert_same(params(net), params(hand_net))
    assert any(not np.array_equal(v, params(mlp())[k]) for k, v in params(net).items())  # it trained


def test_amp_or_a_manager_without_an_optimizer_raise_as_mindspore():
    with pytest.raises(ValueError, match="amp_level 'O2' needs the optimizer"):
        Model(mlp(), ce_loss(), amp_level="O2")
    with pytest.raises(ValueError, match="'optimizer' can not be None when set 'loss_scale_manager'"):
        Model(mlp(), ce_loss(), loss_scale_manager=amp.FixedLossScaleManager())


# ---- data parallel ---------------------------------------------------------------------------------


def _averaged_by_hand(xs, ys, manager):
    """One device: each step's gradients on every rank's part of the batch, each unscaled and
    halved, then added (what DistributedGradReducer(mean=True) does at n = 2: the 1/2 folded into
    its packing copy, then the sum), the overflow checked, the optimizer run; MindSpore's rule
    on the scale. Returns the parameters and the final scale."""
    net = mlp()
    cast = amp.auto_mixed_precision(net, "O2")
    opt = momentum(cast)
    with_loss = nn.WithLossCell(cast, ce_loss()).set_train()
    for x, y in zip(xs, ys):
        scale = np.float32(manager.get_loss_scale())

        def scaled(data, label):
            loss = with_loss(data, label)
            return loss * Tensor(scale), loss
        grad_fn = minidl.value_and_grad(scaled, None, opt.parameters, has_aux=True)
        total = None
        for part in np.split(np.arange(len(x)), 2):
            _, grads = grad_fn(Tensor(x[part]), Tensor(y[part]))
            half = [g.asnumpy() * (np.float32(1) / scale) * np.float32(0.5) for g in grads]
            total = half if total is None else [a + b for a, b in zip(total, half)]
        overflow = not all(np.isfinite(g).all() for g in total)
        manager.update_loss_scale(overflow)
        if not overflow:
            opt(tuple(Tensor(g) for g in total))
    return {p.name: p.asnumpy().copy() for p in net.trainable_params()}, manager.get_loss_scale()


def test_data_parallel_amp_model_equals_one_device_with_the_ranks_gradients_averaged_bit_for_bit():
    """n = 2 thread-ranks, DATA_PARALLEL with gradients_mean: each rank's Model(amp_level="O2",
    loss_scale_manager=...) trains on its half of every batch. Each rank's float16 forward and
    backward are the reference's on that half, and at n = 2 the all-reduce's sum of halves is
    the same addition in either order, so the parameters equal the reference's bit for bit."""
    import minidl_parallel as mp
    k, per_rank = 4, 4
    x, y = blobs(k * 2 * per_rank)
    xs, ys = x.reshape(k, 2 * per_rank, 4), y.reshape(k, 2 * per_rank)

    def rank_body():
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        part = slice(mp.get_rank() * per_rank, (mp.get_rank() + 1) * per_rank)
        net = mlp()
        model = Model(net, ce_loss(), momentum(net), amp_level="O2",
                      loss_scale_manager=amp.DynamicLossScaleManager(2 ** 10, 2, 2))
        model.train(1, dataset(xs[:, part].reshape(-1, 4), ys[:, part].reshape(-1), per_rank), progress=False)
        return ({p.name: p.asnumpy().copy() for p in net.trainable_params()},
                float(model.train_network.scale_sense.asnumpy()), type(model.train_network.grad_reducer).__name__)

    want, want_scale = _averaged_by_hand(xs, ys, amp.DynamicLossScaleManager(2 ** 10, 2, 2))
    assert want_scale == 2 ** 12  # doubled after steps 2 and 4
    for got, scale, reducer in mp.run_threads(2, rank_body):
        assert reducer == "DistributedGradReducer"  # the runtime's, asked by the step cell
        assert scale == want_scale
        assert_same(got, want)
    assert any(not np.array_equal(v, params(mlp())[k]) for k, v in want.items())


def test_a_given_grad_reducer_is_the_step_cells():
    seen = []

    def reducer(grads):
        seen.append(len(grads))
        return grads
    x, y = blobs(16)
    net = mlp()
    model = Model(net, ce_loss(), momentum(net), amp_level="O2", grad_reducer=reducer,
                  loss_scale_manager=amp.DynamicLossScaleManager(2 ** 10, 2, 2))
    assert model.train_network.grad_reducer is reducer
    model.train(1, dataset(x, y, 8))
    assert seen == [len(net.trainable_params())] * 2


def test_data_parallel_uneven_inputs_with_a_loss_scale_step_raise_on_every_rank():
    import minidl_parallel as mp
    x, y = blobs(8)

    def rank_body():
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        net = mlp()
        model = Model(net, ce_loss(), momentum(net), amp_level="O2",
                      loss_scale_manager=amp.DynamicLossScaleManager(2 ** 10, 2, 2))
        with pytest.raises(ValueError, match="uneven_inputs=True is not supported when the training network is a "
                                             "step cell \\(TrainOneStepWithLossScaleCell"):
            model.train(1, dataset(x, y, 4), progress=False, uneven_inputs=True)
        return True

    assert mp.run_threads(2, rank_body) == [True, True]


def test_a_checkpoint_resumes_the_scale_sequence_bit_identically_and_the_network_saves_float32_keys(tmp_path):
    from minidl.train import Callback, ModelCheckpoint, latest_checkpoint

    class StopAt(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num >= 3:
                run_context.request_stop()

    x, y = blobs(24)

    def model():
        net = mlp()
        return net, Model(net, ce_loss(), momentum(net), amp_level="O2",
                          loss_scale_manager=amp.DynamicLossScaleManager(2 ** 10, 2, 2))
    net, whole = model()
    whole.train(2, dataset(x, y, 8))
    _, stopped = model()
    stopped.train(2, dataset(x, y, 8), callbacks=[ModelCheckpoint("amp", str(tmp_path)), StopAt()])
    assert float(stopped.train_network.scale_sense.asnumpy()) == 2 ** 11  # saved after step 3
    resumed_net, resumed = model()
    resumed.train(2, dataset(x, y, 8), resume_from=latest_checkpoint(str(tmp_path), "amp"))
    assert_same(params(resumed.train_network), params(whole.train_network))  # the scale and counters too
    assert_same(params(resumed_net), params(net))
    # The cast network keeps the float32 network's names: its checkpoint loads into mlp().
    path = str(tmp_path / "net.ckpt")
    minidl.save_checkpoint(resumed.predict_network, path)
    plain = mlp()
    not_loaded, _ = minidl.load_param_into_net(plain, minidl.load_checkpoint(path), strict_load=True)
    assert not not_loaded
    assert_same(params(plain), params(net))


def test_auto_computes_the_loss_in_float32_as_mindspore():
    # A net ending in a Dense without bias: "auto" leaves its output float16 (MatMul is on the white
    # list); MindSpore's Model casts it to float32 before the loss, and so does minidl's.
    net = nn.SequentialCell(nn.Dense(4, 3, has_bias=False))
    model = Model(net, nn.MSELoss(), nn.Momentum(net.trainable_params(), 0.1, 0.9), amp_level="auto")
    out = model.predict_network(Tensor(np.ones((2, 4), np.float32)))
    assert out.dtype == minidl.float32
