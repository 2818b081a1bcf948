"""Model's construction and step: the argument checks name the wrong value and the expected one,
the step equals a hand-written loop, the grad reducer's optional parts, and how each callback finds
its counterpart on the other ranks."""
import os
import re

import numpy as np
import pytest

import minidl
from minidl import nn, ops, Tensor
from minidl.autograd import value_and_grad
from minidl.runtime import Runtime
from minidl.train import Accuracy, Callback, CheckpointConfig, Model, ModelCheckpoint

from .helpers import FakeSlices, blobs, ce_loss, mlp, momentum, slices


def _params(net):
    return [p.asnumpy().copy() for p in net.get_parameters()]


def _copy_params(src, dst):
    for p, q in zip(src.get_parameters(), dst.get_parameters()):
        q.set_data(p.data.copy())


# ---- construction ----------------------------------------------------------------------------


class _NotCallable:
    """Has the names Model looks for, but cannot be called."""

    def parameters_and_names(self):
        return iter(())

    def set_train(self, mode=True):
        return self


def test_each_bad_argument_is_named_with_its_type():
    net = mlp()
    opt = momentum(net)
    with pytest.raises(TypeError, match=r"^Model: network must be a Cell, got int$"):
        Model(42)
    # an optimizer passed as the network: callable, with parameters, but no set_train
    with pytest.raises(TypeError, match=r"^Model: network must be a Cell, got Momentum$"):
        Model(opt)
    with pytest.raises(TypeError, match=r"^Model: network must be a Cell, got _NotCallable$"):
        Model(_NotCallable())
    with pytest.raises(TypeError, match=r"^Model: loss_fn must be a loss Cell \(callable\) or None, got str$"):
        Model(net, "cross_entropy")
    with pytest.raises(TypeError, match=r"^Model: optimizer must be an Optimizer or None, got str$"):
        Model(net, ce_loss(), "sgd")
    # the class instead of an instance: callable, with parameters_and_names, but no parameters
    with pytest.raises(TypeError, match=r"^Model: optimizer must be an Optimizer or None, got type$"):
        Model(net, ce_loss(), nn.Momentum)
    with pytest.raises(TypeError, match=r"^Model: optimizer must be an Optimizer or None, got _NotCallable$"):
        Model(net, ce_loss(), _NotCallable())
    with pytest.raises(TypeError, match=r"^Model: eval_network must be a Cell or None, got int$"):
        Model(net, ce_loss(), opt, eval_network=3)
    with pytest.raises(TypeError, match=r"^Model: grad_reducer must be callable \(grads -> grads\) or None, got "
                                        r"str$"):
        Model(net, ce_loss(), opt, grad_reducer="allreduce")


def test_eval_indexes_and_metrics_name_what_they_need():
    net = mlp()
    with pytest.raises(ValueError, match=r"^Model: eval_indexes needs eval_network$"):
        Model(net, ce_loss(), eval_indexes=[0, 1, 2])
    with pytest.raises(ValueError, match=r"^Model: metrics need either loss_fn \(to evaluate network\(data\) against "
                                         r"the label\) or eval_network; pass one, or no metrics$"):
        Model(net, metrics={"accuracy"})


def test_a_given_grad_reducer_is_the_models_before_training():
    net = mlp()
    reducer = lambda grads: grads  # noqa: E731
    assert Model(net, ce_loss(), momentum(net), grad_reducer=reducer).grad_reducer is reducer
    assert Model(net, ce_loss(), momentum(net)).grad_reducer is None


def test_eval_network_without_eval_indexes_gives_every_metric_all_its_outputs():
    x, y = blobs(n=12)
    net = mlp()

    class LogitsAndLabel(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, data, label):
            return self.net(data), label

    model = Model(net, ce_loss(), momentum(net), metrics={"acc": Accuracy()}, eval_network=LogitsAndLabel())
    res = model.eval(slices((x, y), ["x", "y"], 4))
    assert res["acc"] == pytest.approx(float((net(Tensor(x)).asnumpy().argmax(1) == y).mean()))


