"""Strategy checkpoints: the tensor-parallel plan saved as a file, and loaded back (MindSpore's
``set_auto_parallel_context(strategy_ckpt_config={"save_file": ..., "load_file": ...})``).

minidl makes its plan at a network's first call: each operator takes its strategy as it runs
(``shard()``, else the strategy file's, else propagation or the data-parallel default) and each
Parameter takes its layout at its first sharded use (parameters.py). So the first outermost call
of a Cell under SEMI_AUTO_PARALLEL / AUTO_PARALLEL is where the file is read and written
(dispatch.run_cell), once per network and setting:

- ``load_file``: read before the call, on every rank; the ranks agree that they read the same
  bytes (one ``allgather_object`` of a digest), so a file missing or different on one host raises
  on every rank instead of leaving the others waiting in a collective. During the call, an
  operator with no ``shard()`` takes the file's strategy, keyed as MindSpore keys it: its
  primitive's name and its first Parameter's name (``MatMul_w1``). A user's ``shard()`` wins, as
  in MindSpore. After the call, every parameter's layout is compared with the file's: a layout
  that differs (other blocks on some rank), a parameter the file names that the network lacks,
  and one the network placed that the file lacks all raise on every rank, naming the parameter
  and both layouts. MindSpore only uses the file's strategies; the check is minidl's.
- ``save_file``: written after the call (and after the check), by every rank, as MindSpore does:
  the content is global (device matrices, tensor maps, whole shapes), so it is the same on every
  rank, and each rank writes a temporary file and renames it, so that ranks sharing a file system
  (the threads world) never leave a torn file.

The ranks agree on the outcome of the check and of the write before anyone raises, so one rank's
failure raises on all of them.

The file is JSON, with MindSpore's own names: MindSpore writes its strategy checkpoint as
protobuf (``ParallelStrategyMap``) or, when the name ends in ``.json``, as JSON with the same
contents, and minidl writes that JSON always, since it is readable, diffable and needs no
protobuf. Its parts:

- ``parallel_strategy_item``: ``{"MatMul_w1": {"stage": 0, "parallel_strategy": [[1, 1], [1, 2]]}}``,
  MindSpore's operator strategies (protobuf ``ParallelStrategyItem``);
- ``parallel_layout_item``: per parameter, MindSpore's ``ParallelLayouts``: ``dev_matrix``,
  ``tensor_map`` (per tensor dimension, the device-matrix axis that cuts it counted from the
  right, as MindSpore counts, -1 for none; a list of axes, major first, when several cut it),
  ``tensor_shape`` (the whole shape), ``field`` (0: minidl has no field split), and
  ``opt_weight_shard_size`` / ``opt_weight_shard_step``: under optimizer parallelism the number of
  ranks a parameter's block is sliced over and the rank stride between them (0 without slicing),
  filled in when the slices are made, after the first step's backward
  (:func:`record_optimizer_slices`; when that backward runs inside the first call, as in a
  TrainOneStepCell, once the call has written the file); a load file whose non-zero values differ
  from the run's raises naming the parameter;
- ``current_stage`` (0: no pipeline stages), and minidl's own ``format``, ``version``,
  ``parallel_mode`` and ``device_num``.
"""
import contextlib
import hashlib
import json
import os
import threading
import weakref

from minidl.io.parameter_names import checkpoint_name
from minidl.tensor import Parameter

from ..agreement import describe_ranks, disagreement
from .layout import Layout
from .parameters import same_blocks
from .rules.base import StrategyError

__all__ = ["FORMAT", "VERSION", "begin", "running", "active", "Session", "StrategyFile", "layout_item",
           "layout_from_item", "read", "write", "plan_of", "differences", "record_optimizer_slices"]

FORMAT = "minidl strategy checkpoint"
VERSION = 1

_tls = threading.local()  # this rank's (thread's) session of a first call, and what it has done


# ---- the JSON items ---------------------------------------------------------------------------

