"""Checkpoints: save_checkpoint / load_checkpoint / load_param_into_net, as in MindSpore 2.x.

Files are safetensors (see minidl/io/safetensors.py), written atomically: a crash while
saving leaves the previous checkpoint intact. The file name is used as given (MindSpore
appends ".ckpt"; we do not). Anything with ``parameters_and_names()`` can be saved and
loaded: a Cell, and also an Optimizer (its buffers and global step).

A parameter is stored under the name it was given (``Parameter(x, name="w")``), as in
MindSpore, and under its attribute path (``"fc.weight"``) when it has none (see
``minidl.io.parameter_names.checkpoint_name``). Loading finds each parameter's entry by that name first,
else by its path, so files keyed either way load while the match is unambiguous.

Example:
    >>> minidl.save_checkpoint(net, "net.ckpt", append_dict={"epoch": 3})
    >>> params = minidl.load_checkpoint("net.ckpt")
    >>> param_not_load, ckpt_not_load = minidl.load_param_into_net(net, params)
    >>> load_checkpoint_metadata("net.ckpt")["epoch"]
    '3'
"""
import numbers
import os
import warnings

import numpy

from .. import backend
from ..runtime import get_runtime
from ..tensor import Parameter, Tensor
from . import safetensors
from .parameter_names import checkpoint_name

__all__ = ["save_checkpoint", "load_checkpoint", "load_param_into_net", "load_checkpoint_metadata",
           "CheckpointLoadWarning"]


class CheckpointLoadWarning(UserWarning):
    """``load_param_into_net`` (strict_load=False) left parameters without a value or
    checkpoint entries unused; the message names every one of them."""


def _to_numpy(who, name, value):
    if isinstance(value, Tensor):
        value = value.data
    if isinstance(value, (bool, numbers.Number)) or hasattr(value, "__array_interface__") \
            or hasattr(value, "__cuda_array_interface__"):
        return numpy.asarray(backend.to_numpy(value))
    raise TypeError(f"{who}: value of {name!r} must be a Parameter, Tensor, array or number, "
                    f"got {type(value).__name__}")


def keyed_parameters(obj, who="save_checkpoint"):
    """(checkpoint name, path, Parameter) for each parameter of ``obj.parameters_and_names()``.

    The checkpoint name is the parameter's given name, else its path (``checkpoint_name``).

    Raises:
        ValueError: two parameters would be saved under the same name (both listed).
    """
    triples, owner = [], {}
    for path, param in obj.parameters_and_names():
        key = checkpoint_name(path, param)
        if key in owner:
            raise ValueError(f"{who}: parameters {owner[key]!r} and {path!r} would both be saved as {key!r}; "
                             f"a checkpoint needs unique names: give one of them another name")
        owner[key] = path
        triples.append((key, path, param))
    return triples


def _named_values(save_obj):
    """(name, value) pairs of any form save_checkpoint accepts."""
    if hasattr(save_obj, "parameters_and_names"):
        return [(key, param) for key, _, param in keyed_parameters(save_obj)]
    if isinstance(save_obj, dict):
        return list(save_obj.items())
    if isinstance(save_obj, (list, tuple)):
        pairs = []
        for i, item in enumerate(save_obj):
            if isinstance(item, Parameter):
                if not item.name:
                    raise ValueError(f"save_checkpoint: Parameter {i} of the list has no name")
                pairs.append((item.name, item))
            elif isinstance(item, dict) and {"name", "data"} <= set(item):
                pairs.append((item["name"], item["data"]))
            else:
                raise TypeError(f"save_checkpoint: list element {i} must be a named Parameter or a dict "
                                f"{{'name': ..., 'data': ...}}, got {type(item).__name__}")
        return pairs
    raise TypeError(f"save_checkpoint: save_obj must be a Cell (anything with parameters_and_names()), a list of "
                    f"Parameters, a list of {{'name', 'data'}} dicts or a dict, got {type(save_obj).__name__}")


