"""Checkpoints during training: ModelCheckpoint, CheckpointConfig, and the resume state.

A checkpoint written by ModelCheckpoint is an ordinary minidl checkpoint (safetensors,
``minidl.load_checkpoint`` reads it) holding the network's parameters and the optimizer's
state (its buffers, e.g. ``moments.fc.weight``, and ``global_step``), as MindSpore's do. Its
metadata (``minidl.load_checkpoint_metadata``) also holds where training stood and the
framework's random state, so ``Model.train(..., resume_from=path)`` continues exactly:

    epoch_num      the epoch (1-based) of the last step done
    step_num       the global step (1-based) of the last step done
    step_in_epoch  the step within that epoch (1-based)
    batch_num      steps per epoch of the dataset it was trained on
    seed           minidl.get_seed() ("None" when unset)
    rng_state      minidl.backend.rng().bit_generator.state, as JSON

Files are named ``{prefix}-{epoch}_{step_in_epoch}.ckpt``. As in MindSpore, when the
directory already holds checkpoints with the same prefix, a new ModelCheckpoint writes
under ``{prefix}_1``, ``{prefix}_2`` ... so that a second run never deletes the first one's.
"""
import collections
import json
import os
import re
import time

from .. import backend
from ..io.checkpoint import (save_checkpoint, load_checkpoint, load_param_into_net, load_checkpoint_metadata,
                             keyed_parameters, match_parameters)
from ..runtime import get_runtime
from .callbacks import Callback

__all__ = ["CheckpointConfig", "ModelCheckpoint", "latest_checkpoint", "save_train_state", "restore_train_state",
           "TrainPosition"]

_STATE_KEYS = ("epoch_num", "step_num", "step_in_epoch", "batch_num", "seed", "rng_state")

TrainPosition = collections.namedtuple("TrainPosition", "epoch skip_batches global_step batch_num")
TrainPosition.__doc__ = """Where a resumed run starts: ``epoch`` (0-based) and ``skip_batches`` (steps of that
epoch already done), the ``global_step`` done so far, and the ``batch_num`` it was trained with."""


def _state_tensors(who, network, optimizer):
    """Checkpoint name -> Parameter for the network and the optimizer, as save_checkpoint keys them."""
    tensors = {name: p for name, _, p in keyed_parameters(network, who)}
    if optimizer is not None:
        for name, _, p in keyed_parameters(optimizer, who):
            if name in tensors:
                raise ValueError(f"{who}: the network and the optimizer both have a parameter named {name!r}; "
                                 f"a checkpoint needs unique names")
            tensors[name] = p
    return tensors


def save_train_state(path, network, optimizer, epoch_num, step_num, step_in_epoch, batch_num, append_dict=None,
                     integrated_save=None):
    """Saves a checkpoint that ``Model.train(resume_from=path)`` can continue from.

    Args:
        path: the file to write (atomically).
        network: the Cell whose parameters are saved.
        optimizer: its Optimizer (state saved too), or None.
        epoch_num, step_num, step_in_epoch: the position after the last step done (1-based).
        batch_num: steps per epoch.
        append_dict: extra metadata (str/number/bool) or tensors to store.
        integrated_save: how parameters sharded by tensor parallelism are saved (see
            ``save_checkpoint``; True gathers them, a collective every rank must join).
    """
    who = "save_train_state"
    meta = dict(append_dict or {})
    meta.update(epoch_num=int(epoch_num), step_num=int(step_num), step_in_epoch=int(step_in_epoch),
                batch_num=int(batch_num), seed=str(backend.get_seed()),
                rng_state=json.dumps(backend.rng().bit_generator.state))
    save_checkpoint(_state_tensors(who, network, optimizer), path, append_dict=meta, integrated_save=integrated_save)


