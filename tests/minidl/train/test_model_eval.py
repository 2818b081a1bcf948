"""Model.eval and Model.predict as a user sees them: the cb_params of the eval hooks, the order
the steps read the dataset, stopping early, eval networks with and without eval_indexes,
metrics with their own indexes, datasets of one column or of single rows, and the messages
of bad arguments."""
import numpy as np
import pytest

from minidl import nn, ops, Tensor
from minidl.dataset import NumpySlicesDataset
from minidl.train import Accuracy, Callback, Loss, Metric, Model

from .helpers import FakeSlices, Rank, blobs, ce_loss, mlp, momentum, slices


class EvalNet(nn.Cell):
    """An eval network over ``net``: it returns ``outputs(logits, label, loss)`` (the cross-entropy loss)."""

    def __init__(self, net, outputs):
        super().__init__(auto_prefix=False)
        self.net, self.loss, self.outputs = net, ce_loss(), outputs

    def construct(self, data, label):
        logits = self.net(data)
        return self.outputs(logits, label, self.loss(logits, label))


class Grab(Callback):
    """Records, at every eval hook, (hook, a copy of cb_params)."""

    def __init__(self, stop_at=None, log=None):
        self.seen = []
        self.stop_at = stop_at
        self.log = log

    def _grab(self, name, run_context):
        self.seen.append((name, dict(run_context.original_args())))
        if self.log is not None:
            self.log.append(name)

    def on_eval_begin(self, run_context):
        self._grab("begin", run_context)

    def on_eval_epoch_begin(self, run_context):
        self._grab("epoch_begin", run_context)

    def on_eval_step_begin(self, run_context):
        self._grab("step_begin", run_context)

    def on_eval_step_end(self, run_context):
        self._grab("step_end", run_context)
        if self.stop_at is not None and run_context.original_args().cur_step_num >= self.stop_at:
            run_context.request_stop()

    def on_eval_epoch_end(self, run_context):
        self._grab("epoch_end", run_context)

    def on_eval_end(self, run_context):
        self._grab("end", run_context)


class Columns:
    """A dataset with only the contract's methods, whose epoch_iterator takes exactly what Model
    passes (no defaults). ``batches`` is a list of rows; a row is a tuple of columns, or one
    bare array (a one-column dataset). ``closable``: a generator (with close) or a plain iterator;
    ``log`` gets "closed" when the generator is closed."""

    def __init__(self, batches, names, closable=True, log=None):
        self.batches, self.names, self.closable, self.log = batches, list(names), closable, log

    def get_col_names(self):
        return list(self.names)

    def get_dataset_size(self):
        return len(self.batches)

    def _rows(self, skip_batches, output_numpy):
        def convert(row):
            if isinstance(row, tuple):
                return tuple(convert(c) for c in row)
            return row if output_numpy else Tensor(row)
        return [convert(row) for row in self.batches[skip_batches:]]

    def epoch_iterator(self, epoch, skip_batches, output_numpy):
        rows = self._rows(skip_batches, output_numpy)
        if not self.closable:
            return iter(rows)

        def generate():
            try:
                yield from rows
            finally:
                if self.log is not None:
                    self.log.append("closed")
        return generate()


def _batches(arrays, size):
    n = len(arrays[0])
    return [tuple(a[i:i + size] for a in arrays) for i in range(0, n, size)]


def _per_sample_loss(net, x, y):
    return float(ce_loss()(net(Tensor(x)), Tensor(y)).item())


