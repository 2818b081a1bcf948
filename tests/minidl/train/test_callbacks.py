"""Callbacks: hook order and the 1.x aliases, LossMonitor's exact line, TimeMonitor,
ModelCheckpoint's files and keep policy, latest_checkpoint; the monitors' lines on several
ranks ([rank r] prefix, rank0_only), the rank asked at each print; callbacks as context managers,
CallbackList's dispatch, loss_value (one device read per loss), each line flushed, LossMonitor
driven by a loop of one's own or resumed, TimeMonitor's figures on a clock the test moves."""
import os
import re

import numpy as np
import pytest

import minidl
from minidl import nn, ops, Parameter, Tensor
from minidl.train import (Callback, CallbackList, CallbackParam, CheckpointConfig, LossMonitor, Model,
                          ModelCheckpoint, RunContext, TimeMonitor, latest_checkpoint)

from .helpers import Rank, Recorder, StopAt, blobs, ce_loss, mlp, momentum, slices


class ConstLoss(nn.Cell):
    """Returns ``w * 0 + value`` (as float32): a loss whose printed value is known exactly."""

    def __init__(self, value):
        super().__init__()
        self.w = Parameter(np.ones(1, np.float32), name="w")
        self.value = np.float32(value)

    def construct(self, x, y):
        return ops.reduce_sum(self.w * 0.0) + Tensor(self.value)


def _const_model(value):
    net = ConstLoss(value)
    return Model(net, None, nn.SGD(net.trainable_params(), learning_rate=0.1))


def _small_ds(n=12, batch=4):
    x, y = blobs(n=n)
    return slices((x, y), ["x", "y"], batch)


def test_loss_monitor_prints_mindspore_line_exactly(capsys):
    _const_model(2.3025854).train(1, _small_ds(8, 4), callbacks=LossMonitor())
    assert capsys.readouterr().out.splitlines() == ["epoch: 1 step: 1, loss is 2.3025854",
                                                    "epoch: 1 step: 2, loss is 2.3025854"]


def test_loss_monitor_prints_float32_shortest_repr_of_real_loss(capsys):
    # zero weights: uniform softmax over 10 classes, loss = ln(10) rounded to float32
    net = nn.Dense(4, 10, weight_init="zeros", bias_init="zeros")
    x = np.ones((4, 4), np.float32)
    Model(net, ce_loss(), momentum(net)).train(1, slices((x, np.zeros(4, np.int32)), ["x", "y"], 4),
                                               callbacks=[LossMonitor()])
    assert capsys.readouterr().out == "epoch: 1 step: 1, loss is 2.3025851\n"
    assert str(np.float32(np.log(10))) == "2.3025851"


def test_loss_monitor_per_print_times_counts_global_steps_and_step_in_epoch(capsys):
    _const_model(1.5).train(2, _small_ds(12, 4), callbacks=LossMonitor(per_print_times=2))
    assert capsys.readouterr().out.splitlines() == ["epoch: 1 step: 2, loss is 1.5",
                                                    "epoch: 2 step: 1, loss is 1.5",
                                                    "epoch: 2 step: 3, loss is 1.5"]
    _const_model(1.5).train(1, _small_ds(), callbacks=LossMonitor(per_print_times=0))
    assert capsys.readouterr().out == ""


def test_loss_monitor_stops_on_nan_and_checks_its_argument():
    with pytest.raises(ValueError, match=r"epoch: 1 step: 1\. Invalid loss nan"):
        _const_model(np.nan).train(1, _small_ds(), callbacks=LossMonitor())
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="per_print_times must be an int >= 0"):
            LossMonitor(bad)


def test_time_monitor_line(capsys):
    _const_model(1.0).train(2, _small_ds(12, 4), callbacks=TimeMonitor())
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line in lines:
        m = re.fullmatch(r"epoch time: (\d+\.\d{3}) ms, per step time: (\d+\.\d{3}) ms", line)
        assert m, line
        assert float(m.group(2)) == pytest.approx(float(m.group(1)) / 3, abs=2e-3)
    with pytest.raises(ValueError, match="data_size"):
        TimeMonitor(0)


