"""nn.WithLossCell and nn.TrainOneStepCell, MindSpore's training wrappers: WithLossCell trains as
Model(net, loss_fn, opt) does; one call of TrainOneStepCell is value_and_grad then the optimizer,
bit for bit, and under minidl_parallel's DATA_PARALLEL it reduces the gradients by itself."""
import contextlib

import numpy as np
import pytest

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Model
from minidl.testing.modes import mode as _mode


def blobs(n, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = 3.0 * rng.standard_normal((3, 4))[y] + 0.5 * rng.standard_normal((n, 4))
    return x.astype(np.float32), y.astype(np.int32)


def mlp():
    return nn.SequentialCell([nn.Dense(4, 16), nn.ReLU(), nn.Dense(16, 3)])


def ce_loss():
    return nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")


def momentum(net):
    return nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)


def slices(data, column_names, batch_size):
    return NumpySlicesDataset(data, column_names=column_names, shuffle=False).batch(batch_size)


def _trained(with_wrapper):
    minidl.set_seed(3)
    net = mlp()
    x, y = blobs(n=24)
    ds = slices((x, y), ["x", "y"], 8)
    if with_wrapper:
        wrapped = nn.WithLossCell(net, ce_loss())
        Model(wrapped, None, momentum(wrapped)).train(2, ds)
    else:
        Model(net, ce_loss(), momentum(net)).train(2, ds)
    return {p.name: p.asnumpy() for p in net.trainable_params()}


def test_training_the_wrapper_equals_training_with_loss_fn():
    plain, wrapped = _trained(False), _trained(True)
    assert plain.keys() == wrapped.keys()
    minidl.set_seed(3)
    first = mlp()  # the initial parameters of both runs
    assert any(not np.array_equal(plain[p.name], p.asnumpy()) for p in first.trainable_params())  # it trained
    for name in plain:
        np.testing.assert_array_equal(wrapped[name], plain[name], err_msg=name)


def test_the_wrapper_keeps_the_backbones_names_and_computes_its_loss():
    net, loss = mlp(), ce_loss()
    wrapped = nn.WithLossCell(net, loss)
    assert wrapped.backbone_network is net
    assert [p.name for p in wrapped.trainable_params()] == [p.name for p in net.trainable_params()]
    x, y = blobs(n=8)
    want = loss(net(minidl.Tensor(x)), minidl.Tensor(y)).asnumpy()
    assert np.array_equal(wrapped(minidl.Tensor(x), minidl.Tensor(y)).asnumpy(), want)
    with pytest.raises(TypeError, match="WithLossCell: loss_fn must be a Cell or a callable, got str"):
        nn.WithLossCell(net, "cross_entropy")
    with pytest.raises(TypeError, match="WithLossCell: backbone must be a Cell or a callable, got NoneType"):
        nn.WithLossCell(None, loss)


# ---- TrainOneStepCell ------------------------------------------------------------------------------


def _net_and_step(seed=3, optimizer=momentum, **step_args):
    """A fresh MLP (the same initial parameters for the same seed) and its TrainOneStepCell."""
    minidl.set_seed(seed)
    net = mlp()
    opt = optimizer(net)
    return net, nn.TrainOneStepCell(nn.WithLossCell(net, ce_loss()), opt, **step_args)


def _manual_steps(xs, ys, seed=3, optimizer=momentum):
    """value_and_grad + optimizer on the same net and batches: (losses, gradients of the last step, parameters)."""
    minidl.set_seed(seed)
    net = mlp()
    opt = optimizer(net)
    net.set_train()
    grad_fn = minidl.value_and_grad(nn.WithLossCell(net, ce_loss()), None, opt.parameters)
    losses, grads = [], ()
    for x, y in zip(xs, ys):
        loss, grads = grad_fn(minidl.Tensor(x), minidl.Tensor(y))
        opt(grads)
        losses.append(loss.asnumpy())
    return losses, [g.asnumpy() for g in grads], {p.name: p.asnumpy() for p in net.trainable_params()}


def _batches(k, batch, seed=0):
    x, y = blobs(n=k * batch, seed=seed)
    return x.reshape(k, batch, 4), y.reshape(k, batch)


def _cell_steps(step, xs, ys):
    step.set_train()
    return [step(minidl.Tensor(x), minidl.Tensor(y)) for x, y in zip(xs, ys)]


