"""Model.train's progress bar and metrics log, as a user sees them: when a bar is drawn (a
terminal, the ``progress`` option, tqdm missing), what it shows (the epoch's steps, the
latest loss, a resumed epoch's steps already run), and the log's records (fields, values,
NaN/inf, numpy scalars, arrays), its file's opening, appending and closing, and exceptions.

Tests with "by hand" in their names drive the callbacks as a training loop other than
Model's does (MindSpore's cb_params, without ``cur_step_in_epoch``)."""
import io
import json
import math
import os
import re
import sys
import time

import numpy as np
import pytest

from minidl import Tensor
from minidl.train import (Callback, CallbackList, CallbackParam, CheckpointConfig, LossMonitor, Model,
                          ModelCheckpoint, ProgressBar, RunContext, latest_checkpoint)
from minidl.train.progress import MetricsLogger, tqdm_available, use_progress_bar

from .helpers import StopAt, blobs, ce_loss, mlp, momentum, slices


class _Tty(io.StringIO):
    def isatty(self):
        return True


def _train(epochs=1, callbacks=None, **kw):
    x, y = blobs(n=12)
    net = mlp()
    Model(net, ce_loss(), momentum(net)).train(epochs, slices((x, y), ["x", "y"], 4), callbacks=callbacks, **kw)