def save_checkpoint(save_obj, ckpt_file_name, append_dict=None, choice_func=None, integrated_save=None):
    """Saves parameters to a safetensors file, atomically.

    Under tensor parallelism a parameter may hold only this rank's block of a larger tensor.
    Saving it whole gathers the blocks, a collective that every rank must join; minidl never
    does that behind the caller's back, so such a save must say how (MindSpore's argument):
    ``integrated_save=True`` on every rank (the file holds whole tensors and loads into any
    strategy or world size), or ``False`` (this rank's blocks only, no communication; it
    loads into the same strategy on the same rank). Without sharded parameters the argument
    changes nothing.

    Args:
        save_obj: a Cell (or anything with ``parameters_and_names()``, e.g. an Optimizer:
            each parameter under its given name, else its path), a list of Parameters, a
            list of dicts {"name": str, "data": Tensor/array}, or a dict name -> Parameter /
            Tensor / array.
        ckpt_file_name: the path, used as given.
        append_dict: extra entries: str, int, float and bool values go to the file's
            metadata, as strings (read them with ``load_checkpoint_metadata``); Tensor and
            array values are saved as tensors (returned by ``load_checkpoint``).
        choice_func: optional ``f(name) -> bool``; only names it accepts are saved.
        integrated_save: None, True or False: how sharded parameters are saved (see above);
            None refuses to save them.
    """
    who = "save_checkpoint"
    if integrated_save not in (None, True, False):
        raise ValueError(f"{who}: integrated_save must be None, True or False, got {integrated_save!r}")
    if not isinstance(ckpt_file_name, (str, os.PathLike)):
        raise TypeError(f"{who}: ckpt_file_name must be a str or path, got {type(ckpt_file_name).__name__}")
    tensors, metadata = {}, {}

    def add(name, value):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{who}: names must be non-empty strings, got {name!r}")
        if name in tensors:
            raise ValueError(f"{who}: the name {name!r} appears twice")
        tensors[name] = _to_numpy(who, name, value)

    chosen = [(name, value) for name, value in _named_values(save_obj) if choice_func is None or choice_func(name)]
    sharded = [name for name, value in chosen if isinstance(value, Tensor) and value.is_sharded]
    if sharded and integrated_save is None:
        shown = ", ".join(repr(n) for n in sharded[:3]) + (", ..." if len(sharded) > 3 else "")
        raise ValueError(f"{who}: {len(sharded)} parameter(s) ({shown}) hold this rank's block of a sharded tensor; "
                         f"pass integrated_save=True on every rank to gather and save whole tensors (a collective), "
                         f"or integrated_save=False to save this rank's blocks")
    for name, value in chosen:
        if isinstance(value, Tensor) and value.is_sharded:
            metadata[f"layout.{name}"] = str(value.placement)
            if integrated_save:
                value = get_runtime().full_value(value)  # a collective: every rank saves together
            else:
                metadata[f"block.{name}"] = str(tuple(value.data.shape))
        add(name, value)
    if append_dict is not None:
        if not isinstance(append_dict, dict):
            raise TypeError(f"{who}: append_dict must be a dict, got {type(append_dict).__name__}")
        for key, value in append_dict.items():
            if not isinstance(key, str):
                raise TypeError(f"{who}: append_dict keys must be str, got {key!r}")
            if isinstance(value, (str, bool, numbers.Number)):
                metadata[key] = str(value)
            else:
                add(key, value)
    safetensors.save_file(tensors, ckpt_file_name, metadata)


def _prefixes(who, name, value):
    if value is None:
        return ()
    value = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(v, str) for v in value):
        raise TypeError(f"{who}: {name} must be a str or a list of str, got {value!r}")
    return value


