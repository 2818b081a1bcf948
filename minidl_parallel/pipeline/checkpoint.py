"""Pipeline checkpoints: each stage saves its own cells; a load merges the stages' files.

Between steps a rank's copies of the other stages' parameters are stale (only its stage trains
them), so under a pipeline the checkpoint a rank writes (``ModelCheckpoint``, ``save_train_state``)
holds its stage's part, as MindSpore's do: the stage's parameters (a shared one on each stage that
uses it), their optimizer state, the BatchNorm statistics of its cells, whatever lies outside the
pipelined network (a wrapper's own parameters, the optimizer's step count) and the train state. Its
metadata says which part (``minidl.load_checkpoint_metadata``):

    pipeline_stages    the run's stage count
    pipeline_stage     the stage this file holds
    pipeline_network   the path of the pipelined network (the Cell ``nn.PipelineCell`` wraps) in the
                       saved Cell: its parameters' names start with it plus "."

``minidl.runtime``'s ``checkpoint_segment`` asks this module which part that is (the ParallelRuntime
answers under a pipeline); ``load_segmented_checkpoints`` (MindSpore's name) merges the files of one
save, one per stage, into the whole model and loads it into a network of any stage count, or one
device's.
"""
import collections
import os

from minidl.io.checkpoint import (load_checkpoint, load_checkpoint_metadata, load_param_into_net_quietly,
                                  match_parameters)
from minidl.train.checkpoint import rank_checkpoint_path

from .cell import PipelineCell
from .stage_forward import PipelineError
from .stages import StagePlan

__all__ = ["Segment", "stage_segment", "load_segmented_checkpoints", "STAGES_KEY", "STAGE_KEY", "NETWORK_KEY"]

STAGES_KEY, STAGE_KEY, NETWORK_KEY = "pipeline_stages", "pipeline_stage", "pipeline_network"

Segment = collections.namedtuple("Segment", "stale metadata")
Segment.__doc__ = """This rank's part of a checkpoint: ``stale``, the ids of the parameters it leaves out
(the other stages', stale on this rank), and ``metadata``, the layout the file records."""


def _pipelined(network):
    """(path, Cell, its PipelineCell or None) of the network the pipeline cuts into stages, found in
    ``network``: the Cell an ``nn.PipelineCell`` inside wraps, else ``network`` itself when some of its
    cells have a stage (a ``saved_network`` without the wrappers); None when neither."""
    cells = list(network.cells_and_names())
    path_of = {id(cell): path for path, cell in reversed(cells)}  # (the first path, as parameters_and_names)
    for _, cell in cells:
        if isinstance(cell, PipelineCell):
            return path_of[id(cell.network)], cell.network, cell
    if any(getattr(cell, "pipeline_stage", None) is not None for _, cell in cells):
        return "", network, None
    return None


def stage_segment(network, stages, stage, who="checkpoint"):
    """The :class:`Segment` of ``network`` (the saved Cell: a TrainOneStepCell around an
    ``nn.PipelineCell``, the PipelineCell, or the staged network itself) that stage ``stage`` of a
    ``stages``-stage pipeline saves.

    Raises:
        PipelineError: the network holds no PipelineCell and no cell with a pipeline_stage (or the
            stages are set wrongly: see StagePlan).
    """
    found = _pipelined(network)
    if found is None:
        raise PipelineError(f"{who}: pipeline_stages is {stages}, but the saved network ({type(network).__name__}) "
                            f"holds no nn.PipelineCell and no cell with a pipeline_stage, so this rank (stage {stage}) "
                            f"cannot tell its stage's parameters from the others' stale copies: save the Cell that "
                            f"holds the PipelineCell (Model(PipelineCell(net, micro_size), ...) does), or call "
                            f"PipelineCell.gather_parameters() and save_checkpoint the whole network")
    path, inner, pipeline_cell = found
    # A parameter an op of a later stage reads (GPT's tied head) is shared from the step's forward on:
    # the latest step's plan knows it, a fresh plan only knows the cells that hold parameters.
    plan = getattr(pipeline_cell, "last_plan", None)
    if plan is None or plan.stages != stages:
        plan = StagePlan(inner, stages)
    stale = set()
    for _, param in inner.parameters_and_names():
        if stage not in plan.stages_of(param):
            stale.add(id(param))
    return Segment(frozenset(stale), {STAGES_KEY: stages, STAGE_KEY: stage, NETWORK_KEY: path})


