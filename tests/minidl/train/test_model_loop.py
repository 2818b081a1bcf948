"""Model's training loop: what callbacks see (cb_params, epochs, validation), the dataset
contract it uses, the errors of bad arguments, and how the ranks agree on their step counts
(through a stand-in runtime whose other ranks' plans the test chooses)."""
import numpy as np
import pytest

from minidl import nn, ops
from minidl.train import Callback, CheckpointConfig, Model, ModelCheckpoint, latest_checkpoint

from .helpers import FakeSlices, Rank, StopAt, blobs, ce_loss, mlp, momentum, slices


class Snapshot(Callback):
    """Copies cb_params at train begin; records per epoch the metrics at its begin and end, and
    per step whether the network was in training mode."""

    def __init__(self):
        self.begin, self.epochs, self.training = None, [], []

    def on_train_begin(self, run_context):
        self.begin = dict(run_context.original_args())

    def on_train_epoch_begin(self, run_context):
        cb = run_context.original_args()
        self.epochs.append([cb.cur_epoch_num, cb.metrics])

    def on_train_step_begin(self, run_context):
        self.training.append(run_context.original_args().network.training)

    def on_train_epoch_end(self, run_context):
        self.epochs[-1].append(run_context.original_args().metrics)


def _data(n=12, batch=4):
    x, y = blobs(n=n)
    return slices((x, y), ["x", "y"], batch)


def test_cb_params_at_train_begin_describe_the_run():
    net = mlp()
    loss, opt = ce_loss(), momentum(net)
    ds, valid = _data(), _data(n=8)
    snap = Snapshot()
    Model(net, loss, opt, metrics={"accuracy"}).fit(2, ds, valid, callbacks=[snap])
    seen = snap.begin
    assert set(seen) == {"train_network", "network", "optimizer", "loss_fn", "train_dataset", "valid_dataset",
                         "epoch_num", "batch_num", "cur_epoch_num", "cur_step_num", "cur_step_in_epoch",
                         "net_outputs", "dataset_sink_mode", "mode", "list_callback", "metrics", "eval_results"}
    assert seen["train_network"] is net and seen["network"] is net
    assert seen["optimizer"] is opt and seen["loss_fn"] is loss
    assert seen["train_dataset"] is ds and seen["valid_dataset"] is valid
    assert (seen["epoch_num"], seen["batch_num"]) == (2, 3)
    assert (seen["cur_epoch_num"], seen["cur_step_num"], seen["cur_step_in_epoch"]) == (0, 0, 0)
    assert seen["net_outputs"] is None and seen["metrics"] is None and seen["eval_results"] is None
    assert seen["dataset_sink_mode"] is False and seen["mode"] == "train"
    assert seen["list_callback"].callbacks == [snap]

    Model(net, loss, opt).train(1, ds, callbacks=snap)
    assert snap.begin["dataset_sink_mode"] is False and snap.begin["valid_dataset"] is None
    Model(net, loss, opt).train(1, ds, callbacks=snap, dataset_sink_mode=True)
    assert snap.begin["dataset_sink_mode"] is True


def test_fit_validates_every_valid_frequency_epochs_and_after_the_last_then_trains_on():
    net = mlp(dropout=0.2)
    snap = Snapshot()
    Model(net, ce_loss(), momentum(net), metrics={"accuracy"}).fit(5, _data(), _data(n=8), valid_frequency=3,
                                                                   callbacks=snap)
    assert [epoch for epoch, _, _ in snap.epochs] == [1, 2, 3, 4, 5]
    assert all(begin is None for _, begin, _ in snap.epochs)  # each epoch starts without the last results
    assert [epoch for epoch, _, end in snap.epochs if end is not None] == [3, 5]
    assert all(set(end) == {"accuracy"} for _, _, end in snap.epochs if end is not None)
    assert snap.training == [True] * 15  # back in training mode after every evaluation


