"""The runtime: the one object the core asks, at the moment of use, how to run in parallel.

minidl itself is single-device. Everything a parallel package changes goes through the
:class:`Runtime` that is active when the question comes up, never through state captured
when a Model, dataset or optimizer was built:

- running an operator (``Primitive.__call__``) and a Cell (``Cell.__call__``);
- reducing gradients in ``Model.train`` (asked at the start of every ``train``/``fit``);
- the rank and world size for logs, progress and checkpoints;
- the whole value of a tensor that holds only this rank's block (checkpoints), and the
  block of a whole value (loading, optimizer state);
- the cross-rank sums of evaluation metrics, and decisions every rank must share
  (whether to save a checkpoint now);
- whether training steps are collective (``trains_in_lockstep``), and every rank's small
  value (``gather``), with which ``Model.train`` agrees the ranks' step counts.

The base class is the single-device runtime, and it is what :func:`get_runtime` returns
when nothing is installed. A parallel package subclasses it and installs its instance with
``with runtime:`` (or :func:`set_runtime`): for the calling thread (the threads world of
tests runs one rank per thread) or for the whole process (one rank per process under
mpirun). A thread's own runtime wins over the process's. ``minidl`` never imports
``minidl_parallel``; the arrow goes one way.

Runtimes compose: an execution mode that changes how ops run but not where (GRAPH_MODE's
fusion, minidl/graph_mode/) is a :class:`Layered` runtime over the one that places the work.
:func:`set_mode_layer` installs it for the process; :func:`get_runtime` then returns it
wrapped around the placing runtime the thread would otherwise get (the local one, or a
parallel one), and everything the layer does not change goes to that inner runtime.

Example:
    >>> class Counting(Runtime):
    ...     calls = 0
    ...     def call_op(self, prim, args):
    ...         Counting.calls += 1
    ...         return prim.apply(*args)
    >>> with Counting():
    ...     y = ops.relu(Tensor([1.0, -1.0]))
"""
import threading

__all__ = ["Runtime", "Layered", "get_runtime", "set_runtime", "set_mode_layer", "mode_layer", "LOCAL"]