@pytest.mark.parametrize("mode", [None, "GRAPH_MODE"])
def test_a_step_is_value_and_grad_then_the_optimizer_bit_for_bit(mode):
    xs, ys = _batches(k=4, batch=8)
    with _mode(getattr(minidl, mode)) if mode else contextlib.nullcontext():
        want_losses, _, want = _manual_steps(xs, ys)
        net, step = _net_and_step()
        losses = _cell_steps(step, xs, ys)
    assert [float(l.asnumpy()) for l in losses] == [float(l) for l in want_losses]
    assert not losses[-1].requires_grad  # the loss comes back detached
    first = _manual_steps(xs[:0], ys[:0])[2]  # no step: the initial parameters
    assert any(not np.array_equal(want[name], first[name]) for name in want)  # it trained
    for p in net.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), want[p.name], err_msg=p.name)


def test_return_grad_gives_the_loss_and_the_gradients_by_parameter_name():
    xs, ys = _batches(k=1, batch=8)
    want_losses, want_grads, _ = _manual_steps(xs, ys)
    net, step = _net_and_step(return_grad=True)
    loss, grads = _cell_steps(step, xs, ys)[0]
    assert float(loss.asnumpy()) == float(want_losses[0])
    assert list(grads) == [p.name for p in net.trainable_params()] == step.weights_name
    for got, want in zip(grads.values(), want_grads):
        np.testing.assert_array_equal(got.asnumpy(), want)


def _sgd(lr):
    return lambda net: nn.SGD(net.trainable_params(), learning_rate=lr)


def test_sens_starts_backward_from_sens_so_the_gradients_are_sens_times_the_losss():
    xs, ys = _batches(k=1, batch=8)
    _, step1 = _net_and_step(optimizer=_sgd(0.1), return_grad=True)
    net2, step2 = _net_and_step(optimizer=_sgd(0.1), sens=2.0, return_grad=True)
    loss1, grads1 = _cell_steps(step1, xs, ys)[0]
    loss2, grads2 = _cell_steps(step2, xs, ys)[0]
    assert float(loss2.asnumpy()) == float(loss1.asnumpy())  # the loss itself is not scaled
    for name in grads1:
        np.testing.assert_array_equal(grads2[name].asnumpy(), 2 * grads1[name].asnumpy(), err_msg=name)
    # Plain SGD shows it in the update: lr with sens 2 moves as 2 * lr with sens 1 (scaling by 2 is exact).
    _, _, twice_lr = _manual_steps(xs, ys, optimizer=_sgd(0.2))
    _, _, once_lr = _manual_steps(xs, ys, optimizer=_sgd(0.1))
    for p in net2.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), twice_lr[p.name], err_msg=p.name)
        assert not np.array_equal(p.asnumpy(), once_lr[p.name])


def test_the_step_cell_has_mindsporess_attributes():
    net, step = _net_and_step()
    assert step.network.backbone_network is net and step.weights is step.optimizer.parameters
    assert (step.sens, step.sense_flag, step.return_grad) == (1.0, False, False)
    assert nn.TrainOneStepCell(step.network, step.optimizer, sens=-0.5).sens == -0.5
    assert step.weights_name == [p.name for p in net.trainable_params()]
    assert [p.name for p in step.trainable_params()] == step.weights_name  # no prefix added
    assert step.reducer_flag is False  # one device: no reducer, the gradients pass unchanged
    grads = (minidl.Tensor(np.ones(2, np.float32)),)
    assert step.grad_reducer(grads) is grads
    assert not step.training and not net.training  # as MindSpore: set_train() is the caller's (Model does it)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"sens": 0}, ValueError, "sens must not be 0"),
    ({"sens": "2"}, TypeError, "sens must be a number .* got str '2'"),
    ({"sens": True}, TypeError, "sens must be a number .* got bool True"),
    ({"sens": float("inf")}, ValueError, "sens must be finite, got inf"),
    ({"return_grad": "yes"}, TypeError, "return_grad must be a bool, got 'yes'"),
    ({"network": None}, TypeError, "network must be a Cell returning the loss .* got NoneType"),
    ({"optimizer": None}, TypeError, "optimizer must be an Optimizer .* got NoneType"),
    ({"network": 3}, TypeError, "network must be a Cell returning the loss .* got int"),
    ({"optimizer": lambda grads: grads}, TypeError, "optimizer must be an Optimizer .* got function"),
])
def test_bad_arguments_raise_naming_the_argument(kwargs, error, message):
    net = mlp()
    args = {"network": nn.WithLossCell(net, ce_loss()), "optimizer": momentum(net), **kwargs}
    with pytest.raises(error, match=message):
        nn.TrainOneStepCell(args.pop("network"), args.pop("optimizer"), **args)


