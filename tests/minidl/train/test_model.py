"""Model: training learns, eval/predict, the grad reducer seam, the metrics log and progress
bar, and clear errors for bad input."""
import io
import json
import sys
import threading

import numpy as np
import pytest

from minidl import nn, ops, Tensor
from minidl.train import Accuracy, Loss, Model, ProgressBar, TopKCategoricalAccuracy
from minidl.train.progress import use_progress_bar

from .helpers import FakeSlices, StopAt, blobs, ce_loss, mlp, momentum, slices


def _params(net):
    return [p.asnumpy().copy() for p in net.get_parameters()]


def test_train_learns_and_eval_reports_metrics():
    x, y = blobs(n=48)
    ds = slices((x, y), ["x", "y"], 8, shuffle=True)
    net = mlp(dropout=0.1)
    model = Model(net, ce_loss(), momentum(net), metrics={"accuracy", "loss"})
    before = model.eval(ds)
    model.train(6, ds)
    after = model.eval(ds)
    assert set(after) == {"accuracy", "loss"}
    assert after["loss"] < 0.5 * before["loss"]
    assert after["accuracy"] >= 0.9
    assert not net.training  # eval leaves the network in inference mode


def test_eval_matches_metrics_computed_by_hand():
    x, y = blobs(n=20)
    net = mlp()
    model = Model(net, ce_loss(), momentum(net), metrics={"acc": Accuracy(), "top2": TopKCategoricalAccuracy(2),
                                                          "loss": Loss()})
    res = model.eval(slices((x, y), ["x", "y"], 20))
    logits = net(Tensor(x)).asnumpy()
    assert res["acc"] == pytest.approx(float((logits.argmax(1) == y).mean()))
    top2 = np.argsort(-logits, 1)[:, :2]
    assert res["top2"] == pytest.approx(float((top2 == y[:, None]).any(1).mean()))
    assert res["loss"] == pytest.approx(float(ce_loss()(Tensor(logits), Tensor(y)).item()), rel=1e-6)


def test_contract_methods_suffice():
    # Model uses only get_dataset_size, epoch_iterator and get_col_names.
    x, y = blobs(n=16)
    net = mlp()
    model = Model(net, ce_loss(), momentum(net), metrics={"accuracy"})
    ds = FakeSlices((x, y), ["x", "y"], 4, shuffle=True)
    model.train(2, ds)
    assert 0 <= model.eval(ds)["accuracy"] <= 1


def test_predict_runs_inference_without_graph():
    net = mlp(dropout=0.5)
    x = Tensor(np.ones((3, 4), np.float32))
    model = Model(net)
    out = model.predict(x)
    assert out.shape == (3, 3) and out._node is None
    assert np.array_equal(out.asnumpy(), model.predict(np.ones((3, 4), np.float32)).asnumpy())  # no dropout
    with pytest.raises(ValueError, match="at least one input"):
        model.predict()