def test_eval_hooks_see_the_evaluation_in_cb_params():
    x, y = blobs(n=10)
    net = mlp()
    ds = slices((x, y), ["x", "y"], 4)  # batches of 4, 4, 2
    grab = Grab()
    model = Model(net, ce_loss(), momentum(net), metrics={"accuracy", "loss"})
    results = model.eval(ds, callbacks=grab)
    assert [name for name, _ in grab.seen] == ["begin", "epoch_begin"] + ["step_begin", "step_end"] * 3 + [
        "epoch_end", "end"]
    begin = grab.seen[0][1]
    assert begin["eval_network"] is net and begin["network"] is net and begin["valid_dataset"] is ds
    assert begin["batch_num"] == 3 and begin["epoch_num"] == 1 and begin["cur_epoch_num"] == 1
    assert begin["cur_step_num"] == 0 and begin["net_outputs"] is None and begin["metrics"] is None
    assert begin["mode"] == "eval"
    assert begin["list_callback"].callbacks == [grab]
    steps = [params for name, params in grab.seen if name == "step_end"]
    assert [params["cur_step_num"] for params in steps] == [1, 2, 3]
    for params, (bx, by) in zip(steps, _batches((x, y), 4)):
        loss, logits, label = params["net_outputs"]
        assert np.array_equal(label.asnumpy(), by)
        assert np.array_equal(logits.asnumpy(), net(Tensor(bx)).asnumpy())
        assert loss.item() == pytest.approx(_per_sample_loss(net, bx, by), rel=1e-6)
    assert grab.seen[-1][1]["metrics"] == results and grab.seen[-2][1]["metrics"] == results
    assert results["loss"] == pytest.approx(_per_sample_loss(net, x, y), rel=1e-6)


def test_eval_hooks_see_the_eval_network_when_there_is_one():
    x, y = blobs(n=8)
    net = mlp()

    eval_net = EvalNet(net, lambda logits, label, loss: (logits, label))
    grab = Grab()
    Model(net, None, metrics={"acc": Accuracy()}, eval_network=eval_net).eval(slices((x, y), ["x", "y"], 4),
                                                                              callbacks=[grab])
    assert grab.seen[0][1]["eval_network"] is eval_net and grab.seen[0][1]["network"] is net


@pytest.mark.parametrize("kind", ["dataset", "contract"])
def test_eval_steps_read_the_first_pass_of_a_shuffled_dataset(kind):
    # The steps see the batches of epoch 0 of the dataset's (seed, epoch) order, each once.
    x, y = blobs(n=12)
    y = np.arange(12).astype(np.int32) % 3
    if kind == "dataset":
        ds = NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=True, seed=7).batch(4)
    else:
        ds = FakeSlices((x, y), ["x", "y"], 4, shuffle=True, seed=7)
    first = [b[1] for b in ds.epoch_iterator(0, output_numpy=True)]
    second = [b[1] for b in ds.epoch_iterator(1, output_numpy=True)]
    assert not all(np.array_equal(a, b) for a, b in zip(first, second))  # the passes differ
    grab = Grab()
    net = mlp()
    Model(net, ce_loss(), metrics={"accuracy"}).eval(ds, callbacks=grab)
    seen = [params["net_outputs"][2].asnumpy() for name, params in grab.seen if name == "step_end"]
    assert len(seen) == 3 and all(np.array_equal(a, b) for a, b in zip(seen, first))


def test_a_stop_request_ends_the_evaluation_after_the_step_and_closes_the_dataset():
    x, y = blobs(n=12)
    net = mlp()
    log = []
    ds = Columns(_batches((x, y), 4), ["x", "y"], log=log)
    grab = Grab(stop_at=2, log=log)
    model = Model(net, ce_loss(), metrics={"acc": Accuracy(), "loss": Loss()})
    got = model.eval(ds, callbacks=grab)
    assert got == model.eval(Columns(_batches((x[:8], y[:8]), 4), ["x", "y"]))  # the two batches read
    assert got["loss"] == pytest.approx(_per_sample_loss(net, x[:8], y[:8]), rel=1e-6)
    # the dataset is closed when the loop ends, before the end hooks run
    assert log == ["begin", "epoch_begin", "step_begin", "step_end", "step_begin", "step_end", "closed",
                   "epoch_end", "end"]
    assert grab.seen[-1][1]["metrics"] == got


def test_a_dataset_whose_iterator_has_no_close_is_evaluated():
    x, y = blobs(n=12)
    net = mlp()
    model = Model(net, ce_loss(), metrics={"loss": Loss()})
    want = _per_sample_loss(net, x, y)
    assert model.eval(Columns(_batches((x, y), 5), ["x", "y"], closable=False))["loss"] == pytest.approx(want,
                                                                                                       rel=1e-6)
    stopped = model.eval(Columns(_batches((x, y), 5), ["x", "y"], closable=False), callbacks=Grab(stop_at=1))
    assert stopped["loss"] == pytest.approx(_per_sample_loss(net, x[:5], y[:5]), rel=1e-6)