def layout_item(layout, shape):
    """MindSpore's ``parallel_layout_item`` entry for a parameter of whole ``shape`` laid out as ``layout``."""
    last = len(layout.device_matrix) - 1
    tensor_map = []
    for dim in layout.tensor_map:
        axes = [last - a for a in dim]  # MindSpore counts device-matrix axes from the right
        tensor_map.append(-1 if not axes else axes[0] if len(axes) == 1 else axes)
    return {"dev_matrix": list(layout.device_matrix), "tensor_map": tensor_map, "tensor_shape": list(shape),
            "field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}


def layout_from_item(item, who):
    """(Layout, whole shape) of a ``parallel_layout_item`` entry; ValueError naming ``who`` when malformed."""
    try:
        dev_matrix = [int(s) for s in item["dev_matrix"]]
        last = len(dev_matrix) - 1
        dims = []
        for entry in item["tensor_map"]:
            axes = [entry] if isinstance(entry, int) else list(entry)
            if not all(isinstance(a, int) and not isinstance(a, bool) for a in axes):
                raise ValueError(f"tensor_map entry {entry!r} is not an int or a list of ints")
            dims.append(tuple(last - a for a in axes if a != -1))
        shape = tuple(int(n) for n in item["tensor_shape"])
        layout = Layout(tuple(dev_matrix), tuple(dims))
        layout.check_shape(shape, who)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{who}: not a layout entry (dev_matrix, tensor_map, tensor_shape as MindSpore writes "
                         f"them): {item!r} ({type(e).__name__}: {e})") from None
    return layout, shape


def _strategy_from_item(item, who):
    try:
        strategy = tuple(tuple(item["parallel_strategy"][i]) for i in range(len(item["parallel_strategy"])))
        ok = all(isinstance(c, int) and not isinstance(c, bool) and c >= 1 for s in strategy for c in s)
    except (KeyError, TypeError) as e:
        raise ValueError(f"{who}: not a strategy entry ({{'stage': 0, 'parallel_strategy': [[...], ...]}}): "
                         f"{item!r} ({type(e).__name__}: {e})") from None
    if not ok:
        raise ValueError(f"{who}: every cut of parallel_strategy must be a positive int, got {item!r}")
    return strategy


# ---- reading and writing ----------------------------------------------------------------------

class StrategyFile:
    """A loaded strategy checkpoint: operator strategies and parameter layouts, by name."""

    def __init__(self, path, strategies, layouts, device_num, digest):
        self.path = path
        self.strategies = strategies  # {"MatMul_w1": ((1, 1), (1, 2))}
        self.layouts = layouts        # {"w1": (Layout, whole shape)}
        self.device_num = device_num
        self.digest = digest          # of the bytes read: what the ranks compare


def read(path):
    """The StrategyFile at ``path``; FileNotFoundError or ValueError naming the file and the problem."""
    who = f"strategy_ckpt_config['load_file'] {path!r}"
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{who}: no such file; save one first with strategy_ckpt_config="
                                f"{{'save_file': ...}} (the path is relative to {os.getcwd()!r})")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        content = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{who}: not a JSON strategy checkpoint ({e}); minidl reads the JSON it writes, not "
                         f"MindSpore's protobuf") from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        raise ValueError(f"{who}: not a {FORMAT!r} file (its 'format' is "
                         f"{content.get('format') if isinstance(content, dict) else None!r})")
    if content.get("version") != VERSION:
        raise ValueError(f"{who}: version {content.get('version')!r}, this minidl reads version {VERSION}")
    for section in ("parallel_strategy_item", "parallel_layout_item"):
        if not isinstance(content.get(section, {}), dict):  # (else an AttributeError on one rank leaves the rest waiting)
            raise ValueError(f"{who}: {section} must be an object {{name: entry}}, got "
                             f"{type(content[section]).__name__} {content[section]!r}")
    strategies = {key: _strategy_from_item(item, f"{who}: parallel_strategy_item {key!r}")
                  for key, item in content.get("parallel_strategy_item", {}).items()}
    layouts = {name: layout_from_item(item, f"{who}: parallel_layout_item {name!r}")
               for name, item in content.get("parallel_layout_item", {}).items()}
    return StrategyFile(path, strategies, layouts, content.get("device_num"), hashlib.sha1(raw).hexdigest())


