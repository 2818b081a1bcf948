"""Callbacks as MindSpore's: the Callback base, RunContext, LossMonitor and TimeMonitor.

``Model.train`` calls, on every callback, ``on_train_begin``, then per epoch
``on_train_epoch_begin``, per step ``on_train_step_begin`` / ``on_train_step_end``, then
``on_train_epoch_end``, and finally ``on_train_end``; ``Model.eval`` calls the ``on_eval_*``
family. Each receives a RunContext whose ``original_args()`` is the ``cb_params``: a dict
with attribute access holding ``cur_epoch_num`` (1-based), ``cur_step_num`` (global,
1-based), ``batch_num`` (steps per epoch), ``epoch_num``, ``net_outputs`` (the step's loss
Tensor), ``train_network``, ``optimizer``, ``loss_fn``, ``train_dataset`` ... A callback
stops training with ``run_context.request_stop()``: the current step finishes, then
``on_train_epoch_end`` and ``on_train_end`` still run.

As in MindSpore 2.x, the ``on_*`` methods default to MindSpore 1.x's names (``begin``,
``epoch_begin``, ``step_begin``, ``step_end``, ``epoch_end``, ``end``), so callbacks written
either way work. The built-in callbacks override the ``on_train_*`` names, so they stay
silent during ``Model.eval``.

Example:
    >>> class StopAt(Callback):
    ...     def on_train_step_end(self, run_context):
    ...         if run_context.original_args().cur_step_num == 10:
    ...             run_context.request_stop()
"""
import threading
import time
import weakref

import numpy

from ..backend import get_device_target
from ..runtime import get_runtime
from ..tensor import Tensor

__all__ = ["Callback", "RunContext", "CallbackParam", "CallbackList", "LossMonitor", "TimeMonitor", "loss_value"]

class Callback:
    """Base class of callbacks: override the hooks you need (all default to doing nothing).

    Callbacks are also context managers; ``Model.train`` enters them for the duration of
    training, so ``__enter__`` / ``__exit__`` can acquire and release resources.
    """

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    # MindSpore 1.x names.
    def begin(self, run_context):
        """Called once before training (and before evaluation)."""

    def epoch_begin(self, run_context):
        """Called before each epoch."""

    def epoch_end(self, run_context):
        """Called after each epoch."""

    def step_begin(self, run_context):
        """Called before each step."""

    def step_end(self, run_context):
        """Called after each step."""

    def end(self, run_context):
        """Called once after training (and after evaluation)."""

    # MindSpore 2.x names: each defaults to its 1.x counterpart.
    def on_train_begin(self, run_context):
        self.begin(run_context)

    def on_train_epoch_begin(self, run_context):
        self.epoch_begin(run_context)

    def on_train_epoch_end(self, run_context):
        self.epoch_end(run_context)

    def on_train_step_begin(self, run_context):
        self.step_begin(run_context)

    def on_train_step_end(self, run_context):
        self.step_end(run_context)

    def on_train_end(self, run_context):
        self.end(run_context)

    def on_eval_begin(self, run_context):
        self.begin(run_context)

    def on_eval_epoch_begin(self, run_context):
        self.epoch_begin(run_context)

    def on_eval_epoch_end(self, run_context):
        self.epoch_end(run_context)

    def on_eval_step_begin(self, run_context):
        self.step_begin(run_context)

    def on_eval_step_end(self, run_context):
        self.step_end(run_context)

    def on_eval_end(self, run_context):
        self.end(run_context)

    # minidl's addition: agreeing with the same callback on the other ranks. Model.train
    # gathers, in the one small exchange it makes when a parallel run starts, every callback's
    # plan, and hands each callback its counterparts' (the same class, in the same position
    # among those with a plan). A callback that must act with the other ranks (ModelCheckpoint:
    # one prefix for all, skip a save together) learns this way which ranks run it too, so a
    # callback that only rank 0 runs never waits for ranks that will not come.

    def _rank_plan(self, batch_num):
        """A small picklable value to share with the other ranks when training starts, or None
        (the default: nothing to share)."""
        return None

    def _adopt_rank_plans(self, plans):
        """Called before ``on_train_begin`` with every rank's plan from its counterpart of this
        callback, in rank order (None for a rank without one), or with None when nothing was
        exchanged (one process, or ranks that do not train in lockstep)."""


