"""The dispatcher: runs every operator of a (semi-)auto parallel network on this rank's blocks.

The parallel runtime (minidl_parallel/runtime.py) calls :func:`run_op` for every primitive
call and :func:`run_cell` for every Cell call while this rank runs SEMI_AUTO_PARALLEL or
AUTO_PARALLEL. For each primitive call it:

1. reads the layouts of the tensor arguments (tensors.py; untagged tensors are whole);
2. takes the strategy: ``.shard()``'s, else a loaded strategy file's (strategy_file.py), else
   AUTO's propagation from the inputs' layouts, else SEMI_AUTO's data-parallel default;
3. asks the op's rule (rules/) for the device matrix and the layouts it needs; a broken rule
   raises here, identically on every rank, before any communication;
4. places Parameters at their first use (parameters.py) and redistributes every other input
   to the layout the op needs (a plan of slices and collectives, recorded for autograd);
5. runs the op locally and tags its output with the output layout (which may be partial);
6. wraps the op's backward so that an input gradient that is only a partial sum over some
   device axes is all-reduced over them (MatMul's weight gradient over the batch axis), which
   keeps the invariant that a tensor's gradient has its layout without partial axes.

The outermost Cell call tags its untagged inputs by ``dataset_strategy`` and reduces partial
outputs, so a loss is whole, and equal, on every rank. Its first call makes the plan, so a
strategy checkpoint is read before it and checked and written after it (strategy_file.py).

Before step 3 of a primitive's first call with a given signature, every rank compares the
parallel context and the strategy it chose (one small ``allgather_object``, once per world
and signature): ranks that call ``shard()`` differently, or set another context, would ask
``split`` for different groups and hang there; they get a StrategyError on every rank naming
each rank's strategy instead.
"""
import copy
import threading
import weakref

from minidl.ops.updates import ApplyMomentum, MultiApplyMomentum
from minidl.tensor import Parameter, Tensor, is_grad_enabled

from .. import context
from ..agreement import describe_ranks, disagreement
from ..pipeline_groups import stage_group
from ..collectives import AllGather, AllReduce, Broadcast, ReduceScatter
from . import counter, strategy_file
from .explain import recording, saving_plan
from .executor import GroupCache, Redistribute
from .layout import Layout
from .parameters import place_parameter
from .redistribution import comm_bytes, plan_redistribution
from .rules import Decomposed, StrategyError, TensorSpec, get_rule
from .rules.base import NoRuleError, Site
from .tensors import get_layout, layout_of, set_layout, tag_input

__all__ = ["run_op", "run_cell", "outermost", "defer_gradient_reduction", "reduction_state", "active_context", "groups", "redistribute", "group_along", "full_value",
           "gather_like"]

_tls = threading.local()
_groups = GroupCache()
# Collectives and redistributions run as they are: they already act on this rank's blocks. So does
# an in-place optimizer update: a parameter's block, its state and its gradient share one layout,
# and a redistributed copy would take the update away from the parameter.
_PASSTHROUGH = (Redistribute, AllReduce, AllGather, ReduceScatter, Broadcast, ApplyMomentum, MultiApplyMomentum)


def _rank_state():
    st = getattr(_tls, "state", None)
    if st is None:
        st = _tls.state = _RankState()
    return st


class _RankState:
    def __init__(self):
        self.depth = 0      # nesting of Cell calls
        self.root = None    # the outermost Cell being called (for operator paths)


def groups():
    """The sub-communicator cache shared by every rank of the process."""
    return _groups


def active_context():
    """(communicator, settings, device_num) when this rank runs (semi-)auto parallel, else None.

    The communicator is the world's, or under a pipeline the ranks of this rank's stage (MindSpore cuts
    each stage over its own devices: device_num // pipeline_stages of them), and device_num its size.
    """
    if not context.tensor_parallel_active():
        return None
    world = context.current_world()
    device_num = context.get_auto_parallel_context("device_num")
    if device_num != world.comm.size:
        raise ValueError(f"tensor parallel: device_num is {device_num} but the world has {world.comm.size} ranks; "
                         f"set_auto_parallel_context(device_num=...) must equal the number of ranks")
    stages = world.settings["pipeline_stages"]
    if stages > 1:
        comm = stage_group(world.comm, stages)[1]
        return comm, world.settings, comm.size
    return world.comm, world.settings, device_num