def load_checkpoint(ckpt_file_name, net=None, strict_load=False, filter_prefix=None, specify_prefix=None,
                    choice_func=None):
    """Loads a checkpoint into a dict name -> Parameter (on the context's device).

    Args:
        ckpt_file_name: the path.
        net: when given, the values are also loaded into it (``load_param_into_net``).
        strict_load: passed to ``load_param_into_net``.
        filter_prefix: str or list of str: names starting with one of them are skipped.
        specify_prefix: str or list of str: only names starting with one of them are loaded.
        choice_func: optional ``f(name) -> bool``; only names it accepts are loaded.

    Raises:
        ValueError: the file is not a valid safetensors file (the message says why).
    """
    who = "load_checkpoint"
    skip = _prefixes(who, "filter_prefix", filter_prefix)
    only = _prefixes(who, "specify_prefix", specify_prefix)
    if not os.path.isfile(ckpt_file_name):
        raise ValueError(f"{who}: checkpoint file {os.fspath(ckpt_file_name)!r} does not exist")
    params = {}
    for name, array in safetensors.load_file(ckpt_file_name).items():
        if (skip and name.startswith(skip)) or (only and not name.startswith(only)):
            continue
        if choice_func is not None and not choice_func(name):
            continue
        params[name] = Parameter(array, name=name)
    if net is not None:
        missing, unused = load_param_into_net_quietly(net, params, strict_load, who)
        if not strict_load:
            _warn_unmatched(who, missing, unused)
    return params


def load_checkpoint_metadata(ckpt_file_name):
    """The ``append_dict`` scalars saved with a checkpoint, as a dict str -> str (without the
    file's checksums, which loading verifies)."""
    return safetensors.load_metadata(ckpt_file_name)


def _copy_into(param, value):
    """Writes value into param's own array (same device, dtype and identity, so that views,
    optimizers and fused buffers holding it stay valid)."""
    dst = param.data
    xp = backend.get_array_module(dst)
    src = backend.to_device(value.data if isinstance(value, Tensor) else value, xp)
    if getattr(dst.flags, "writeable", True):
        xp.copyto(dst, src, casting="unsafe")
    else:
        param.set_data(src.copy())


def match_parameters(net, parameter_dict, who="load_param_into_net"):
    """Finds each parameter's checkpoint entry: by its checkpoint name first, else by its path.

    A parameter's checkpoint name is the name it was given, else its path (what
    ``save_checkpoint`` writes now); the path alone is what files written before explicit
    names were honoured hold, and what a network whose names changed still shares.

    Returns:
        (found, missing): found lists (checkpoint name, Parameter, entry) for the parameters
        with an entry; missing holds the checkpoint names of the others, in order.

    Raises:
        ValueError: one entry is claimed by several parameters (e.g. one is named
            ``"fc.weight"`` and another sits at the path ``fc.weight``); all such are listed.
    """
    found, missing, claims = [], [], {}
    for path, param in net.parameters_and_names():
        key = checkpoint_name(path, param)
        entry = key if key in parameter_dict else path if path in parameter_dict else None
        if entry is None:
            missing.append(key)
            continue
        claims.setdefault(entry, []).append(repr(path) if entry == path else f"{path!r} (named {key!r})")
        found.append((key, param, entry))
    clashes = [f"{entry!r} matches the parameters at {' and '.join(paths)}"
               for entry, paths in claims.items() if len(paths) > 1]
    if clashes:
        raise ValueError(f"{who}: {len(clashes)} checkpoint entr{'y matches' if len(clashes) == 1 else 'ies match'} "
                         f"more than one parameter, nothing was loaded: " + "; ".join(clashes) + "; give the "
                         "parameters names that tell them apart, or pass a dict keyed by the names wanted")
    return found, missing