def test_hooks_run_in_order_with_1x_aliases_and_stop_finishes_epoch():
    rec = Recorder()
    _const_model(1.0).train(3, _small_ds(12, 4), callbacks=[rec, StopAt(4)])
    names = [e[0] for e in rec.events]
    assert names == (["begin", "epoch_begin"] + ["step_begin", "step_end"] * 3 + ["epoch_end", "epoch_begin"]
                     + ["step_begin", "step_end", "epoch_end", "end"])
    # cur_epoch_num is 1-based, cur_step_num global and 1-based
    assert [e[1:] for e in rec.events if e[0] == "step_end"] == [(1, 1), (1, 2), (1, 3), (2, 4)]


def test_cb_params_fields():
    seen = {}

    class Grab(Callback):
        def on_train_step_end(self, run_context):
            cb = run_context.original_args()
            seen.update(cb)
            seen["loss"] = cb.net_outputs.asnumpy()

    x, y = blobs(n=8)
    net = mlp()
    opt = momentum(net)
    Model(net, ce_loss(), opt).train(2, slices((x, y), ["x", "y"], 4), callbacks=Grab())
    assert seen["epoch_num"] == 2 and seen["batch_num"] == 2
    assert seen["cur_epoch_num"] == 2 and seen["cur_step_num"] == 4
    assert seen["train_network"] is net and seen["optimizer"] is opt
    assert seen["loss"].shape == () and seen["loss"].dtype == np.float32


def test_eval_hooks_default_to_1x_names():
    rec = Recorder()
    x, y = blobs(n=8)
    net = mlp()
    Model(net, ce_loss(), momentum(net), metrics={"accuracy"}).eval(slices((x, y), ["x", "y"], 4), callbacks=rec)
    assert [e[0] for e in rec.events] == ["begin", "epoch_begin", "step_begin", "step_end", "step_begin",
                                          "step_end", "epoch_end", "end"]


def test_callback_list_and_run_context_checks():
    with pytest.raises(TypeError, match=r"^Model: callbacks\[1\] must be a Callback, got int$"):
        CallbackList([LossMonitor(), 3])
    with pytest.raises(TypeError, match="^Model: callbacks must be a Callback or a list of Callbacks, got str$"):
        CallbackList("LossMonitor")
    with pytest.raises(TypeError, match="^Model.eval: callbacks must be a Callback or a list of Callbacks, got dict$"):
        CallbackList({}, "Model.eval")
    with pytest.raises(TypeError, match="^RunContext: original_args must be a dict, got list$"):
        RunContext([1])
    run_context = RunContext({})
    assert run_context.get_stop_requested() is False
    run_context.request_stop()
    assert run_context.get_stop_requested() is True
    p = CallbackParam(a=1)
    p.b = 2
    assert (p.a, p["b"]) == (1, 2)
    with pytest.raises(AttributeError, match="no field 'c'"):
        p.c


def _train_with_ckpt(tmp_path, epochs, config, prefix="net", n=12, batch=4, callbacks=()):
    x, y = blobs(n=n)
    net = mlp()
    ckpt = ModelCheckpoint(prefix, str(tmp_path), config)
    Model(net, ce_loss(), momentum(net)).train(epochs, slices((x, y), ["x", "y"], batch),
                                               callbacks=[ckpt, *callbacks])
    return net, ckpt


def test_model_checkpoint_names_keeps_max_and_holds_the_resume_state(tmp_path):
    net, ckpt = _train_with_ckpt(tmp_path, 2, CheckpointConfig(save_checkpoint_steps=2, keep_checkpoint_max=2))
    # steps 2, 4, 6 (epoch 1 step 2, epoch 2 step 1, epoch 2 step 3); the oldest is gone
    assert sorted(os.listdir(tmp_path)) == ["net-2_1.ckpt", "net-2_3.ckpt"]
    assert ckpt.latest_ckpt_file_name == str(tmp_path / "net-2_3.ckpt")
    params = minidl.load_checkpoint(ckpt.latest_ckpt_file_name)
    for name, p in net.parameters_and_names():
        assert np.array_equal(params[name].asnumpy(), p.asnumpy())
    assert "global_step" in params and any(k.startswith("moments.") for k in params)
    meta = minidl.load_checkpoint_metadata(ckpt.latest_ckpt_file_name)
    assert {k: meta[k] for k in ("epoch_num", "step_num", "step_in_epoch", "batch_num")} == \
        {"epoch_num": "2", "step_num": "6", "step_in_epoch": "3", "batch_num": "3"}