@pytest.mark.parametrize("kind", ["dataset", "contract"])
def test_the_loss_is_the_mean_per_sample_over_uneven_batches(kind):
    # Batches of 4, 4, 2 rows (4 features): each batch's loss weighs its rows, counted along axis 0.
    x, y = blobs(n=10)
    net = mlp()
    ds = slices((x, y), ["x", "y"], 4) if kind == "dataset" else Columns(_batches((x, y), 4), ["x", "y"])

    want = _per_sample_loss(net, x, y)
    batch_means = np.mean([_per_sample_loss(net, bx, by) for bx, by in _batches((x, y), 4)])
    assert abs(batch_means - want) > 1e-3  # the mean of the batch means would differ
    assert Model(net, ce_loss(), metrics={"loss"}).eval(ds)["loss"] == pytest.approx(want, rel=1e-6)
    loss_net = EvalNet(net, lambda logits, label, loss: loss)  # one Tensor, not a tuple
    got = Model(net, None, metrics={"loss": Loss()}, eval_network=loss_net).eval(ds)
    assert got["loss"] == pytest.approx(want, rel=1e-6)


def test_an_eval_network_without_eval_indexes_passes_all_its_outputs_to_every_metric():
    x, y = blobs(n=10)
    net = mlp()

    logits_label = EvalNet(net, lambda logits, label, loss: [logits, label])
    got = Model(net, None, metrics={"acc": Accuracy()}, eval_network=logits_label).eval(
        slices((x, y), ["x", "y"], 4))
    assert got["acc"] == pytest.approx(float((net(Tensor(x)).asnumpy().argmax(1) == y).mean()))


class MeanSquare(nn.Cell):
    """The mean of x*x over a batch (or of a single value): a "loss" of one column."""

    def __init__(self):
        super().__init__()
        self.mean = ops.ReduceMean()

    def construct(self, x):
        return self.mean(x * x)


def test_a_one_column_dataset_through_an_eval_network():
    values = np.arange(1.0, 11.0)
    want = float((values * values).mean())
    net = mlp()
    model = Model(net, None, metrics={"loss": Loss()}, eval_network=MeanSquare())
    # batches of 4, 4, 2 values, each a bare array (not a tuple of one column)
    batched = Columns([values[i:i + 4] for i in range(0, 10, 4)], ["v"])
    assert model.eval(batched)["loss"] == pytest.approx(want, rel=1e-12)
    # single values (0-d rows): each counts as one sample
    single = Columns([np.float64(v) for v in values], ["v"])
    assert model.eval(single)["loss"] == pytest.approx(want, rel=1e-12)
    single_tuples = Columns([(np.float64(v),) for v in values], ["v"])
    assert model.eval(single_tuples)["loss"] == pytest.approx(want, rel=1e-12)
    # batches and single values mixed: a batch weighs its rows, a single value one
    mixed = Columns([values[:4], values[4:8], np.float64(values[8]), np.float64(values[9])], ["v"])
    assert model.eval(mixed)["loss"] == pytest.approx(want, rel=1e-12)


def test_metrics_with_their_own_indexes_get_those_outputs():
    x, y = blobs(n=10)
    net = mlp()

    eval_net = EvalNet(net, lambda logits, label, loss: (label, loss, logits))
    metrics = {"acc": Accuracy().set_indexes([2, 0]), "loss": Loss().set_indexes([1])}
    for ds in (slices((x, y), ["x", "y"], 4), Columns(_batches((x, y), 4), ["x", "y"])):
        got = Model(net, None, metrics=metrics, eval_network=eval_net).eval(ds)
        assert got["acc"] == pytest.approx(float((net(Tensor(x)).asnumpy().argmax(1) == y).mean()))
        assert got["loss"] == pytest.approx(_per_sample_loss(net, x, y), rel=1e-6)  # weighed by rows