class NetWithLoss(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net
        self.loss = ce_loss()

    def construct(self, x, y):
        return self.loss(self.net(x), y)


def test_loss_fn_none_network_returns_the_loss():
    x, y = blobs(n=24)
    ds = slices((x, y), ["x", "y"], 8)
    inner = mlp()
    net = NetWithLoss(inner)
    losses = []

    class Grab(StopAt):
        def on_train_step_end(self, run_context):
            losses.append(float(run_context.original_args().net_outputs.asnumpy()))

    Model(net, None, momentum(net)).train(5, ds, callbacks=Grab(10 ** 6))
    assert len(losses) == 15 and losses[-1] < losses[0] * 0.5


def test_grad_reducer_sees_every_gradient_before_the_optimizer():
    x, y = blobs(n=8)
    net = mlp()
    opt = momentum(net)
    calls = []

    def zero(grads):
        calls.append([g.shape for g in grads])
        return tuple(Tensor(np.zeros_like(g.asnumpy())) for g in grads)

    before = _params(net)
    Model(net, ce_loss(), opt, grad_reducer=zero).train(1, slices((x, y), ["x", "y"], 4))
    assert calls == [[p.shape for p in opt.parameters]] * 2
    assert all(np.array_equal(a, b) for a, b in zip(before, _params(net)))  # zero gradients: no change


def test_the_runtime_is_asked_for_a_grad_reducer_when_training_starts():
    """Not when the Model is built: a parallel mode set later must still take effect."""
    from minidl.runtime import Runtime
    made = []

    class Reducing(Runtime):
        def grad_reducer(self, parameters):
            made.append(len(parameters))
            return lambda grads: grads

    net = mlp()
    model = Model(net, ce_loss(), momentum(net))
    assert model.grad_reducer is None and made == []
    x, y = blobs(n=8)
    with Reducing():
        model.train(1, slices((x, y), ["x", "y"], 4))
        assert made == [4] and model.grad_reducer is not None
        explicit = Model(net, ce_loss(), momentum(net), grad_reducer=lambda g: g)
        explicit.train(1, slices((x, y), ["x", "y"], 4))
        assert made == [4]  # a given reducer wins
    model.train(1, slices((x, y), ["x", "y"], 4))
    assert model.grad_reducer is None  # the local runtime again: no reduction


def test_metrics_log_has_a_record_per_step_and_per_epoch(tmp_path):
    x, y = blobs(n=12)
    ds = slices((x, y), ["x", "y"], 4)
    net = mlp()
    log = tmp_path / "train.jsonl"
    Model(net, ce_loss(), momentum(net), metrics={"accuracy"}).fit(2, ds, ds, log_file=str(log))
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r for r in recs if "loss" in r]
    epochs = [r for r in recs if "epoch_time" in r]
    assert [(r["epoch"], r["step"]) for r in steps] == [(1, 1), (1, 2), (1, 3), (2, 4), (2, 5), (2, 6)]
    assert all(set(r) == {"epoch", "step", "step_in_epoch", "loss", "time"} for r in steps)
    assert all(np.isfinite(r["loss"]) for r in steps)
    assert [(r["epoch"], r["step"]) for r in epochs] == [(1, 3), (2, 6)]
    assert all(0 <= r["eval"]["accuracy"] <= 1 for r in epochs)
    assert len(recs) == 8
    # a new (not resumed) run starts the log afresh
    Model(net, ce_loss(), momentum(net)).train(1, ds, log_file=str(log))
    assert len(log.read_text().splitlines()) == 4


def test_fit_prints_eval_results_through_loss_monitor(capsys):
    from minidl.train import LossMonitor
    x, y = blobs(n=8)
    ds = slices((x, y), ["x", "y"], 8)
    net = mlp()
    Model(net, ce_loss(), momentum(net), metrics={"accuracy"}).fit(2, ds, ds, valid_frequency=2,
                                                                   callbacks=LossMonitor())
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[2].startswith("Eval result: epoch 2, metrics: {'accuracy': ")


def test_progress_is_quiet_off_a_terminal_and_optional():
    assert use_progress_bar(None, io.StringIO()) is False
    assert use_progress_bar(False) is False
    with pytest.raises(TypeError, match="progress must be None, True or False"):
        use_progress_bar("yes")


def test_progress_true_without_tqdm_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.raises(ImportError, match="pip install tqdm"):
        use_progress_bar(True)
    assert use_progress_bar(None, io.StringIO()) is False


def test_progress_bar_draws_with_tqdm():
    pytest.importorskip("tqdm")
    x, y = blobs(n=12)
    net = mlp()
    buf = io.StringIO()
    Model(net, ce_loss(), momentum(net)).train(1, slices((x, y), ["x", "y"], 4),
                                               callbacks=ProgressBar(file=buf, refresh_seconds=0))
    text = buf.getvalue()
    assert "epoch 1/1" in text and "3/3" in text and "loss=" in text


# ---- bad input ---------------------------------------------------------------------------------