def test_a_network_that_does_not_return_the_loss_raises():
    net = mlp()
    step = nn.TrainOneStepCell(net, momentum(net))  # the backbone: its output is the logits
    x, _ = blobs(n=8)
    with pytest.raises(ValueError, match=r"the network must return the loss as a one-element Tensor, got shape "
                                         r"\(8, 3\); wrap the backbone with nn.WithLossCell"):
        step(minidl.Tensor(x))


class Returns(nn.Cell):
    def __init__(self, value):
        super().__init__()
        self.fc, self.value = nn.Dense(4, 3), value

    def construct(self, x, y):
        self.fc(x)
        return self.value


@pytest.mark.parametrize("value, got", [((minidl.Tensor(np.float32(1)),) * 2, "tuple of 2"), (1.5, "float")])
def test_a_network_returning_a_tuple_or_a_number_is_named_in_the_message(value, got):
    net = Returns(value)
    step = nn.TrainOneStepCell(net, momentum(net))
    with pytest.raises(ValueError, match=f"the loss as a one-element Tensor, got {got}; wrap the backbone"):
        step(minidl.Tensor(np.ones((2, 4), np.float32)), minidl.Tensor(np.zeros(2, np.int32)))


class ReducerRuntime(minidl.runtime.Runtime):
    """A runtime whose gradient reducer, world size and lockstep the test sets, counting the asks."""

    def __init__(self, reducer, size=1, lockstep=False):
        self.reducer, self.size, self.lockstep, self.asked = reducer, size, lockstep, 0

    def group_size(self):
        return self.size

    def trains_in_lockstep(self):
        return self.lockstep

    def grad_reducer(self, parameters):
        self.asked += 1
        return self.reducer


class Overlapping:
    """A reducer of the overlapping kind (ready per gradient, finish at the end), which doubles."""

    def __init__(self):
        self.fired, self.pending, self.called, self.broadcast = [], [], [], 0

    def ready(self, index, grad):
        self.fired.append((index, grad))
        self.pending.append((index, grad))

    def finish(self):
        done, self.pending = sorted(self.pending, key=lambda f: f[0]), []
        return tuple(minidl.Tensor(g.asnumpy() * 2) for _, g in done)

    def __call__(self, grads):
        self.called.append(grads)
        return tuple(minidl.Tensor(g.asnumpy() * 2) for g in grads)


def test_the_step_asks_the_runtime_again_when_its_size_lockstep_or_interception_change():
    runtime = ReducerRuntime(Overlapping())
    net, step = _net_and_step()
    xs, ys = _batches(k=1, batch=8)
    with runtime:
        for change in (None, None, ("size", 2), ("lockstep", True), ("intercepts_ops", True)):
            if change is not None:
                setattr(runtime, *change)
            _cell_steps(step, xs, ys)
    assert runtime.asked == 4  # (not at the second step: nothing changed)


