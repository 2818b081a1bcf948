"""Resuming after a restart: the newest checkpoint every rank has whole, found and loaded.

A launcher that restarts a failed job (``python -m minidl_parallel.run --max-restarts K``,
``minidl_parallel.spawn(..., max_restarts=K)``) tells the new workers which restart they are
through the environment variable ``MINIDL_RESTART_COUNT`` (0 or unset: the first attempt).
On a restart ``Model.train`` with a ``ModelCheckpoint`` in its callbacks, and a custom loop
through :func:`resume_after_restart`, continue from the newest checkpoint that

- every rank has (each rank its own file, as ModelCheckpoint names them: rank 0 the plain
  name, rank r ``..._rank{r}.ckpt`` in a shared directory),
- was written by this job (the ``MINIDL_RUN_ID`` the launcher gives every attempt, which
  ``save_train_state`` records; files of an earlier job in the same directory are not used),
- holds each rank's own file (of the ranks of the world that wrote it: after an elastic restart
  with fewer ranks the others' files are not needed; with more, a new rank starts from rank 0's
  state), and
- reads back whole: every tensor's checksum matches (a damaged file is skipped with a warning
  naming it, and the next older checkpoint is tried).

A save is atomic (a temporary file, then a rename), so a rank killed while writing leaves no
torn checkpoint, only a temporary file that ModelCheckpoint removes; the checkpoint the other
ranks wrote at that step is then not complete, and the one before it wins.

Newest means the largest (epoch, step in epoch) among the files of the prefix and of its
``prefix_N`` runs (each restart's ModelCheckpoint writes under a new ``prefix_N``, as every
new run does); the ranks agree on it with one small exchange. When no checkpoint qualifies the
restart trains from the start, which repeats the first attempt (the script sets its seeds).

When ``MINIDL_RESTART_LOG`` names a file (the launcher's), rank 0 appends one JSON line per
resume there: ``{"restart": r, "checkpoint": path or null, "step": global step}``, which the
launcher reports.
"""
import json
import os
import warnings

from ..io.checkpoint import load_checkpoint_metadata
from ..io.safetensors import load_file, remove_stale_temp_files
from ..runtime import get_runtime
from .checkpoint import _pattern, rank_checkpoint_path, restore_train_state

__all__ = ["restart_count", "resume_after_restart", "restart_checkpoint", "newest_complete_checkpoint"]

RESTART_COUNT_VARIABLE = "MINIDL_RESTART_COUNT"
RESTART_LOG_VARIABLE = "MINIDL_RESTART_LOG"
RUN_ID_VARIABLE = "MINIDL_RUN_ID"


def restart_count():
    """Which restart of its job this process belongs to: 0 on the first attempt (or without a
    restarting launcher), r after r restarts (``MINIDL_RESTART_COUNT``)."""
    text = os.environ.get(RESTART_COUNT_VARIABLE, "").strip()
    if not text:
        return 0
    try:
        count = int(text)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{RESTART_COUNT_VARIABLE} must be an int >= 0 (the launcher sets it), got {text!r}")
    return count


def _candidates(directory, prefix):
    """{(epoch, step_in_epoch, run): rank 0's file name} of the checkpoints of prefix and prefix_N."""
    pattern, found = _pattern(prefix), {}
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m and m.group(4) is None:  # rank 0's names: rank r's file is derived from it
            found[(int(m.group(2)), int(m.group(3)), int(m.group(1) or 0))] = name
    return found


def _readable_file(path, rank, who):
    """The file this rank loads of the checkpoint whose rank 0 file is ``path``: its own (``_rank{r}``
    beside it, or the plain name in a directory of its own), or, for a rank beyond the world that
    wrote it (an elastic restart with more ranks), rank 0's; None when that file is missing, not
    this job's, or damaged (which warns)."""
    own = rank_checkpoint_path(path, rank)
    chosen = own if os.path.isfile(own) else path
    if not os.path.isfile(chosen):
        return None
    try:
        meta = load_checkpoint_metadata(chosen)
        if meta.get("run_id") != os.environ.get(RUN_ID_VARIABLE, meta.get("run_id")):
            return None  # an earlier job's
        # (save_train_state called by hand records no writer: such a file is every rank's, as for resume_from)
        if "rank" in meta and meta["rank"] != str(rank) and not (
                meta["rank"] == "0" and rank >= int(meta.get("group_size", "1"))):
            return None  # another rank's file: this rank's own is missing
        load_file(chosen)  # every tensor read back and checked against its checksum
    except (OSError, ValueError) as exc:
        warnings.warn(f"{who}: skipped the damaged checkpoint {chosen}: {exc}", RuntimeWarning, stacklevel=4)
        return None
    return chosen


