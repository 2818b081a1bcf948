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

ModelCheckpoint adds who wrote the file (``save_train_state`` alone does not: a file saved by
hand on one rank stays every rank's starting point):

    rank           the rank that wrote it (0 on one device)
    group_size     the number of ranks of the run (1 on one device)
    batch_size     the training dataset's batch (per rank: its last ``.batch``)
    num_shards     the number of shards of the training dataset (batch_size x num_shards is
                   the global batch, which a resume on another number of shards keeps:
                   minidl/train/resize.py)

and, under a restarting launcher, ``run_id``: its job's ``MINIDL_RUN_ID`` (minidl/train/restart.py).

Files are named ``{prefix}-{epoch}_{step_in_epoch}.ckpt``. As in MindSpore, when the
directory already holds checkpoints with the same prefix, a new ModelCheckpoint writes
under ``{prefix}_1``, ``{prefix}_2`` ... so that a second run never deletes the first one's.

Several ranks (data or tensor parallelism) may share one directory. Their states differ
(BatchNorm moving statistics under data parallelism without SyncBatchNorm, random state,
blocks saved with ``integrated_save=False``), so every rank writes its own file: rank 0 the
name above, rank r > 0 ``{prefix}-{epoch}_{step_in_epoch}_rank{r}.ckpt``. The prefix
(``prefix_N``) is decided once, by the lowest rank writing into the directory, and adopted
by the others, so no two ranks ever write or remove the same path. Ranks with directories
of their own keep the plain names. ``latest_checkpoint`` returns the calling rank's file,
and ``restore_train_state`` (``Model.train(resume_from=...)``) maps rank 0's name to the
calling rank's own file, so every rank may be given the same path. The ranks learn who
shares a directory from the one exchange ``Model.train`` makes when a parallel run starts
(``Callback._rank_plan``), so a ModelCheckpoint that rank 0 alone runs never waits for the
others.

A save is skipped, with a warning, when a parameter or optimizer state is NaN or inf (on
any rank of those that save together): older, finite checkpoints are kept instead of being
pruned in favour of a diverged one.

Under a pipeline (``pipeline_stages`` > 1) a rank's copies of the other stages' parameters are
stale between steps, so its file holds its stage's part (parameters, their optimizer state, the
BatchNorm statistics of its cells) and records which (``pipeline_stages``, ``pipeline_stage``,
``pipeline_network``): the runtime's ``checkpoint_segment`` says what to leave out. A resume at
the same stage count loads each rank's part; ``minidl_parallel.load_segmented_checkpoints``
merges the stages' files for any other stage count or one device.
"""
import collections
import json
import os
import re
import time
import warnings

from .. import backend
from ..dataset import Dataset
from ..io.safetensors import remove_stale_temp_files
from ..io.checkpoint import (save_checkpoint, load_checkpoint, load_param_into_net_quietly, load_checkpoint_metadata,
                             keyed_parameters, match_parameters)
from ..runtime import get_runtime
from .callbacks import Callback

__all__ = ["CheckpointConfig", "ModelCheckpoint", "latest_checkpoint", "save_train_state", "restore_train_state",
           "TrainPosition", "rank_checkpoint_path"]

_STATE_KEYS = ("epoch_num", "step_num", "step_in_epoch", "batch_num", "seed", "rng_state")
# Who wrote the file: lets a rank refuse another rank's file instead of resuming from it silently.
_RANK_KEYS = ("rank", "group_size", "run_id")
# Which part of a pipelined model the file holds (minidl_parallel/pipeline/checkpoint.py writes them).
_PIPELINE_KEYS = ("pipeline_stages", "pipeline_stage", "pipeline_network")
# The global batch (batch_size x num_shards) a resume on another number of shards keeps (resize.py).
_DATASET_KEYS = ("batch_size", "num_shards")
_RESERVED_KEYS = _STATE_KEYS + _RANK_KEYS + _PIPELINE_KEYS + _DATASET_KEYS

class TrainPosition(collections.namedtuple("TrainPosition", "epoch skip_batches global_step batch_num")):
    """Where a resumed run starts: ``epoch`` (0-based) and ``skip_batches`` (steps of that epoch already
    done), the ``global_step`` done so far and the ``batch_num`` it was trained with. Attributes, not
    tuple items (a position still compares and unpacks as its four numbers), None where the file does
    not record them: ``group_size``, the number of ranks that trained it, and ``batch_size`` and
    ``num_shards``, each rank's batch and the number of shards of its training dataset (ModelCheckpoint
    records them; their product is the global batch)."""

    def __new__(cls, epoch, skip_batches, global_step, batch_num, group_size=None, batch_size=None,
                num_shards=None):
        position = super().__new__(cls, epoch, skip_batches, global_step, batch_num)
        position.group_size, position.batch_size, position.num_shards = group_size, batch_size, num_shards
        return position


def _state_tensors(who, network, optimizer, segment=None):
    """Checkpoint name -> Parameter for the network and the optimizer, as save_checkpoint keys them;
    with a ``segment`` (the runtime's ``checkpoint_segment``), without the parameters it names stale
    and their optimizer state."""
    stale = segment.stale if segment is not None else frozenset()
    tensors = {name: p for name, _, p in keyed_parameters(network, who) if id(p) not in stale}
    for name, p in _optimizer_state(who, optimizer, stale).items():
        if name in tensors:
            raise ValueError(f"{who}: the network and the optimizer both have a parameter named {name!r}; "
                             f"a checkpoint needs unique names")
        tensors[name] = p
    return tensors


def _optimizer_state(who, optimizer, stale):
    """Checkpoint name -> Parameter for the optimizer's state, without that of the ``stale`` parameters."""
    if optimizer is None:
        return {}
    return {name: p for name, _, p in keyed_parameters(optimizer, who)
            if not stale or id(_mirrored_parameter(optimizer, name)) not in stale}


def _mirrored_parameter(optimizer, name):
    """The parameter whose state the optimizer's entry ``name`` is (``moments.fc.weight``), or None for
    state of the whole optimizer (``global_step``, Adam's ``beta1_power``)."""
    owner = getattr(optimizer, "_buffer_owner", {})
    if name in owner:
        return optimizer.parameters[owner[name]]
    # Per-parameter flags (SGD's "stat.<key>") are registered without an owner: found by their key.
    keys = getattr(optimizer, "_keys", ())
    _, dot, key = name.partition(".")
    if dot and key in keys:
        return optimizer.parameters[keys.index(key)]
    return None


class _Chosen:
    """Some of a Cell's or an Optimizer's parameters, as ``load_param_into_net`` takes them."""

    def __init__(self, tensors):
        self._tensors = tensors

    def parameters_and_names(self):
        return iter(self._tensors.items())


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
    segment = get_runtime().checkpoint_segment(network)
    meta = dict(append_dict or {})
    meta.update(epoch_num=int(epoch_num), step_num=int(step_num), step_in_epoch=int(step_in_epoch),
                batch_num=int(batch_num), seed=str(backend.get_seed()),
                rng_state=json.dumps(backend.rng().bit_generator.state))
    if segment is not None:
        meta.update(segment.metadata)
    if os.environ.get("MINIDL_RUN_ID"):  # (a restarting launcher's job: its restarts resume from its own files)
        meta["run_id"] = os.environ["MINIDL_RUN_ID"]
    save_checkpoint(_state_tensors(who, network, optimizer, segment), path, append_dict=meta,
                    integrated_save=integrated_save)


def restore_train_state(path, network, optimizer, who="Model.train"):
    """Loads a ``save_train_state`` checkpoint into network and optimizer, restores the seed
    and the framework's random generator, and returns the TrainPosition to continue from.

    Under several ranks each resumes from its own file: given rank 0's file
    (``net-2_5.ckpt``), rank r > 0 reads ``net-2_5_rank{r}.ckpt`` beside it when it exists
    (see :func:`rank_checkpoint_path`); resuming from another rank's file (rank 0 alone saved)
    warns that per-rank state (BatchNorm statistics, random state) is that rank's.
    A file that does not record its rank (``save_train_state`` called by hand, older files) or
    that one process wrote is read by every rank.

    Raises:
        FileNotFoundError: path does not exist (nor, under several ranks, this rank's file).
        ValueError: the file is not a training checkpoint, or lacks some parameter or
            optimizer state, or a shape differs (nothing is loaded then).
    """
    path = _own_checkpoint(os.fspath(path), who)
    meta = load_checkpoint_metadata(path)
    missing = [k for k in _STATE_KEYS if k not in meta]
    if missing:
        raise ValueError(f"{who}: {path!r} is not a training checkpoint: its metadata lacks {missing}; resume_from "
                         f"needs a file written by ModelCheckpoint (or save_train_state) during Model.train")
    params = load_checkpoint(path)
    # Under a pipeline a file holds its stage's part: that part must be there, and what the file holds
    # is loaded (this rank's copies of the other stages' parameters are not used by its stage). A
    # parameter an op of this stage reads from another (a tied head) is in the file, though a new
    # network's segment does not know it until its first step.
    segment = _check_segment(path, meta, network, who)
    if segment is not None:
        network = _Chosen({name: p for name, where, p in keyed_parameters(network, who)
                           if id(p) not in segment.stale or name in params or where in params})
        if optimizer is not None:
            needed = _optimizer_state(who, optimizer, segment.stale)
            optimizer = _Chosen({name: p for name, _, p in keyed_parameters(optimizer, who)
                                 if name in needed or name in params})
    # Matched as load_param_into_net matches (name, else path), so that a file keyed by paths
    # (written before explicit names were saved) still resumes.
    matches = [match_parameters(part, params, who) for part in (network, optimizer) if part is not None]
    absent = [name for _, missing in matches for name in missing]
    if absent:
        raise ValueError(f"{who}: checkpoint {path!r} lacks {len(absent)} parameter(s) or optimizer state(s) of "
                         f"this model, nothing was loaded: {absent[:8]}{' ...' if len(absent) > 8 else ''}")
    try:
        rng_state = json.loads(meta["rng_state"])
        position = TrainPosition(*(int(meta[k]) for k in ("epoch_num", "step_in_epoch", "step_num", "batch_num")))
    except ValueError as e:
        raise ValueError(f"{who}: checkpoint {path!r} has a corrupt training state in its metadata: {e}") from None
    # One load for the network and the optimizer's state, keyed by the entries they matched: every shape
    # is checked before anything is copied, so a mismatch in either leaves both as they were.
    load_param_into_net_quietly(_Chosen({entry: p for found, _ in matches for _, p, entry in found}), params,
                                who=who)
    if meta["seed"] != "None":
        backend.set_seed(int(meta["seed"]))
    backend.rng().bit_generator.state = rng_state
    epoch_num, step_in_epoch, step_num, batch_num = position
    world = [int(meta[key]) if key in meta else None for key in ("group_size", "batch_size", "num_shards")]
    if step_in_epoch >= batch_num:  # the epoch was complete: start the next one
        return TrainPosition(epoch_num, 0, step_num, batch_num, *world)
    return TrainPosition(epoch_num - 1, step_in_epoch, step_num, batch_num, *world)


def _check_segment(path, meta, network, who):
    """The part of ``network`` to load from the file at ``path`` (its metadata ``meta``): None (all of
    it) for a whole file, this rank's segment for the file of its stage; another stage's file, or a
    pipeline's file on a run without one, raises saying what to do."""
    if "pipeline_stages" not in meta:
        return None  # a whole model (one device's, or gathered) loads into any layout
    segment = get_runtime().checkpoint_segment(network)
    saved = (meta["pipeline_stages"], meta.get("pipeline_stage"))
    mine = None if segment is None else tuple(str(segment.metadata[k]) for k in ("pipeline_stages", "pipeline_stage"))
    if saved == mine:
        return segment
    here = "the whole model (no pipeline)" if mine is None else f"stage {mine[1]} of a {mine[0]}-stage pipeline"
    raise ValueError(f"{who}: {path!r} holds pipeline stage {saved[1]} of a {saved[0]}-stage pipeline, but this rank "
                     f"trains {here}: load the stages' files with minidl_parallel.load_segmented_checkpoints(path, "
                     f"net, optimizer), which merges them for any stage count, then train")


def rank_checkpoint_path(path, rank):
    """The name rank ``rank`` gives its own copy of the checkpoint ``path`` (rank 0's name).

    Rank 0 keeps the name; rank r > 0 adds ``_rank{r}`` before the extension:
    ``ckpt/net-2_5.ckpt`` -> ``ckpt/net-2_5_rank1.ckpt``. A path that already ends so is
    returned unchanged.
    """
    path = os.fspath(path)
    if rank == 0:
        return path
    root, ext = os.path.splitext(path)
    if root.endswith(f"_rank{rank}"):
        return path
    return f"{root}_rank{rank}{ext}"


def _own_checkpoint(path, who):
    """The file the calling rank resumes from, given the path the user passed (rank 0's name,
    or this rank's own), checked to hold this rank's state."""
    runtime = get_runtime()
    size = runtime.group_size()
    if size <= 1:  # one process: the path as given, whoever wrote it
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{who}: resume_from checkpoint {path!r} does not exist")
        return path
    rank = runtime.rank()
    own = rank_checkpoint_path(path, rank)
    chosen = own if os.path.isfile(own) else path
    if not os.path.isfile(chosen):
        beside = f" (nor rank {rank}'s own file {own!r})" if own != path else ""
        raise FileNotFoundError(f"{who}: resume_from checkpoint {path!r} does not exist{beside}")
    meta = load_checkpoint_metadata(chosen)
    saved_rank, saved_size = meta.get("rank"), meta.get("group_size")
    # A file without these keys, or one of a single-process run, is every rank's starting point.
    if saved_rank is not None and saved_size not in (None, "1") and saved_rank != str(rank):
        # Rank 0 alone saved (the PyTorch habit): its parameters and optimizer state are every
        # rank's under data parallelism, so resuming works, but not bit for bit: say so.
        warnings.warn(f"{who}: rank {rank} of {size} resumes from {chosen!r}, rank {saved_rank}'s state of a "
                      f"{saved_size}-rank run, since its own file {own!r} does not exist: what differs between "
                      f"ranks (BatchNorm moving statistics, the random state) is rank {saved_rank}'s, so this run "
                      f"will not equal the uninterrupted one bit for bit; run ModelCheckpoint on every rank to "
                      f"resume exactly", RuntimeWarning, stacklevel=3)
    return chosen


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
                    if k in _RESERVED_KEYS:
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
    # groups: run suffix N of prefix_N, epoch, step in epoch, writing rank (None: rank 0's name)
    return re.compile(rf"^{re.escape(prefix)}(?:_(\d+))?-(\d+)_(\d+)(?:_rank(\d+))?\.ckpt$")


def _unique_prefix(directory, prefix):
    """prefix, or prefix_N (N one more than any used) when the directory has its checkpoints
    (any rank's: a new run must not overwrite another rank's files of an earlier one)."""
    pattern, suffix = _pattern(prefix), -1
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m:
            suffix = max(suffix, int(m.group(1) or 0))
    return prefix if suffix < 0 else f"{prefix}_{suffix + 1}"


def _calling_rank():
    runtime = get_runtime()
    return runtime.rank() if runtime.group_size() > 1 else 0


def latest_checkpoint(directory, prefix="CKP"):
    """The newest checkpoint ModelCheckpoint(prefix) wrote in directory, or None.

    Newest means: of the latest run (``prefix_N`` with the largest N, ``prefix`` being run
    0), the largest (epoch, step). Under several ranks it is the calling rank's own file: on
    rank r > 0 the newest ``..._rank{r}.ckpt``, else (a directory of its own) the newest plain
    name; rank 0 (and one process) only looks at plain names.
    """
    if not os.path.isdir(directory):
        return None
    rank = _calling_rank()
    pattern, best = _pattern(prefix), {}
    for name in os.listdir(directory):
        m = pattern.match(name)
        if not m:
            continue
        writer = int(m.group(4) or 0)
        if writer not in (0, rank):
            continue
        key = (int(m.group(1) or 0), int(m.group(2)), int(m.group(3)))
        if writer not in best or key > best[writer][0]:
            best[writer] = (key, name)
    found = best.get(rank) or best.get(0)
    return None if found is None else os.path.join(directory, found[1])


def _non_finite(tensors):
    """The names of the floating tensors in ``tensors`` (name -> Parameter) holding a NaN or inf."""
    bad = []
    for name, tensor in tensors.items():
        data = tensor.data if hasattr(tensor, "data") else tensor
        if getattr(data, "dtype", None) is None or data.dtype.kind not in "fc":
            continue  # integers (global_step) cannot be NaN
        xp = backend.get_array_module(data)
        if not bool(xp.isfinite(data).all()):
            bad.append(name)
    return bad


class ModelCheckpoint(Callback):
    """Saves checkpoints during training (and once more at its end), to resume from later.

    Args:
        prefix: file name prefix (no '/').
        directory: where to write (created if needed); None: the current directory.
        config: a CheckpointConfig (default: every step, keep 5).

    A save is skipped, with a RuntimeWarning naming them, when parameters or optimizer
    states of the saved network hold NaN or inf, and no older file is removed for it: a
    diverged run keeps its last finite checkpoints (under several ranks the ranks skip
    together when any has one).

    Under several ranks sharing ``directory``, rank r > 0 writes ``..._rank{r}.ckpt`` beside
    rank 0's file, and the prefix is the one the lowest rank in the directory chose (see the
    module docstring); this is settled when training begins.

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
        # Temporary files of writers killed mid-save (kill -9, a lost node) pile up otherwise;
        # only those of dead processes on this host go, never a live writer's.
        remove_stale_temp_files(self._directory)
        # This process's proposal; under several ranks sharing the directory, on_train_begin
        # replaces it with the lowest such rank's (listings taken at different moments differ).
        self._prefix = _unique_prefix(self._directory, prefix)
        self._base_prefix = prefix  # (a restart resumes from the files of prefix and of every prefix_N)
        self._saved = []  # (path, time) of the files this callback wrote and still keeps
        self._latest_ckpt_file_name = ""
        self._last_triggered_step = 0
        self._last_time = time.time()
        # Settled with the other ranks when Model.train starts (None: used outside Model.train,
        # then rank r > 0 adds _rank{r} and decides alone):
        self._name_rank = None  # the rank in this rank's file names (0: rank 0's plain names)
        self._together = False  # whether every rank reaches every save (decisions are combined)

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

    def _rank_plan(self, batch_num):
        cfg = self._config
        return (self._prefix, os.path.realpath(self._directory),
                (batch_num, cfg.save_checkpoint_steps, cfg.save_checkpoint_seconds))

    def _adopt_rank_plans(self, plans):
        """Settles the prefix, the file names and whether saves are decided together, from the
        plans of the ModelCheckpoints on every rank (see ``Callback._adopt_rank_plans``).

        Ranks writing into one directory take the lowest such rank's prefix (listings taken at
        different moments may differ) and name their files by rank. Saves are decided together
        (the NaN verdict, a time-based schedule) only when every rank runs a ModelCheckpoint on
        the same schedule and steps per epoch: a ModelCheckpoint on rank 0 alone, or ranks
        saving at different steps (uneven inputs), decide alone, so no rank waits for one that
        never comes. Without an exchange (``plans`` None: one process, or ranks that train
        independently) rank r > 0 adds ``_rank{r}`` and decides alone.
        """
        runtime = get_runtime()
        rank = runtime.rank() if runtime.group_size() > 1 else 0
        if plans is None:
            self._name_rank, self._together = rank, False
            return
        mine = plans[rank]
        sharing = [r for r, plan in enumerate(plans) if plan is not None and plan[1] == mine[1]]
        self._prefix = plans[sharing[0]][0]  # the lowest rank in this directory decides
        self._name_rank = rank if len(sharing) > 1 else 0
        self._together = all(plan is not None and plan[2] == mine[2] for plan in plans)

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
            due = time.time() - self._last_time > cfg.save_checkpoint_seconds
            # Clocks differ between ranks: when they save together rank 0 decides for all (a
            # save may be a collective).
            return bool(get_runtime().agree(due)) if self._together else due
        return False

    def _file_name(self, epoch, step_in_epoch):
        name_rank = self._name_rank
        if name_rank is None:  # used outside Model.train: the safe choice, own names on rank r > 0
            name_rank = _calling_rank()
        return rank_checkpoint_path(os.path.join(self._directory, f"{self._prefix}-{epoch}_{step_in_epoch}.ckpt"),
                                    name_rank)

    def _non_finite_verdict(self, tensors):
        """'' when every saved tensor is finite on every rank that decides together, else what is not."""
        bad = _non_finite(tensors)
        # A save may be collective (integrated_save gathers blocks): ranks that save together skip alike.
        verdicts = get_runtime().gather((len(bad), bad[:3])) if self._together else [(len(bad), bad[:3])]
        if not any(count for count, _ in verdicts):
            return ""

        def shown(count, names):
            return ", ".join(repr(n) for n in names) + (f" and {count - len(names)} more" if count > len(names)
                                                        else "")
        if len(verdicts) == 1:
            count, names = verdicts[0]
            return f"{count} parameter(s) or optimizer state(s) hold NaN or inf: {shown(count, names)}"
        parts = [f"rank {r}: {count} ({shown(count, names)})" for r, (count, names) in enumerate(verdicts) if count]
        return f"parameters or optimizer states hold NaN or inf on {len(parts)} rank(s): " + "; ".join(parts)

    def _save(self, cb_params, force):
        if cb_params.cur_step_num == self._last_triggered_step or not self._due(cb_params, force):
            return
        batch_num = cb_params.batch_num
        step_in_epoch = cb_params.get("cur_step_in_epoch") or (cb_params.cur_step_num - 1) % batch_num + 1
        path = self._file_name(cb_params.cur_epoch_num, step_in_epoch)
        cfg = self._config
        saved = cfg.saved_network if cfg.saved_network is not None else cb_params.train_network
        segment = get_runtime().checkpoint_segment(saved)  # (under a pipeline: this stage's part)
        optimizer = None if cfg.saved_network is not None else cb_params.get("optimizer")
        tensors = _state_tensors("ModelCheckpoint", saved, optimizer, segment)
        problem = self._non_finite_verdict(tensors)
        if problem:
            # Nothing pruned: the files kept are the last finite ones, which a resume needs.
            kept = self._latest_ckpt_file_name or "none written yet"
            warnings.warn(f"ModelCheckpoint: skipped the checkpoint {path} (epoch {cb_params.cur_epoch_num}, step "
                          f"{cb_params.cur_step_num}): {problem}; the earlier checkpoints are kept (latest: {kept})",
                          RuntimeWarning, stacklevel=2)
            self._last_triggered_step = cb_params.cur_step_num
            self._last_time = time.time()
            return
        self._prune()
        runtime = get_runtime()
        # Every rank writes its own file: restore_train_state reads these keys to refuse another rank's.
        writer = dict(cfg.append_dict, rank=runtime.rank(), group_size=runtime.group_size())
        dataset = cb_params.get("train_dataset")
        if isinstance(dataset, Dataset):  # the global batch, which a resume on another number of shards keeps
            writer.update(batch_size=dataset.get_batch_size(), num_shards=dataset.num_shards)
        if cfg.saved_network is not None:
            meta = dict(writer, epoch_num=cb_params.cur_epoch_num, step_num=cb_params.cur_step_num,
                        **(segment.metadata if segment is not None else {}))
            save_checkpoint(tensors, path, append_dict=meta, integrated_save=cfg.integrated_save)
        else:
            save_train_state(path, cb_params.train_network, cb_params.get("optimizer"), cb_params.cur_epoch_num,
                             cb_params.cur_step_num, step_in_epoch, batch_num, append_dict=writer,
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