def test_model_checkpoint_saves_at_train_end_when_not_just_saved(tmp_path):
    _train_with_ckpt(tmp_path, 1, CheckpointConfig(save_checkpoint_steps=100), callbacks=[StopAt(2)])
    assert os.listdir(tmp_path) == ["net-1_2.ckpt"]


def test_second_run_gets_a_new_prefix_and_latest_checkpoint_finds_it(tmp_path):
    cfg = CheckpointConfig(save_checkpoint_steps=3, keep_checkpoint_max=10)
    _, first = _train_with_ckpt(tmp_path, 1, cfg)
    _, second = _train_with_ckpt(tmp_path, 1, cfg, callbacks=[StopAt(2)])
    assert (first.prefix, second.prefix) == ("net", "net_1")
    assert sorted(os.listdir(tmp_path)) == ["net-1_3.ckpt", "net_1-1_2.ckpt"]
    assert latest_checkpoint(str(tmp_path), "net") == str(tmp_path / "net_1-1_2.ckpt")
    assert latest_checkpoint(str(tmp_path), "other") is None
    assert latest_checkpoint(str(tmp_path / "missing"), "net") is None


def test_checkpoint_config_and_model_checkpoint_checks(tmp_path):
    with pytest.raises(ValueError, match="cannot all be 0"):
        CheckpointConfig(save_checkpoint_steps=0, keep_checkpoint_max=0)
    with pytest.raises(ValueError, match="save_checkpoint_steps must be an int >= 0"):
        CheckpointConfig(save_checkpoint_steps=-1)
    with pytest.raises(ValueError, match="reserved"):
        CheckpointConfig(append_info=[{"step_num": 3}])
    assert CheckpointConfig(keep_checkpoint_max=0).keep_checkpoint_max == 1
    with pytest.raises(ValueError, match="prefix must be a non-empty str without '/'"):
        ModelCheckpoint("a/b", str(tmp_path))
    with pytest.raises(TypeError, match="config must be a CheckpointConfig"):
        ModelCheckpoint("a", str(tmp_path), config={"save_checkpoint_steps": 1})


def test_append_info_goes_to_metadata(tmp_path):
    cfg = CheckpointConfig(save_checkpoint_steps=100, append_info=["epoch_num", {"lr": 0.05, "tag": "x"}])
    _, ckpt = _train_with_ckpt(tmp_path, 1, cfg)
    meta = minidl.load_checkpoint_metadata(ckpt.latest_ckpt_file_name)
    assert (meta["lr"], meta["tag"], meta["epoch_num"]) == ("0.05", "x", "1")


def test_loss_monitor_rank0_only_asks_the_runtime_for_the_rank(capsys):
    with Rank(1):
        _const_model(1.5).train(1, _small_ds(8, 4), callbacks=LossMonitor(rank0_only=True))
        assert capsys.readouterr().out == ""
        _const_model(1.5).train(1, _small_ds(8, 4), callbacks=LossMonitor())  # every rank prints by default
        assert capsys.readouterr().out == ("[rank 1] epoch: 1 step: 1, loss is 1.5\n"
                                           "[rank 1] epoch: 1 step: 2, loss is 1.5\n")
    with Rank(0):
        _const_model(1.5).train(1, _small_ds(8, 4), callbacks=LossMonitor(rank0_only=True))
        assert capsys.readouterr().out.count("loss is 1.5") == 2
    with pytest.raises(TypeError, match="rank0_only must be True or False"):
        LossMonitor(rank0_only=1)