def _world():
    ctx = active_context()
    return (context.get_communicator() if ctx is None else ctx[0]), _groups


# ---- operators ------------------------------------------------------------------------------

def run_op(prim, args):
    """Runs primitive ``prim`` on this rank's blocks of ``args`` (see the module docstring)."""
    ctx = active_context()
    if ctx is None or isinstance(prim, _PASSTHROUGH):
        return prim.apply(*args)
    return _run_sharded(prim, args, *ctx)


def _path_of(prim):
    """The attribute path of a primitive in the outermost Cell ("dense1.matmul"), or None."""
    root = _rank_state().root
    if root is None:
        return None
    for name, cell in root.cells_and_names():
        for attr, value in vars(cell).items():
            if value is prim:
                return f"{name}.{attr}" if name else attr
    return None


def _who(prim):
    path = _path_of(prim)
    return f"{prim.name} ({path})" if path else prim.name


def _given_strategy(prim, args):
    """(strategy, origin) the user gave: ``shard()``'s, else a loaded strategy file's (MindSpore's
    order: the file fills in operators without one), else (None, None).

    The file is read at the network's first call; the strategy it gave an operator stays the
    operator's (kept on the primitive, per first Parameter), as a MindSpore graph keeps the
    strategies it was compiled with, so later steps cut nothing differently.
    """
    if prim.in_strategy is not None:
        return prim.in_strategy, "shard"
    first = next((id(a) for a in args if isinstance(a, Parameter)), None)
    if first is None:
        return None, None
    kept = prim.__dict__.setdefault("_file_strategies", {})
    session = strategy_file.active()
    loaded = None if session is None else session.strategy_for(prim, args)
    if loaded is not None:
        kept[first] = loaded
    loaded = kept.get(first)
    return (loaded, "strategy file") if loaded is not None else (None, None)


def _choose_strategy(prim, rule, spec_args, specs, current, settings, device_num, given):
    if given[0] is not None:
        return given
    if settings["parallel_mode"] == "auto_parallel":
        layouts = tuple(Layout.replicated(s.ndim, device_num) if cur is None else cur[0]
                        for s, cur in zip(specs, current))
        return rule.propagate(prim, spec_args, layouts, device_num), "propagated"
    return rule.data_parallel(prim, spec_args, device_num), "data parallel"


_AGREED_SETTINGS = ("parallel_mode", "device_num", "dataset_strategy", "gradients_mean", "search_mode")


def _agree_on_strategy(prim, comm, key, strategy, origin, specs, settings):
    """Checks, once per world and call signature, that every rank runs ``prim`` alike (collective).

    Recorded per communicator (not in the decision cache, which ranks sharing one network in
    the threads world share) so that every rank takes part in its own first check.
    """
    agreed = prim.__dict__.setdefault("_strategy_agreed", weakref.WeakKeyDictionary()).setdefault(comm, set())
    if key is not None and key in agreed:
        return
    description = (tuple((k, settings.get(k)) for k in _AGREED_SETTINGS), _who(prim),
                   tuple(s.shape for s in specs), strategy, origin)
    found = disagreement(comm, "strategy", description)
    if found is not None:
        kinds = [kind for kind, _ in found]
        if any(k != kinds[0] for k in kinds):
            raise StrategyError(f"the ranks are running different checks at the same point "
                                f"({describe_ranks(kinds)}): they run different programs or parallel modes")
        described = [d for _, d in found]
        contexts = [dict(d[0]) for d in described]
        for name in _AGREED_SETTINGS:
            if any(c[name] != contexts[0][name] for c in contexts):
                raise StrategyError(f"the ranks' parallel contexts differ before any sub-communicator is split: "
                                    f"{name} is {describe_ranks([c[name] for c in contexts])}; every rank must "
                                    f"call set_auto_parallel_context with the same values")
        raise StrategyError(f"the ranks run this operator differently before any sub-communicator is split: "
                            f"{describe_ranks(described, lambda d: f'{d[1]} on inputs {d[2]}, strategy {d[3]} ({d[4]})')}"
                            f"; every rank must build the same network and call shard() with the same strategy")
    if key is not None:
        agreed.add(key)


