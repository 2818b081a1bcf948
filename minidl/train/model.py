"""Model: the one-call training loop (train / fit / eval / predict), as MindSpore's Model.

Each training step computes the loss (and the logits) with ``value_and_grad`` over
``optimizer.parameters``, passes the gradients through the model's grad reducer, and
applies ``optimizer(grads)``. With ``loss_fn`` None the network itself takes every column
of the dataset and returns the loss.

The grad reducer is where data-parallel training plugs in: a callable ``grads -> grads`` (a
tuple aligned with ``optimizer.parameters``) run between backward and the optimizer, e.g. an
all-reduce over ranks. ``Model(grad_reducer=...)`` sets it; otherwise the active runtime
(minidl/runtime.py) is asked for one at the start of every ``train`` / ``fit``, so a
parallel mode set after the Model was built takes effect; the local runtime gives none, and
the gradients pass unchanged. ``model.grad_reducer`` is the reducer of the latest run.

Two optional parts of a reducer's interface are used when present:
- ``ready(index, grad)`` and ``finish()``: the step hands each gradient to ``ready`` the
  moment backward finalises it (``value_and_grad(on_grad_ready=...)``), so a reducer can
  start all-reducing the last layers' buckets while backward still runs on the first
  ones; ``finish()`` then returns the reduced gradients for the optimizer. Without them the
  reducer is called once with every gradient after backward.
- ``parameter_broadcast`` (True) and ``broadcast_parameters(tensors)``: at the start of
  every ``train``/``fit`` without ``resume_from`` the network's parameters and the
  optimizer's state are overwritten with rank 0's, so all ranks start alike
  (``set_auto_parallel_context(parameter_broadcast=True)`` in minidl_parallel); a resumed
  run starts from each rank's own checkpoint instead (its BatchNorm statistics are its own).
- a reducer may return None: the step only accumulated gradients (e.g. gradient
  accumulation), and the optimizer does not run; and ``overflowed()`` True after a reduction
  (a 16-bit compressed sum out of range): the optimizer skips that step, with a warning.
- ``collective`` (True): every call communicates, so every rank must run as many steps (as
  under a runtime whose ``trains_in_lockstep()`` is True); ``join(optimizer)``: a context in
  which a rank whose data ended keeps taking part with zero gradients (``uneven_inputs``).

Mixed precision (MindSpore's ``amp_level`` and kwargs, its ``amp.build_train_network``): a level
other than "O0" casts the network in place with ``amp.auto_mixed_precision`` (keep_batchnorm_fp32
picks O2's or O3's casting for those two levels); the cast network's outputs, and so the loss, are
float32 at every level ("auto"'s output is cast to float32, as MindSpore's Model does). A loss scale manager (given, or O2's default ``DynamicLossScaleManager()``) makes the
training network a step cell, as the one built by hand: ``nn.TrainOneStepWithLossScaleCell(
nn.WithLossCell(cast net, loss_fn), optimizer, manager.get_update_cell())``, or for
``FixedLossScaleManager(drop_overflow_update=False)`` ``nn.TrainOneStepCell(..., sens=loss_scale)``
with the optimizer's ``loss_scale`` dividing it back. Such a Model trains that cell
(``model.train_network``), which asks the runtime for its reducer and agrees on overflow across
ranks by itself; eval and predict run the cast network.

Step counts: when steps communicate, ``train``/``fit`` first gather every rank's (epochs,
position, steps per epoch) through the runtime (one small exchange per run) and, by default,
raise on every rank naming each rank's count: a rank that ran out of batches first would
leave the others waiting forever. ``uneven_inputs=True`` trains each epoch inside the
reducer's join block instead (minidl_parallel/join.py): the ranks with data go on, the
finished ones contribute zero gradients.

Evaluation whose outputs live on some ranks only (a pipeline: the last stage holds the logits):
an eval network may define ``evaluation_layout()``, returning None (every rank holds its outputs) or
``(holds_outputs, replicas, replica)``: whether this rank's calls return the outputs (the others
return None), into how many data-parallel replicas the ranks split, and this rank's. ``eval`` then
updates the metrics on the ranks that hold the outputs (one per replica when the dataset is sharded
over the replicas, replica 0's alone when every replica reads it whole), the others keep zero
statistics, and the one sum over the ranks at the end gives every rank the totals
(minidl_parallel/pipeline/evaluation.py's PipelineEvalCell).

Example:
    >>> model = Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
    ...               nn.Momentum(net.trainable_params(), 0.1, 0.9), metrics={"accuracy"})
    >>> model.train(2, train_ds, callbacks=[LossMonitor(), ModelCheckpoint("net", "ckpt")])
    epoch: 1 step: 1, loss is 2.3025854
    ...
    >>> model.eval(test_ds)
    {'accuracy': 0.91}
"""
import inspect
import numbers
import warnings

import numpy

from ..amp.build import amp_networks, check_amp_arguments
from ..autograd import value_and_grad
from ..dataset import Dataset
from ..dataset.iterators import drop_padding
from ..runtime import get_runtime
from ..tensor import Tensor, no_grad
from .callbacks import CallbackList, CallbackParam, RunContext
from .checkpoint import ModelCheckpoint, restore_train_state
from .resize import check_keep_batch, resume_on_these_shards
from .restart import restart_checkpoint
from .metrics import Loss, get_metrics, has_statistics
from .progress import MetricsLogger, ProgressBar, use_progress_bar

__all__ = ["Model"]


def _is_cell(x):
    return callable(x) and hasattr(x, "parameters_and_names") and hasattr(x, "set_train")