def restore_train_state(path, network, optimizer, who="Model.train"):
    """Loads a ``save_train_state`` checkpoint into network and optimizer, restores the seed
    and the framework's random generator, and returns the TrainPosition to continue from.

    Raises:
        FileNotFoundError: path does not exist.
        ValueError: the file is not a training checkpoint, or lacks some parameter or
            optimizer state, or a shape differs (nothing is loaded then).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{who}: resume_from checkpoint {path!r} does not exist")
    meta = load_checkpoint_metadata(path)
    missing = [k for k in _STATE_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{who}: {path!r} is not a training checkpoint: its metadata lacks {missing}; resume_from "
                         f"needs a file written by ModelCheckpoint (or save_train_state) during Model.train")
    params = load_checkpoint(path)
    # Matched as load_param_into_net matches (name, else path), so that a file keyed by paths
    # (written before explicit names were saved) still resumes.
    absent = [name for part in (network, optimizer) if part is not None
              for name in match_parameters(part, params, who)[1]]
    if absent:
        raise ValueError(f"{who}: checkpoint {path!r} lacks {len(absent)} parameter(s) or optimizer state(s) of "
                         f"this model, nothing was loaded: {absent[:8]}{' ...' if len(absent) > 8 else ''}")
    try:
        rng_state = json.loads(meta["rng_state"])
        position = TrainPosition(*(int(meta[k]) for k in ("epoch_num", "step_in_epoch", "step_num", "batch_num")))
    except ValueError as e:
        raise ValueError(f"{who}: checkpoint {path!r} has a corrupt training state in its metadata: {e}") from None
    # Shapes are checked for both before either changes (load_param_into_net checks all first).
    load_param_into_net(network, params, strict_load=True)
    if optimizer is not None:
        optimizer.load_state_dict(params, strict=True)
    if meta["seed"] != "None":
        backend.set_seed(int(meta["seed"]))
    backend.rng().bit_generator.state = rng_state
    epoch_num, step_in_epoch, step_num, batch_num = position
    if step_in_epoch >= batch_num:  # the epoch was complete: start the next one
        return TrainPosition(epoch_num, 0, step_num, batch_num)
    return TrainPosition(epoch_num - 1, step_in_epoch, step_num, batch_num)


def _check_int(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"CheckpointConfig: {name} must be an int >= 0 (or None), got {value!r}")
    return value


class CheckpointConfig:
    """When ModelCheckpoint saves, and how many files it keeps.

    Args:
        save_checkpoint_steps: save every this many steps (takes precedence over seconds).
        save_checkpoint_seconds: save every this many seconds (when steps is 0).
        keep_checkpoint_max: keep at most this many files, deleting the oldest.
        keep_checkpoint_per_n_minutes: when keep_checkpoint_max is 0, keep one file per
            this many minutes.
        saved_network: save this Cell instead of the trained network (no optimizer state;
            such files cannot be resumed from).
        append_info: a list of "epoch_num" / "step_num" (always saved here) and at most one
            dict of extra str -> int/float/bool/str metadata.
        integrated_save: under tensor parallelism, save whole tensors gathered from every
            rank's block (True, MindSpore's default; every rank saves together) or each rank's
            blocks (False).

    Under a parallel runtime every decision to save is the same on every rank: step counts
    agree by construction, and a time-based decision (``save_checkpoint_seconds``) is rank
    0's, shared with the others, so that ranks never disagree about a collective save.
    """

    def __init__(self, save_checkpoint_steps=1, save_checkpoint_seconds=0, keep_checkpoint_max=5,
                 keep_checkpoint_per_n_minutes=0, saved_network=None, append_info=None, integrated_save=True):
        steps = _check_int("save_checkpoint_steps", save_checkpoint_steps)
        seconds = _check_int("save_checkpoint_seconds", save_checkpoint_seconds)
        keep_max = _check_int("keep_checkpoint_max", keep_checkpoint_max)
        per_min = _check_int("keep_checkpoint_per_n_minutes", keep_checkpoint_per_n_minutes)
        if not (steps or seconds or keep_max or per_min):
            raise ValueError("CheckpointConfig: save_checkpoint_steps, save_checkpoint_seconds, keep_checkpoint_max "
                             "and keep_checkpoint_per_n_minutes cannot all be 0 or None")
        if saved_network is not None and not hasattr(saved_network, "parameters_and_names"):
            raise TypeError(f"CheckpointConfig: saved_network must be a Cell or None, got "
                            f"{type(saved_network).__name__}")
        self.save_checkpoint_steps = steps
        self.save_checkpoint_seconds = None if steps else seconds
        self.keep_checkpoint_max = keep_max
        self.keep_checkpoint_per_n_minutes = None if keep_max else per_min
        if not keep_max and not per_min:
            self.keep_checkpoint_max = 1
        if not isinstance(integrated_save, bool):
            raise TypeError(f"CheckpointConfig: integrated_save must be True or False, got {integrated_save!r}")
        self.saved_network = saved_network
        self.append_dict = self._append_dict(append_info)
        self.integrated_save = integrated_save

    @staticmethod
    def _append_dict(append_info):
        if not append_info:
            return {}
        if not isinstance(append_info, list):
            raise TypeError(f"CheckpointConfig: append_info must be a list, got {type(append_info).__name__}")
        out, dicts = {}, 0
        for item in append_info:
            if isinstance(item, str):
                if item not in ("epoch_num", "step_num"):
                    raise ValueError(f"CheckpointConfig: append_info strings must be 'epoch_num' or 'step_num', "
                                     f"got {item!r}")
            elif isinstance(item, dict):
                dicts += 1
                if dicts > 1:
                    raise TypeError("CheckpointConfig: append_info may hold at most one dict")
                for k, v in item.items():
                    if not isinstance(k, str) or not isinstance(v, (int, float, bool, str)):
                        raise TypeError(f"CheckpointConfig: append_info dict entries must be str -> int/float/bool/"
                                        f"str, got {k!r}: {type(v).__name__}")
                    if k in _STATE_KEYS:
                        raise ValueError(f"CheckpointConfig: append_info key {k!r} is reserved for the training state")
                out.update(item)
            else:
                raise TypeError(f"CheckpointConfig: append_info elements must be str or dict, "
                                f"got {type(item).__name__}")
        return out

    def get_checkpoint_policy(self):
        """The policy as a dict."""
        return {"save_checkpoint_steps": self.save_checkpoint_steps,
                "save_checkpoint_seconds": self.save_checkpoint_seconds,
                "keep_checkpoint_max": self.keep_checkpoint_max,
                "keep_checkpoint_per_n_minutes": self.keep_checkpoint_per_n_minutes,
                "saved_network": self.saved_network,
                "integrated_save": self.integrated_save}


def _pattern(prefix):
    return re.compile(rf"^{re.escape(prefix)}(?:_(\d+))?-(\d+)_(\d+)\.ckpt$")


def _unique_prefix(directory, prefix):
    """prefix, or prefix_N (N one more than any used) when the directory has its checkpoints."""
    pattern, suffix = _pattern(prefix), -1
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m:
            suffix = max(suffix, int(m.group(1) or 0))
    return prefix if suffix < 0 else f"{prefix}_{suffix + 1}"


def latest_checkpoint(directory, prefix="CKP"):
    """The newest checkpoint ModelCheckpoint(prefix) wrote in directory, or None.

    Newest means: of the latest run (``prefix_N`` with the largest N, ``prefix`` being run
    0), the largest (epoch, step).
    """
    if not os.path.isdir(directory):
        return None
    pattern, best = _pattern(prefix), None
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m:
            key = (int(m.group(1) or 0), int(m.group(2)), int(m.group(3)))
            if best is None or key > best[0]:
                best = (key, name)
    return None if best is None else os.path.join(directory, best[1])


class ModelCheckpoint(Callback):
    """Saves checkpoints during training (and once more at its end), to resume from later.

    Args:
        prefix: file name prefix (no '/').
        directory: where to write (created if needed); None: the current directory.
        config: a CheckpointConfig (default: every step, keep 5).

    Example:
        >>> ckpt = ModelCheckpoint("net", "ckpt", CheckpointConfig(save_checkpoint_steps=100))
        >>> model.train(10, ds, callbacks=[ckpt])
        >>> model.train(10, ds, resume_from=latest_checkpoint("ckpt", "net"))
    """

    def __init__(self, prefix="CKP", directory=None, config=None):
        super().__init__()
        if not isinstance(prefix, str) or not prefix or "/" in prefix or os.sep in prefix:
            raise ValueError(f"ModelCheckpoint: prefix must be a non-empty str without '/', got {prefix!r}")
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise ValueError(f"ModelCheckpoint: directory must be a str or path, got {type(directory).__name__}")
        if config is None:
            config = CheckpointConfig()
        elif not isinstance(config, CheckpointConfig):
            raise TypeError(f"ModelCheckpoint: config must be a CheckpointConfig, got {type(config).__name__}")
        self._config = config
        self._directory = os.path.abspath(os.fspath(directory)) if directory is not None else os.getcwd()
        os.makedirs(self._directory, exist_ok=True)
        self._prefix = _unique_prefix(self._directory, prefix)
        self._saved = []  # (path, time) of the files this callback wrote and still keeps
        self._latest_ckpt_file_name = ""
        self._last_triggered_step = 0
        self._last_time = time.time()

    @property
    def latest_ckpt_file_name(self):
        """The path of the last checkpoint written ("" before the first)."""
        return self._latest_ckpt_file_name

    @property
    def prefix(self):
        """The prefix files are written with (``prefix_N`` when the directory had others)."""
        return self._prefix

    @property
    def directory(self):
        return self._directory

    def on_train_begin(self, run_context):
        self._last_triggered_step = run_context.original_args().cur_step_num
        self._last_time = time.time()

    def on_train_step_end(self, run_context):
        self._save(run_context.original_args(), force=False)

    def on_train_end(self, run_context):
        self._save(run_context.original_args(), force=True)

    def _due(self, cb_params, force):
        if force:
            return True
        cfg = self._config
        if cfg.save_checkpoint_steps:
            return cb_params.cur_step_num >= self._last_triggered_step + cfg.save_checkpoint_steps
        if cfg.save_checkpoint_seconds:
            # Clocks differ between ranks: rank 0 decides for all (a save may be a collective).
            return bool(get_runtime().agree(time.time() - self._last_time > cfg.save_checkpoint_seconds))
        return False

    def _save(self, cb_params, force):
        if cb_params.cur_step_num == self._last_triggered_step or not self._due(cb_params, force):
            return
        batch_num = cb_params.batch_num
        step_in_epoch = cb_params.get("cur_step_in_epoch") or (cb_params.cur_step_num - 1) % batch_num + 1
        path = os.path.join(self._directory, f"{self._prefix}-{cb_params.cur_epoch_num}_{step_in_epoch}.ckpt")
        self._prune()
        cfg = self._config
        if cfg.saved_network is not None:
            meta = dict(cfg.append_dict, epoch_num=cb_params.cur_epoch_num, step_num=cb_params.cur_step_num)
            save_checkpoint(cfg.saved_network, path, append_dict=meta, integrated_save=cfg.integrated_save)
        else:
            save_train_state(path, cb_params.train_network, cb_params.get("optimizer"), cb_params.cur_epoch_num,
                             cb_params.cur_step_num, step_in_epoch, batch_num, append_dict=cfg.append_dict,
                             integrated_save=cfg.integrated_save)
        now = time.time()
        self._saved = [(p, t) for p, t in self._saved if p != path] + [(path, now)]
        self._latest_ckpt_file_name = path
        self._last_triggered_step = cb_params.cur_step_num
        self._last_time = now

    def _prune(self):
        """Makes room for one more file under the keep policy (before writing it)."""
        cfg = self._config
        if cfg.keep_checkpoint_max:
            while len(self._saved) >= cfg.keep_checkpoint_max:
                self._remove(self._saved.pop(0)[0])
        elif cfg.keep_checkpoint_per_n_minutes:
            # Within the current window keep only its first file; the next one replaces the rest.
            window = cfg.keep_checkpoint_per_n_minutes * 60
            now = time.time()
            recent = [(p, t) for p, t in self._saved if now - t < window]
            for p, _ in recent[1:]:
                self._remove(p)
            self._saved = [(p, t) for p, t in self._saved if now - t >= window] + recent[:1]

    @staticmethod
    def _remove(path):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass  # removed by someone else: nothing left to do