class Runtime:
    """The single-device runtime; parallel runtimes override what they change.

    Every method is asked at the moment of use, on the calling thread.
    """

    name = "local"
    intercepts_ops = False  # True: call_op does more than prim.apply (so fused shortcuts must not bypass it)
    # True: a mode's layer (GRAPH_MODE) is not put over this runtime: it sees every op and Cell call as
    # the user's code makes them (a pipeline stage's forward, which places its own work and runs the
    # mode's layer itself inside the stage's cells).
    layers_pass_through = False

    # ---- where this process stands ----------------------------------------------------------

    def rank(self):
        """This rank in the world (0 on one device)."""
        return 0

    def group_size(self):
        """The number of ranks in the world (1 on one device)."""
        return 1

    # ---- running the network ----------------------------------------------------------------

    def call_op(self, prim, args):
        """Runs primitive ``prim`` on ``args`` (Tensors and Python values) and returns its Tensor."""
        return prim.apply(*args)

    def call_cell(self, cell, args, kwargs):
        """Runs ``cell.construct(*args, **kwargs)``."""
        return cell.construct(*args, **kwargs)

    def settle(self):
        """Runs whatever this runtime left pending on this thread (the end of a function under
        ``value_and_grad`` / ``grad``): nothing on the local runtime."""

    @property
    def placing(self):
        """The runtime that decides where work runs: itself, or a layer's innermost runtime."""
        return self

    # ---- training ---------------------------------------------------------------------------

    def grad_reducer(self, parameters):
        """The gradient reducer ``Model.train`` uses for ``parameters`` when given none, or None.

        Asked at the start of every ``train`` / ``fit``, so a mode set after the Model was
        built takes effect (and one the Model cannot follow raises there).
        """
        return None

    # ---- sharded state ----------------------------------------------------------------------

    def full_value(self, tensor):
        """The whole value of ``tensor`` as an array (a collective when it holds a block)."""
        self._refuse_sharded(tensor, "full_value")
        return tensor.data

    def local_value(self, tensor, value):
        """The part of the whole ``value`` that ``tensor`` holds on this rank (loading a checkpoint)."""
        self._refuse_sharded(tensor, "local_value")
        return value

    def follow(self, param, buffer):
        """The block of ``buffer`` (made whole) that matches ``param``'s block (optimizer state)."""
        self._refuse_sharded(param, "follow")
        raise ValueError(f"optimizer state {getattr(buffer, 'name', '?')!r} has shape {tuple(buffer.shape)} but its "
                         f"parameter {getattr(param, 'name', '?')!r} has shape {tuple(param.shape)}")

    def sum_over_slices(self, tensors, partials, who):
        """The sums over whole tensors, from ``partials[i]``: a sum over what ``tensors[i]`` holds on
        this rank (a norm's squares). A tensor holding one rank's slice (optimizer parallelism)
        gets the sum over the ranks holding its slices (a collective); a whole one keeps its own.
        ``who`` names the caller in errors (LARS, clip_by_global_norm)."""
        for tensor in tensors:
            if tensor.placement is not None:
                raise ValueError(f"{who}: parameter {getattr(tensor, 'name', None)!r} of shape {tuple(tensor.shape)} "
                                 f"is sharded (this rank holds a block of shape {tuple(tensor.data.shape)}), and no "
                                 f"parallel runtime that can sum its blocks is active")
        return partials

    @staticmethod
    def _refuse_sharded(tensor, what):
        placement = getattr(tensor, "placement", None)
        if placement is not None:
            name = getattr(tensor, "name", None)
            named = f" {name!r}" if name else ""
            raise RuntimeError(f"{what}: tensor{named} holds one rank's block {tuple(tensor.data.shape)} of a "
                               f"sharded tensor {placement}, but no parallel runtime is active on this thread "
                               f"(was minidl_parallel.release() called?)")

    # ---- agreement across ranks -------------------------------------------------------------

    def sum_over_ranks(self, values):
        """The element-wise sum over ranks of a 1-d float64 NumPy array (every rank must call)."""
        return values

    def agree(self, value):
        """Rank 0's ``value`` (a bool or a small int), on every rank (every rank must call)."""
        return value

    def gather(self, value):
        """Every rank's small picklable ``value`` (counts, names), as a list in rank order (every rank must call)."""
        return [value]

    def trains_in_lockstep(self):
        """Whether every training step communicates with the other ranks (data or tensor parallelism).

        When True, every rank must run the same number of steps: ``Model.train`` agrees them.
        """
        return False

    # ---- checkpoints --------------------------------------------------------------------------

    def checkpoint_segment(self, network):
        """What of ``network`` this rank's training checkpoint leaves out, or None to save it all.

        Asked by ``ModelCheckpoint`` and ``save_train_state`` (and ``restore_train_state``, to know
        what a file of this rank must hold). A runtime whose ranks hold stale copies of parameters
        that other ranks train (a pipeline's other stages) answers an object with ``stale``, the ids
        of those parameters (left out, and their optimizer state too), and ``metadata``, a dict of
        str -> int/str recording the layout in the file. The single-device runtime saves everything.
        """
        return None

    def reports_loss(self):
        """Whether this rank prints the training loss (LossMonitor): every rank has its own, except that
        the stages of a pipeline share their last stage's, which one stage prints."""
        return True

    # ---- installing ---------------------------------------------------------------------------

    def __enter__(self):
        # The runtime it replaces goes on this thread's stack, not on self: one runtime (LOCAL,
        # say) may be entered by several threads at once, and nested in one.
        _thread.entered.append(set_runtime(self, scope="thread"))
        return self

    def __exit__(self, *exc):
        set_runtime(_thread.entered.pop(), scope="thread")
        return False

    def __repr__(self):
        return f"<{type(self).__name__} {self.name}: rank {self.rank()} of {self.group_size()}>"