def test_eval_indexes_beyond_the_eval_networks_outputs():
    x, y = blobs(n=8)
    net = mlp()
    eval_net = EvalNet(net, lambda logits, label, loss: (loss, logits, label))
    ds = slices((x, y), ["x", "y"], 4)
    with pytest.raises(ValueError, match=r"^Model\.eval: eval_indexes \[0, 1, 3\] need at least 4 outputs from the "
                                         r"eval network, got 3$"):
        Model(net, None, metrics={"accuracy"}, eval_network=eval_net, eval_indexes=[0, 1, 3]).eval(ds)
    with pytest.raises(ValueError, match=r"^Model\.eval: eval_indexes \[2, 5, 0\] need at least 6 outputs from the "
                                         r"eval network, got 3$"):
        Model(net, None, metrics={"accuracy"}, eval_network=eval_net, eval_indexes=[2, 5, 0]).eval(ds)
    got = Model(net, None, metrics={"accuracy", "loss"}, eval_network=eval_net, eval_indexes=[0, 1, 2]).eval(ds)
    assert got["loss"] == pytest.approx(_per_sample_loss(net, x, y), rel=1e-6)


def test_the_eval_network_runs_in_inference_mode():
    x, y = blobs(n=16)
    net = mlp()

    class NoisyEval(nn.Cell):
        """Its own Dropout, outside the network: only eval_network.set_train(False) turns it off."""

        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net, self.drop = net, nn.Dropout(p=0.9)

        def construct(self, data, label):
            return self.drop(self.net(data)), label

    eval_net = NoisyEval()
    eval_net.set_train(True)
    model = Model(net, None, metrics={"acc": Accuracy()}, eval_network=eval_net)
    want = float((net(Tensor(x)).asnumpy().argmax(1) == y).mean())
    assert [model.eval(slices((x, y), ["x", "y"], 4))["acc"] for _ in range(3)] == pytest.approx([want] * 3)
    assert eval_net.training is False and eval_net.drop.training is False

    def plain_function(data, label):  # a callable without set_train also serves
        return net(data), label

    got = Model(net, None, metrics={"acc": Accuracy()}, eval_network=plain_function).eval(
        slices((x, y), ["x", "y"], 4))
    assert got["acc"] == pytest.approx(want)