def test_a_reducer_that_overlaps_gets_each_gradient_as_backward_makes_it():
    """ready(index, gradient) during backward, then finish() gives what the optimizer applies;
    a loss that reaches no parameter fires nothing, and the zero gradients go to the reducer whole."""
    xs, ys = _batches(k=1, batch=8)
    want = _manual_steps(xs, ys)[2]
    reducer = Overlapping()
    net, step = _net_and_step(sens=0.5)  # (sens 0.5 and the reducer's doubling cancel: the plain step)
    with ReducerRuntime(reducer):
        _cell_steps(step, xs, ys)
    assert sorted(i for i, _ in reducer.fired) == list(range(len(step.weights))) and not reducer.called
    for p in net.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), want[p.name], err_msg=p.name)

    class Unreached(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc = nn.Dense(4, 3)

        def construct(self, x, y):
            return (x * 0).sum()

    reducer = Overlapping()
    unreached = Unreached()
    step = nn.TrainOneStepCell(unreached, momentum(unreached))
    with ReducerRuntime(reducer):
        _cell_steps(step, xs, ys)
    assert not reducer.fired and len(reducer.called) == 1
    assert [float(np.abs(g.asnumpy()).sum()) for g in reducer.called[0]] == [0.0, 0.0]


def test_a_reducer_asking_for_parameter_broadcast_broadcasts_once_or_is_refused_without_the_method():
    class Broadcasting(Overlapping):
        parameter_broadcast = True

        def broadcast_parameters(self, tensors):
            self.broadcast += 1

    xs, ys = _batches(k=2, batch=8)
    reducer = Broadcasting()
    with ReducerRuntime(reducer):
        _cell_steps(_net_and_step()[1], xs, ys)
    assert reducer.broadcast == 1
    reducer = Broadcasting()
    with ReducerRuntime(reducer):
        step = _net_and_step()[1]
        assert step.reducer_flag  # (the runtime's reducer, asking for a broadcast, resolved)
        step.grad_reducer = Overlapping()  # ... then one given before the first step: no broadcast
        _cell_steps(step, xs, ys)
    assert reducer.broadcast == 0

    class NoMethod(Overlapping):
        parameter_broadcast = True

    refused = (r"^TrainOneStepCell: the grad reducer asks for parameter_broadcast but has no "
               r"broadcast_parameters\(tensors\) method \(NoMethod\)$")
    with ReducerRuntime(NoMethod()), pytest.raises(TypeError, match=refused):
        _cell_steps(_net_and_step()[1], xs, ys)
    with ReducerRuntime(3), pytest.raises(TypeError, match=r"^TrainOneStepCell: the runtime's grad reducer must be "
                                                         r"callable \(grads -> grads\), got int$"):
        _cell_steps(_net_and_step()[1], xs, ys)


def test_a_reducer_with_ready_but_no_finish_is_called_with_every_gradient_at_once():
    class ReadyOnly:
        ready = None  # (not callable: not the overlapping kind)

        def __init__(self):
            self.called = 0

        def __call__(self, grads):
            self.called += 1
            return grads

    reducer = ReadyOnly()
    reducer.ready = lambda index, grad: None  # (callable, but there is no finish)
    xs, ys = _batches(k=1, batch=8)
    with ReducerRuntime(reducer):
        _cell_steps(_net_and_step()[1], xs, ys)
    assert reducer.called == 1


@pytest.mark.call_site
def test_the_overflow_warning_names_the_line_that_called_the_step():
    class Overflowed(Overlapping):
        def overflowed(self):
            return True

    xs, ys = _batches(k=1, batch=8)
    step = _net_and_step()[1].set_train()
    with ReducerRuntime(Overflowed()), pytest.warns(RuntimeWarning) as caught:
        step(minidl.Tensor(xs[0]), minidl.Tensor(ys[0]))
    assert caught[0].filename == __file__


def test_reduced_gradients_that_overflowed_skip_the_optimizer_with_a_warning():
    class Overflowed(Overlapping):
        def overflowed(self):
            return True

    xs, ys = _batches(k=1, batch=8)
    net, step = _net_and_step()
    before = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
    message = (r"^TrainOneStepCell: the reduced gradients hold inf or NaN \(a compressed 16-bit sum out of range, or a "
               r"non-finite gradient on some rank\); the optimizer skips this step$")
    with ReducerRuntime(Overflowed()), pytest.warns(RuntimeWarning, match=message):
        _cell_steps(step, xs, ys)
    for p in net.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), before[p.name], err_msg=p.name)


def test_model_trains_a_step_cell_given_no_loss_fn_or_optimizer_as_mindspore():
    x, y = blobs(n=24)
    ds = lambda: slices((x, y), ["x", "y"], 8)
    want = _trained(False)  # Model(net, loss_fn, Momentum), 2 epochs
    net, step = _net_and_step()
    model = Model(step)
    model.train(2, ds())
    assert model.grad_reducer is None  # the step cell reduces, not the Model
    for p in net.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), want[p.name], err_msg=p.name)
    with pytest.raises(ValueError, match=r"an optimizer is needed to train; pass optimizer= to Model, or a "
                                         r"training-step network \(nn.TrainOneStepCell"):
        Model(nn.WithLossCell(mlp(), ce_loss())).train(1, ds())


def test_model_of_a_step_cell_checkpoints_and_resumes_the_optimizer_state_bit_identically(tmp_path):
    from minidl.train import Callback, ModelCheckpoint, latest_checkpoint

    class StopAt(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num >= 2:
                run_context.request_stop()

    x, y = blobs(n=24)
    ds = lambda: slices((x, y), ["x", "y"], 8)
    net, step = _net_and_step()
    Model(step).train(2, ds())
    want = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
    want.update({name: v.asnumpy().copy() for name, v in step.optimizer.state_dict().items()})

    _, step = _net_and_step()
    Model(step).train(2, ds(), callbacks=[ModelCheckpoint("step", str(tmp_path)), StopAt()])
    net, step = _net_and_step()
    Model(step).train(2, ds(), resume_from=latest_checkpoint(str(tmp_path), "step"))
    got = {p.name: p.asnumpy() for p in net.trainable_params()}
    got.update({name: v.asnumpy() for name, v in step.optimizer.state_dict().items()})
    assert got.keys() == want.keys() and any(name.startswith("moments.") for name in got)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


# ---- under minidl_parallel's data parallelism ----------------------------------------------------------

# float32 MLP, gradients_mean: each rank's gradient is the mean over its half of the batch, and the
# all-reduce averages the halves, where one device averages the whole batch at once: the same sum in
# another order, a few float32 roundings (2^-24 ~ 6e-8 relative each) per gradient element. After 3
# Momentum steps at lr 0.05 the parameters differed by 6e-8 relative (7e-9 absolute) when measured;
# the bounds leave a 15x margin, and a run without the reducer (each rank on its own half) differs
# by 0.1.
DP_RTOL, DP_ATOL = 1e-6, 1e-7


def _data_parallel(n, k, per_rank, body):
    """body(rank's xs, rank's ys) on n thread-ranks, DATA_PARALLEL with gradients_mean set in
    each rank after body builds its cell (so the cell must ask when it steps); rank results."""
    import minidl_parallel as mp
    xs, ys = _batches(k, n * per_rank)

    def rank_body():
        r = mp.get_rank()
        part = slice(r * per_rank, (r + 1) * per_rank)
        set_mode = lambda: mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL,
                                                        gradients_mean=True)
        return body(xs[:, part], ys[:, part], set_mode)
    return xs, ys, mp.run_threads(n, rank_body)