# ---- dataset checks ----------------------------------------------------------------------------


class _Sized(FakeSlices):
    """A dataset whose get_dataset_size() returns ``size``."""

    def __init__(self, size):
        x, y = blobs(n=8)
        super().__init__((x, y), ["x", "y"], 4)
        self.size = size

    def get_dataset_size(self):
        return self.size


def test_dataset_checks_name_the_wrong_value():
    x, y = blobs(n=8)
    net = mlp()
    with pytest.raises(TypeError, match=r"^Model.train: train_dataset must be a minidl.dataset Dataset \(with "
                                        r"get_dataset_size, epoch_iterator, get_col_names\), got list$"):
        Model(net, ce_loss(), momentum(net)).train(1, [(x, y)])
    for size in (-1, 2.5):
        with pytest.raises(ValueError, match=rf"^Model.train: train_dataset is empty \(get_dataset_size\(\) returned "
                                             rf"{re.escape(repr(size))}\)"):
            Model(net, ce_loss(), momentum(net)).train(1, _Sized(size))


def test_an_empty_valid_dataset_is_refused_before_training_and_by_eval():
    x, y = blobs(n=8)
    net = mlp()
    before = _params(net)
    model = Model(net, ce_loss(), momentum(net), metrics={"accuracy"})
    empty = FakeSlices((x[:0], y[:0]), ["x", "y"], 4)
    with pytest.raises(ValueError, match=r"^Model.fit: valid_dataset is empty \(get_dataset_size\(\) returned 0\)"):
        model.fit(1, slices((x, y), ["x", "y"], 4), valid_dataset=empty)
    assert all(np.array_equal(a, b) for a, b in zip(before, _params(net)))  # raised before any step
    with pytest.raises(ValueError, match=r"^Model.eval: valid_dataset is empty \(get_dataset_size\(\) returned 0\)"):
        model.eval(empty)


def test_column_count_errors_say_why_two_columns_and_the_alternative():
    x, y = blobs(n=8)
    three = slices((x, y, y), ["x", "y", "z"], 4)
    net = mlp()
    with pytest.raises(ValueError, match=r"^Model.train: train_dataset must yield 2 columns \(data, label\) since "
                                         r"loss_fn is given, got 3 column\(s\) \['x', 'y', 'z'\]; build the dataset "
                                         r"with those two columns, or pass loss_fn=None and a network taking every "
                                         r"column$"):
        Model(net, ce_loss(), momentum(net)).train(1, three)
    with pytest.raises(ValueError, match=r"^Model.eval: valid_dataset must yield 2 columns \(data, label\) since the "
                                         r"default evaluation is used, got 3 column\(s\) \['x', 'y', 'z'\]; build the "
                                         r"dataset with those two columns, or pass eval_network=$"):
        Model(net, ce_loss(), momentum(net), metrics={"accuracy"}).eval(three)


def test_an_eval_network_takes_every_column_even_with_a_loss_fn():
    # the 2-column rule of eval is the default evaluation's, not loss_fn's
    x, y = blobs(n=8)
    net = mlp()

    class Weighted(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, data, label, weight):
            return self.net(data * weight), label

    model = Model(net, ce_loss(), momentum(net), metrics={"acc": Accuracy()}, eval_network=Weighted())
    ones = np.ones((8, 1), np.float32)
    res = model.eval(slices((x, y, ones), ["x", "y", "w"], 4))
    assert res["acc"] == pytest.approx(float((net(Tensor(x)).asnumpy().argmax(1) == y).mean()))


# ---- the step ------------------------------------------------------------------------------------


class _LossAndLogits(nn.Cell):
    """construct(data, label) -> (loss, logits): the loss comes first."""

    def __init__(self, net):
        super().__init__()
        self.net = net
        self.loss = ce_loss()

    def construct(self, x, y):
        logits = self.net(x)
        return self.loss(logits, y), logits