def write(path, layouts, strategies, settings, device_num, rank):
    """Writes the plan to ``path`` (atomically: a temporary file renamed over it)."""
    content = {"format": FORMAT, "version": VERSION, "parallel_mode": settings["parallel_mode"],
               "device_num": device_num, "current_stage": 0,
               "parallel_strategy_item": {key: {"stage": 0, "parallel_strategy": [list(s) for s in strategy]}
                                          for key, strategy in strategies.items()},
               "parallel_layout_item": {name: layout_item(layout, shape) for name, (layout, shape) in layouts.items()}}
    folder = os.path.dirname(path)
    if folder:
        os.makedirs(folder, exist_ok=True)
    temporary = f"{path}.rank{rank}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        f.write(_readable(content))
    os.replace(temporary, path)


def _readable(content):
    """JSON with one line per operator and per parameter (json.dump's indent puts every number on its own)."""
    lines = []
    for key, value in content.items():
        if isinstance(value, dict):
            items = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()]
            lines.append(f" {json.dumps(key)}: {{" + ("\n" + ",\n".join(items) + "\n }" if items else "}"))
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


# ---- the plan and the check -------------------------------------------------------------------

def _layout(param):
    """(layout, whole shape) of ``param``'s tensor-parallel block, or None when no operator placed it.

    A parameter that optimizer parallelism sliced during the first call (a TrainOneStepCell's step)
    carries an OptimizerSlice whose ``inner`` is the block's placement (None: never placed); read
    by attribute, since optimizer_parallel imports this module.
    """
    placement = param.placement
    placement = getattr(placement, "inner", placement)
    return None if placement is None else (placement.layout, placement.shape)


def plan_of(names, only_trainable):
    """{name: (layout, whole shape)} of the placed parameters among ``names`` ({name: Parameter})."""
    plan = {}
    for name, param in names.items():
        entry = _layout(param)
        if entry is not None and (param.requires_grad or not only_trainable):
            plan[name] = entry
    return plan


def differences(names, plan, loaded):
    """What differs between this run's plan and the file's, as one message, or None.

    ``names``: every parameter of the network by name; ``plan``: plan_of(names, ...);
    ``loaded``: the StrategyFile.
    """
    problems = []
    for name, (want, shape) in loaded.layouts.items():
        if name not in names:
            problems.append(f"the file lays out parameter {name!r} of shape {shape} as {want}, but the network has "
                            f"no parameter of that name")
            continue
        entry = _layout(names[name])
        if entry is None:
            problems.append(f"parameter {name!r}: the file lays it out as {want} (shape {shape}), but no sharded "
                            f"operator of this call used it")
            continue
        have, have_shape = entry
        if tuple(have_shape) != tuple(shape):
            problems.append(f"parameter {name!r} has shape {tuple(have_shape)} here but {shape} in the file")
        elif have != want and not same_blocks(have, want, shape):
            problems.append(f"parameter {name!r} of shape {shape} is laid out as {have} here but as {want} in "
                            f"the file")
    for name, (have, shape) in plan.items():
        if name not in loaded.layouts:
            problems.append(f"parameter {name!r} of shape {shape} is laid out as {have} here, but the file has no "
                            f"layout for it")
    if not problems:
        return None
    return (f"strategy_ckpt_config['load_file'] {loaded.path!r}: this run's plan differs from the file's: "
            f"{'; '.join(problems)}. Layouts read (a, -) on [2, 4]: dimension 0 cut along device axis a of a "
            f"2 x 4 device matrix; a shard() strategy wins over the file's, so remove or change the shard() "
            f"calls that differ, or save a new file")


# ---- the session of a first call (dispatch.run_cell) ------------------------------------------

def _agree(comm, what, outcome):
    """Raises on every rank when any rank's ``outcome`` (None: fine, else (error type, message)) is an error.

    Collective: every rank of ``comm`` calls it at the same point.
    """
    found = disagreement(comm, what, outcome)
    if found is None:
        if outcome is not None and outcome[0] != "ok":
            raise _ERRORS.get(outcome[0], StrategyError)(outcome[1])
        return
    raise StrategyError(f"{what}: the ranks differ: {describe_ranks([o for _, o in found], _show_outcome)}; every "
                        f"rank must read the same file and make the same plan")