def _by_hand(callbacks, losses, batch_num, **fields):
    """Runs the hooks of ``callbacks`` as a loop of one's own: a new epoch every ``batch_num``
    steps, step ``s`` (global, from 1) with loss ``losses[s - 1]``; ``fields`` go into cb_params."""
    cb = CallbackParam(epoch_num=-(-len(losses) // batch_num), batch_num=batch_num, cur_epoch_num=0, cur_step_num=0,
                       net_outputs=None, **fields)
    rc = RunContext(cb)
    with CallbackList(callbacks) as cbs:
        cbs.on_train_begin(rc)
        for step, loss in enumerate(losses, 1):
            if (step - 1) % batch_num == 0:
                cb.cur_epoch_num += 1
                cbs.on_train_epoch_begin(rc)
            cb.cur_step_num, cb.net_outputs = step, loss
            cbs.on_train_step_begin(rc)
            cbs.on_train_step_end(rc)
            if step % batch_num == 0 or step == len(losses):
                cbs.on_train_epoch_end(rc)
        cbs.on_train_end(rc)


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _closed_bars(text):
    """{epoch: (steps done, total, loss shown or None)} of the last line each epoch's bar drew."""
    bars = {}
    for line in re.split(r"[\r\n]", text):
        m = re.match(r"epoch (\d+)/\d+: .*\| *(\d+)/(\d+) \[[^]]*?(?:, loss=(\S+))?\]$", line.strip())
        if m:
            bars[int(m[1])] = (int(m[2]), int(m[3]), m[4])
    return bars


# ---- when a bar is drawn -------------------------------------------------------------------


def test_automatically_a_bar_is_drawn_on_a_terminal_only(monkeypatch):
    pytest.importorskip("tqdm")
    assert tqdm_available() is True
    monkeypatch.setattr(sys, "stderr", _Tty())
    assert use_progress_bar(None) is True                 # stderr by default
    assert use_progress_bar(None, io.StringIO()) is False  # the stream given, not stderr
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert use_progress_bar(None) is False
    assert use_progress_bar(None, _Tty()) is True
    assert use_progress_bar(None, object()) is False       # a stream without isatty is no terminal
    assert use_progress_bar(True) is True and use_progress_bar(False) is False


def test_without_tqdm_no_bar_is_drawn_and_progress_true_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # as if not installed
    assert tqdm_available() is False
    assert use_progress_bar(None, _Tty()) is False
    assert use_progress_bar(False) is False
    with pytest.raises(ImportError) as err:
        use_progress_bar(True)
    assert str(err.value) == ("Model.train: progress=True needs tqdm: pip install tqdm (or pass progress=None to "
                              "show a bar only when tqdm is installed)")


def test_model_train_draws_its_bar_on_stderr_when_progress_is_true(capsys):
    pytest.importorskip("tqdm")
    _train(progress=True)
    assert _closed_bars(capsys.readouterr().err)[1][:2] == (3, 3)
    _train(progress=False)
    _train(progress=None)  # pytest's stderr is no terminal
    assert capsys.readouterr().err == ""


# ---- what the bar shows --------------------------------------------------------------------


def test_the_bar_counts_each_epochs_steps_and_shows_the_loss_loss_monitor_printed(capsys):
    pytest.importorskip("tqdm")
    buf = io.StringIO()
    _train(2, callbacks=[LossMonitor(), ProgressBar(file=buf, refresh_seconds=0)])
    printed = re.findall(r"epoch: (\d+) step: \d+, loss is (\S+)", capsys.readouterr().out)
    last = dict((int(e), loss) for e, loss in printed)  # the last loss printed in each epoch
    assert _closed_bars(buf.getvalue()) == {1: (3, 3, last[1]), 2: (3, 3, last[2])}
    assert buf.getvalue().endswith("\n")  # closed: the next output starts on a line of its own


def test_a_resumed_epochs_bar_starts_at_the_steps_already_run(tmp_path):
    pytest.importorskip("tqdm")
    ckpt = ModelCheckpoint("m", str(tmp_path), CheckpointConfig(save_checkpoint_steps=100))
    _train(2, callbacks=[ckpt, StopAt(4)])  # stopped after epoch 2's first step
    buf = io.StringIO()
    _train(2, callbacks=ProgressBar(file=buf, refresh_seconds=0), resume_from=latest_checkpoint(str(tmp_path), "m"))
    text = buf.getvalue()
    assert "epoch 1/2" not in text
    first = next(line for line in re.split(r"[\r\n]", text) if line.strip())
    assert re.match(r"epoch 2/2: +33%\|.*\| 1/3 ", first)
    assert _closed_bars(text)[2][:2] == (3, 3)


def test_by_hand_the_bar_starts_at_zero_and_counts_to_the_epochs_steps():
    pytest.importorskip("tqdm")
    buf = io.StringIO()
    losses = [Tensor(np.float32(v)) for v in (0.5, 0.25, 0.125, 1.5)]
    _by_hand([ProgressBar(file=buf, refresh_seconds=0)], losses, batch_num=2)
    assert _closed_bars(buf.getvalue()) == {1: (2, 2, "0.25"), 2: (2, 2, "1.5")}


class _Clock(Callback):
    """Sets time.monotonic (what the bar measures its refresh interval with) before each step."""

    def __init__(self, monkeypatch, times):
        self.times = list(times)
        self.monkeypatch = monkeypatch

    def on_train_step_end(self, run_context):
        now = self.times.pop(0)
        self.monkeypatch.setattr(time, "monotonic", lambda: now)


@pytest.mark.parametrize("times, shown", [
    ([1.25], "0.5"),          # the first step of an epoch shows its loss, whatever the clock reads
    ([1.25, 1.5], "0.5"),     # 0.25 s later: not read again
    ([1.25, 1.75], "0.25"),   # refresh_seconds (0.5 by default) later: read again
    ([1.25, 1.5, 1.75], "0.125"),
])
def test_the_loss_shown_is_read_again_every_refresh_seconds(monkeypatch, times, shown):
    pytest.importorskip("tqdm")
    buf = io.StringIO()
    losses = [Tensor(np.float32(v)) for v in (0.5, 0.25, 0.125)][:len(times)]
    _by_hand([_Clock(monkeypatch, times), ProgressBar(file=buf)], losses, batch_num=len(times))
    assert _closed_bars(buf.getvalue())[1][2] == shown


def test_reading_the_loss_does_not_redraw_the_bar():
    """The bar is drawn at tqdm's pace (here: when it opens, and when it closes with the loss),
    not once more at every read of the loss."""
    pytest.importorskip("tqdm")
    buf = io.StringIO()
    _by_hand([ProgressBar(file=buf, refresh_seconds=0)], [Tensor(np.float32(0.5))], batch_num=1)
    assert buf.getvalue().count("loss=0.5") == 1


def test_under_a_bar_of_ones_own_each_epochs_bar_stays_on_screen():
    tqdm = pytest.importorskip("tqdm")
    buf = io.StringIO()
    with tqdm.tqdm(total=1, file=io.StringIO()):  # e.g. a bar over several runs
        _by_hand([ProgressBar(file=buf, refresh_seconds=0)], [Tensor(np.float32(0.5))], batch_num=1)
    assert _closed_bars(buf.getvalue()) == {1: (1, 1, "0.5")}
    assert buf.getvalue().endswith("\n")


def test_on_a_terminal_the_bar_keeps_to_its_width_when_it_is_resized():
    pytest.importorskip("tqdm")
    pty, fcntl, termios, select, struct = (pytest.importorskip(m) for m in ("pty", "fcntl", "termios", "select",
                                                                             "struct"))
    try:
        master, slave = pty.openpty()
    except OSError as e:
        pytest.skip(f"no pseudo-terminal here: {e}")

    def columns(n):
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, n, 0, 0))

    class Resize(Callback):
        def on_train_step_end(self, run_context):
            columns(40)

    columns(60)
    with os.fdopen(slave, "w", encoding="utf-8") as terminal:
        _by_hand([Resize(), ProgressBar(file=terminal, refresh_seconds=0)], [Tensor(np.float32(0.5))] * 2,
                 batch_num=2)
        out = b""
        while select.select([master], [], [], 0.5)[0]:
            out += os.read(master, 1 << 16)
    os.close(master)
    lines = [line.rstrip() for line in re.split(r"[\r\n]+", out.decode("utf-8")) if line.strip()]
    assert lines[-1].startswith("epoch 1/1: 100%") and " 2/2 " in lines[-1]
    assert len(lines[-1]) <= 40