def _stage_files(ckpt_files, who):
    """{stage: (path, metadata)} for one save's files, the lowest rank's of each stage, and the stage count."""
    if isinstance(ckpt_files, (str, os.PathLike)):
        given = os.fspath(ckpt_files)
        if os.path.isdir(given):
            paths = sorted(os.path.join(given, name) for name in os.listdir(given) if name.endswith(".ckpt"))
            if not paths:
                raise FileNotFoundError(f"{who}: directory {given!r} holds no .ckpt file")
        elif os.path.isfile(given):
            paths = _siblings(given, who)
        else:
            raise FileNotFoundError(f"{who}: checkpoint {given!r} does not exist")
    elif isinstance(ckpt_files, (list, tuple)) and ckpt_files and all(
            isinstance(p, (str, os.PathLike)) for p in ckpt_files):
        paths = [os.fspath(p) for p in ckpt_files]
        absent = [p for p in paths if not os.path.isfile(p)]
        if absent:
            raise FileNotFoundError(f"{who}: checkpoint file(s) {absent} do not exist")
    else:
        raise TypeError(f"{who}: ckpt_files must be a path (rank 0's file of a save, or a directory of one save's "
                        f"files) or a non-empty list of paths, got {ckpt_files!r}")
    metas = {p: load_checkpoint_metadata(p) for p in paths}
    plain = [p for p, meta in metas.items() if STAGES_KEY not in meta]
    if plain:
        raise ValueError(f"{who}: {plain} record no pipeline layout (no {STAGES_KEY!r} in their metadata): they are "
                         f"not the files of a pipeline stage; load a whole checkpoint with minidl.load_checkpoint")
    counts = {int(meta[STAGES_KEY]) for meta in metas.values()}
    saves = {meta.get("step_num") for meta in metas.values()}
    if len(counts) > 1 or len(saves) > 1:
        raise ValueError(f"{who}: the files {paths} come from several saves (pipeline_stages {sorted(counts)}, steps "
                         f"{sorted(int(s) for s in saves if s is not None)}): pass the files of one save (rank 0's file "
                         f"of it finds the others)")
    stages = counts.pop()
    chosen = {}
    for p, meta in metas.items():  # of a stage's data-parallel replicas, the lowest rank's file
        stage, rank = int(meta[STAGE_KEY]), int(meta.get("rank", 0))
        if stage not in chosen or rank < chosen[stage][0]:
            chosen[stage] = (rank, p, meta)
    missing = [s for s in range(stages) if s not in chosen]
    if missing:
        raise FileNotFoundError(f"{who}: the save has {stages} pipeline stages, but no file of stage(s) {missing} was "
                                f"found among {paths}")
    return {s: (p, meta) for s, (_, p, meta) in chosen.items()}, stages


