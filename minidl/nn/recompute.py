"""Recompute (``Cell.recompute()``): a cell keeps only its inputs in forward and runs again in backward.

The forward runs the cell's own ``construct`` with recording off, so none of its activations
is kept, and records ONE node in the graph (``_Recomputation``) whose inputs are the cell's
tensor arguments and its trainable parameters. When backward reaches that node, it runs
``construct`` again on the saved inputs with recording on, backpropagates the node's incoming
gradient through that sub-graph, and returns the gradients of the arguments and parameters, so
they reach the same places (``value_and_grad``'s weights, ``.grad``, a data-parallel reducer's
``on_grad_ready``) as without recompute. The activations of one recomputed cell live only while
its own backward runs.

The second run must compute what the first did, and leave the rest of the step as the first
left it:

- random numbers: the framework generator's state (``backend.rng()``, which also seeds the CuPy
  draws) and the own generators of seeded ``ops.Dropout`` primitives in the cell are saved
  before the forward, put back for the re-run, and set again afterwards to where backward found
  them, so the masks are the forward's and the next step draws what it would have drawn;
- state the forward updates (BatchNorm's moving statistics: the cell's parameters that do not
  require grad) is copied before the re-run and written back after it: one update per step.

As MindSpore's (``internal_params = block.trainable_params()``), the node's parameters are the
cell's ``trainable_params()``; a tensor that needs a gradient and is neither an argument nor a
parameter of the cell (a parameter of another cell read through a closure) cannot be given its
gradient, and backward raises naming it rather than dropping it.
"""
import contextlib
import copy
import weakref

from .. import backend
from ..autograd import _toposort, run_backward
from ..ops.dropouts import Dropout
from ..tensor import Tensor, _grad_mode, no_grad

# MindSpore's **kwargs of Cell.recompute: all three steer communication in its graph compiler.
_COMM_KWARGS = ("mp_comm_recompute", "parallel_optimizer_comm_recompute", "recompute_slice_activation")


def set_recompute(cell, use_reentrant=True, output_recompute=False, early_stop=True, context_fn=None, **kwargs):
    """Makes ``cell`` recompute itself in backward (``Cell.recompute``: its docstring has the Args).

    Everything is validated before anything changes. Calling it again replaces the settings.
    """
    for key in kwargs:
        if key not in _COMM_KWARGS:
            raise ValueError(f"For 'recompute', keyword '{key}' is not recognized! the key kwargs must be "
                             f"'mp_comm_recompute', 'parallel_optimizer_comm_recompute', 'recompute_slice_activation'")
    for name, value in [("use_reentrant", use_reentrant), ("output_recompute", output_recompute),
                        ("early_stop", early_stop)] + sorted(kwargs.items()):
        # (MindSpore lets None through its type check for the communication flags: so does minidl)
        if not isinstance(value, bool) and not (name in _COMM_KWARGS and value is None):
            raise TypeError(f"recompute: {name} must be a bool, got {value!r} ({type(value).__name__})")
    if output_recompute:
        use_reentrant = False  # as MindSpore: output_recompute goes through its non-reentrant path
    if context_fn is not None:
        if use_reentrant:
            raise ValueError("recompute: context_fn is only supported when use_reentrant=False "
                             f"(got context_fn={context_fn!r} with use_reentrant=True)")
        if not callable(context_fn):
            raise TypeError(f"recompute: context_fn must be a callable returning two context managers "
                            f"(forward, recomputation), got {type(context_fn).__name__}")
    previous = cell.__dict__.get("construct")
    original = previous.original if isinstance(previous, _RecomputedConstruct) else previous
    # An instance attribute: every path that runs the cell (Cell.__call__, a runtime's call_cell)
    # calls ``cell.construct``, so no runtime needs to know about recompute.
    object.__setattr__(cell, "construct", _RecomputedConstruct(cell, original, context_fn))


def run_recomputed(cell, args, kwargs, context_fn):
    """Runs ``cell(*args, **kwargs)`` once as a recomputed cell with ``context_fn``'s two contexts
    (``cell.recompute(use_reentrant=False, context_fn=context_fn)`` for this call only), leaving
    the cell unchanged: a runtime's ``call_cell`` uses it to hold state only while the cell runs
    (optimizer parallelism's level3 gathers the cell's weights in both contexts)."""
    return _RecomputedConstruct(cell, cell.__dict__.get("construct"), context_fn)(*args, **kwargs)