def test_data_parallel_step_cells_equal_one_device_on_the_global_batch_with_no_reducer_in_user_code():
    def body(xs, ys, set_mode):
        net, step = _net_and_step()
        set_mode()  # after the cell was built: it asks the runtime at its first step
        _cell_steps(step, xs, ys)
        return type(step.grad_reducer).__name__, {p.name: p.asnumpy() for p in net.trainable_params()}

    def alone(xs, ys, set_mode):  # no mode set: the ranks train on their halves, unreduced
        net, step = _net_and_step()
        _cell_steps(step, xs, ys)
        return step.reducer_flag, {p.name: p.asnumpy() for p in net.trainable_params()}

    xs, ys, ranks = _data_parallel(n=2, k=3, per_rank=4, body=body)
    _, _, want = _manual_steps(xs, ys)
    for reducer, got in ranks:
        assert reducer == "DistributedGradReducer"
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=DP_RTOL, atol=DP_ATOL, err_msg=name)
    reduced, unreduced = _data_parallel(n=2, k=3, per_rank=4, body=alone)[2][0]
    assert reduced is False
    assert any(not np.allclose(unreduced[name], want[name], rtol=1e-3) for name in want)


def test_data_parallel_model_of_a_step_cell_equals_one_device_on_the_global_batch():
    import minidl_parallel as mp

    def body(xs, ys, set_mode):
        set_mode()
        net, step = _net_and_step()
        ds = slices((xs.reshape(-1, 4), ys.reshape(-1)), ["x", "y"], xs.shape[1])
        Model(step).train(1, ds, progress=False)
        return {p.name: p.asnumpy() for p in net.trainable_params()}

    xs, ys, ranks = _data_parallel(n=2, k=3, per_rank=4, body=body)
    _, _, want = _manual_steps(xs, ys)
    for got in ranks:
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=DP_RTOL, atol=DP_ATOL, err_msg=name)
    assert not mp.is_initialized()  # run_threads released the world


def test_the_step_cell_keeps_its_reducer_across_steps_so_accumulation_works():
    """grad_accumulation_step=2: the first call only accumulates (no update, grads None), the
    second reduces the sum and updates; a reducer asked anew every step would never update."""
    import minidl_parallel as mp

    def body(xs, ys, set_mode):
        set_mode()
        mp.set_auto_parallel_context(grad_accumulation_step=2)
        net, step = _net_and_step(return_grad=True)
        step.set_train()
        before = [p.asnumpy().copy() for p in net.trainable_params()]
        _, first = step(minidl.Tensor(xs[0]), minidl.Tensor(ys[0]))
        unchanged = all(np.array_equal(b, p.asnumpy()) for b, p in zip(before, net.trainable_params()))
        _, second = step(minidl.Tensor(xs[1]), minidl.Tensor(ys[1]))
        moved = all(not np.array_equal(b, p.asnumpy()) for b, p in zip(before, net.trainable_params()))
        return first, unchanged, sorted(second), moved

    for first, unchanged, second, moved in _data_parallel(n=2, k=2, per_rank=4, body=body)[2]:
        assert first is None and unchanged
        assert second == ["0.bias", "0.weight", "2.bias", "2.weight"] and moved