def _siblings(path, who):
    """One file per stage of the save whose file ``path`` is: ModelCheckpoint's names, rank r > 0's
    ``_rank{r}`` beside rank 0's (stage s's lowest rank is s * ranks per stage)."""
    meta = load_checkpoint_metadata(path)
    if STAGES_KEY not in meta:
        return [path]  # (refused, naming it, by the caller)
    rank, size, stages = int(meta.get("rank", 0)), int(meta.get("group_size", 1)), int(meta[STAGES_KEY])
    root, ext = os.path.splitext(path)
    base = root[:-len(f"_rank{rank}")] + ext if rank and root.endswith(f"_rank{rank}") else path
    per_stage = max(size // stages, 1)
    paths = [rank_checkpoint_path(base, s * per_stage) for s in range(stages)]
    absent = [(s, p) for s, p in enumerate(paths) if not os.path.isfile(p)]
    if absent:
        raise FileNotFoundError(f"{who}: {path!r} is stage {meta[STAGE_KEY]}'s file of a {stages}-stage pipeline save; "
                                f"the file(s) of " + ", ".join(f"stage {s} ({p!r})" for s, p in absent) +
                                " do not exist: every stage's file is needed to load the whole model")
    return paths


def load_segmented_checkpoints(ckpt_files, net=None, optimizer=None):
    """Merges the files of one pipeline save (one per stage) into the whole model, and loads it.

    MindSpore's ``load_segmented_checkpoints``: each stage of a pipeline saves its own part (see the
    module docstring); this reads the lowest rank's file of each stage (a stage's data-parallel
    replicas hold the same parameters) and puts them together, so the model trained with p stages
    loads into a network of any stage count, or one device's. It reads files only: no rank waits for
    another.

    Args:
        ckpt_files: rank 0's file of the save (ModelCheckpoint's ``prefix-epoch_step.ckpt``: the other
            stages' ``_rank{r}`` files beside it are found), a directory holding one save's files, or a
            list of paths.
        net: optional Cell to load into: the network, or a Cell around an ``nn.PipelineCell`` holding it
            (any ``pipeline_stages``); every parameter of the network is loaded.
        optimizer: optional Optimizer whose state (momenta, step count) is loaded too.

    Returns:
        dict name -> Parameter: every parameter, named as in the network the pipeline cut (the Cell
        PipelineCell wraps), and the optimizer's state.

    Raises:
        FileNotFoundError: a file, or a stage's file, does not exist (named).
        ValueError: a file is not a pipeline stage's, the files mix saves, a parameter of ``net`` or a
            state of ``optimizer`` is in no file (named; nothing is loaded then), or shapes differ.

    Example:
        >>> params = mp.load_segmented_checkpoints("ckpt/net-1_100.ckpt", net, optimizer)  # any stage count
    """
    who = "load_segmented_checkpoints"
    files, stages = _stage_files(ckpt_files, who)
    merged = {}
    for stage in range(stages):  # an entry several files hold (a shared parameter, the step count): stage 0's
        path, meta = files[stage]
        prefix = meta.get(NETWORK_KEY, "")
        prefix = prefix + "." if prefix else ""
        for name, value in load_checkpoint(path).items():
            key = name[len(prefix):] if prefix and name.startswith(prefix) else name
            merged.setdefault(key, value)
    target = None
    if net is not None:
        if not hasattr(net, "cells_and_names"):
            raise TypeError(f"{who}: net must be a Cell, got {type(net).__name__}")
        found = _pipelined(net)
        target = net if found is None else found[1]
    parts = [part for part in (target, optimizer) if part is not None]
    found = [match_parameters(part, merged, who) for part in parts]
    absent = [name for _, missing in found for name in missing]
    if absent:
        shown = [files[s][0] for s in range(stages)]
        raise ValueError(f"{who}: {len(absent)} parameter(s) or optimizer state(s) are in none of the files {shown}, "
                         f"nothing was loaded: {absent[:8]}{' ...' if len(absent) > 8 else ''}")
    # Every shape checked before anything changes (load_param_into_net checks one part at a time).
    wrong = [f"{name!r}: {tuple(p.shape)} vs checkpoint {tuple(merged[entry].shape)}"
             for matched, _ in found for name, p, entry in matched
             if not p.is_sharded and tuple(merged[entry].shape) != tuple(p.shape)]
    if wrong:
        raise ValueError(f"{who}: {len(wrong)} parameter(s) have a different shape in the checkpoint, nothing was "
                         f"loaded: " + "; ".join(wrong))
    for part in parts:
        load_param_into_net_quietly(part, merged, strict_load=True, who=who)
    return merged