_TIME = r"epoch time: \d+\.\d{3} ms, per step time: \d+\.\d{3} ms"


def _fit_printing(callbacks):
    """One epoch of 2 steps with an evaluation at its end (LossMonitor's "Eval result" line)."""
    x, y = blobs(n=8)
    ds = slices((x, y), ["x", "y"], 4)
    net = mlp()
    Model(net, ce_loss(), momentum(net), metrics={"accuracy"}).fit(1, ds, ds, callbacks=callbacks)


def test_monitors_prefix_their_lines_with_the_rank_when_several_ranks_print(capsys):
    with Rank(1):
        _fit_printing([LossMonitor(), TimeMonitor()])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4, lines
    assert re.fullmatch(r"\[rank 1\] epoch: 1 step: 1, loss is [0-9.]+", lines[0]), lines[0]
    assert re.fullmatch(r"\[rank 1\] epoch: 1 step: 2, loss is [0-9.]+", lines[1]), lines[1]
    assert lines[2].startswith("[rank 1] Eval result: epoch 1, metrics: {'accuracy': ")
    assert re.fullmatch(rf"\[rank 1\] {_TIME}", lines[3]), lines[3]
    # the exact line: MindSpore's, after the prefix
    with Rank(0, size=4):
        _const_model(1.5).train(1, _small_ds(4, 4), callbacks=LossMonitor())
    assert capsys.readouterr().out == "[rank 0] epoch: 1 step: 1, loss is 1.5\n"


def test_rank0_only_monitors_print_on_rank_0_alone_and_unprefixed(capsys):
    with Rank(1):
        _fit_printing([LossMonitor(rank0_only=True), TimeMonitor(rank0_only=True)])
    assert capsys.readouterr().out == ""
    with Rank(0):
        _fit_printing([LossMonitor(rank0_only=True), TimeMonitor(rank0_only=True)])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and not any(line.startswith("[rank") for line in lines), lines
    assert lines[0].startswith("epoch: 1 step: 1, loss is ") and re.fullmatch(_TIME, lines[3])
    with pytest.raises(TypeError, match="TimeMonitor: rank0_only must be True or False, got 1"):
        TimeMonitor(rank0_only=1)


def test_monitors_ask_the_rank_when_they_print_not_when_built(capsys):
    loss_monitor, time_monitor = LossMonitor(), TimeMonitor()  # built on one device ...
    with Rank(1):                                             # ... used on rank 1 of 2: prefixed
        _const_model(1.5).train(1, _small_ds(4, 4), callbacks=[loss_monitor, time_monitor])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[rank 1] epoch: 1 step: 1, loss is 1.5" and re.fullmatch(rf"\[rank 1\] {_TIME}", lines[1])
    _const_model(1.5).train(1, _small_ds(4, 4), callbacks=[loss_monitor, time_monitor])  # one device again
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "epoch: 1 step: 1, loss is 1.5" and re.fullmatch(_TIME, lines[1])
    with Rank(1):
        only0 = LossMonitor(rank0_only=True)  # built on rank 1 ...
        with Rank(0):                        # ... prints on rank 0
            _const_model(1.5).train(1, _small_ds(4, 4), callbacks=only0)
    assert capsys.readouterr().out == "epoch: 1 step: 1, loss is 1.5\n"


@pytest.mark.parametrize("monitor", [LossMonitor, TimeMonitor])
def test_rank0_only_must_be_a_bool_named_with_its_monitor(monitor):
    with pytest.raises(TypeError, match=rf"^{monitor.__name__}: rank0_only must be True or False, got 'yes'$"):
        monitor(rank0_only="yes")


# ---- the hooks' contract, the monitors driven step by step, their printed figures -------------

_HOOK_NAMES = [f"on_{phase}_{hook}" for phase in ("train", "eval")
               for hook in ("begin", "epoch_begin", "epoch_end", "step_begin", "step_end", "end")]


@pytest.mark.parametrize("make", [Callback, LossMonitor, TimeMonitor,
                                  lambda: CallbackList([LossMonitor(), Callback()])])