def _model(**kw):
    net = mlp()
    return Model(net, ce_loss(), momentum(net), **kw)


@pytest.mark.parametrize("epoch", [0, -1, 1.5, True, None])
def test_bad_epoch(epoch):
    x, y = blobs(n=8)
    with pytest.raises(ValueError, match=r"Model.train: epoch must be an int >= 1, got"):
        _model().train(epoch, slices((x, y), ["x", "y"], 4))


def test_dataset_without_the_needed_columns():
    x, y = blobs(n=8)
    three = slices((x, y, y), ["x", "y", "z"], 4)
    with pytest.raises(ValueError, match=r"must yield 2 columns \(data, label\).*got 3 column\(s\) \['x', 'y', 'z'\]"):
        _model().train(1, three)
    with pytest.raises(ValueError, match="Model.eval: valid_dataset must yield 2 columns"):
        _model(metrics={"accuracy"}).eval(three)
    with pytest.raises(TypeError, match="train_dataset must be a minidl.dataset Dataset"):
        _model().train(1, [(x, y)])
    with pytest.raises(ValueError, match="train_dataset is empty"):
        _model().train(1, FakeSlices((x[:0], y[:0]), ["x", "y"], 4))


def test_network_output_that_is_not_a_scalar_loss():
    x, y = blobs(n=8)
    net = mlp()
    with pytest.raises(ValueError, match=r"since loss_fn is None, the network must return the loss as a scalar "
                                         r"Tensor, but it returned a Tensor of shape \(4, 3\); pass loss_fn="):
        Model(net, None, momentum(net)).train(1, slices((x,), ["x"], 4))
    with pytest.raises(ValueError, match=r"loss_fn must return the loss as a scalar Tensor.*reduction='mean'"):
        Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True), momentum(net)).train(1, slices((x, y), ["x", "y"], 4))