def test_a_stop_request_skips_that_epochs_validation():
    net = mlp()
    snap = Snapshot()
    Model(net, ce_loss(), momentum(net), metrics={"accuracy"}).fit(3, _data(), _data(n=8),
                                                                   callbacks=[StopAt(2), snap])
    assert snap.epochs == [[1, None, None]] and len(snap.training) == 2


def test_progress_true_draws_a_bar_in_train_and_fit(capsys):
    pytest.importorskip("tqdm")
    net = mlp()
    model = Model(net, ce_loss(), momentum(net), metrics={"accuracy"})
    model.train(1, _data(), progress=True)
    assert "epoch 1/1" in capsys.readouterr().err
    model.fit(1, _data(), _data(n=8), progress=True)
    assert "epoch 1/1" in capsys.readouterr().err
    model.fit(1, _data(), progress=False)
    assert capsys.readouterr().err == ""


def test_fit_argument_errors_name_the_argument_and_the_value():
    model = Model(mlp(), ce_loss(), momentum(mlp()))
    with pytest.raises(ValueError, match=r"^Model\.fit: valid_dataset needs metrics; pass metrics= to Model$"):
        model.fit(1, _data(), _data())
    model = Model(mlp(), ce_loss(), momentum(mlp()), metrics={"accuracy"})
    x, y = blobs(n=8)
    with pytest.raises(ValueError, match=r"^Model\.fit: valid_dataset must yield 2 columns \(data, label\) since the "
                                         r"default evaluation is used, got 3 column\(s\) \['x', 'y', 'z'\]"):
        model.fit(1, _data(), slices((x, y, y), ["x", "y", "z"], 4))
    with pytest.raises(TypeError, match=r"^Model\.fit: valid_dataset must be a minidl\.dataset Dataset .* got list"):
        model.fit(1, _data(), [(x, y)])
    for bad in (True, 2.0, 0):
        with pytest.raises(ValueError, match=rf"^Model\.fit: valid_frequency must be an int >= 1, got {bad!r}$"):
            model.fit(1, _data(), _data(), valid_frequency=bad)


def test_train_argument_errors_name_the_argument_and_the_value():
    net = mlp()
    with pytest.raises(ValueError, match=r"^Model\.train: an optimizer is needed to train; pass optimizer= to "
                                         r"Model$"):
        Model(net, ce_loss()).train(1, _data())
    model = Model(net, ce_loss(), momentum(net))
    with pytest.raises(TypeError, match=r"^Model\.train: dataset_sink_mode must be a bool, got 'yes'$"):
        model.train(1, _data(), dataset_sink_mode="yes")
    with pytest.raises(TypeError, match=r"^Model\.train: train_dataset must be a minidl\.dataset Dataset .* got "
                                        r"tuple$"):
        model.train(1, blobs(n=8))
    with pytest.raises(TypeError, match=r"^Model\.train: callbacks\[1\] must be a Callback, got int$"):
        model.train(1, _data(), callbacks=[StopAt(1), 3])
    with pytest.raises(TypeError, match=r"^Model\.train: callbacks must be a Callback or a list of Callbacks, got "
                                        r"int$"):
        model.fit(1, _data(), callbacks=3)


EMPTY = r"^Model\.train: train_dataset is empty \(get_dataset_size\(\) returned 0\); check its source, sharding " \
        r"and batch\(drop_remainder=\.\.\.\)$"


def test_an_empty_dataset_raises_before_anything_else_is_checked_or_written(tmp_path):
    x, y = blobs(n=8)
    empty = slices((x[:0], y[:0]), ["x", "y"], 4)
    net = nn.Dense(4, 3)  # cannot take (x, y): an error the empty dataset comes before
    log = tmp_path / "log.jsonl"
    with pytest.raises(ValueError, match=EMPTY):
        Model(net, None, momentum(net)).train(1, empty, log_file=str(log))
    assert not log.exists()


