"""Progress display and the JSON-lines metrics log of Model.train.

The progress bar uses tqdm (an optional dependency, ``pip install tqdm``) and is shown only
on an interactive terminal: logs redirected to a file stay free of carriage returns.

The metrics log (``Model.train(..., log_file=path)``) holds one JSON object per line,
written and flushed as training goes, so it can be followed (``tail -f``) and plotted
(``python -m minidl.plot path -o curve.png``) while training runs:

    {"epoch": 1, "step": 1, "loss": 2.3025854, "time": 1718000000.123}
    ...
    {"epoch": 1, "step": 32, "time": 1718000003.456, "epoch_time": 3.2, "eval": {"accuracy": 0.61}}

Step records have ``epoch`` (1-based), ``step`` (global, 1-based), ``loss`` and ``time``
(Unix seconds); the record closing an epoch has ``epoch_time`` (seconds) instead of
``loss``, and ``eval`` when the epoch was evaluated (``Model.fit``).
"""
import json
import math
import sys
import time

import numpy

from .callbacks import Callback, loss_value

__all__ = ["ProgressBar", "MetricsLogger", "tqdm_available", "use_progress_bar"]


def tqdm_available():
    """True when tqdm can be imported."""
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return False
    return True


def use_progress_bar(progress, stream=None):
    """Whether Model.train shows a bar: ``progress`` True / False, or None for automatic
    (stderr is a terminal and tqdm is installed)."""
    if progress is None:
        stream = sys.stderr if stream is None else stream
        isatty = getattr(stream, "isatty", None)
        return bool(isatty and isatty()) and tqdm_available()
    if not isinstance(progress, bool):
        raise TypeError(f"Model.train: progress must be None, True or False, got {progress!r}")
    if progress and not tqdm_available():
        raise ImportError("Model.train: progress=True needs tqdm: pip install tqdm (or pass progress=None to show a "
                          "bar only when tqdm is installed)")
    return progress


def _json_float(v):
    """A float that prints as the loss's own dtype does (2.3025854, not 2.3025853633880615)."""
    f = float(v)
    return float(str(v)) if math.isfinite(f) else f


def _jsonable(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return numpy.asarray(v).tolist()  # per-class metrics are arrays


class ProgressBar(Callback):
    """A tqdm bar per epoch with the latest loss (requires tqdm).

    Args:
        file: where the bar is drawn (default stderr).
        refresh_seconds: how often the loss shown is refreshed (reading it waits for the
            device, so not every step).
    """

    def __init__(self, file=None, refresh_seconds=0.5):
        super().__init__()
        from tqdm.auto import tqdm  # optional dependency: imported only when a bar is wanted
        self._tqdm = tqdm
        self._file = file
        self._refresh = refresh_seconds
        self._bar = None
        self._last = 0.0

    def on_train_epoch_begin(self, run_context):
        cb = run_context.original_args()
        done = cb.get("cur_step_in_epoch", 0) or 0
        self._bar = self._tqdm(total=cb.batch_num, initial=done, desc=f"epoch {cb.cur_epoch_num}/{cb.epoch_num}",
                               file=self._file, leave=True, dynamic_ncols=True)
        self._last = 0.0

    def on_train_step_end(self, run_context):
        if self._bar is None:
            return
        self._bar.update(1)
        now = time.monotonic()
        if now - self._last >= self._refresh:
            self._last = now
            loss = loss_value(run_context.original_args().net_outputs)
            if loss is not None:
                self._bar.set_postfix_str(f"loss={str(loss)}", refresh=False)

    def on_train_epoch_end(self, run_context):
        self._close()

    def on_train_end(self, run_context):
        self._close()

    def __exit__(self, *exc):
        self._close()
        return False

    def _close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class MetricsLogger(Callback):
    """Appends one JSON object per step (and per epoch) to a file, flushed line by line.

    Args:
        path: the log file.
        mode: "w" starts a new log, "a" appends (Model.train appends when resuming).
    """

    def __init__(self, path, mode="w"):
        super().__init__()
        if mode not in ("w", "a"):
            raise ValueError(f"MetricsLogger: mode must be 'w' or 'a', got {mode!r}")
        self.path = path
        self._mode = mode
        self._file = None
        self._epoch_start = None

    def __enter__(self):
        self._open()
        return self

    def __exit__(self, *exc):
        if self._file is not None:
            self._file.close()
            self._file = None
        return False

    def _open(self):
        if self._file is None:
            self._file = open(self.path, self._mode, encoding="utf-8")
            self._mode = "a"  # a second train() call continues the same log

    def _write(self, record):
        self._open()
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def on_train_epoch_begin(self, run_context):
        self._epoch_start = time.perf_counter()

    def on_train_step_end(self, run_context):
        cb = run_context.original_args()
        loss = loss_value(cb.net_outputs)
        self._write({"epoch": cb.cur_epoch_num, "step": cb.cur_step_num,
                     "loss": None if loss is None else _json_float(loss), "time": time.time()})

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        record = {"epoch": cb.cur_epoch_num, "step": cb.cur_step_num, "time": time.time(),
                  "epoch_time": time.perf_counter() - (self._epoch_start or time.perf_counter())}
        metrics = cb.get("metrics")
        if metrics:
            record["eval"] = {k: _jsonable(v) for k, v in metrics.items()}
        self._write(record)