def _show_outcome(outcome):
    if outcome is None:
        return "fine"
    if outcome[0] == "ok":
        return f"read it (sha1 {outcome[1][:12]})"
    return f"{outcome[0]}: {outcome[1]}"


# the kinds an outcome carries, each before its base classes
_ERRORS = {"FileNotFoundError": FileNotFoundError, "PermissionError": PermissionError, "OSError": OSError,
           "StrategyError": StrategyError, "ValueError": ValueError}


def _failure(error):
    """(kind, message) of an OSError or ValueError: its class's name, else its nearest base's among
    _ERRORS (json's JSONDecodeError is a ValueError, IsADirectoryError an OSError)."""
    return next(name for name, kind in _ERRORS.items() if isinstance(error, kind)), str(error)


class Session:
    """One rank's strategy-file work around a network's first call (see the module docstring)."""

    def __init__(self, cell, comm, settings, config, device_num):
        self.cell, self.comm, self.settings, self.config = cell, comm, settings, config
        self.device_num = device_num
        self.names = {}   # {name: Parameter}: checkpoint names, as checkpoints store them
        for path, param in cell.parameters_and_names():
            self.names.setdefault(checkpoint_name(path, param), param)
        self._name_of = {id(p): n for n, p in self.names.items()}
        # {name the optimizer gave: checkpoint name}: under a wrapper (WithLossCell, TrainOneStepCell)
        # a tree-derived name ("dense.weight") is not the path from the called cell ("_backbone.dense.weight")
        self._name_of_given = {p.name: n for n, p in self.names.items()}
        self.optimizer_slices = None  # recorded during this call (record_optimizer_slices), for finish
        self.strategies = {}  # what this call's operators ran with, MindSpore's keys
        self.loaded = None
        if config["load_file"]:
            outcome = None
            try:
                self.loaded = read(config["load_file"])
                outcome = ("ok", self.loaded.digest)
                if self.loaded.device_num != device_num:
                    # Checked before any operator takes the file's strategies, whose cuts assume its world.
                    outcome = ("ValueError", f"strategy_ckpt_config['load_file'] {self.loaded.path!r}: the file "
                                             f"holds the plan of {self.loaded.device_num} devices, this run has "
                                             f"{device_num}; a strategy file is made for one world size")
            except (OSError, ValueError) as e:
                outcome = _failure(e)
            _agree(comm, "strategy_ckpt_config['load_file']", outcome)

    def key(self, prim, args):
        """MindSpore's key of an operator: its name and its first Parameter's ("MatMul_w1"), or None."""
        for a in args:
            if isinstance(a, Parameter):
                name = self._name_of.get(id(a), a.name)
                return f"{prim.name}_{name}" if name else None
        return None

    def strategy_for(self, prim, args):
        """The file's strategy for an operator without shard(), or None."""
        if self.loaded is None:
            return None
        key = self.key(prim, args)
        return None if key is None else self.loaded.strategies.get(key)

    def record(self, prim, args, strategy):
        key = self.key(prim, args)
        if key is not None and _plain(strategy):
            self.strategies[key] = tuple(tuple(s) for s in strategy)

    def finish(self):
        """After the call: checks the plan against the loaded file, writes the save file; agreed on every rank."""
        plan = plan_of(self.names, self.config["only_trainable_params"])
        outcome = None
        if self.loaded is not None:
            message = differences(self.names, plan, self.loaded)
            outcome = None if message is None else ("StrategyError", message)
        if outcome is None and self.config["save_file"]:
            try:
                write(self.config["save_file"], plan, self.strategies, self.settings, self.device_num,
                      self.comm.rank)
            except OSError as e:
                outcome = _failure(OSError(f"strategy_ckpt_config['save_file'] {self.config['save_file']!r}: "
                                           f"cannot write it: {e}"))
        _agree(self.comm, "strategy checkpoint", outcome)
        _mark_done(self)
        if self.optimizer_slices is not None:  # on every rank: the reducer sliced inside this call
            record_optimizer_slices(self.comm, self.settings, self.optimizer_slices)