def load_param_into_net(net, parameter_dict, strict_load=False):
    """Copies checkpoint values into ``net``'s Parameters, in place.

    Each parameter takes the entry of its checkpoint name (the name it was given, else its
    path from ``net.parameters_and_names()``) or, failing that, of its path, so a file keyed
    either way loads. Values are cast to each parameter's dtype. Nothing is copied when any
    shape differs or when an entry matches two parameters.

    With ``strict_load=False``, a partial match loads what matches and issues one
    ``CheckpointLoadWarning`` naming every parameter that got no value (it keeps its current
    value) and every checkpoint entry that matched no parameter, as MindSpore logs both; none
    when everything matched. With ``strict_load=True`` a missing parameter raises instead, and
    unused entries are only returned (a training checkpoint also holds optimizer state).

    Args:
        net: a Cell (or anything with ``parameters_and_names()``, e.g. an Optimizer).
        parameter_dict: name -> Parameter / Tensor / array, e.g. from ``load_checkpoint``.
        strict_load: when True, a net parameter absent from parameter_dict raises.

    Returns:
        (param_not_load, ckpt_not_load): the checkpoint names of the net's parameters that got
        no value, and the checkpoint entries that matched no parameter.

    Raises:
        ValueError: shapes differ (every mismatched name is listed with both shapes), or
            strict_load and some parameters are missing (all listed), or an entry matches
            several parameters (see ``match_parameters``).
    """
    who = "load_param_into_net"
    missing, unused = load_param_into_net_quietly(net, parameter_dict, strict_load, who)
    if not strict_load:
        _warn_unmatched(who, missing, unused)
    return missing, unused


def _warn_unmatched(who, missing, unused):
    """One CheckpointLoadWarning naming every unloaded parameter and unused entry, if any;
    attributed to the caller of the public function that called this."""
    if not missing and not unused:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} parameter(s) of the net got no value and keep their current values: {missing}")
    if unused:
        parts.append(f"{len(unused)} checkpoint entr{'y' if len(unused) == 1 else 'ies'} matched no parameter: "
                     f"{unused}")
    if missing:
        advice = ("check that the network is built as when the checkpoint was saved (strict_load=True makes "
                  "missing parameters an error)")
    else:  # nothing is missing: most likely state the net has no use for, e.g. an optimizer's
        advice = ("entries the net does not need (e.g. the optimizer state of a training checkpoint) can be "
                  "left out with load_checkpoint's specify_prefix, filter_prefix or choice_func")
    warnings.warn(f"{who}: " + "; ".join(parts) + "; " + advice, CheckpointLoadWarning, stacklevel=3)


def load_param_into_net_quietly(net, parameter_dict, strict_load=False, who="load_param_into_net"):
    """``load_param_into_net`` without its warning, for callers that load a part of a
    checkpoint on purpose (e.g. an optimizer's state out of a file that also holds the
    network's parameters) and check the returned lists themselves."""
    if not hasattr(net, "parameters_and_names"):
        raise TypeError(f"{who}: net must be a Cell (anything with parameters_and_names()), got {type(net).__name__}")
    if not isinstance(parameter_dict, dict):
        raise TypeError(f"{who}: parameter_dict must be a dict, got {type(parameter_dict).__name__}")
    found, missing = match_parameters(net, parameter_dict, who)
    mismatched, pairs, used = [], [], set()
    for name, param, entry in found:
        value = parameter_dict[entry]
        if not isinstance(value, Tensor) and not hasattr(value, "shape"):
            value = numpy.asarray(value)
        if param.is_sharded and tuple(value.shape) == tuple(param.shape):
            value = get_runtime().local_value(param, value)  # a whole tensor becomes this rank's block
        local = tuple(param.data.shape)
        if tuple(value.shape) != local:
            shown = f"{tuple(param.shape)} (block {local})" if tuple(param.shape) != local else f"{local}"
            mismatched.append(f"{name!r}: net {shown} vs checkpoint {tuple(value.shape)}")
            continue
        pairs.append((param, value))
        used.add(entry)
    if mismatched:
        raise ValueError(f"{who}: {len(mismatched)} parameter(s) have a different shape in the checkpoint, "
                         f"nothing was loaded: " + "; ".join(mismatched))
    if missing and strict_load:
        raise ValueError(f"{who}: strict_load is set and {len(missing)} parameter(s) are missing from the "
                         f"checkpoint, nothing was loaded: {missing}")
    for param, value in pairs:
        _copy_into(param, value)
    return missing, [name for name in parameter_dict if name not in used]