def _decide(prim, rule, spec_args, specs, current, settings, device_num, comm, given):
    """(strategy, origin, sharding) of a call, cached on the primitive per call signature.

    A network calls the same primitives with the same shapes and layouts every step, and
    rules are pure functions of those, so each decision is made once.
    """
    key = (settings["parallel_mode"], given, spec_args,
           tuple(None if c is None else c[0] for c in current), device_num)
    cache = prim.__dict__.setdefault("_sharding_cache", {})
    try:
        hit = cache.get(key)
    except TypeError:  # an unhashable argument (a list, an array): decide every time
        key, hit = None, None
    if hit is None:
        strategy, origin = _choose_strategy(prim, rule, spec_args, specs, current, settings, device_num, given)
        _agree_on_strategy(prim, comm, key, strategy, origin, specs, settings)  # before infer, which may raise
        try:
            hit = (strategy, origin, rule.infer(prim, spec_args, strategy, device_num))
        except StrategyError as e:
            e.strategy, e.origin = strategy, origin  # for the caller's message
            raise
        if key is not None:
            cache[key] = hit
    else:  # decided by another rank sharing this primitive (threads world), or agreed already
        _agree_on_strategy(prim, comm, key, hit[0], hit[1], specs, settings)
    return hit


def _run_sharded(prim, args, comm, settings, device_num):
    positions = [i for i, a in enumerate(args) if isinstance(a, Tensor)]
    current, specs = [], []
    grad = is_grad_enabled()
    for i in positions:
        a = args[i]
        entry = get_layout(a)
        if entry is None and isinstance(a, Parameter):
            current.append(None)  # not placed yet: whole on every rank
            specs.append(TensorSpec(tuple(a.shape), a.dtype, True, grad and a.requires_grad))
        else:
            cur = entry if entry is not None else layout_of(a, device_num)
            current.append(cur)
            specs.append(TensorSpec(cur[1], a.dtype, isinstance(a, Parameter), grad and a.requires_grad))
    spec_args = list(args)
    for i, s in zip(positions, specs):
        spec_args[i] = s
    spec_args = tuple(spec_args)
    try:
        rule = get_rule(prim)
    except NoRuleError as e:
        raise NoRuleError(f"{_who(prim)}: {e}") from None
    strategy = origin = None
    given = _given_strategy(prim, args)
    try:
        strategy, origin, sharding = _decide(prim, rule, spec_args, specs, current, settings, device_num, comm,
                                             given)
    except StrategyError as e:
        strategy, origin = getattr(e, "strategy", given[0]), getattr(e, "origin", given[1])
        shapes = ", ".join(str(s.shape) for s in specs)
        raise StrategyError(f"{_who(prim)}: inputs of shapes {shapes}, strategy {strategy} ({origin}), "
                            f"device_num {device_num}: {e}") from None
    session = strategy_file.active()
    if session is not None:
        session.record(prim, args, strategy)
    record = recording()
    if isinstance(sharding, Decomposed):
        if record is not None:
            record.decomposed(_who(prim), strategy, origin, sharding.description)
        return sharding.fn(*args)

    rank = comm.rank
    for k, (i, need) in enumerate(zip(positions, sharding.in_layouts)):
        if isinstance(args[i], Parameter) and current[k] is not None and current[k][0] != need:
            place_parameter(args[i], need, specs[k].shape, rank, _who(prim))  # raises: before any communication
    local_args = list(args)
    moves = []
    for k, (i, need) in enumerate(zip(positions, sharding.in_layouts)):
        if isinstance(args[i], Parameter):
            # Parameters never move: the first use cuts them, later uses must agree with it.
            place_parameter(args[i], need, specs[k].shape, rank, _who(prim))
            moves.append((specs[k], current[k] and current[k][0], need, None))
            continue
        have, shape = current[k]
        plan = None
        if have != need:
            plan = plan_redistribution(have, need, shape, args[i].dtype.itemsize)
            if plan.moves_data:  # else only device axes are renamed ([2, 4, 1] -> [2, 4])
                local_args[i] = Redistribute(plan, comm, _groups)(args[i])
        moves.append((specs[k], have, need, plan))

    if sharding.localize is not None:
        arrays = [a.data if isinstance(a, Tensor) else a for a in local_args]
        new = list(sharding.localize(sharding.out_layout.coords(rank), list(arrays)))
        for i, (old, value) in enumerate(zip(arrays, new)):
            if i in positions:
                if value is not old:
                    assert not local_args[i].requires_grad, "localize may only rewrite tensors without gradient"
                    local_args[i] = Tensor(value)
            else:
                local_args[i] = value
    op = prim
    attrs = sharding.local_attrs
    if callable(attrs):
        attrs = attrs(Site(sharding.out_layout.coords(rank), group_along))
    if attrs:
        op = copy.copy(prim)
        op.__dict__.update(attrs)
    out = op.apply(*local_args)
    if out.grad_fn is not None:
        _wrap_backward(out.grad_fn, sharding, positions, comm, args)
    set_layout(out, sharding.out_layout, sharding.out_layout.global_shape(tuple(out.shape)))
    if record is not None:
        record.operator(_who(prim), strategy, origin, sharding, moves, get_layout(out)[1], tuple(out.data.shape))
    return out