def test_a_callback_as_a_context_manager_lets_exceptions_through(make):
    callback = make()
    with pytest.raises(RuntimeError, match="^raised inside$"):
        with callback as entered:
            assert entered is callback
            raise RuntimeError("raised inside")


def test_a_callback_list_passes_the_run_context_to_each_callback_in_order():
    calls = []

    class Spy(Callback):
        def __init__(self, tag):
            self.tag = tag

    for name in _HOOK_NAMES:
        setattr(Spy, name, lambda self, run_context, name=name: calls.append((name, self.tag, run_context)))
    callbacks = CallbackList([Spy("a"), Spy("b")])
    run_context = RunContext(CallbackParam(cur_step_num=0))
    for name in _HOOK_NAMES:
        calls.clear()
        hook = getattr(callbacks, name)
        assert hook.__name__ == name
        hook(run_context)
        assert calls == [(name, "a", run_context), (name, "b", run_context)]


def test_loss_value_takes_the_first_output_and_the_mean_of_an_array():
    from minidl.train.callbacks import loss_value
    first = loss_value((Tensor(np.float32(2.5)), Tensor(np.float32(7.0))))
    assert first == 2.5 and first.dtype == np.float32
    assert loss_value([np.array([1.0, 4.0])]) == 2.5
    assert loss_value(np.array([], np.float32)) is None
    as_float = loss_value(3)
    assert as_float == 3.0 and type(as_float) is np.float64
    assert loss_value(()) is None and loss_value("2.5") is None


def test_loss_value_on_the_device_reads_each_loss_once_per_thread(on_the_double):
    """On the GPU each read is a host synchronisation: several callbacks reading one step's loss
    cost one. Another Tensor, the same Tensor with new data, and another thread (a threads world
    trains one rank per thread) read again, and never get a stale value."""
    import threading
    from minidl.testing import cupy_double
    from minidl.train.callbacks import loss_value
    a, b = Tensor(np.float32(1.5)), Tensor(np.float32(2.5))

    def read_in_a_new_thread(loss):
        got = []
        thread = threading.Thread(target=lambda: got.append(loss_value(loss)))
        thread.start()
        thread.join()
        return got

    with cupy_double.count_host_syncs() as syncs:
        assert read_in_a_new_thread(a) == [1.5]
    assert syncs.total == 1, syncs.by_reason
    with cupy_double.count_host_syncs() as syncs:
        assert loss_value(a) == 1.5 and loss_value((a, None)) == 1.5 and loss_value([a]) == 1.5
    assert syncs.total == 1, syncs.by_reason
    with cupy_double.count_host_syncs() as syncs:
        assert loss_value(b) == 2.5 and loss_value(a) == 1.5
    assert syncs.total == 2, syncs.by_reason
    a.data = Tensor(np.float32(3.5)).data
    assert loss_value(a) == 3.5 and read_in_a_new_thread(a) == [3.5]


class _FlushRecorder:
    """A stdout that records what each flush pushed out."""

    def __init__(self):
        self.pending, self.flushed = "", []

    def write(self, text):
        self.pending += text
        return len(text)

    def flush(self):
        self.flushed.append(self.pending)
        self.pending = ""

    def isatty(self):
        return False


def test_the_monitors_flush_each_line_as_they_print_it(monkeypatch):
    stdout = _FlushRecorder()
    monkeypatch.setattr("sys.stdout", stdout)
    _const_model(1.5).train(1, _small_ds(8, 4), callbacks=[LossMonitor(), TimeMonitor()])
    with Rank(0):
        _const_model(1.5).train(1, _small_ds(4, 4), callbacks=[LossMonitor(rank0_only=True),
                                                               TimeMonitor(rank0_only=True)])
    flushed = [text for text in stdout.flushed if text]
    assert flushed[:2] == ["epoch: 1 step: 1, loss is 1.5\n", "epoch: 1 step: 2, loss is 1.5\n"]
    assert flushed[3] == "epoch: 1 step: 1, loss is 1.5\n"
    for time_line in (flushed[2], flushed[4]):
        assert re.fullmatch(rf"{_TIME}\n", time_line), time_line
    assert len(flushed) == 5 and stdout.pending == ""