def _plain(strategy):
    return isinstance(strategy, tuple) and all(
        isinstance(s, tuple) and all(isinstance(c, int) and not isinstance(c, bool) for c in s) for s in strategy)


def active():
    """This rank's Session during a network's first call, else None."""
    return getattr(_tls, "session", None)


@contextlib.contextmanager
def running(session):
    """Makes ``session`` (or None) this rank's active one for the duration of the call."""
    _tls.session = session
    try:
        yield session
    finally:
        _tls.session = None


def _mark(session_or_config, comm):
    return id(comm), tuple(sorted(session_or_config.items()))


def begin(cell, comm, settings, device_num):
    """The Session of ``cell``'s outermost call when it is the first with a strategy file
    configured (reading the load file: collective), else None.

    The file describes one network: the outermost Cell that holds parameters (a loss called on
    its own has none and is skipped). Two such Cells saving to one path leave the last one's plan,
    as two MindSpore graphs would.

    Once per network, communicator and configuration: a file set between steps is read or written
    at the next call.
    """
    config = settings["strategy_ckpt_config"]
    if not (config["load_file"] or config["save_file"]):
        return None
    if next(iter(cell.parameters_and_names()), None) is None:
        return None  # a loss or another Cell without parameters: no plan of its own to save or check
    done = _tls.__dict__.setdefault("done", weakref.WeakKeyDictionary())
    if _mark(config, comm) in done.get(cell, ()):
        return None
    return Session(cell, comm, settings, config, device_num)


def _mark_done(session):
    done = _tls.__dict__.setdefault("done", weakref.WeakKeyDictionary())
    done.setdefault(session.cell, set()).add(_mark(session.config, session.comm))


def record_optimizer_slices(comm, settings, slices_by_name):
    """Optimizer parallelism's part of the plan: ``slices_by_name`` {name: (size, step)} per sliced
    parameter. Written into the save file (which the first call wrote) and checked against the load
    file's non-zero entries; agreed on every rank, as the first call's check and write.

    Called during the first call (the optimizer of a TrainOneStepCell slices in its first step),
    the slices wait for Session.finish, which writes the save file first and then records them."""
    session = active()
    if session is not None:
        session.optimizer_slices = {session._name_of_given.get(name, name): value
                                    for name, value in slices_by_name.items()}
        return
    config = settings["strategy_ckpt_config"]
    outcome, which = None, "load_file"
    try:
        if config["load_file"]:
            with open(config["load_file"]) as f:
                items = json.load(f).get("parallel_layout_item", {})
            for name, (size, step) in slices_by_name.items():
                item = items.get(name, {})
                want = (item.get("opt_weight_shard_size", 0), item.get("opt_weight_shard_step", 0))
                if want[0] and want != (size, step):
                    outcome = ("StrategyError", f"strategy_ckpt_config['load_file'] {config['load_file']!r}: parameter "
                                                f"{name!r} is sliced for the optimizer over {want[0]} ranks, stride "
                                                f"{want[1]}, in the file, but over {size}, stride {step}, in this run "
                                                f"(parallel_optimizer_config, the world or the layout differ)")
                    break
        which = "save_file"
        if outcome is None and config["save_file"] and os.path.exists(config["save_file"]):
            with open(config["save_file"]) as f:
                content = json.load(f)
            for name, (size, step) in slices_by_name.items():
                item = content.get("parallel_layout_item", {}).get(name)
                if item is not None:
                    item["opt_weight_shard_size"], item["opt_weight_shard_step"] = size, step
            temporary = f"{config['save_file']}.rank{comm.rank}.{os.getpid()}.tmp"
            with open(temporary, "w") as f:
                f.write(_readable(content))
            os.replace(temporary, config["save_file"])
    except (OSError, ValueError) as e:
        outcome = (_failure(e)[0], f"strategy_ckpt_config[{which!r}] {config[which]!r}: cannot read or write its "
                                   f"optimizer slices: {e}")
    _agree(comm, "strategy checkpoint (optimizer slices)", outcome)
