"""Progress display and the JSON-lines metrics log of Model.train.

The progress bar uses tqdm (an optional dependency, ``pip install tqdm``) and is shown only
on an interactive terminal: logs redirected to a file stay free of carriage returns.

The metrics log (``Model.train(..., log_file=path)``) holds one JSON object per line,
written and flushed as training goes, so it can be followed (``tail -f``) and plotted
(``python -m minidl.plot path -o curve.png``) while training runs:

    {"epoch": 1, "step": 1, "step_in_epoch": 1, "loss": 2.3025854, "time": 1718000000.123}
    ...
    {"epoch": 1, "step": 32, "step_in_epoch": 32, "time": 1718000003.456, "epoch_time": 3.2, "eval": {"accuracy": 0.61}}

Step records have ``epoch`` (1-based), ``step`` (the global step, 1-based, counted across
epochs: what ``python -m minidl.plot`` draws against), ``step_in_epoch`` (1-based, counted
within the epoch: the ``step: S`` that LossMonitor prints, as MindSpore's does), ``loss``
and ``time`` (Unix seconds); the record closing an epoch has ``epoch_time`` (seconds)
instead of ``loss``, and ``eval`` when the epoch was evaluated (``Model.fit``).

A log file has exactly one writer. Under data parallelism (``mpirun -n 8``, or the threads
world of tests) only rank 0 writes it, with rank 0's losses; a path holding ``{rank}``
(``log_file="train.{rank}.jsonl"``) gives every rank its own file instead. The rank is the
active runtime's (minidl/runtime.py), asked when the file is opened. The progress bar, too,
is drawn by rank 0 only.
"""
import json
import math
import os
import sys
import time

import numpy

from ..runtime import get_runtime
from .callbacks import Callback, loss_value

RANK_PLACEHOLDER = "{rank}"

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


def _step_in_epoch(cb):
    """The step within the epoch, as LossMonitor numbers it (0 at the end of an epoch that ran
    none, e.g. a rank with an empty shard under uneven_inputs)."""
    step = cb.get("cur_step_in_epoch")
    if step is None and cb.get("batch_num"):  # a loop other than Model's: derived as LossMonitor does
        step = (cb.cur_step_num - 1) % cb.batch_num + 1
    return step


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
        if get_runtime().rank() != 0:  # one bar for the whole job, not one per rank
            return
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

    Only rank 0 writes ``path`` (other ranks log nothing), unless ``path`` holds ``{rank}``:
    then each rank writes its own file, the placeholder replaced by its rank. The rank is
    the active runtime's when the file is opened, never the one at construction.

    Args:
        path: the log file (str or path-like); ``{rank}`` in it: one file per rank.
        mode: "w" starts a new log, "a" appends (Model.train appends when resuming).

    Example:
        >>> model.train(2, ds, log_file="train.jsonl")          # rank 0's log
        >>> model.train(2, ds, log_file="train.{rank}.jsonl")   # train.0.jsonl, train.1.jsonl, ...
    """

    def __init__(self, path, mode="w"):
        super().__init__()
        if mode not in ("w", "a"):
            raise ValueError(f"MetricsLogger: mode must be 'w' or 'a', got {mode!r}")
        try:
            path = os.fspath(path)
        except TypeError:
            raise TypeError(f"MetricsLogger: path must be a str or a path-like object, got {type(path).__name__}") \
                from None
        self.path = path
        self._mode = mode
        self._file = None
        self._writer = None  # whether this rank writes, decided when the file is opened
        self._epoch_start = None

    def __enter__(self):
        self._open()
        return self

    def __exit__(self, *exc):
        if self._file is not None:
            self._file.close()
            self._file = None
        self._writer = None
        return False

    def rank_path(self, rank):
        """The file rank ``rank`` writes, or None when it writes none."""
        if RANK_PLACEHOLDER in self.path:
            return self.path.replace(RANK_PLACEHOLDER, str(rank))
        return self.path if rank == 0 else None

    def _open(self):
        if self._writer is None:
            path = self.rank_path(get_runtime().rank())
            self._writer = path is not None
            if self._writer:
                self._file = open(path, self._mode, encoding="utf-8")
                self._mode = "a"  # a second train() call continues the same log

    def _write(self, record):
        self._open()
        if self._writer:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def on_train_epoch_begin(self, run_context):
        self._epoch_start = time.perf_counter()

    def on_train_step_end(self, run_context):
        self._open()
        if not self._writer:
            return  # reading the loss would wait for the device for nothing
        cb = run_context.original_args()
        loss = loss_value(cb.net_outputs)
        self._write({"epoch": cb.cur_epoch_num, "step": cb.cur_step_num, "step_in_epoch": _step_in_epoch(cb),
                     "loss": None if loss is None else _json_float(loss), "time": time.time()})

    def on_train_epoch_end(self, run_context):
        cb = run_context.original_args()
        record = {"epoch": cb.cur_epoch_num, "step": cb.cur_step_num, "step_in_epoch": _step_in_epoch(cb),
                  "time": time.time(),
                  "epoch_time": time.perf_counter() - (self._epoch_start or time.perf_counter())}
        metrics = cb.get("metrics")
        if metrics:
            record["eval"] = {k: _jsonable(v) for k, v in metrics.items()}
        self._write(record)