def test_parameter_broadcast_gives_every_rank_rank_0s_start_at_the_first_step():
    import minidl_parallel as mp

    def body(xs, ys, set_mode):
        set_mode()
        mp.set_auto_parallel_context(parameter_broadcast=True)
        net, step = _net_and_step(seed=3 + mp.get_rank())  # the ranks start apart
        _cell_steps(step, xs, ys)
        return {p.name: p.asnumpy() for p in net.trainable_params()}

    xs, ys, ranks = _data_parallel(n=2, k=2, per_rank=4, body=body)
    _, _, want = _manual_steps(xs, ys, seed=3)  # rank 0's start, on the global batch
    for got in ranks:
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=DP_RTOL, atol=DP_ATOL, err_msg=name)


def test_semi_auto_parallel_step_cells_equal_one_device_with_no_reducer():
    """Tensor parallelism: the ops communicate themselves, so the runtime gives the step cell no
    reducer; a sharded MatMul trained by Model(step cell) on 2 ranks equals one device (float64:
    the only difference is the order of a two-block sum, 1e-12 relative)."""
    import minidl_parallel as mp
    from minidl import ops
    from minidl_parallel.tensor_parallel.dispatch import full_value

    class Linear(nn.Cell):
        def __init__(self):
            super().__init__()
            rng = np.random.default_rng(4)
            self.weight = minidl.Parameter(minidl.Tensor(rng.standard_normal((6, 3)) / 3))
            self.matmul = ops.MatMul()

        def construct(self, x):
            return self.matmul(x, self.weight)

    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((8, 6)), rng.standard_normal((8, 3))

    def train(shard):
        net = Linear()
        if shard:
            net.matmul.shard(((1, 2), (2, 1)))
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        Model(step).train(1, NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(4))
        return step.reducer_flag, np.array(minidl.backend.to_numpy(full_value(net.weight) if shard else net.weight.data))

    want = train(shard=False)[1]

    def rank_body():
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.SEMI_AUTO_PARALLEL, dataset_strategy="full_batch")
        try:
            return train(shard=True)
        finally:
            mp.reset_auto_parallel_context()

    for reduced, got in mp.run_threads(2, rank_body):
        assert reduced is False
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert not np.allclose(want, Linear().weight.asnumpy())  # it trained


# ---- TrainOneStepWithLossScaleCell ---------------------------------------------------------------------


def _loss_scale_step(scale_sense, seed=3, optimizer=momentum):
    minidl.set_seed(seed)
    net = mlp()
    return net, nn.TrainOneStepWithLossScaleCell(nn.WithLossCell(net, ce_loss()), optimizer(net), scale_sense)


def _overflowing(x):
    """A batch of equal rows of 3e38: the hidden layer holds ~1e38, so with labels that are not all
    the (equal) prediction, the scaled gradients of the second layer overflow float32 (inf/NaN)."""
    return np.full_like(x, 3e38)


def _params(net):
    return {p.name: p.asnumpy().copy() for p in net.trainable_params()}


@pytest.mark.parametrize("scale_sense", ["tensor", "dynamic"])
def test_the_loss_scale_step_equals_train_one_step_bit_for_bit_without_overflow(scale_sense):
    """float32, a power-of-2 scale: scaling every gradient by 2^k and back is exact, so the
    losses and parameters equal TrainOneStepCell's bit for bit (a window of 2 doubles the
    dynamic scale twice in 4 steps, so the scale changes between steps too)."""
    from minidl import amp
    xs, ys = _batches(k=4, batch=8)
    net1, plain = _net_and_step()
    want_losses = _cell_steps(plain, xs, ys)
    sense = (minidl.Tensor(np.float32(2 ** 10)) if scale_sense == "tensor"
             else amp.DynamicLossScaleManager(2 ** 10, 2, 2).get_update_cell())
    net2, step = _loss_scale_step(sense)
    results = _cell_steps(step, xs, ys)
    assert [float(r[0].asnumpy()) for r in results] == [float(l.asnumpy()) for l in want_losses]
    assert [bool(r[1].asnumpy()) for r in results] == [False] * 4
    want_scales = [1024.0] * 4 if scale_sense == "tensor" else [1024.0, 1024.0, 2048.0, 2048.0]
    assert [float(r[2].asnumpy()) for r in results] == want_scales  # the scale each step used
    want = _params(net1)
    for p in net2.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), want[p.name], err_msg=p.name)
    assert not any(np.array_equal(want[name], value) for name, value in _params(_net_and_step()[0]).items())