def _partial_axes_of_gradient(sharding, k):
    """Device axes over which input k's local gradient is only a partial sum (see step 6)."""
    layout = sharding.in_layouts[k]
    cut = {a for dim in layout.tensor_map for a in dim}
    return tuple(a for a, size in enumerate(layout.device_matrix)
                 if size > 1 and a not in cut and a not in sharding.repeat_axes)


# Parameters whose partial gradients the optimizer-parallel reducer reduce-scatters itself (level2):
# {id(param): [weak reference, ranks of its slice group, what this step's backward left]}, the last
# None (nothing yet), "partial" (every contribution left partial over exactly those ranks),
# "complete" (all-reduced here) or "mixed". Keyed by id: each rank (thread) has its own parameters.
_deferred = {}


def defer_gradient_reduction(param, ranks):
    """From now on, a partial gradient of ``param`` over exactly ``ranks`` is left partial for the caller."""
    entry = _deferred.get(id(param))
    if entry is not None and entry[0]() is param and entry[1] == tuple(ranks):
        return  # (a new reducer with the same plan, at its first call: keep what this step's backward left)
    _deferred[id(param)] = [weakref.ref(param), tuple(ranks), None]


def reduction_state(param):
    """What the backward since the last call left for a deferred ``param`` (see ``_deferred``); cleared."""
    entry = _deferred.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    state, entry[2] = entry[2], None
    return state


def _deferred_entry(arg):
    entry = _deferred.get(id(arg)) if isinstance(arg, Parameter) else None
    return entry if entry is not None and entry[0]() is arg else None


def _note(entry, state):
    entry[2] = state if entry[2] in (None, state) else "mixed"


def _wrap_backward(node, sharding, positions, comm, args):
    """Runs the op's backward in the backward phase, then all-reduces its partial input gradients."""
    reductions = {}
    noted = {}  # input -> (deferred entry, its state this op leaves: "partial" or "complete")
    needs = getattr(node, "needs_grad", None)
    for k, i in enumerate(positions):
        axes = _partial_axes_of_gradient(sharding, k)
        entry = _deferred_entry(args[i])
        if entry is not None and (needs is None or needs[i]):
            ranks = sharding.in_layouts[k].group(comm.rank, axes) if axes else None
            partial = ranks is not None and tuple(ranks) == entry[1]
            noted[i] = (entry, "partial" if partial else "complete")
            if partial:
                continue  # the optimizer-parallel reducer reduce-scatters it
        # An input that takes no gradient (a mask, a constant) must not cost a collective, even
        # when the op's backward returns one for it.
        if axes and (needs is None or needs[i]):
            reductions[i] = (sharding.in_layouts[k], axes)
    local_backward = node.backward

    def backward(gy):
        with counter.backward_phase():
            grads = list(local_backward(gy))
            for i, (layout, axes) in reductions.items():
                if grads[i] is None:
                    continue
                ranks = layout.group(comm.rank, axes)
                group = _groups.get(comm, ranks)
                if group is not None:
                    grads[i] = group.allreduce(grads[i], "sum")
                    counter.record("allreduce", len(ranks), comm_bytes("allreduce", grads[i].nbytes, len(ranks)))
            for i, (entry, state) in noted.items():
                if grads[i] is not None:
                    _note(entry, state)
        return tuple(grads)

    node.backward = backward  # the instance attribute shadows the class's backward for this call only