def _is_optimizer(x):
    return callable(x) and hasattr(x, "parameters") and hasattr(x, "parameters_and_names")


def _step_optimizer(network):
    """The optimizer a network that is itself a training step holds (nn.TrainOneStepCell's
    ``optimizer``), or None."""
    optimizer = getattr(network, "optimizer", None)
    return optimizer if _is_optimizer(optimizer) else None


def _describe(out):
    if isinstance(out, Tensor):
        return f"a Tensor of shape {out.shape}"
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)} values"
    return f"a {type(out).__name__}"


def _missing_loss_fn(network, columns, why):
    """The error for Model(net, None, opt) whose network cannot take the dataset's columns: most
    often a loss_fn left out (Python alone says only 'construct() takes 2 positional arguments
    but 3 were given')."""
    name = type(network).__name__
    return TypeError(f"Model.train: loss_fn is None, so the network must take every column of the dataset "
                     f"({columns}) and return the loss itself, but {why}; pass loss_fn (e.g. Model(net, "
                     f"nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction='mean'), optimizer)), or a network "
                     f"whose construct(data, label) returns the loss (nn.WithLossCell(net, loss_fn), as in MindSpore) "
                     f"instead of {name}")


def _check_network_takes(network, cols):
    """Raises _missing_loss_fn when the network's construct cannot be called with len(cols)
    positional arguments; a signature that cannot be read is left to the call."""
    construct = getattr(network, "construct", None)
    try:
        signature = inspect.signature(construct)
    except (TypeError, ValueError):
        return
    try:
        signature.bind(*cols)
    except TypeError as exc:
        raise _missing_loss_fn(network, f"{len(cols)}: {cols}", f"{type(network).__name__}.construct{signature} "
                                                                f"cannot take them ({exc})") from None


def _as_tensor(x):
    return x if isinstance(x, Tensor) else Tensor(x)


def _keyed_callbacks(callbacks):
    """{(class name, occurrence): callback}: how a callback finds its counterpart on other ranks."""
    keyed, seen = {}, {}
    for cb in callbacks:
        name = f"{type(cb).__module__}.{type(cb).__qualname__}"
        seen[name] = seen.get(name, -1) + 1
        keyed[(name, seen[name])] = cb
    return keyed