def test_an_overflow_skips_the_step_and_halves_the_scale():
    from minidl import amp
    xs, ys = _batches(k=2, batch=8)
    net, step = _loss_scale_step(amp.DynamicLossScaleManager(2 ** 10, 2, 2).get_update_cell())
    step.set_train()
    before = _params(net)
    with np.errstate(over="ignore", invalid="ignore"):
        loss, overflow, scale = step(minidl.Tensor(_overflowing(xs[0])), minidl.Tensor(np.arange(8, dtype=np.int32) % 3))
    assert bool(overflow.asnumpy()) is True and overflow.dtype == np.bool_
    assert float(scale.asnumpy()) == 1024.0 and float(step.scale_sense.asnumpy()) == 512.0
    for name, value in _params(net).items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)  # skipped: nothing moved
    moments = {n: v.asnumpy() for n, v in step.optimizer.state_dict().items() if n.startswith("moments.")}
    assert moments and not any(np.any(v) for v in moments.values())  # nor the momentum
    _, overflow, scale = step(minidl.Tensor(xs[1]), minidl.Tensor(ys[1]))
    assert bool(overflow.asnumpy()) is False and float(scale.asnumpy()) == 512.0
    assert any(not np.array_equal(v, before[n]) for n, v in _params(net).items())  # a clean step trains


def test_a_tensor_scale_with_no_update_cell_skips_without_changing_and_set_sense_scale_sets_it():
    xs, ys = _batches(k=1, batch=8)
    net, step = _loss_scale_step(minidl.Tensor(np.array([64.0], np.float32)))
    step.set_train()
    with np.errstate(over="ignore", invalid="ignore"):
        _, overflow, scale = step(minidl.Tensor(_overflowing(xs[0])), minidl.Tensor(np.arange(8, dtype=np.int32) % 3))
    assert bool(overflow.asnumpy()) and scale.asnumpy().tolist() == [64.0]
    assert step.scale_sense.asnumpy().tolist() == [64.0] and step.scale_sense.name == "scale_sense"
    step.set_sense_scale(minidl.Tensor(np.array([8.0], np.float32)))
    assert step.scale_sense.asnumpy().tolist() == [8.0]
    assert [p.name for p in step.trainable_params()] == step.weights_name  # the scale is not trained
    with pytest.raises(TypeError, match="the type of 'sens' must be Tensor, but got float"):
        step.set_sense_scale(8.0)


@pytest.mark.parametrize("scale_sense, error, message", [
    (minidl.Tensor(np.ones((2,), np.float32)), ValueError,
     r"^For 'TrainOneStepWithLossScaleCell', the shape of 'scale_sense' must be \(1,\) or \(\), but got \(2,\)"),
    (1024.0, TypeError, r"^For 'TrainOneStepWithLossScaleCell', the 'scale_sense' must be Cell or Tensor, but got "
                        r"'scale_sense' type: float"),
    (nn.ReLU(), TypeError, r"^For 'TrainOneStepWithLossScaleCell', a Cell 'scale_sense' must have get_loss_scale\(\) "
                           r"\(an update cell such as nn.DynamicLossScaleUpdateCell\), got ReLU$"),
])
def test_bad_scale_sense_raises_as_mindspore(scale_sense, error, message):
    with pytest.raises(error, match=message):
        _loss_scale_step(scale_sense)


@pytest.mark.parametrize("scale_sense", [lambda: nn.DynamicLossScaleUpdateCell(2 ** 10, 2, 2),
                                         lambda: minidl.Tensor(np.float64(2 ** 10))],
                         ids=["int_scale_cell", "float64_tensor"])
def test_the_scale_is_a_float32_parameter_whatever_type_it_is_given_in(scale_sense):
    _, step = _loss_scale_step(scale_sense())
    assert step.scale_sense.dtype == np.float32 and float(step.scale_sense.asnumpy()) == 2 ** 10
    assert not step.scale_sense.requires_grad


def test_a_step_whose_reducer_only_accumulates_reports_no_overflow_and_leaves_the_scale():
    from minidl import amp
    xs, ys = _batches(k=1, batch=8)
    net, step = _loss_scale_step(amp.DynamicLossScaleManager(2 ** 10, 2, 1).get_update_cell())
    step.grad_reducer = lambda grads: None  # (what an accumulating reducer returns until its last micro-step)
    step.set_train()
    before = _params(net)
    with np.errstate(over="ignore", invalid="ignore"):
        _, overflow, scale = step(minidl.Tensor(_overflowing(xs[0])), minidl.Tensor(np.arange(8, dtype=np.int32) % 3))
    assert overflow.dtype == np.bool_ and bool(overflow.asnumpy()) is False
    assert float(step.scale_sense.asnumpy()) == 2 ** 10 == float(scale.asnumpy())
    assert all(np.array_equal(v, before[n]) for n, v in _params(net).items())