class _SumOf(nn.Cell):
    """Takes the one column and returns a scalar loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Dense(4, 3)

    def construct(self, x):
        return ops.reduce_sum(self.net(x) * self.net(x))


def test_on_one_of_several_ranks_that_do_not_agree_steps_an_empty_dataset_still_raises():
    # Several ranks let an empty shard pass the first check (to report it on every rank after
    # the step counts are agreed); without an agreement it must still raise, as on one device.
    x, y = blobs(n=8)
    net = mlp()
    with Rank(0):
        with pytest.raises(ValueError, match=EMPTY):
            Model(net, ce_loss(), momentum(net)).train(1, slices((x[:0], y[:0]), ["x", "y"], 4))
        single = _SumOf()  # loss_fn None: one column is right
        with pytest.raises(ValueError, match=EMPTY):
            Model(single, None, momentum(single)).train(1, slices((x[:0],), ["x"], 4))
        one = slices((x[:4], y[:4]), ["x", "y"], 4)
        Model(net, ce_loss(), momentum(net)).train(1, one, callbacks=StopAt(10))


def test_fit_resumes_from_a_checkpoint(tmp_path):
    net = mlp()
    Model(net, ce_loss(), momentum(net)).train(1, _data(), callbacks=ModelCheckpoint("f", str(tmp_path)))
    path = latest_checkpoint(str(tmp_path), "f")
    model = Model(net, ce_loss(), momentum(net), metrics={"accuracy"})
    snap = Snapshot()
    model.fit(2, _data(), _data(n=8), resume_from=path, callbacks=snap)
    assert (snap.begin["cur_epoch_num"], snap.begin["cur_step_num"]) == (1, 3)
    assert [epoch for epoch, _, _ in snap.epochs] == [2]
    with pytest.raises(ValueError, match=r"was trained with 3 steps per epoch, but train_dataset has 2"):
        model.fit(2, _data(n=8), resume_from=path)


# ---- the dataset contract ---------------------------------------------------------------------


class _Iterator:
    def __init__(self, rows, closed):
        self.rows, self.closed = iter(rows), closed

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.rows)

    def close(self):
        self.closed.append(True)


class Contract(FakeSlices):
    """Records every epoch_iterator call (its default output_numpy is True, so Model must ask for
    Tensors) and the closing of the iterators it hands out; ``closable=False`` hands out plain
    iterators without close, and ``bare`` yields single-column rows as bare Tensors."""

    def __init__(self, *args, closable=True, bare=False, **kw):
        super().__init__(*args, **kw)
        self.calls, self.closed, self.closable, self.bare = [], [], closable, bare

    def epoch_iterator(self, epoch, skip_batches=0, output_numpy=True):
        self.calls.append((epoch, skip_batches, output_numpy))
        rows = list(super().epoch_iterator(epoch, skip_batches, output_numpy))
        if self.bare:
            rows = [row[0] for row in rows]
        return _Iterator(rows, self.closed) if self.closable else iter(rows)


def test_model_asks_the_dataset_for_tensors_per_epoch_and_closes_each_iterator():
    x, y = blobs(n=12)
    net = mlp()
    ds = Contract((x, y), ["x", "y"], 4)
    Model(net, ce_loss(), momentum(net)).train(2, ds)
    assert ds.calls == [(0, 0, False), (1, 0, False)] and ds.closed == [True, True]
    ds = Contract((x, y), ["x", "y"], 4)
    Model(net, ce_loss(), momentum(net)).train(3, ds, callbacks=StopAt(4))  # leaves epoch 2 after its 1st step
    assert ds.calls == [(0, 0, False), (1, 0, False)] and ds.closed == [True, True]
    plain = Contract((x, y), ["x", "y"], 4, closable=False)  # an iterator without close is fine
    opt = momentum(net)
    Model(net, ce_loss(), opt).train(1, plain)
    assert opt.global_step == 3


def test_rows_may_be_bare_tensors_and_must_have_the_listed_columns():
    x, y = blobs(n=12)
    net = _SumOf()
    opt = momentum(net)
    Model(net, None, opt).train(1, Contract((x,), ["x"], 4, bare=True))
    assert opt.global_step == 3
    lying = Contract((x, y, y), ["x", "y", "z"], 4)
    lying.names = ["x", "y"]
    with pytest.raises(ValueError, match=r"^Model\.train: train_dataset yielded a row of 3 column\(s\), but "
                                         r"get_col_names\(\) lists 2$"):
        Model(mlp(), ce_loss(), momentum(mlp())).train(1, lying)


# ---- agreeing on the steps -------------------------------------------------------------------


class World(Rank):
    """Rank 0 of a world of ``size``; ``gather`` returns this rank's (plan, callback plans) and,
    for each dict of ``others``, the next rank's: this rank's plan with those entries changed
    (the ranks past ``others`` plan as this one)."""

    def __init__(self, *others, size=None, lockstep=True):
        size = size if size is not None else 1 + len(others)
        super().__init__(0, size)
        self.others = list(others) + [{}] * (size - 1 - len(others))
        self.lockstep, self.gathers = lockstep, 0

    def trains_in_lockstep(self):
        return self.lockstep

    def gather(self, value):
        self.gathers += 1
        plan, callback_plans = value
        return [value] + [(dict(plan, **other), callback_plans) for other in self.others]


class _Collective:
    """A reducer whose every call communicates."""
    collective = True

    def __call__(self, grads):
        return grads


def _train(world, epochs=2, **kw):
    net = mlp()
    with world:
        Model(net, ce_loss(), momentum(net), grad_reducer=kw.pop("grad_reducer", None)).train(epochs, _data(), **kw)


def test_the_step_counts_are_exchanged_only_when_several_ranks_communicate_every_step():
    alone = World(size=1)
    _train(alone)
    assert alone.gathers == 0
    independent = World(size=2, lockstep=False)  # no collective reducer: uneven inputs need no join block
    _train(independent, uneven_inputs=True)
    assert independent.gathers == 0
    collective = World(size=2, lockstep=False)
    _train(collective, grad_reducer=_Collective())
    assert collective.gathers == 1
    with pytest.raises(ValueError, match=r"different numbers of steps per epoch \(rank 0: 3, rank 1: 4\)"):
        _train(World({"steps per epoch": 4}, lockstep=False), grad_reducer=_Collective())


def _plan(epochs=2, start=0, skipped=0, steps=3, uneven=False):
    return (f"{{'epochs': {epochs}, 'start epoch': {start}, 'skipped steps': {skipped}, 'steps per epoch': {steps}, "
            f"'uneven_inputs': {uneven}}}")


def test_ranks_disagreeing_on_the_epochs_raise_with_every_ranks_plan():
    with pytest.raises(ValueError) as caught:
        _train(World({"epochs": 3}))
    assert str(caught.value) == (f"Model.train: the ranks disagree on epochs (rank 0: {_plan()}; rank 1: "
                                 f"{_plan(epochs=3)}); every rank must call train with the same epoch, resume_from "
                                 f"and uneven_inputs")


def test_ranks_resuming_at_different_steps_raise_naming_each_ranks_step():
    with pytest.raises(ValueError) as caught:
        _train(World({"skipped steps": 1}, {}))
    assert str(caught.value).startswith("Model.train: the ranks resume at different steps of the epoch (rank 0: 0, "
                                        "rank 1: 1, rank 2: 0); every step all-reduces gradients over all ranks")


def test_fit_passes_uneven_inputs_which_needs_a_reducer_with_a_join_block():
    net = mlp()
    model = Model(net, ce_loss(), momentum(net), grad_reducer=lambda grads: grads)
    with World({"steps per epoch": 2}) as world:
        with pytest.raises(ValueError, match=r"different numbers of steps per epoch \(rank 0: 3, rank 1: 2\)"):
            model.fit(1, _data())
        with pytest.raises(ValueError) as caught:
            model.fit(1, _data(), uneven_inputs=True, progress=False)
    assert str(caught.value) == (f"Model.train: uneven_inputs=True needs data parallelism (a grad reducer with a join "
                                 f"block, such as DistributedGradReducer), but the runtime {world!r} gives function; "
                                 f"in tensor-parallel modes every operator communicates, which a rank without data "
                                 f"cannot stand in for")
    assert repr(world) == "<World local: rank 0 of 2>"