def _hand_loop(net, batches, lr=0.05, skip=()):
    """The training loop Model replaces: value_and_grad, then the optimizer (skipping steps in ``skip``)."""
    loss_fn = ce_loss()
    opt = momentum(net, lr)
    grad_fn = value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    losses = []
    for k, (x, y) in enumerate(batches):
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        losses.append(float(loss.asnumpy()))
        if k not in skip:
            opt(grads)
    return losses


def _batches(x, y, size):
    return [(x[i:i + size], y[i:i + size]) for i in range(0, len(x), size)]


class _Losses(Callback):
    def __init__(self):
        self.losses = []

    def on_train_step_end(self, run_context):
        self.losses.append(float(run_context.original_args().net_outputs.asnumpy()))


def test_a_network_returning_loss_and_logits_trains_on_its_loss_as_a_hand_written_loop():
    x, y = blobs(n=12)
    inner, twin = mlp(), mlp()
    _copy_params(inner, twin)
    net = _LossAndLogits(inner)
    seen = _Losses()
    Model(net, None, momentum(net)).train(1, slices((x, y), ["x", "y"], 4), callbacks=seen)
    want = _hand_loop(twin, _batches(x, y, 4))
    np.testing.assert_allclose(seen.losses, want, rtol=1e-5)
    for a, b in zip(_params(inner), _params(twin)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_loss_that_is_not_a_scalar_is_described_and_named_by_model_train():
    x, y = blobs(n=8)
    ds = slices((x, y), ["x", "y"], 4)
    net = mlp()
    with pytest.raises(ValueError, match=r"^Model.train: since loss_fn is None, the network must return the loss as "
                                         r"a scalar Tensor, but it returned a Tensor of shape \(4, 3\); pass "
                                         r"loss_fn= \(e.g. nn.SoftmaxCrossEntropyWithLogits\(sparse=True, "
                                         r"reduction='mean'\)\)$"):
        Model(net, None, momentum(net)).train(1, slices((x,), ["x"], 4))
    loss = ce_loss()
    for bad, described in ((lambda logits, label: (loss(logits, label), logits), "a tuple of 2 values"),
                           (lambda logits, label: float(loss(logits, label).asnumpy()), "a float")):
        with pytest.raises(ValueError, match=rf"^Model.train: loss_fn must return the loss as a scalar Tensor, but it "
                                             rf"returned {described}; use a loss with reduction='mean' or 'sum'$"):
            Model(net, bad, momentum(net)).train(1, ds)


class _ForwardsEverything(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, *inputs):
        return self.net(*inputs)


def test_a_network_that_cannot_take_the_columns_is_named_by_its_class():
    x, y = blobs(n=8)
    ds = slices((x, y), ["x", "y"], 4)
    net = nn.Dense(4, 3)
    with pytest.raises(TypeError, match=r"instead of Dense$"):
        Model(net, None, momentum(net)).train(1, ds)
    wrapped = _ForwardsEverything(mlp())
    with pytest.raises(TypeError, match=r"calling it with them raised TypeError: .*instead of _ForwardsEverything$"):
        Model(wrapped, None, momentum(wrapped)).train(1, ds)


class _DuckNetwork:
    """A network without construct: callable, with the Cell methods Model uses."""

    def __init__(self, cell):
        self.cell = cell

    def __call__(self, *columns):
        return self.cell(*columns)

    def parameters_and_names(self):
        return self.cell.parameters_and_names()

    def set_train(self, mode=True):
        self.cell.set_train(mode)
        return self


def test_a_network_without_a_readable_signature_is_left_to_the_call():
    x, y = blobs(n=8)
    inner, twin = mlp(), mlp()
    _copy_params(inner, twin)
    duck = _DuckNetwork(_LossAndLogits(inner))
    seen = _Losses()
    Model(duck, None, momentum(inner)).train(1, slices((x, y), ["x", "y"], 4), callbacks=seen)
    np.testing.assert_allclose(seen.losses, _hand_loop(twin, _batches(x, y, 4)), rtol=1e-5)


def test_predict_and_eval_hand_the_network_tensors():
    net = mlp()
    model = Model(net)
    rows = [[1.0, 2.0, 3.0, 4.0], [0.5, 0.0, -1.0, 2.0]]
    np.testing.assert_allclose(model.predict(rows).asnumpy(), model.predict(Tensor(np.array(rows, np.float32)))
                               .asnumpy(), rtol=1e-6)
    seen = []

    class Typed(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, data, label):
            seen.append((type(data), type(label)))
            return self.net(data), label

    x, y = blobs(n=8)
    Model(net, None, metrics={"acc": Accuracy()}, eval_network=Typed()).eval(slices((x, y), ["x", "y"], 4))
    assert seen == [(Tensor, Tensor)] * 2


# ---- the grad reducer's optional parts -------------------------------------------------------------


class _Overflowing:
    """A blocking reducer whose reduction overflows on the steps in ``bad``."""

    def __init__(self, bad):
        self.bad, self.calls = set(bad), 0

    def __call__(self, grads):
        self.calls += 1
        return grads

    def overflowed(self):
        return self.calls in self.bad


def test_an_overflowed_reduction_skips_the_optimizer_with_a_runtime_warning():
    x, y = blobs(n=12)
    net, twin = mlp(), mlp()
    _copy_params(net, twin)
    with pytest.warns(RuntimeWarning) as caught:
        Model(net, ce_loss(), momentum(net), grad_reducer=_Overflowing({2})).train(1, slices((x, y), ["x", "y"], 4))
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert re.fullmatch(r"Model\.train: the reduced gradients hold inf or NaN \(a compressed 16-bit sum out of range, "
                        r"or a non-finite gradient on some rank\); the optimizer skips this step\. With fp16, "
                        r"gradient_predivide_factor=<ranks> or gradient_compression='bf16' keeps sums in range",
                        messages[0]), messages[0]
    _hand_loop(twin, _batches(x, y, 4), skip={1})  # the second step (index 1) is skipped
    for a, b in zip(_params(net), _params(twin)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


class _HalfOverlapping:
    """A blocking reducer that has only one of ready/finish."""

    def __init__(self, part):
        self.calls = 0
        setattr(self, part, self._part)

    def _part(self, *args):
        raise AssertionError("ready/finish are used only together")

    def __call__(self, grads):
        self.calls += 1
        return tuple(Tensor(g.asnumpy() * 2) for g in grads)


@pytest.mark.parametrize("part", ["ready", "finish"])
def test_a_reducer_with_only_one_of_ready_and_finish_is_called_whole(part):
    x, y = blobs(n=8)
    net, twin = mlp(), mlp()
    _copy_params(net, twin)
    reducer = _HalfOverlapping(part)
    Model(net, ce_loss(), momentum(net), grad_reducer=reducer).train(1, slices((x, y), ["x", "y"], 4))
    assert reducer.calls == 2
    double = lambda grads: tuple(Tensor(g.asnumpy() * 2) for g in grads)  # noqa: E731
    Model(twin, ce_loss(), momentum(twin), grad_reducer=double).train(1, slices((x, y), ["x", "y"], 4))
    for a, b in zip(_params(net), _params(twin)):
        np.testing.assert_array_equal(a, b)


class _Overlapping:
    """A reducer with ready/finish that logs what it is handed."""

    def __init__(self):
        self.log, self.given = [], {}

    def ready(self, index, grad):
        self.log.append(("ready", index))
        self.given[index] = grad

    def finish(self):
        self.log.append("finish")
        out, self.given = tuple(self.given[i] for i in sorted(self.given)), {}
        return out

    def __call__(self, grads):
        self.log.append(("whole", [float(np.abs(g.asnumpy()).sum()) for g in grads]))
        return grads


class _ConstantLoss(nn.Cell):
    """Has parameters, but its loss reaches none of them."""

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def construct(self, x, y):
        return ops.reduce_sum(x * 0.0)


def test_an_overlapping_reducer_gets_the_zero_gradients_whole_when_the_loss_reaches_no_parameter():
    x, y = blobs(n=8)
    net = _ConstantLoss()
    before = _params(net)
    reducer = _Overlapping()
    Model(net, None, momentum(net), grad_reducer=reducer).train(1, slices((x, y), ["x", "y"], 4))
    assert reducer.log == [("whole", [0.0] * 4)] * 2
    assert all(np.array_equal(a, b) for a, b in zip(before, _params(net)))


class _BroadcastOnly:
    parameter_broadcast = True

    def __call__(self, grads):
        return grads


def test_a_reducer_asking_for_a_broadcast_it_cannot_do_is_named():
    x, y = blobs(n=8)
    net = mlp()
    with pytest.raises(TypeError, match=r"^Model.train: the grad reducer asks for parameter_broadcast but has no "
                                        r"broadcast_parameters\(tensors\) method \(_BroadcastOnly\)$"):
        Model(net, ce_loss(), momentum(net), grad_reducer=_BroadcastOnly()).train(1, slices((x, y), ["x", "y"], 4))


def test_a_runtime_reducer_that_is_not_callable_is_named():
    class Misconfigured(Runtime):
        def grad_reducer(self, parameters):
            return "allreduce"

    x, y = blobs(n=8)
    net = mlp()
    with Misconfigured():
        with pytest.raises(TypeError, match=r"^Model.train: the runtime's grad reducer must be callable \(grads -> "
                                            r"grads\), got str$"):
            Model(net, ce_loss(), momentum(net)).train(1, slices((x, y), ["x", "y"], 4))


# ---- callbacks' counterparts on the other ranks ----------------------------------------------------


class _Noted(Callback):
    """A callback with nothing to share, that rank 0 alone runs."""


class _Saver(ModelCheckpoint):
    """A user's ModelCheckpoint subclass, from this module, as _Noted."""


class _Renamed(ModelCheckpoint):
    """A user's subclass that keeps the name ModelCheckpoint (another module's class of that name)."""


_Renamed.__name__ = _Renamed.__qualname__ = "ModelCheckpoint"


def _save(cls, prefix, directory):
    return cls(prefix, str(directory), CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=5))


SCENARIOS = {
    # rank 0 runs a callback before its checkpoint that rank 1 does not
    "one rank's extra callback": lambda r, tmp: ([_Noted()] if r == 0 else []) + [_save(_Saver, "net", tmp / "shared")],
    # rank 0 runs a class of the same name from another module
    "a class of the same name": lambda r, tmp: ([_save(_Renamed, "own", tmp / "own0")] if r == 0 else [])
    + [_save(ModelCheckpoint, "net", tmp / "shared")],
    # two of one class on every rank: one in a directory of each rank's own, one shared
    "two of one class": lambda r, tmp: [_save(ModelCheckpoint, "own", tmp / f"own{r}"),
                                        _save(ModelCheckpoint, "net", tmp / "shared")],
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_each_callback_finds_its_counterpart_on_the_other_ranks(tmp_path, scenario):
    """The ranks pair callbacks by class and position among that class's: the ModelCheckpoints
    sharing a directory name their files by rank; one alone in its directory keeps plain names."""
    import minidl_parallel as mp
    from minidl_parallel import run_threads

    x, y = blobs(n=8)

    def fn():
        rank = mp.get_rank()
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
        minidl.set_seed(1)
        net = mlp()
        Model(net, ce_loss(), momentum(net)).train(1, slices((x, y), ["x", "y"], 4), progress=False,
                                                   callbacks=SCENARIOS[scenario](rank, tmp_path))

    run_threads(2, fn, timeout=60)
    assert sorted(os.listdir(tmp_path / "shared")) == ["net-1_2.ckpt", "net-1_2_rank1.ckpt"]
    for own in sorted(tmp_path.glob("own*")):
        assert os.listdir(own) == ["own-1_2.ckpt"], own