def test_data_parallel_the_overflow_flag_is_summed_even_where_no_all_reduce_carries_the_inf():
    """A reducer that does not all-reduce (as for tensor-parallel blocks or reduce-scattered
    slices): rank 1's overflow still skips the step, and halves the scale, on both ranks."""
    from minidl import amp

    def body(xs, ys, set_mode):
        import minidl_parallel as mp
        set_mode()
        net, step = _loss_scale_step(amp.DynamicLossScaleManager(2 ** 8, 2, 100).get_update_cell())
        step.grad_reducer = lambda grads: grads  # (each rank keeps its own gradients)
        step.set_train()
        before = _params(net)
        x0 = _overflowing(xs[0]) if mp.get_rank() == 1 else xs[0]
        with np.errstate(over="ignore", invalid="ignore"):
            _, overflow, _ = step(minidl.Tensor(x0), minidl.Tensor(np.arange(len(ys[0]), dtype=np.int32) % 3))
        skipped = all(np.array_equal(v, before[n]) for n, v in _params(net).items())
        return bool(overflow.asnumpy()), skipped, float(step.scale_sense.asnumpy())

    for rank in _data_parallel(n=2, k=1, per_rank=4, body=body)[2]:
        assert rank == (True, True, 128.0)


@pytest.mark.parametrize("compression", [None, "fp16"])
def test_data_parallel_an_overflow_on_one_rank_skips_the_step_on_both(compression):
    """n = 2 thread-ranks, DATA_PARALLEL: rank 1's input overflows; both ranks skip the step,
    halve the scale, keep their parameters equal, and train equally on the next step."""
    import minidl_parallel as mp
    from minidl import amp

    def body(xs, ys, set_mode):
        set_mode()
        mp.set_auto_parallel_context(gradient_compression=compression)
        net, step = _loss_scale_step(amp.DynamicLossScaleManager(2 ** 8, 2, 100).get_update_cell())
        step.set_train()
        before = _params(net)
        x0, y0 = (_overflowing(xs[0]) if mp.get_rank() == 1 else xs[0]), np.arange(len(ys[0]), dtype=np.int32) % 3
        with np.errstate(over="ignore", invalid="ignore"):
            _, overflow, _ = step(minidl.Tensor(x0), minidl.Tensor(y0))
        skipped = all(np.array_equal(v, before[n]) for n, v in _params(net).items())
        _, clean, _ = step(minidl.Tensor(xs[1]), minidl.Tensor(ys[1]))
        return bool(overflow.asnumpy()), skipped, float(step.scale_sense.asnumpy()), bool(clean.asnumpy()), _params(net)

    ranks = _data_parallel(n=2, k=2, per_rank=4, body=body)[2]
    for overflow, skipped, scale, clean, _ in ranks:
        assert (overflow, skipped, scale, clean) == (True, True, 128.0, False)
    for name, value in ranks[0][4].items():
        np.testing.assert_array_equal(ranks[1][4][name], value, err_msg=name)
        assert not np.array_equal(value, _params(_net_and_step()[0])[name])  # the second step trained


@pytest.mark.parametrize("compression", ["none", "fp16", pytest.param("bf16", marks=pytest.mark.cpu_only)])  # (CuPy has no bf16)
def test_the_gradient_all_reduce_alone_carries_one_ranks_inf_to_every_rank(compression):
    """Why the ranks would agree even without the explicit flag sum: inf + x = inf and NaN + x
    = NaN in the sum of every bucket, compressed or not."""
    import minidl_parallel as mp

    def rank_body():
        p = minidl.Parameter(np.zeros(4, np.float32), name="w")
        reducer = mp.DistributedGradReducer([p], mean=True, compression=compression)
        g = np.array([1.0, 2.0, np.inf if mp.get_rank() == 1 else 3.0, np.nan if mp.get_rank() == 0 else 4.0],
                     np.float32)
        return reducer((minidl.Tensor(g),))[0].asnumpy()

    for got in mp.run_threads(2, rank_body):
        assert got[:2].tolist() == [1.0, 2.0] and np.isinf(got[2]) and np.isnan(got[3])


def test_model_trains_a_loss_scale_step_cell_as_the_plain_step_cell():
    from minidl import amp
    x, y = blobs(n=24)
    ds = lambda: slices((x, y), ["x", "y"], 8)
    want = _trained(False)  # Model(net, loss_fn, Momentum), 2 epochs of 3 steps
    net, step = _loss_scale_step(amp.DynamicLossScaleManager(2 ** 10, 2, 2).get_update_cell())
    Model(step).train(2, ds())
    for p in net.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), want[p.name], err_msg=p.name)
    assert float(step.scale_sense.asnumpy()) == 2 ** 13  # doubled after steps 2, 4 and 6