class Model:
    """Trains, evaluates and predicts with a network.

    Args:
        network: the Cell to train; with loss_fn None it returns the loss itself.
        loss_fn: a loss Cell called as ``loss_fn(network(data), label)``, or None.
        optimizer: an Optimizer over the network's parameters (needed by train), or None
            when the network is a whole training step (``nn.TrainOneStepCell``, loss_fn None
            too): each step then calls it with every column, and it differentiates, reduces
            and updates by itself, as MindSpore's Model does.
        metrics: names ({"accuracy", "loss"}) or a dict name -> Metric, for eval.
        eval_network: a Cell used by eval instead of the default ``(loss, logits, label)``
            evaluation; called with every column of a row. It may define
            ``evaluation_layout()`` (see the module doc: a pipeline's outputs on its last stage).
        eval_indexes: with eval_network, the positions of (loss, logits, label) in its
            outputs; None passes all its outputs to every metric's update.
        amp_level: mixed precision, as MindSpore's: "O0" (default: none), "O1", "O2", "O3",
            "auto"; needs the optimizer. The network is cast in place (see the module doc).
        boost_level: MindSpore's boost mode; only "O0" (none) is built: "O1"/"O2" raise
            NotImplementedError.
        grad_reducer: ``grads -> grads``, run before the optimizer (see the module doc);
            None: the active runtime's, asked when training starts.
        **kwargs: MindSpore's ``loss_scale_manager`` (an ``amp.LossScaleManager`` or None; O2's
            default is ``amp.DynamicLossScaleManager()``, the other levels' None) and
            ``keep_batchnorm_fp32`` (a bool: BatchNorm and LayerNorm stay float32 at O2/O3;
            default True for O2, False for O3); ``boost_config_dict`` and ``acc_level`` (the
            older name of boost_level) are accepted, as MindSpore's.

    Raises:
        ValueError: an unknown kwarg (as MindSpore's), an unknown amp_level or boost_level,
            amp_level other than "O0" or a loss_scale_manager without an optimizer, an
            optimizer whose ``loss_scale`` does not match the manager's.
        NotImplementedError: boost_level "O1"/"O2".

    Example (mixed precision):
        >>> model = Model(net, loss_fn, nn.Momentum(net.trainable_params(), 0.1, 0.9), amp_level="O2",
        ...               loss_scale_manager=amp.DynamicLossScaleManager(2 ** 12, 2, 1000))
        >>> model.train(1, train_ds)  # float16 compute, float32 master weights, dynamic loss scale
    """

    def __init__(self, network, loss_fn=None, optimizer=None, metrics=None, eval_network=None, eval_indexes=None,
                 amp_level="O0", boost_level="O0", grad_reducer=None, **kwargs):
        if not _is_cell(network):
            raise TypeError(f"Model: network must be a Cell, got {type(network).__name__}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"Model: loss_fn must be a loss Cell (callable) or None, got {type(loss_fn).__name__}")
        if optimizer is not None and not _is_optimizer(optimizer):
            raise TypeError(f"Model: optimizer must be an Optimizer or None, got {type(optimizer).__name__}")
        if eval_network is not None and not callable(eval_network):
            raise TypeError(f"Model: eval_network must be a Cell or None, got {type(eval_network).__name__}")
        if eval_indexes is not None:
            if eval_network is None:
                raise ValueError("Model: eval_indexes needs eval_network")
            if (not isinstance(eval_indexes, (list, tuple)) or len(eval_indexes) != 3
                    or not all(isinstance(i, numbers.Integral) for i in eval_indexes)):
                raise ValueError(f"Model: eval_indexes must be 3 ints (positions of loss, logits, label in the "
                                 f"eval_network's outputs), got {eval_indexes!r}")
        self._metric_fns = get_metrics(metrics)
        if self._metric_fns and eval_network is None and loss_fn is None:
            raise ValueError("Model: metrics need either loss_fn (to evaluate network(data) against the label) or "
                             "eval_network; pass one, or no metrics")
        if grad_reducer is not None and not callable(grad_reducer):
            raise TypeError(f"Model: grad_reducer must be callable (grads -> grads) or None, got "
                            f"{type(grad_reducer).__name__}")
        self._boost_level = check_amp_arguments(amp_level, boost_level, kwargs)
        if optimizer is None and amp_level != "O0":
            raise ValueError(f"Model: amp_level {amp_level!r} needs the optimizer (mixed precision builds the training "
                             f"step around it), but optimizer is None; pass optimizer=, or amp_level='O0'")
        if optimizer is None and kwargs.get("loss_scale_manager") is not None:
            raise ValueError("Model: the argument 'optimizer' can not be None when set 'loss_scale_manager'")
        train_network = network
        if optimizer is not None and (amp_level != "O0" or kwargs.get("loss_scale_manager") is not None):
            network, train_network = amp_networks(network, loss_fn, optimizer, amp_level, kwargs)
        self._network = network  # what eval and predict run (cast in place for amp)
        self._train_network = train_network  # what a training step runs: the network, or a step cell
        self._loss_fn = loss_fn
        self._optimizer = optimizer
        # The training network is the whole step (it holds its optimizer; its reducer is its own).
        self._network_steps = train_network is not network or (
            optimizer is None and loss_fn is None and _step_optimizer(network) is not None)
        if self._network_steps and train_network is not network and grad_reducer is not None:
            train_network.grad_reducer = grad_reducer
        self._eval_network = eval_network
        self._eval_indexes = list(eval_indexes) if eval_indexes is not None else (
            [0, 1, 2] if eval_network is None else None)
        self._given_grad_reducer = grad_reducer
        self.grad_reducer = grad_reducer  # the reducer of the latest run (resolved when training starts)

    # ---- what MindSpore's Model exposes ------------------------------------------------------

    @property
    def train_network(self):
        """The network a training step runs: the network, or the step cell amp built (see the module doc)."""
        return self._train_network

    @property
    def predict_network(self):
        return self._network

    @property
    def eval_network(self):
        return self._eval_network

    @property
    def metrics(self):
        """The dict name -> Metric used by eval."""
        return self._metric_fns

    # ---- input checks --------------------------------------------------------------------------

    def _check_dataset(self, who, name, dataset, for_training, allow_empty=False):
        for method in ("get_dataset_size", "epoch_iterator", "get_col_names"):
            if not callable(getattr(dataset, method, None)):
                raise TypeError(f"Model.{who}: {name} must be a minidl.dataset Dataset (with get_dataset_size, "
                                f"epoch_iterator, get_col_names), got {type(dataset).__name__}")
        cols = list(dataset.get_col_names())
        needs_pair = self._loss_fn is not None if for_training else self._eval_network is None
        if needs_pair and len(cols) != 2:
            why = "loss_fn is given" if for_training else "the default evaluation is used"
            alternative = "loss_fn=None and a network taking every column" if for_training else "eval_network="
            raise ValueError(f"Model.{who}: {name} must yield 2 columns (data, label) since {why}, got {len(cols)} "
                             f"column(s) {cols}; build the dataset with those two columns, or pass {alternative}")
        size = dataset.get_dataset_size()
        if not isinstance(size, numbers.Integral) or size < 0 or (size == 0 and not allow_empty):
            raise ValueError(f"Model.{who}: {name} is empty (get_dataset_size() returned {size!r}); "
                             f"check its source, sharding and batch(drop_remainder=...)")
        return int(size), len(cols)

    @staticmethod
    def _check_epoch(epoch):
        if isinstance(epoch, bool) or not isinstance(epoch, numbers.Integral) or epoch <= 0:
            raise ValueError(f"Model.train: epoch must be an int >= 1, got {epoch!r}")
        return int(epoch)

    # ---- one step ------------------------------------------------------------------------------

    def _build_step(self):
        net, loss_fn, who = self._network, self._loss_fn, "Model.train"
        if self._network_steps:
            net = self._train_network
            def network_step(row):
                out = net(*row)
                loss = out[0] if isinstance(out, (tuple, list)) and out else out  # (loss, grads) with return_grad
                if not isinstance(loss, Tensor) or loss.size != 1:
                    raise ValueError(f"{who}: the training-step network {type(net).__name__} must return the loss "
                                     f"as a scalar Tensor, but it returned {_describe(out)}")
                return loss.detach()
            return network_step

        def scalar(loss, what, hint):
            if not isinstance(loss, Tensor) or loss.size != 1:
                raise ValueError(f"{who}: {what} must return the loss as a scalar Tensor, but it returned "
                                 f"{_describe(loss)}; {hint}")
            return loss

        if loss_fn is None:
            def forward(*columns):
                try:
                    out = net(*columns)
                except TypeError as exc:
                    # A construct(*inputs) passes the check in _run and fails inside instead, when
                    # it hands data and label on to a layer that takes one input.
                    if "positional argument" not in str(exc):
                        raise
                    raise _missing_loss_fn(net, f"{len(columns)} of them", f"calling it with them raised "
                                                                             f"TypeError: {exc}") from exc
                loss = out[0] if isinstance(out, (tuple, list)) and out else out
                scalar(loss, "since loss_fn is None, the network",
                       "pass loss_fn= (e.g. nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction='mean'))")
                return loss, None
        else:
            def forward(data, label):
                logits = net(data)
                loss = scalar(loss_fn(logits, label), "loss_fn", "use a loss with reduction='mean' or 'sum'")
                return loss, logits

        reducer = self.grad_reducer
        if not (callable(getattr(reducer, "ready", None)) and callable(getattr(reducer, "finish", None))):
            grad_fn = value_and_grad(forward, None, self._optimizer.parameters, has_aux=True)

            def step(row):
                (loss, _), grads = grad_fn(*row)
                if reducer is not None:
                    grads = reducer(grads)
                self._apply(grads, reducer)
                return loss.detach()
            return step

        fired = []

        def on_grad_ready(index, grad):
            fired.append(index)
            reducer.ready(index, grad)

        overlapped_fn = value_and_grad(forward, None, self._optimizer.parameters, has_aux=True,
                                       on_grad_ready=on_grad_ready)

        def overlapped_step(row):
            fired.clear()
            (loss, _), grads = overlapped_fn(*row)
            # A loss that reaches no parameter fires nothing: reduce the (zero) gradients as a whole
            # so every rank still runs the same collectives.
            grads = reducer.finish() if fired else reducer(grads)
            self._apply(grads, reducer)
            return loss.detach()
        return overlapped_step

    def _apply(self, grads, reducer):
        """The optimizer's update, unless the reducer only accumulated (None) or its reduction
        overflowed (see the module doc)."""
        if grads is None:
            return
        overflowed = getattr(reducer, "overflowed", None)
        if overflowed is not None and overflowed():
            warnings.warn("Model.train: the reduced gradients hold inf or NaN (a compressed 16-bit sum out of range, "
                          "or a non-finite gradient on some rank); the optimizer skips this step. With fp16, "
                          "gradient_predivide_factor=<ranks> or gradient_compression='bf16' keeps sums in range",
                          RuntimeWarning, stacklevel=3)
            return
        self._optimizer(grads)

    def _resolve_grad_reducer(self):
        """The given reducer, else the active runtime's for the optimizer's parameters (or None)."""
        if self._given_grad_reducer is not None:
            return self._given_grad_reducer
        if self._network_steps:
            return None  # the step network asks the runtime itself
        reducer = get_runtime().grad_reducer(self._optimizer.parameters)
        if reducer is not None and not callable(reducer):
            raise TypeError(f"Model.train: the runtime's grad reducer must be callable (grads -> grads), got "
                            f"{type(reducer).__name__}")
        return reducer

    def _broadcast_parameters(self):
        reducer = self.grad_reducer
        if not getattr(reducer, "parameter_broadcast", False):
            return
        broadcast = getattr(reducer, "broadcast_parameters", None)
        if not callable(broadcast):
            raise TypeError(f"Model.train: the grad reducer asks for parameter_broadcast but has no "
                            f"broadcast_parameters(tensors) method ({type(reducer).__name__})")
        tensors = [p for _, p in self._network.parameters_and_names()]
        if self._optimizer is not None:
            tensors += [p for _, p in self._optimizer.parameters_and_names()]
        broadcast(tensors)

    # ---- training ------------------------------------------------------------------------------

    def train(self, epoch, train_dataset, callbacks=None, dataset_sink_mode=False, resume_from=None, log_file=None,
              progress=None, uneven_inputs=False, keep_batch="global"):
        """Trains for ``epoch`` epochs (in total, counting those a resumed checkpoint did).

        Args:
            epoch: number of epochs (>= 1).
            train_dataset: a minidl.dataset Dataset yielding (data, label) rows (batches), or
                the network's inputs when loss_fn is None.
            callbacks: a Callback or a list of them.
            dataset_sink_mode: accepted for MindSpore compatibility; data is always fed
                step by step here.
            resume_from: a checkpoint written by ModelCheckpoint: parameters, optimizer
                state, position and random state are restored, and training continues
                after its last step (on CPU bit-identically to a run never interrupted). One
                written with another number of shards continues as ``keep_batch`` says. Under a
                restarting launcher (``MINIDL_RESTART_COUNT`` > 0) with a
                ModelCheckpoint among the callbacks, None means the newest checkpoint every rank
                of the job has whole (minidl/train/restart.py).
            log_file: path of a JSON-lines metrics log (appended to when resuming), written by
                rank 0 alone under data parallelism; ``{rank}`` in the path gives every rank
                its own file instead (see :class:`~minidl.train.progress.MetricsLogger`).
            progress: True / False for a tqdm progress bar; None: only on a terminal.
            uneven_inputs: under data parallelism, ranks whose datasets yield different numbers
                of batches train together: each epoch lasts as long as the longest rank's, the
                ranks that finished contribute zero gradients (the mean still divides by the
                world size) and apply the same update, so every rank ends with the same
                parameters. False (default): differing step counts raise on every rank at the
                start. Not supported with tensor parallelism or SyncBatchNorm (see
                minidl_parallel/join.py).
            keep_batch: what a resume with another number of shards of train_dataset keeps (an
                elastic restart): "global" (default) resizes the dataset's last ``.batch`` so
                that the global batch, and so the steps per epoch and the rows of each step, are
                the checkpoint's; "per_rank" keeps each rank's batch, and the epoch in progress
                continues at the same share of its steps (minidl/train/resize.py).
        """
        self._run(epoch, train_dataset, None, 1, callbacks, dataset_sink_mode, resume_from, log_file, progress,
                  uneven_inputs, keep_batch)

    def fit(self, epoch, train_dataset, valid_dataset=None, valid_frequency=1, callbacks=None,
            dataset_sink_mode=False, resume_from=None, log_file=None, progress=None, uneven_inputs=False,
            keep_batch="global"):
        """Trains as ``train`` and evaluates on ``valid_dataset`` every ``valid_frequency``
        epochs (and after the last); results go to ``cb_params.metrics`` (LossMonitor prints
        them, the metrics log records them)."""
        if valid_dataset is not None:
            if not self._metric_fns:
                raise ValueError("Model.fit: valid_dataset needs metrics; pass metrics= to Model")
            self._check_dataset("fit", "valid_dataset", valid_dataset, for_training=False)
        if isinstance(valid_frequency, bool) or not isinstance(valid_frequency, int) or valid_frequency < 1:
            raise ValueError(f"Model.fit: valid_frequency must be an int >= 1, got {valid_frequency!r}")
        self._run(epoch, train_dataset, valid_dataset, valid_frequency, callbacks, dataset_sink_mode, resume_from,
                  log_file, progress, uneven_inputs, keep_batch)

    def _run(self, epoch, dataset, valid_dataset, valid_frequency, callbacks, dataset_sink_mode, resume_from,
             log_file, progress, uneven_inputs, keep_batch):
        epoch = self._check_epoch(epoch)
        if not isinstance(uneven_inputs, bool):
            raise TypeError(f"Model.train: uneven_inputs must be a bool, got {uneven_inputs!r}")
        check_keep_batch(keep_batch, "Model.train")
        optimizer = _step_optimizer(self._train_network) if self._network_steps else self._optimizer
        if optimizer is None:
            step_hint = ("" if self._loss_fn is not None else ", or a training-step network "
                         "(nn.TrainOneStepCell(nn.WithLossCell(net, loss_fn), optimizer))")
            raise ValueError(f"Model.train: an optimizer is needed to train; pass optimizer= to Model{step_hint}")
        if not isinstance(dataset_sink_mode, bool):
            raise TypeError(f"Model.train: dataset_sink_mode must be a bool, got {dataset_sink_mode!r}")
        # Several ranks: an empty shard is reported after the step counts are agreed, on every
        # rank (raising here, on its rank alone, would leave the others waiting for it).
        several = get_runtime().group_size() > 1
        batch_num, _ = self._check_dataset("train", "train_dataset", dataset, for_training=True, allow_empty=several)
        if self._loss_fn is None:
            _check_network_takes(self._network, list(dataset.get_col_names()))
        cbs = CallbackList(callbacks, "Model.train")
        if resume_from is None:  # restarted by a launcher: from the newest checkpoint every rank has whole
            resume_from = _restart_checkpoint(cbs.callbacks)
        extra = []
        if log_file is not None:
            extra.append(MetricsLogger(log_file, mode="a" if resume_from is not None else "w"))
        if use_progress_bar(progress):
            extra.append(ProgressBar())
        cbs.callbacks = cbs.callbacks + extra

        start_epoch, skip, global_step = 0, 0, 0
        if resume_from is not None:
            pos = restore_train_state(resume_from, self._train_network, optimizer)
            start_epoch, global_step = pos.epoch, pos.global_step
            batch_num, skip = resume_on_these_shards(resume_from, pos, dataset, batch_num, get_runtime().group_size(),
                                                     keep_batch)
        self.grad_reducer = self._resolve_grad_reducer()
        joined = self._agree_on_steps(epoch, start_epoch, skip, batch_num, uneven_inputs, cbs.callbacks)
        if batch_num == 0 and not joined:
            self._check_dataset("train", "train_dataset", dataset, for_training=True)  # raises: empty
        if resume_from is None:
            # A resumed run restored every rank's own state (per-rank checkpoints hold each
            # rank's BatchNorm statistics): broadcasting rank 0's would undo that.
            self._broadcast_parameters()

        cb_params = CallbackParam(
            train_network=self._train_network, network=self._network, optimizer=optimizer, loss_fn=self._loss_fn,
            train_dataset=dataset, valid_dataset=valid_dataset, epoch_num=epoch, batch_num=batch_num,
            cur_epoch_num=start_epoch, cur_step_num=global_step, cur_step_in_epoch=skip, net_outputs=None,
            dataset_sink_mode=dataset_sink_mode, mode="train", list_callback=cbs, metrics=None, eval_results=None)
        run_context = RunContext(cb_params)
        step = self._build_step()
        self._train_network.set_train(True)
        with cbs:
            cbs.on_train_begin(run_context)
            for ep in range(start_epoch, epoch):
                cb_params.cur_epoch_num = ep + 1
                cb_params.cur_step_in_epoch = skip if ep == start_epoch else 0
                cb_params.metrics = None
                cbs.on_train_epoch_begin(run_context)
                if joined:
                    with self.grad_reducer.join(self._optimizer):
                        self._run_epoch(dataset, ep, cb_params.cur_step_in_epoch, step, cbs, run_context)
                else:
                    self._run_epoch(dataset, ep, cb_params.cur_step_in_epoch, step, cbs, run_context)
                stopped = run_context.get_stop_requested()
                if valid_dataset is not None and not stopped and ((ep + 1) % valid_frequency == 0 or ep + 1 == epoch):
                    cb_params.metrics = cb_params.eval_results = self._evaluate(valid_dataset, None)
                    self._train_network.set_train(True)
                cbs.on_train_epoch_end(run_context)
                if run_context.get_stop_requested():
                    break
            cbs.on_train_end(run_context)

    def _agree_on_steps(self, epoch, start_epoch, skip, batch_num, uneven_inputs, callbacks):
        """Checks that the ranks will run the same steps; returns whether epochs run in join blocks.

        Only when training steps communicate (the runtime trains in lockstep, or the grad
        reducer is collective) and there are several ranks: then every rank gathers every
        rank's plan (one small exchange) and raises alike. The same exchange carries the
        callbacks' plans (``Callback._rank_plan``), handed back to them before training.
        """
        runtime = get_runtime()
        reducer = self.grad_reducer
        if runtime.group_size() <= 1 or not (runtime.trains_in_lockstep() or getattr(reducer, "collective", False)):
            for cb in callbacks:
                cb._adopt_rank_plans(None)
            return False
        keyed = _keyed_callbacks(callbacks)
        mine = {"epochs": epoch, "start epoch": start_epoch, "skipped steps": skip, "steps per epoch": batch_num,
                "uneven_inputs": uneven_inputs}
        gathered = runtime.gather((mine, {key: cb._rank_plan(batch_num) for key, cb in keyed.items()}))
        plans = [plan for plan, _ in gathered]
        for key, cb in keyed.items():
            cb._adopt_rank_plans([callback_plans.get(key) for _, callback_plans in gathered])
        ranks = "; ".join(f"rank {r}: {plan}" for r, plan in enumerate(plans))
        for key in ("uneven_inputs", "epochs", "start epoch"):
            if any(plan[key] != plans[0][key] for plan in plans):
                raise ValueError(f"Model.train: the ranks disagree on {key} ({ranks}); every rank must call train "
                                 f"with the same epoch, resume_from and uneven_inputs")
        counts = [plan["steps per epoch"] for plan in plans]
        skips = [plan["skipped steps"] for plan in plans]
        if not uneven_inputs and (any(c != counts[0] for c in counts) or any(s != skips[0] for s in skips)):
            each = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
            what = f"the ranks' train_dataset yield different numbers of steps per epoch ({each})"
            if all(c == counts[0] for c in counts):
                what = ("the ranks resume at different steps of the epoch (" +
                        ", ".join(f"rank {r}: {s}" for r, s in enumerate(skips)) + ")")
            raise ValueError(f"Model.train: {what}; every step all-reduces gradients over all ranks, so the ranks "
                             f"that run out first would leave the others waiting. Give every rank as many batches "
                             f"(shard with num_shards=get_group_size(), shard_id=get_rank() and "
                             f"batch(..., drop_remainder=True)), or pass uneven_inputs=True to train on with the "
                             f"ranks that still have data (the finished ones contribute zero gradients)")
        if not uneven_inputs:
            return False
        if self._network_steps:
            # A rank whose data ended would have to stand in for the step cell, which also sums the
            # overflow flag of a loss-scale step over the ranks: the join block covers Model's own step only.
            raise ValueError(f"Model.train: uneven_inputs=True is not supported when the training network is a step "
                             f"cell ({type(self._train_network).__name__}: Model(train_cell), or a loss_scale_manager); "
                             f"give every rank as many batches")
        if runtime.placing.intercepts_ops or not callable(getattr(reducer, "join", None)):
            raise ValueError(f"Model.train: uneven_inputs=True needs data parallelism (a grad reducer with a join "
                             f"block, such as DistributedGradReducer), but the runtime {runtime.placing!r} gives "
                             f"{type(reducer).__name__}; in tensor-parallel modes every operator communicates, "
                             f"which a rank without data cannot stand in for")
        return True

    def _run_epoch(self, dataset, ep, skip, step, cbs, run_context):
        cb_params = run_context.original_args()
        n_cols = len(dataset.get_col_names())
        it = dataset.epoch_iterator(ep, skip_batches=skip, output_numpy=False)
        try:
            for row in it:
                row = tuple(_as_tensor(x) for x in (row if isinstance(row, (tuple, list)) else (row,)))
                if len(row) != n_cols:
                    raise ValueError(f"Model.train: train_dataset yielded a row of {len(row)} column(s), but "
                                     f"get_col_names() lists {n_cols}")
                cb_params.cur_step_num += 1
                cb_params.cur_step_in_epoch += 1
                cbs.on_train_step_begin(run_context)
                cb_params.net_outputs = step(row)
                cbs.on_train_step_end(run_context)
                if run_context.get_stop_requested():
                    break
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()  # stops the dataset's prefetch threads when leaving early

    # ---- evaluation ----------------------------------------------------------------------------

    def eval(self, valid_dataset, callbacks=None, dataset_sink_mode=False):
        """Evaluates the metrics over one pass of ``valid_dataset`` (inference mode, no grad).

        Under data parallelism a dataset sharded over the ranks (``num_shards=get_group_size(),
        shard_id=get_rank()``) is evaluated as one: each rank runs its shard, the metrics'
        statistics (minidl/train/metrics.py) are added over the ranks once, at the end, and
        every rank returns the whole dataset's values. The rows that "pad" sharding repeats are
        left out, so each row counts once, exactly as in one process. A dataset that every rank
        reads whole is evaluated by each rank on its own, without communicating.

        Returns:
            dict metric name -> value.

        Raises:
            ValueError: the dataset is split into a number of shards other than the number
                of ranks, or two ranks read the same shard.
            TypeError: a metric without statistics in a sharded evaluation.
        """
        if not self._metric_fns:
            raise ValueError("Model.eval: no metrics to evaluate; pass metrics= (e.g. {'accuracy'}) to Model")
        # In a sharded evaluation a rank's shard may be empty ("exact" mode, fewer rows than
        # ranks): that rank still adds its (zero) statistics, or the others would wait for it.
        if not (self._sums_over_ranks(valid_dataset) and valid_dataset.get_dataset_size() == 0):
            self._check_dataset("eval", "valid_dataset", valid_dataset, for_training=False)
        return self._evaluate(valid_dataset, callbacks)

    def _evaluate(self, dataset, callbacks):
        summed = self._sums_over_ranks(dataset)
        layout = self._evaluation_layout()
        # Under a layout only the ranks holding the outputs update the metrics, and of those, when
        # every replica reads the whole dataset, replica 0's alone: each row is counted once in the sum.
        counts = layout is None or (layout[0] and (getattr(dataset, "num_shards", 1) > 1 or layout[2] == 0))
        cbs = CallbackList(callbacks, "Model.eval")
        batch_num = dataset.get_dataset_size()
        cb_params = CallbackParam(eval_network=self._eval_network or self._network, network=self._network,
                                  valid_dataset=dataset, batch_num=batch_num, epoch_num=1, cur_epoch_num=1,
                                  cur_step_num=0, net_outputs=None, mode="eval", list_callback=cbs, metrics=None)
        run_context = RunContext(cb_params)
        for m in self._metric_fns.values():
            m.clear()
        self._network.set_train(False)
        if self._eval_network is not None and hasattr(self._eval_network, "set_train"):
            self._eval_network.set_train(False)
        # minidl's datasets mark the rows that "pad" sharding repeats, which are left out, and
        # tell a batch (rows counted) from a row (1); a dataset with only the contract's methods
        # is read as before, a batch's rows counted along axis 0 of its first column.
        marked = isinstance(dataset, Dataset)
        with cbs, no_grad():
            cbs.on_eval_begin(run_context)
            cbs.on_eval_epoch_begin(run_context)
            if marked:
                it = dataset.epoch_iterator(0, skip_batches=0, output_numpy=True, with_validity=True)
            else:
                it = dataset.epoch_iterator(0, skip_batches=0, output_numpy=False)
            try:
                for item in it:
                    if marked:
                        row, rows = drop_padding(*item)
                        if rows == 0:  # a batch of repeats only: nothing to count
                            continue
                    else:
                        row, rows = item, None
                    row = tuple(_as_tensor(x) for x in (row if isinstance(row, (tuple, list)) else (row,)))
                    if rows is None:
                        rows = int(row[0].shape[0]) if row and row[0].ndim else 1
                    cb_params.cur_step_num += 1
                    cbs.on_eval_step_begin(run_context)
                    outputs = self._eval_outputs(row)
                    cb_params.net_outputs = outputs
                    if counts:
                        self._update_metrics(outputs, rows)
                    cbs.on_eval_step_end(run_context)
                    if run_context.get_stop_requested():
                        break
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            results = self._metric_values(dataset, summed, layout)
            cb_params.metrics = results
            cbs.on_eval_epoch_end(run_context)
            cbs.on_eval_end(run_context)
        return results

    def _sums_over_ranks(self, dataset):
        """Whether the ranks' statistics must be added up: they evaluate disjoint shards of
        ``dataset``, or the eval network's outputs live on some ranks only (its layout).

        Decided from the dataset's own sharding and the layout, checked before any batch so that
        every rank raises alike instead of some waiting in the collective.
        """
        num_shards = getattr(dataset, "num_shards", 1)
        size = get_runtime().group_size()
        layout = self._evaluation_layout()
        if layout is not None:  # outputs on some ranks only: always summed (see the module doc)
            replicas = layout[1]
            if num_shards > 1 and num_shards != replicas:
                raise ValueError(f"Model.eval: the dataset is split into num_shards={num_shards} shards, but the eval "
                                 f"network {type(self._eval_network).__name__} runs {replicas} data-parallel "
                                 f"replica(s) of {size} ranks; shard it with num_shards={replicas} and each rank's "
                                 f"replica as shard_id (every rank of a replica reads the same shard), or not at all")
            how, instead = "an evaluation whose outputs live on some ranks (a pipeline's last stage)", ""
        else:
            if size <= 1 or num_shards <= 1:
                return False  # one process, or every rank reads (and evaluates) the whole dataset
            if num_shards != size:
                raise ValueError(f"Model.eval: the dataset is split into num_shards={num_shards} shards, but the "
                                 f"runtime has group_size()={size} ranks; shard it with num_shards=get_group_size(), "
                                 f"shard_id=get_rank() (each rank evaluates its shard and the results are combined), "
                                 f"or not at all (each rank evaluates every row)")
            how, instead = "a sharded evaluation", ", or evaluate a dataset every rank reads whole"
        missing = [f"{name!r} ({type(m).__name__})" for name, m in self._metric_fns.items() if not has_statistics(m)]
        if missing:
            raise TypeError(f"Model.eval: metric {', '.join(missing)} cannot be combined over the {size} ranks of "
                            f"{how}: it defines no statistics() and finish(statistics) (see "
                            f"minidl.train.metrics.Metric); define them{instead}")
        return True

    def _evaluation_layout(self):
        """The eval network's ``evaluation_layout()`` (see the module doc), or None."""
        ask = getattr(self._eval_network, "evaluation_layout", None)
        layout = ask() if callable(ask) else None
        if layout is not None and not (isinstance(layout, tuple) and len(layout) == 3
                                       and all(isinstance(v, numbers.Integral) for v in layout[1:])
                                       and 0 <= layout[2] < layout[1]):
            raise TypeError(f"Model.eval: {type(self._eval_network).__name__}.evaluation_layout() must return None or "
                            f"(holds_outputs, replicas, replica) with 0 <= replica < replicas, got {layout!r}")
        return layout

    def _metric_values(self, dataset, summed, layout=None):
        if not summed:
            return {name: m.eval() for name, m in self._metric_fns.items()}
        names = list(self._metric_fns)
        stats = [numpy.asarray(self._metric_fns[name].statistics(), dtype=numpy.float64).ravel() for name in names]
        if layout is not None:
            return self._layout_values(dataset, layout, names, stats)
        # One collective, after the loop, so that ranks with different numbers of batches meet
        # exactly once. A one-hot of shard_id rides along: the sums show whether every shard
        # was read by exactly one rank (two ranks reading one shard would count its rows twice).
        num_shards = dataset.num_shards
        read = numpy.zeros(num_shards)
        read[dataset.shard_id] = 1.0
        total = numpy.asarray(get_runtime().sum_over_ranks(numpy.concatenate([read] + stats)))
        readers = total[:num_shards]
        if not (readers == 1).all():
            raise ValueError(f"Model.eval: each of the {num_shards} shards must be read by exactly one rank, but "
                             f"the ranks read them {readers.astype(int).tolist()} times (by shard_id); pass "
                             f"shard_id=get_rank()")
        results, at = {}, num_shards
        for name, part in zip(names, stats):
            results[name] = self._metric_fns[name].finish(total[at:at + part.size])
            at += part.size
        return results

    def _layout_values(self, dataset, layout, names, stats):
        """``_metric_values`` under an eval network's layout: the ranks that did not count add zeros."""
        num_shards = getattr(dataset, "num_shards", 1)
        _, replicas, replica = layout
        # With a sharded dataset every rank (all of a replica's, not only the counting one) adds a one-hot
        # of (its replica, its shard_id): the sums show each replica's ranks reading one shard together
        # (a stage reading another shard would pair one shard's data with another's labels) and each
        # shard read by one replica.
        read = numpy.zeros((replicas, num_shards if num_shards > 1 else 0))
        if num_shards > 1:
            read[replica, dataset.shard_id] = 1.0
        total = numpy.asarray(get_runtime().sum_over_ranks(numpy.concatenate([read.ravel()] + stats)))
        read = total[:read.size].reshape(read.shape)
        if num_shards > 1:
            each = get_runtime().group_size() // replicas
            replicas_ok = all(numpy.count_nonzero(row) == 1 and row.max() == each for row in read)
            if not replicas_ok or not (numpy.count_nonzero(read, axis=0) == 1).all():
                seen = "; ".join(f"replica {r}: " + ", ".join(f"shard {s} by {int(c)} rank(s)"
                                                              for s, c in enumerate(row) if c)
                                 for r, row in enumerate(read))
                raise ValueError(f"Model.eval: in a pipelined evaluation the {each} ranks of each replica must read "
                                 f"one shard together and each of the {num_shards} shards one replica, but {seen}; "
                                 f"pass each rank's replica as shard_id")
        results, at = {}, read.size
        for name, part in zip(names, stats):
            results[name] = self._metric_fns[name].finish(total[at:at + part.size])
            at += part.size
        return results

    def _eval_outputs(self, row):
        if self._eval_network is not None:
            out = self._eval_network(*row)
            return tuple(out) if isinstance(out, (tuple, list)) else (out,)
        data, label = row
        logits = self._network(data)
        loss = self._loss_fn(logits, label)
        return loss, logits, label

    def _update_metrics(self, outputs, rows):
        """Updates every metric with one batch's outputs; ``rows``, its number of samples, weighs the Loss."""
        idx = self._eval_indexes
        if idx is not None and len(outputs) <= max(idx):
            raise ValueError(f"Model.eval: eval_indexes {idx} need at least {max(idx) + 1} outputs from the eval "
                             f"network, got {len(outputs)}")
        for metric in self._metric_fns.values():
            weight = {"rows": rows} if isinstance(metric, Loss) else {}
            if metric.indexes is not None:
                metric.update(*[outputs[i] for i in metric.indexes], **weight)
            elif idx is None:
                metric.update(*outputs, **weight)
            elif isinstance(metric, Loss):
                metric.update(outputs[idx[0]], **weight)
            else:
                metric.update(outputs[idx[1]], outputs[idx[2]])

    # ---- prediction ----------------------------------------------------------------------------

    def predict(self, *inputs):
        """``network(*inputs)`` in inference mode without recording gradients."""
        if not inputs:
            raise ValueError("Model.predict: needs at least one input")
        self._network.set_train(False)
        with no_grad():
            return self._network(*[_as_tensor(x) for x in inputs])


def _restart_checkpoint(callbacks):
    """On a launcher's restart, the checkpoint of the first ModelCheckpoint to resume from (None:
    a first attempt, or no checkpoint every rank has whole). Every rank takes part, also one without
    a ModelCheckpoint (rank 0 alone may save): it resumes from the others' choice."""
    saver = next((cb for cb in callbacks if isinstance(cb, ModelCheckpoint)), None)
    if saver is None:
        return restart_checkpoint(None, who="Model.train")
    return restart_checkpoint(saver.directory, saver._base_prefix, "Model.train")