def test_a_batch_of_padding_repeats_is_skipped_wherever_it_comes():
    # Shuffling after batch(1) moves the shard's padding repeat before real rows: the rows
    # after it still count.
    x, y = blobs(n=7)
    net = mlp()
    padded = NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False, num_shards=2, shard_id=1)
    padded = padded.batch(1).shuffle(8)
    valid = [bool(v.all()) for _, v in padded.epoch_iterator(0, output_numpy=True, with_validity=True)]
    assert valid.count(False) == 1 and valid.index(False) < len(valid) - 1  # a repeat before a real row
    exact = NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False, num_shards=2, shard_id=1,
                               shard_mode="exact").batch(3)
    model = Model(net, ce_loss(), metrics={"acc": Accuracy(), "loss": Loss()})
    got, want = model.eval(padded), model.eval(exact)
    assert got["acc"] == want["acc"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert want["loss"] == pytest.approx(_per_sample_loss(net, x[1::2], y[1::2]), rel=1e-6)


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_evaluates_a_dataset_without_shards_whole(size):
    # A contract dataset has no num_shards: each rank evaluates all of it, without communicating.
    x, y = blobs(n=10)
    net = mlp()
    model = Model(net, ce_loss(), metrics={"acc": Accuracy(), "loss": Loss()})
    want = model.eval(FakeSlices((x, y), ["x", "y"], 4))
    for r in range(size):
        with Rank(r, size=size):
            assert model.eval(FakeSlices((x, y), ["x", "y"], 4)) == want


def test_metrics_without_statistics_are_all_named_before_a_sharded_eval():
    class Plain(Metric):
        def clear(self):
            pass

        def update(self, *inputs):
            pass

        def eval(self):
            return 0.0

    class Other(Plain):
        pass

    x, y = blobs(n=8)
    net = mlp()
    model = Model(net, ce_loss(), metrics={"acc": Accuracy(), "p": Plain(), "o": Other()})
    ds = NumpySlicesDataset((x, y), column_names=["x", "y"], shuffle=False, num_shards=2, shard_id=0).batch(2)
    with Rank(0, size=2):
        with pytest.raises(TypeError, match=r"^Model\.eval: metric 'p' \(Plain\), 'o' \(Other\) cannot be combined "
                                            r"over the 2 ranks of a sharded evaluation: it defines no statistics\(\) "
                                            r"and finish\(statistics\) \(see minidl.train.metrics.Metric\); define "
                                            r"them, or evaluate a dataset every rank reads whole$"):
            model.eval(ds)


class _Laid(nn.Cell):
    """An eval network saying where its outputs live (the protocol PipelineEvalCell speaks)."""

    def __init__(self, net, layout):
        super().__init__()
        self.net, self.layout = net, layout

    def construct(self, x, y):
        logits = self.net(x)
        return logits, y

    def evaluation_layout(self):
        return self.layout


@pytest.mark.parametrize("layout", [(True, 2, 2), (True, 2, -1), (True, 2), [True, 1, 0], (True, 1.0, 0),
                                    (True, 2, 1.0), "abc"])
def test_an_evaluation_layout_that_is_not_holds_replicas_replica_is_refused(layout):
    x, y = blobs(n=8)
    net = mlp()
    model = Model(net, ce_loss(), metrics={"acc": Accuracy()}, eval_network=_Laid(net, layout), eval_indexes=None)
    with pytest.raises(TypeError) as err:
        model.eval(slices((x, y), ["x", "y"], 4))
    assert str(err.value) == (f"Model.eval: _Laid.evaluation_layout() must return None or (holds_outputs, replicas, "
                              f"replica) with 0 <= replica < replicas, got {layout!r}")


def test_eval_argument_errors_name_the_value_and_what_is_expected():
    x, y = blobs(n=8)
    net = mlp()
    ds = slices((x, y), ["x", "y"], 4)
    model = Model(net, ce_loss(), metrics={"accuracy"})
    with pytest.raises(TypeError, match=r"^Model\.eval: callbacks\[1\] must be a Callback, got int$"):
        model.eval(ds, callbacks=[Grab(), 3])
    with pytest.raises(TypeError, match=r"^Model\.eval: callbacks must be a Callback or a list of Callbacks, "
                                        r"got str$"):
        model.eval(ds, callbacks="Grab")
    with pytest.raises(ValueError, match=r"^Model\.eval: no metrics to evaluate; pass metrics= \(e\.g\. "
                                         r"\{'accuracy'\}\) to Model$"):
        Model(net, ce_loss()).eval(ds)
    with pytest.raises(ValueError, match=r"^Model\.eval: valid_dataset is empty \(get_dataset_size\(\) returned "
                                         r"0\); check its source"):
        model.eval(FakeSlices((x[:0], y[:0]), ["x", "y"], 4))
    three = slices((x, y, y), ["x", "y", "z"], 4)
    with pytest.raises(ValueError, match=r"^Model\.eval: valid_dataset must yield 2 columns \(data, label\) since the "
                                         r"default evaluation is used, got 3 column\(s\) \['x', 'y', 'z'\]; build the "
                                         r"dataset with those two columns, or pass eval_network=$"):
        model.eval(three)

    class ThreeColumns(nn.Cell):  # with an eval_network (and a loss_fn) any number of columns serves
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, data, label, extra):
            return self.net(data), label

    got = Model(net, ce_loss(), metrics={"acc": Accuracy()}, eval_network=ThreeColumns()).eval(three)
    assert got["acc"] == pytest.approx(float((net(Tensor(x)).asnumpy().argmax(1) == y).mean()))


def test_predict_needs_an_input_and_leaves_the_network_in_inference_mode():
    net = mlp(dropout=0.5)
    net.set_train(True)
    model = Model(net)
    with pytest.raises(ValueError, match=r"^Model\.predict: needs at least one input$"):
        model.predict()
    x = np.ones((2, 4), np.float32)
    out = model.predict(x)
    assert net.training is False
    assert np.array_equal(out.asnumpy(), net(Tensor(x)).asnumpy())