LOCAL = Runtime()


class Layered(Runtime):
    """A runtime over another (``inner``): what a subclass does not override goes to ``inner``.

    A layer changes how ops run (it overrides ``call_op``, ``call_cell``, ``settle``) and passes
    every other question (rank, gradient reducer, sharded values, agreement) to the runtime it
    wraps, so it composes with the local runtime and with any parallel one alike. Attributes a
    parallel runtime adds (its ``world``, ``scope``) are read through to it too.
    """

    intercepts_ops = True

    def __init__(self, inner):
        self.inner = inner
        self.name = f"{type(self).__name__} over {inner.name}"

    def __getattr__(self, name):  # only for attributes Runtime does not define: the inner's own
        return getattr(self.__dict__["inner"], name)

    @property
    def placing(self):
        return self.inner.placing

    def settle(self):
        self.inner.settle()


def _passed_to_inner(name):
    def method(self, *args):
        return getattr(self.inner, name)(*args)
    method.__name__ = name
    method.__doc__ = f"The inner runtime's ``{name}``."
    return method


for _name in ("rank", "group_size", "call_op", "call_cell", "grad_reducer", "full_value", "local_value",
              "follow", "sum_over_slices", "sum_over_ranks", "agree", "gather", "trains_in_lockstep",
              "checkpoint_segment", "reports_loss"):
    setattr(Layered, _name, _passed_to_inner(_name))

class _ThreadState(threading.local):
    # Class-level defaults: reading a missing attribute of a threading.local costs ~350 ns (an
    # AttributeError inside), found here it costs ~40, and every op and Cell call reads it.
    runtime = None  # this thread's own runtime, if any

    def __init__(self):
        self.entered = []  # runtimes replaced by ``with runtime:`` blocks still open, innermost last


_process = {"runtime": None, "layer": None}
_thread = _ThreadState()


def get_runtime():
    """The runtime active on this thread: its own, else the process's, else the local one; with
    a mode's layer installed (:func:`set_mode_layer`), that layer over it."""
    placing = _thread.runtime or _process["runtime"] or LOCAL
    layer = _process["layer"]
    return placing if layer is None or placing.layers_pass_through else layer(placing)


def mode_layer():
    """The mode's layer installed by :func:`set_mode_layer` (``runtime -> Layered runtime``), or None."""
    return _process["layer"]


def set_mode_layer(layer):
    """Installs ``layer`` (None removes it) for the process: ``layer(runtime)`` returns the
    :class:`Layered` runtime to use over ``runtime`` (the same object for the same runtime, so
    it can keep state per thread); returns the previous one. GRAPH_MODE installs its layer here
    when the mode is set."""
    if layer is not None and not callable(layer):
        raise TypeError(f"set_mode_layer: layer must be callable (runtime -> Layered runtime) or None, got "
                        f"{type(layer).__name__}")
    previous = _process["layer"]
    _process["layer"] = layer
    return previous


def set_runtime(runtime, scope="process"):
    """Installs ``runtime`` (None removes it) for this thread or for the process; returns the previous one.

    Args:
        runtime: a :class:`Runtime`, or None.
        scope: "thread" (only the calling thread sees it) or "process" (every thread without
            its own).
    """
    if runtime is not None and not isinstance(runtime, Runtime):
        raise TypeError(f"set_runtime: runtime must be a minidl.runtime.Runtime or None, got "
                        f"{type(runtime).__name__}")
    if scope == "thread":
        previous = _thread.runtime
        _thread.runtime = runtime
    elif scope == "process":
        previous = _process["runtime"]
        _process["runtime"] = runtime
    else:
        raise ValueError(f"set_runtime: scope must be 'thread' or 'process', got {scope!r}")
    return previous