def newest_complete_checkpoint(directory, prefix="CKP", who="newest_complete_checkpoint"):
    """The path (rank 0's name) of the newest checkpoint in ``directory`` that every rank has
    whole; None when there is none. In a world that trains in lockstep every rank must call, and
    all agree (one small exchange); a rank that saves nothing passes ``directory=None`` and takes
    the others' choice (it then resumes from another rank's file: ``restore_train_state`` warns)."""
    runtime = get_runtime()
    together = runtime.group_size() > 1 and runtime.trains_in_lockstep()
    rank = runtime.rank() if runtime.group_size() > 1 else 0
    mine = None
    if directory is not None:
        directory = os.fspath(directory)
        found = _candidates(directory, prefix) if os.path.isdir(directory) else {}
        mine = {key: os.path.join(directory, name) for key, name in found.items()
                if _readable_file(os.path.join(directory, name), rank, who) is not None}
    # Every rank's view, so that all choose the same: the newest key in each view (ranks without one abstain).
    views = [view for view in (runtime.gather(mine) if together else [mine]) if view is not None]
    if not views:
        return None
    common = set(views[0]).intersection(*views[1:])
    if not common:
        return None
    return (mine or views[0])[max(common)]


def restart_checkpoint(directory, prefix="CKP", who="restart_checkpoint"):
    """On a restart, the checkpoint to resume from (see the module docstring), said on rank 0 and
    logged for the launcher; None on a first attempt or when no checkpoint qualifies. ``directory``
    None: this rank saves no checkpoints (it takes part in the ranks' agreement all the same)."""
    restart = restart_count()
    if restart == 0:
        return None
    if directory is not None and os.path.isdir(directory):
        remove_stale_temp_files(directory)  # what a rank killed while saving left (ModelCheckpoint does too)
    path = newest_complete_checkpoint(directory, prefix, who)
    step = 0 if path is None else int(load_checkpoint_metadata(path).get("step_num", 0))
    runtime = get_runtime()
    if runtime.group_size() <= 1 or runtime.rank() == 0:
        if path is None:
            where = "" if directory is None else f" in {directory}"
            print(f"{who}: restart {restart}: no checkpoint{where} that every rank has whole; training from the "
                  f"start", flush=True)
        else:
            print(f"{who}: restart {restart}: resuming from {path} (after step {step})", flush=True)
        log = os.environ.get(RESTART_LOG_VARIABLE)
        if log:
            with open(log, "a") as f:
                f.write(json.dumps({"restart": restart, "checkpoint": path, "step": step}) + "\n")
    return path


def resume_after_restart(directory, network, optimizer, prefix="CKP", who="resume_after_restart"):
    """On a restart, loads the newest checkpoint every rank has whole (see the module docstring);
    returns ``(path, TrainPosition)``, or None on a first attempt or when there is none.

    A custom training loop calls it once before its first step, on every rank, with the
    directory and prefix its checkpoints are written under (ModelCheckpoint's names:
    ``{prefix}-{epoch}_{step}.ckpt``, and ``rank_checkpoint_path`` of it on rank r); the
    TrainPosition says where to continue, and ``minidl.load_checkpoint_metadata(path)`` gives
    what the loop stored with ``append_dict``. Parameters, optimizer state and minidl's random
    state are restored as by ``restore_train_state``.
    """
    path = restart_checkpoint(directory, prefix, who)
    if path is None:
        return None
    return path, restore_train_state(path, network, optimizer, who=who)