class _RecomputedConstruct:
    """What ``cell.construct`` becomes: the forward with recording off, and one recorded node.

    It holds the cell weakly (cell -> its construct -> cell would be a reference cycle, keeping
    a dropped network's parameters until the garbage collector ran); ``__reduce__`` makes copies
    and pickles of the cell hold their own cell.
    """

    def __init__(self, cell, original=None, context_fn=None):
        self._cell = weakref.ref(cell)
        self.original = original  # an instance construct the cell had before, else None (its class's)
        self.context_fn = context_fn

    def __reduce__(self):
        return type(self), (self._cell(), self.original, self.context_fn)

    def run_original(self, cell, args, kwargs):
        if self.original is not None:
            return self.original(*args, **kwargs)
        return type(cell).construct(cell, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        cell = self._cell()
        if not _grad_mode.enabled:  # no_grad, inference, or inside another recomputed cell's forward
            return self.run_original(cell, args, kwargs)
        params = cell.trainable_params()
        if not params and not any(isinstance(a, Tensor) and a.requires_grad
                                  for a in list(args) + list(kwargs.values())):
            return self.run_original(cell, args, kwargs)  # nothing to differentiate: no graph to save
        forward_context, recompute_context = (self.context_fn() if self.context_fn is not None
                                              else (contextlib.nullcontext(), contextlib.nullcontext()))
        random_state = _save_random_state(cell)
        with forward_context, no_grad():
            out = self.run_original(cell, args, kwargs)
        if not isinstance(out, Tensor):
            raise TypeError(f"recompute: {_describe(cell)} returned {type(out).__name__}; a recomputed cell "
                            f"must return one Tensor")
        if out.dtype.kind not in "fc":
            return out  # (integer outputs carry no gradient: nothing to recompute for)
        node = _Recomputation(self, cell, args, kwargs, params, random_state, recompute_context)
        result = Tensor._wrap(out.data, node)
        result.placement = out.placement
        return result


class _Recomputation:
    """The node a recomputed cell records: ``inputs`` and ``backward(gy)`` as an op's node.

    Positions: the positional arguments, then the keyword arguments' values, then the parameters.
    """

    def __init__(self, construct, cell, args, kwargs, params, random_state, recompute_context):
        self.construct = construct
        self.cell = cell  # held strongly: the graph keeps what its backward runs (as an op's node does)
        self.args = args
        self.kwargs = kwargs
        self.params = params
        self.random_state = random_state
        self.recompute_context = recompute_context
        values = list(args) + list(kwargs.values()) + list(params)
        self.inputs = tuple((i, t) for i, t in enumerate(values) if isinstance(t, Tensor) and t.requires_grad)

    def backward(self, gy):
        cell = self.cell
        args = [_detached(a) for a in self.args]
        kwargs = {k: _detached(v) for k, v in self.kwargs.items()}
        params = self.params
        targets = [t for t in args + list(kwargs.values()) + params if isinstance(t, Tensor) and t.requires_grad]
        state_after_forward = [(p, p.data.copy()) for p in cell.get_parameters() if not p.requires_grad]
        random_state_now = _save_random_state(cell)
        _restore_random_state(self.random_state)
        enabled = _grad_mode.enabled
        _grad_mode.enabled = True
        try:
            with self.recompute_context:
                out = self.construct.run_original(cell, args, kwargs)
                if isinstance(out, Tensor):
                    out.data  # noqa: B018  (a GRAPH_MODE op still pending on the output runs now, recording its node)
        finally:
            _grad_mode.enabled = enabled
            _restore_random_state(random_state_now)
            for p, value in state_after_forward:
                # (Reading p.data first runs a GRAPH_MODE BatchNorm still pending on it: its update
                # comes before the write-back, as eager's order.)
                p.data[...] = value
        _check_reached(cell, out, targets)
        grads, _ = run_backward(out, gy, targets=targets)
        values = list(args) + list(kwargs.values()) + params
        return tuple(grads.get(id(t)) if isinstance(t, Tensor) else None for t in values)


def _detached(a):
    """An argument for the re-run: a Tensor cut from the outer graph (a leaf whose gradient the
    re-run's backward returns), other values as they are."""
    if not isinstance(a, Tensor):
        return a
    t = Tensor._wrap(a.data)
    t.requires_grad = a.requires_grad
    t.placement = a.placement
    return t


def _check_reached(cell, out, targets):
    """Every leaf the re-run's graph reaches that needs a gradient must be one whose gradient the
    node returns: otherwise its gradient would be silently lost."""
    known = {id(t) for t in targets}
    for t in _toposort(out):
        if t._node is None and t.requires_grad and id(t) not in known:
            name = getattr(t, "name", None)
            what = f"parameter {name!r}" if name else f"a tensor of shape {t.shape}"
            raise RuntimeError(f"recompute: {_describe(cell)} used {what}, which needs a gradient but is neither "
                               f"an argument of the cell nor one of its trainable_params(); pass it as an "
                               f"argument, or make it a parameter of the cell")


def _seeded_dropouts(cell):
    """The ops.Dropout primitives with their own seeds held by the cell and its sub-cells."""
    return [v for _, c in cell.cells_and_names() for v in vars(c).values()
            if isinstance(v, Dropout) and (v.seed0 or v.seed1)]


def _save_random_state(cell):
    """What the cell's random draws depend on: the framework generator's state, and a copy of
    each seeded Dropout's own generators (a primitive's dict, shared by its calls)."""
    return (backend.rng().bit_generator.state,
            [(d._generators, {k: copy.deepcopy(g) for k, g in d._generators.items()}) for d in _seeded_dropouts(cell)])


def _restore_random_state(state):
    framework, seeded = state
    backend.rng().bit_generator.state = framework
    for generators, saved in seeded:
        generators.clear()  # (one made during the forward goes: the re-run makes it again from its seeds)
        generators.update(copy.deepcopy(saved))  # (a copy: a second backward, retain_graph=True, starts over)


def _describe(cell):
    path = cell.__dict__.get("_prefix", "").rstrip(".")
    return f"{type(cell).__name__} {path!r}" if path else type(cell).__name__