class ForwardsEverything(nn.Cell):
    """construct(*inputs): its signature takes any columns; the inner Dense does not."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, *inputs):
        return self.net(*inputs)


def test_loss_fn_none_with_a_network_that_does_not_take_data_and_label():
    # Model(net, None, opt): MindSpore's "the network computes the loss from (data, label)". A plain
    # network there met Python's "construct() takes 2 positional arguments but 3 were given".
    x, y = blobs(n=8)
    ds = slices((x, y), ["x", "y"], 4)
    net = nn.Dense(4, 3)
    before = _params(net)
    with pytest.raises(TypeError, match=r"Model.train: loss_fn is None, so the network must take every column of the "
                                        r"dataset \(2: \['x', 'y'\]\) and return the loss itself, but Dense.construct"
                                        r"\(x\) cannot take them .*; pass loss_fn \(e.g. Model\(net, nn.SoftmaxCross"
                                        r"EntropyWithLogits\(sparse=True, reduction='mean'\), optimizer\)\), or a "
                                        r"network whose construct\(data, label\) returns the loss"):
        Model(net, None, momentum(net)).train(1, ds)
    assert all(np.array_equal(a, b) for a, b in zip(before, _params(net)))  # raised before any step
    wrapped = ForwardsEverything(mlp())
    with pytest.raises(TypeError, match=r"Model.train: loss_fn is None, .* \(2 of them\) .* calling it with them "
                                        r"raised TypeError: .*takes 2 positional arguments but 3 were given; pass "
                                        r"loss_fn"):
        Model(wrapped, None, momentum(wrapped)).fit(1, ds)
    # a network that takes (data, label) and returns the loss still trains, through *inputs too
    with_loss = ForwardsEverything(NetWithLoss(mlp()))
    start = _params(with_loss)
    Model(with_loss, None, momentum(with_loss)).train(1, ds)
    assert any(not np.array_equal(a, b) for a, b in zip(start, _params(with_loss)))


def test_model_argument_checks():
    net = mlp()
    x, y = blobs(n=8)
    with pytest.raises(TypeError, match="network must be a Cell"):
        Model(lambda x: x)
    with pytest.raises(TypeError, match="optimizer must be an Optimizer"):
        Model(net, ce_loss(), optimizer="sgd")
    with pytest.raises(ValueError, match="metrics need either loss_fn"):
        Model(net, metrics={"accuracy"})
    with pytest.raises(ValueError, match="an optimizer is needed to train"):
        Model(net, ce_loss()).train(1, slices((x, y), ["x", "y"], 4))
    with pytest.raises(ValueError, match="Model.eval: no metrics"):
        Model(net, ce_loss()).eval(slices((x, y), ["x", "y"], 4))
    with pytest.raises(ValueError, match="eval_indexes must be 3 ints"):
        Model(net, eval_network=net, eval_indexes=[0, 1])
    with pytest.raises(ValueError, match="valid_frequency must be an int >= 1"):
        _model(metrics={"accuracy"}).fit(1, slices((x, y), ["x", "y"], 4), valid_frequency=0)


def test_custom_eval_network_with_indexes():
    x, y = blobs(n=12)
    net = mlp()

    class EvalNet(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, data, label):
            logits = self.net(data)
            return label, ops.reduce_sum(logits * 0.0), logits

    model = Model(net, None, momentum(net), metrics={"accuracy", "loss"}, eval_network=EvalNet(),
                  eval_indexes=[1, 2, 0])
    res = model.eval(slices((x, y), ["x", "y"], 4))
    assert res["loss"] == 0.0
    assert res["accuracy"] == pytest.approx(float((net(Tensor(x)).asnumpy().argmax(1) == y).mean()))


def test_stop_request_ends_training_after_the_step():
    x, y = blobs(n=16)
    net = mlp()
    opt = momentum(net)
    threads = threading.active_count()
    Model(net, ce_loss(), opt).train(5, slices((x, y), ["x", "y"], 4, shuffle=True), callbacks=StopAt(6))
    assert opt.global_step == 6
    assert threading.active_count() == threads  # the dataset's prefetch thread was closed mid-epoch


class _ReadyReducer:
    """Records ready/finish calls; finish returns the gradients doubled, in parameter order."""

    def __init__(self, n, parameter_broadcast=False):
        self.n, self.log, self.given = n, [], {}
        self.parameter_broadcast = parameter_broadcast
        self.broadcasts = []

    def ready(self, index, grad):
        self.log.append(index)
        self.given[index] = grad

    def finish(self):
        out = tuple(Tensor(self.given[i].asnumpy() * 2) for i in range(self.n))
        self.given = {}
        self.log.append("finish")
        return out

    def __call__(self, grads):
        raise AssertionError("a reducer with ready/finish is not called whole")

    def broadcast_parameters(self, tensors):
        self.broadcasts.append(len(tensors))


def test_reducer_with_ready_and_finish_gets_each_gradient_during_backward():
    x, y = blobs(n=8)
    net, twin = mlp(), mlp()
    for p, q in zip(net.get_parameters(), twin.get_parameters()):
        q.set_data(p.data.copy())
    opt = momentum(net)
    reducer = _ReadyReducer(len(opt.parameters), parameter_broadcast=True)
    Model(net, ce_loss(), opt, grad_reducer=reducer).train(1, slices((x, y), ["x", "y"], 4))
    per_step = sorted(range(len(opt.parameters))) + ["finish"]
    assert sorted(reducer.log[:4]) == per_step[:4] and reducer.log[4] == "finish" and len(reducer.log) == 10
    assert reducer.broadcasts == [4 + 1 + 4]  # parameters, global_step, moments
    # Same as a blocking reducer that doubles the gradients.
    double = lambda grads: tuple(Tensor(g.asnumpy() * 2) for g in grads)
    Model(twin, ce_loss(), momentum(twin), grad_reducer=double).train(1, slices((x, y), ["x", "y"], 4))
    for a, b in zip(_params(net), _params(twin)):
        np.testing.assert_array_equal(a, b)