class CallbackParam(dict):
    """The ``cb_params`` dict, whose keys are also attributes (``cb_params.cur_step_num``)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"cb_params has no field {key!r}; fields: {sorted(self)}") from None

    def __setattr__(self, key, value):
        self[key] = value


class RunContext:
    """What a callback receives: the run's parameters and a way to stop it.

    Args:
        original_args: the cb_params dict.
    """

    def __init__(self, original_args):
        if not isinstance(original_args, dict):
            raise TypeError(f"RunContext: original_args must be a dict, got {type(original_args).__name__}")
        self._original_args = original_args
        self._stop_requested = False

    def original_args(self):
        """The cb_params (a dict with attribute access)."""
        return self._original_args

    def request_stop(self):
        """Asks the loop to stop after the current step (epoch end and train end still run)."""
        self._stop_requested = True

    def get_stop_requested(self):
        """True once some callback called request_stop()."""
        return self._stop_requested


_HOOKS = ("on_train_begin", "on_train_epoch_begin", "on_train_epoch_end", "on_train_step_begin", "on_train_step_end",
          "on_train_end", "on_eval_begin", "on_eval_epoch_begin", "on_eval_epoch_end", "on_eval_step_begin",
          "on_eval_step_end", "on_eval_end")


class CallbackList(Callback):
    """Runs several callbacks in order, as one (MindSpore's CallbackManager).

    Args:
        callbacks: None, a Callback, or a list/tuple of Callbacks.
    """

    def __init__(self, callbacks, who="Model"):
        if callbacks is None:
            callbacks = []
        elif isinstance(callbacks, Callback):
            callbacks = [callbacks]
        elif isinstance(callbacks, (list, tuple)):
            for i, cb in enumerate(callbacks):
                if not isinstance(cb, Callback):
                    raise TypeError(f"{who}: callbacks[{i}] must be a Callback, got {type(cb).__name__}")
            callbacks = list(callbacks)
        else:
            raise TypeError(f"{who}: callbacks must be a Callback or a list of Callbacks, got "
                            f"{type(callbacks).__name__}")
        self.callbacks = callbacks
        self._entered = []

    def __enter__(self):
        for cb in self.callbacks:
            cb.__enter__()
            self._entered.append(cb)
        return self

    def __exit__(self, *exc):
        while self._entered:
            self._entered.pop().__exit__(*exc)
        return False


def _dispatch(name):
    def hook(self, run_context):
        for cb in self.callbacks:
            getattr(cb, name)(run_context)
    hook.__name__ = name
    return hook


for _name in _HOOKS:
    setattr(CallbackList, _name, _dispatch(_name))


_last_read = threading.local()  # per thread: a threads world trains one rank per thread


def _read_once(loss):
    """``loss.asnumpy()``, read from the device once per step's loss Tensor.

    On the GPU each read is a host synchronisation; several callbacks read the same loss
    (LossMonitor, the log_file's MetricsLogger, the progress bar), and should cost one, not
    one each. Only the last Tensor read (in this thread) is remembered, with its array, so
    a Tensor whose ``data`` was replaced is read again (a step's loss is a fresh Tensor that
    nothing writes in place)."""
    if isinstance(loss.data, numpy.ndarray):  # on the CPU reading is free: nothing to remember
        return loss.asnumpy()
    last = getattr(_last_read, "entry", None)
    if last is not None and last[0]() is loss and last[1] is loss.data:
        return last[2]
    value = loss.asnumpy()
    _last_read.entry = (weakref.ref(loss), loss.data, value)
    return value


def loss_value(net_outputs):
    """The loss of a step as a NumPy scalar of the loss's dtype (so it prints as MindSpore's,
    e.g. ``2.3025854`` for float32), or None when the outputs hold no loss."""
    loss = net_outputs
    if isinstance(loss, (tuple, list)) and loss:
        loss = loss[0]
    if isinstance(loss, Tensor):
        loss = _read_once(loss)
    if isinstance(loss, numpy.ndarray) or isinstance(loss, numpy.generic):
        loss = numpy.asarray(loss)
        return loss.dtype.type(loss.mean()) if loss.size else None
    if isinstance(loss, (int, float)):
        return numpy.float64(loss)
    return None


def _print_line(line, rank0_only):
    """Prints one line of a built-in callback, as the active runtime's world needs it.

    The rank and world size are the runtime's now, not when the callback was built: the
    same callback may be made before the parallel context is set up. With ``rank0_only``
    rank 0 alone prints, unprefixed. Otherwise, with several ranks, every rank prints and
    says which it is (``[rank 1] ...``): under mpirun their lines interleave in one stream.
    One rank prints MindSpore's line as it is.
    """
    runtime = get_runtime()
    rank = runtime.rank()
    if rank0_only:
        if rank == 0:
            print(line, flush=True)
        return
    if runtime.group_size() > 1:
        line = f"[rank {rank}] {line}"
    print(line, flush=True)


def _check_rank0_only(who, rank0_only):
    if not isinstance(rank0_only, bool):
        raise TypeError(f"{who}: rank0_only must be True or False, got {rank0_only!r}")


class LossMonitor(Callback):
    """Prints ``epoch: E step: S, loss is L`` every ``per_print_times`` steps, and the
    evaluation metrics at an epoch's end when ``Model.fit`` computed them.

    S is the step within the epoch, as in MindSpore (the metrics log's ``step`` is the
    global step; its ``step_in_epoch`` is this S). In data-parallel training every rank
    prints its own (local) loss, as in MindSpore, each line prefixed with its rank
    (``[rank 1] epoch: 1 step: 3, loss is 2.30``) when there are several ranks;
    ``rank0_only=True`` keeps only rank 0's lines, unprefixed. The rank and world size are
    the active runtime's, asked at each print (see minidl/runtime.py). The NaN/inf check
    runs on every rank either way.

    Args:
        per_print_times: print every this many steps; 0 prints nothing.
        rank0_only: print only on rank 0 of the data-parallel world.

    Example:
        >>> model.train(2, ds, callbacks=[LossMonitor(per_print_times=10, rank0_only=True)])

    Raises:
        ValueError: at a step whose loss is NaN or infinite (training stops).
    """

    def __init__(self, per_print_times=1, rank0_only=False):
        super().__init__()
        if isinstance(per_print_times, bool) or not isinstance(per_print_times, int) or per_print_times < 0:
            raise ValueError(f"LossMonitor: per_print_times must be an int >= 0, got {per_print_times!r}")
        _check_rank0_only("LossMonitor", rank0_only)
        self.rank0_only = rank0_only
        self._per_print_times = per_print_times
        self._last_print_time = 0

    def on_train_begin(self, run_context):
        # Print at multiples of per_print_times, also when a resumed run starts mid-way.
        step = run_context.original_args().cur_step_num
        self._last_print_time = step - step % self._per_print_times if self._per_print_times else step

    def on_train_step_end(self, run_context):
        cb_params = run_context.original_args()
        loss = loss_value(cb_params.net_outputs)
        cur_step_in_epoch = cb_params.get("cur_step_in_epoch") or (cb_params.cur_step_num - 1) % cb_params.batch_num + 1
        if loss is not None and not numpy.isfinite(loss):
            hint = ""
            if get_device_target() == "GPU":
                hint = (" On the GPU a class label outside [0, classes) also gives a NaN loss (the range check "
                        "would cost a host synchronisation per step); set the environment variable "
                        "MINIDL_CHECK_LABELS=1 to check labels on the host: it raises naming the first bad one.")
            raise ValueError(f"epoch: {cb_params.cur_epoch_num} step: {cur_step_in_epoch}. "
                             f"Invalid loss {str(loss)}, terminating training.{hint}")
        if self._per_print_times and cb_params.cur_step_num - self._last_print_time >= self._per_print_times:
            self._last_print_time = cb_params.cur_step_num
            if get_runtime().reports_loss():  # (a pipeline's stages share one loss: one of them prints it)
                _print_line(f"epoch: {cb_params.cur_epoch_num} step: {cur_step_in_epoch}, loss is {str(loss)}",
                            self.rank0_only)

    def on_train_epoch_end(self, run_context):
        cb_params = run_context.original_args()
        metrics = cb_params.get("metrics")
        if metrics:
            _print_line(f"Eval result: epoch {cb_params.cur_epoch_num}, metrics: {metrics}", self.rank0_only)


class TimeMonitor(Callback):
    """Prints ``epoch time: T ms, per step time: t ms`` at the end of every epoch.

    Under data parallelism every rank prints its own times, prefixed with its rank
    (``[rank 1] epoch time: ...``) when there are several, as LossMonitor does;
    ``rank0_only=True`` keeps only rank 0's line, unprefixed.

    Args:
        data_size: steps per epoch, used only when the loop does not tell (MindSpore's
            argument; the loop always tells here). The per-step time divides by the number
            of steps actually run in the epoch (fewer after a resume or a stop).
        rank0_only: print only on rank 0 of the data-parallel world.
    """

    def __init__(self, data_size=None, rank0_only=False):
        super().__init__()
        if data_size is not None and (isinstance(data_size, bool) or not isinstance(data_size, int)
                                      or data_size < 1):
            raise ValueError(f"TimeMonitor: data_size must be None or an int >= 1, got {data_size!r}")
        _check_rank0_only("TimeMonitor", rank0_only)
        self.data_size = data_size
        self.rank0_only = rank0_only
        self.epoch_time = time.perf_counter()
        self._first_step = 0

    def on_train_epoch_begin(self, run_context):
        self.epoch_time = time.perf_counter()
        self._first_step = run_context.original_args().cur_step_num

    def on_train_epoch_end(self, run_context):
        epoch_ms = (time.perf_counter() - self.epoch_time) * 1000
        cb_params = run_context.original_args()
        steps = cb_params.cur_step_num - self._first_step
        if steps <= 0:
            steps = self.data_size or cb_params.get("batch_num") or 1
        _print_line(f"epoch time: {epoch_ms:5.3f} ms, per step time: {epoch_ms / steps:5.3f} ms", self.rank0_only)