# ---- cells ----------------------------------------------------------------------------------

def outermost():
    """Whether the next Cell call on this rank is the outermost one (no Cell is running)."""
    return _rank_state().depth == 0


def run_cell(cell, args, kwargs, root=None):
    """Runs a Cell; the outermost call tags its inputs and makes its partial outputs whole. ``root``: the
    network the operators' paths in messages start from (default: the outermost Cell; a pipeline stage's
    cell is outermost here, its network the root)."""
    ctx = active_context()
    if ctx is None:
        return cell.construct(*args, **kwargs)
    comm, settings, device_num = ctx
    st = _rank_state()
    outermost = st.depth == 0
    if outermost:
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, Tensor) and not isinstance(a, Parameter):
                tag_input(a, settings["dataset_strategy"], device_num)
        st.root = cell if root is None else root
    st.depth += 1
    try:
        if outermost:
            # The plan is made during the first call (each operator's strategy, each parameter's
            # layout at its first use): a strategy file is read before it and written after it.
            session = strategy_file.begin(cell, comm, settings, device_num)
            with strategy_file.running(session), saving_plan(cell, list(args) + list(kwargs.values()),
                                                             comm.rank, settings):
                out = _complete(cell.construct(*args, **kwargs))
            if session is not None:
                session.finish()
        else:
            out = cell.construct(*args, **kwargs)
    finally:
        st.depth -= 1
    return out


def _complete(out):
    """Reduces partial outputs of the outermost Cell (a loss becomes whole on every rank)."""
    if isinstance(out, (tuple, list)):
        return type(out)(_complete(o) for o in out)
    if isinstance(out, Tensor):
        entry = get_layout(out)
        if entry is not None and entry[0].partial:
            return redistribute(out, entry[0].without_partial())
    return out


def group_along(layout, axes):
    """The communicator of this rank and the ranks that differ from it only along ``axes`` of ``layout``.

    Used by ops that synchronise inside their own forward (BatchNorm with the batch cut).
    """
    comm = active_context()[0]
    group = _groups.get(comm, layout.group(comm.rank, axes))
    return None if group is None else counter.CountedGroup(group)


def redistribute(tensor, layout):
    """Returns ``tensor`` moved to ``layout`` (differentiable; every rank must call it)."""
    comm = _world()[0]
    device_num = comm.size
    have, shape = layout_of(tensor, device_num)
    if have == layout:
        return tensor
    plan = plan_redistribution(have, layout, shape, tensor.dtype.itemsize)
    out = Redistribute(plan, comm, _groups)(tensor) if plan.moves_data else _alias(tensor)
    set_layout(out, layout, shape)
    return out


def _alias(tensor):
    """A new Tensor over the same block (so it can carry another placement), differentiable."""
    from minidl import ops
    return ops.Reshape().apply(tensor, tuple(tensor.data.shape))  # the block's shape; apply: not dispatched again


def full_value(tensor):
    """The whole logical value of ``tensor`` as an array on every rank (every rank must call it)."""
    entry = get_layout(tensor)
    if entry is None:
        return tensor.data
    comm, groups = _world()
    from .executor import gather_full
    return gather_full(tensor.data, entry[0], entry[1], comm, groups)


def gather_like(value, like):
    """The whole value of ``value`` (a Tensor or array laid out as tensor ``like``: a gradient)."""
    array = value.data if isinstance(value, Tensor) else value
    entry = get_layout(like)
    if entry is None:
        return array
    comm, groups = _world()
    from .executor import gather_full
    return gather_full(array, entry[0].without_partial(), entry[1], comm, groups)