def test_loss_monitor_steps_on_from_where_a_resumed_run_starts(tmp_path, capsys):
    """Resumed at global step 5 (epoch 2, step 1 of 4) with per_print_times=3: the lines come at
    the multiples of 3 (steps 6, 9, 12), as in the run never interrupted."""
    ckpt = ModelCheckpoint("c", str(tmp_path), CheckpointConfig(save_checkpoint_steps=100))
    _const_model(1.5).train(3, _small_ds(16, 4), callbacks=[ckpt, StopAt(5)])
    assert os.listdir(tmp_path) == ["c-2_1.ckpt"]
    _const_model(1.5).train(3, _small_ds(16, 4), callbacks=LossMonitor(per_print_times=3),
                            resume_from=str(tmp_path / "c-2_1.ckpt"))
    assert capsys.readouterr().out.splitlines() == ["epoch: 2 step: 2, loss is 1.5",
                                                    "epoch: 3 step: 1, loss is 1.5",
                                                    "epoch: 3 step: 4, loss is 1.5"]


def _run_context(**fields):
    return RunContext(CallbackParam(net_outputs=Tensor(np.float32(0.5)), **fields))


def test_loss_monitor_in_a_loop_of_ones_own(capsys):
    """A loop that calls only on_train_step_end, with MindSpore's cb_params (no
    cur_step_in_epoch): the monitor prints from the start, and works out the step in the epoch
    from the global step and batch_num (3 steps an epoch)."""
    monitor = LossMonitor(per_print_times=2)
    for step in range(1, 8):
        monitor.on_train_step_end(_run_context(cur_epoch_num=(step - 1) // 3 + 1, cur_step_num=step, batch_num=3))
    assert capsys.readouterr().out.splitlines() == ["epoch: 1 step: 2, loss is 0.5",
                                                    "epoch: 2 step: 1, loss is 0.5",
                                                    "epoch: 2 step: 3, loss is 0.5"]
    monitor = LossMonitor()
    monitor.on_train_step_end(_run_context(cur_epoch_num=1, cur_step_num=1, batch_num=3))
    assert capsys.readouterr().out == "epoch: 1 step: 1, loss is 0.5\n"


def test_loss_monitor_believes_the_step_in_the_epoch_a_loop_gives(capsys):
    """Epochs of varying length (a generator's last epoch short): the loop's
    cur_step_in_epoch is printed, not one worked out from batch_num."""
    monitor = LossMonitor()
    monitor.on_train_begin(_run_context(cur_step_num=0))
    for epoch, step, in_epoch in [(1, 1, 1), (1, 2, 2), (2, 3, 1), (2, 4, 2), (2, 5, 3)]:
        monitor.on_train_step_end(_run_context(cur_epoch_num=epoch, cur_step_num=step, cur_step_in_epoch=in_epoch,
                                               batch_num=2))
    assert capsys.readouterr().out.splitlines() == [f"epoch: {e} step: {s}, loss is 0.5"
                                                    for e, s in [(1, 1), (1, 2), (2, 1), (2, 2), (2, 3)]]


@pytest.mark.cpu_only
def test_a_nan_loss_on_the_cpu_names_the_step_and_nothing_else():
    with pytest.raises(ValueError) as raised:
        _const_model(np.nan).train(2, _small_ds(8, 4), callbacks=LossMonitor())
    assert str(raised.value) == "epoch: 1 step: 1. Invalid loss nan, terminating training."
    monitor = LossMonitor()
    with pytest.raises(ValueError) as raised:
        monitor.on_train_step_end(RunContext(CallbackParam(cur_epoch_num=2, cur_step_num=5, batch_num=3,
                                                           net_outputs=np.float32(np.inf))))
    assert str(raised.value) == "epoch: 2 step: 2. Invalid loss inf, terminating training."


def test_a_nan_loss_on_the_gpu_tells_how_to_find_a_bad_label(on_the_double):
    with pytest.raises(ValueError) as raised:
        _const_model(np.nan).train(1, _small_ds(8, 4), callbacks=LossMonitor())
    assert str(raised.value) == (
        "epoch: 1 step: 1. Invalid loss nan, terminating training. On the GPU a class label outside [0, classes) "
        "also gives a NaN loss (the range check would cost a host synchronisation per step); set the environment "
        "variable MINIDL_CHECK_LABELS=1 to check labels on the host: it raises naming the first bad one.")


class _Clock:
    """The monitors' clock, moved only by the test (or by _Tick)."""

    def __init__(self, monkeypatch):
        from minidl.train import callbacks
        self.now = 1000.0
        monkeypatch.setattr(callbacks, "time", self)

    def perf_counter(self):
        return self.now


class _Tick(Callback):
    """Moves the clock: every step takes ``step_s``, and ``gap_s`` passes before every epoch."""

    def __init__(self, clock, step_s, gap_s=10.0):
        self.clock, self.step_s, self.gap_s = clock, step_s, gap_s

    def on_train_epoch_begin(self, run_context):
        self.clock.now += self.gap_s

    def on_train_step_end(self, run_context):
        self.clock.now += self.step_s


def test_time_monitor_prints_the_epochs_time_and_the_mean_over_the_steps_run(monkeypatch, capsys):
    clock = _Clock(monkeypatch)
    _const_model(1.0).train(2, _small_ds(12, 4), callbacks=[_Tick(clock, 0.25), TimeMonitor()])
    assert capsys.readouterr().out.splitlines() == ["epoch time: 750.000 ms, per step time: 250.000 ms"] * 2
    # a stop after one step of three: the time of that one step
    _const_model(1.0).train(2, _small_ds(12, 4), callbacks=[_Tick(clock, 0.125), TimeMonitor(data_size=3), StopAt(1)])
    assert capsys.readouterr().out == "epoch time: 125.000 ms, per step time: 125.000 ms\n"


def test_time_monitor_over_an_epoch_without_steps(monkeypatch, capsys):
    """No step ran in the epoch (a rank with an empty shard under uneven_inputs): the per-step
    time divides by data_size, else batch_num, else 1."""
    clock = _Clock(monkeypatch)
    for monitor, fields in [(TimeMonitor(data_size=4), {"batch_num": 3}), (TimeMonitor(), {"batch_num": 3}),
                            (TimeMonitor(), {"batch_num": 0}), (TimeMonitor(), {})]:
        run_context = RunContext(CallbackParam(cur_step_num=6, **fields))
        monitor.on_train_epoch_begin(run_context)
        clock.now += 1.0
        monitor.on_train_epoch_end(run_context)
    assert capsys.readouterr().out.splitlines() == ["epoch time: 1000.000 ms, per step time: 250.000 ms",
                                                    "epoch time: 1000.000 ms, per step time: 333.333 ms",
                                                    "epoch time: 1000.000 ms, per step time: 1000.000 ms",
                                                    "epoch time: 1000.000 ms, per step time: 1000.000 ms"]


def test_time_monitor_in_a_loop_without_epoch_begin_times_from_its_creation(monkeypatch, capsys):
    """As MindSpore's: the epoch starts when the monitor is made, at step 0."""
    clock = _Clock(monkeypatch)
    monitor = TimeMonitor()
    clock.now += 2.0
    monitor.on_train_epoch_end(RunContext(CallbackParam(cur_step_num=4, batch_num=8)))
    assert capsys.readouterr().out == "epoch time: 2000.000 ms, per step time: 500.000 ms\n"


def test_time_monitor_data_size_must_be_none_or_a_positive_int():
    assert TimeMonitor(1).data_size == 1 and TimeMonitor(5).data_size == 5 and TimeMonitor().data_size is None
    for bad in (0, -2, True, 1.5, "3"):
        message = f"TimeMonitor: data_size must be None or an int >= 1, got {bad!r}"
        with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
            TimeMonitor(bad)