def test_the_bar_is_closed_and_errors_go_through():
    pytest.importorskip("tqdm")

    class Fail(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == 2:
                raise RuntimeError("step 2 failed")

    buf = io.StringIO()
    with pytest.raises(RuntimeError, match="step 2 failed"):
        _train(2, callbacks=[ProgressBar(file=buf, refresh_seconds=0), Fail()])
    assert _closed_bars(buf.getvalue())[1][:2] == (2, 3) and buf.getvalue().endswith("\n")
    with pytest.raises(RuntimeError, match="raised in the block"):
        with ProgressBar(file=io.StringIO()):
            raise RuntimeError("raised in the block")


# ---- the metrics log -------------------------------------------------------------------------


def test_log_mode_must_be_w_or_a(tmp_path):
    with pytest.raises(ValueError, match=re.escape("MetricsLogger: mode must be 'w' or 'a', got 'x'")):
        MetricsLogger(tmp_path / "train.jsonl", mode="x")


def test_a_logger_starts_its_file_afresh_then_appends_the_next_runs(tmp_path):
    log = tmp_path / "train.jsonl"
    log.write_text('{"old": 1}\n')
    logger = MetricsLogger(log)
    _train(callbacks=logger)
    _train(callbacks=logger)  # the same logger again: continues its log
    assert [(r["step"], "loss" in r) for r in _records(log)] == [(1, True), (2, True), (3, True), (3, False)] * 2
    _train(callbacks=MetricsLogger(log, mode="a"))
    assert len(_records(log)) == 12


def test_the_log_keeps_the_steps_before_an_error_which_goes_through(tmp_path):
    log = tmp_path / "train.jsonl"

    class Fail(Callback):
        def on_train_step_end(self, run_context):
            if run_context.original_args().cur_step_num == 2:
                raise RuntimeError("step 2 failed")

    with pytest.raises(RuntimeError, match="step 2 failed"):
        _train(callbacks=[MetricsLogger(log), Fail()])
    assert [r["step"] for r in _records(log)] == [1, 2]
    logger = MetricsLogger(log)
    with pytest.raises(RuntimeError, match="raised in the block"):
        with logger:
            raise RuntimeError("raised in the block")
    logger.__exit__(None, None, None)  # closing again does nothing
    assert log.read_text() == ""


def test_epoch_records_hold_the_time_and_how_long_the_epoch_took(tmp_path):
    log = tmp_path / "train.jsonl"

    class Slow(Callback):
        def on_train_step_end(self, run_context):
            time.sleep(0.02)

    t0, p0 = time.time(), time.perf_counter()
    _train(2, callbacks=Slow(), log_file=str(log))
    t1, took = time.time(), time.perf_counter() - p0
    recs = _records(log)
    epochs = [r for r in recs if "epoch_time" in r]
    assert [set(r) for r in epochs] == [{"epoch", "step", "step_in_epoch", "time", "epoch_time"}] * 2
    assert all(0.06 <= r["epoch_time"] <= took for r in epochs)  # 3 steps of at least 20 ms
    assert all(t0 <= r["time"] <= t1 for r in recs)


def test_by_hand_losses_are_written_as_json_allows(tmp_path):
    log = tmp_path / "train.jsonl"
    losses = [Tensor(np.float32(2.3025854)), np.float16(0.1), np.float64(0.1), 3, Tensor(np.float32(np.nan)),
              np.float64(np.inf), -math.inf, None, (Tensor(np.float32(0.5)), Tensor(np.float32(7.0)))]
    with MetricsLogger(log) as logger:
        _by_hand([logger], losses, batch_num=len(losses))
    lines = log.read_text().splitlines()
    written = [re.search(r'"loss": ([^,]+),', line)[1] for line in lines[:-1]]
    assert written == ["2.3025854", "0.1", "0.1", "3.0", "NaN", "Infinity", "-Infinity", "null", "0.5"]
    assert str(_records(log)[4]["loss"]) == "nan"  # read back by json


def test_by_hand_the_step_in_epoch_is_loss_monitors(tmp_path, capsys):
    """A loop that gives no cur_step_in_epoch: worked out from the global step and batch_num,
    as LossMonitor prints it (3 steps an epoch)."""
    log = tmp_path / "train.jsonl"
    _by_hand([LossMonitor(), MetricsLogger(log)], [Tensor(np.float32(0.5))] * 7, batch_num=3)
    printed = re.findall(r"epoch: (\d+) step: (\d+),", capsys.readouterr().out)
    recs = _records(log)
    assert [(str(r["epoch"]), str(r["step_in_epoch"])) for r in recs if "loss" in r] == printed
    assert [r["step_in_epoch"] for r in recs] == [1, 2, 3, 3, 1, 2, 3, 3, 1, 1]
    with MetricsLogger(log) as logger:  # nor batch_num: no step in the epoch either
        logger.on_train_step_end(RunContext(CallbackParam(cur_epoch_num=1, cur_step_num=4, net_outputs=None)))
    assert [r["step_in_epoch"] for r in _records(log)] == [None]


def test_the_step_in_epoch_a_loop_gives_is_written_as_it_is(tmp_path):
    """Model's loop gives cur_step_in_epoch: 0 closes an epoch that ran no step (a rank's empty
    shard under uneven_inputs), though the global step is a multiple of batch_num."""
    log = tmp_path / "train.jsonl"
    rc = RunContext(CallbackParam(epoch_num=2, batch_num=3, cur_epoch_num=2, cur_step_num=3, cur_step_in_epoch=0,
                                  net_outputs=None))
    with MetricsLogger(log) as logger:
        logger.on_train_epoch_begin(rc)
        logger.on_train_epoch_end(rc)
        rc.original_args().update(cur_step_num=5, cur_step_in_epoch=1, net_outputs=Tensor(np.float32(0.5)))
        logger.on_train_step_end(rc)
    assert [(r["step"], r["step_in_epoch"]) for r in _records(log)] == [(3, 0), (5, 1)]


def test_eval_metrics_are_written_as_floats_and_per_class_lists(tmp_path):
    log = tmp_path / "train.jsonl"
    metrics = {"accuracy": np.float32(0.5), "seen": 12, "per_class": np.array([0.25, 0.75], np.float32),
               "nan": float("nan")}
    rc = RunContext(CallbackParam(epoch_num=1, batch_num=3, cur_epoch_num=1, cur_step_num=3, metrics=metrics))
    with MetricsLogger(log) as logger:
        logger.on_train_epoch_end(rc)
    assert '"seen": 12.0' in log.read_text() and '"nan": NaN' in log.read_text()
    ev = _records(log)[0]["eval"]
    assert {k: v for k, v in ev.items() if k != "nan"} == {"accuracy": 0.5, "seen": 12.0, "per_class": [0.25, 0.75]}
    assert math.isnan(ev["nan"])
