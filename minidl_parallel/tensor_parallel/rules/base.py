"""What a sharding rule is, and the helpers every rule shares.

A rule knows, for one primitive class (looked up by the exact class: a subclass computes
something else, so it has its own rule or none), how a strategy turns into layouts:

    rule.infer(prim, args, strategy, device_num)  -> OpSharding or Decomposed
    rule.data_parallel(prim, args, device_num)     -> strategy   (SEMI_AUTO: ops without one)
    rule.propagate(prim, args, layouts, device_num) -> strategy  (AUTO: follow the inputs)

``args`` are the primitive's positional arguments with every Tensor replaced by a
:class:`TensorSpec` (its GLOBAL shape, dtype, whether it is a Parameter); other arguments
(axis, shape, dtype ...) are passed as given. ``strategy`` has one tuple of cuts per tensor
argument, in order. ``layouts`` (propagate) are the current layouts of the tensor arguments.

A rule raises :class:`StrategyError` with the rule that was broken ("dimension 1 of input 0
has size 30, not divisible by its cut 4"); the dispatcher adds the operator, its Cell path,
the input shapes, the strategy and device_num to the message.
"""
from dataclasses import dataclass, field
from math import prod

from ..layout import Layout

__all__ = ["TensorSpec", "OpSharding", "Decomposed", "Site", "StrategyError", "NoRuleError", "Rule", "RULES",
           "register", "get_rule", "device_matrix_for", "tensor_specs", "check_counts", "check_strategy_shape",
           "largest_cut"]


class StrategyError(ValueError):
    """A strategy that breaks a sharding rule (raised identically on every rank, before any communication)."""


class NoRuleError(NotImplementedError):
    """An operator with no sharding rule was used in a (semi-)auto parallel network."""


@dataclass(frozen=True)
class TensorSpec:
    """What a rule sees of a tensor argument: its global (logical) shape and dtype."""

    shape: tuple
    dtype: object
    is_parameter: bool = False
    requires_grad: bool = True  # False: no gradient will flow to it (cheaper rules may apply)

    @property
    def ndim(self):
        return len(self.shape)


@dataclass(frozen=True)
class OpSharding:
    """How one call of an operator runs under a strategy.

    Attributes:
        strategy: the strategy (one tuple of cuts per tensor argument).
        in_layouts: the layout each tensor argument must have (never partial).
        out_layout: the layout of what the local computation returns (may be partial:
            MatMul with K cut returns partial sums over K's axis).
        repeat_axes: device-matrix axes along which every rank repeats the same computation
            (strategy uses fewer devices than device_num). Gradients of inputs are partial
            over the axes of ``out_layout.device_matrix`` that neither cut the input nor
            repeat; the dispatcher reduces them.
        localize: None, or ``localize(coords, args) -> args``: rewrites the positional
            arguments for the local call, given this rank's coordinates in the device matrix
            and ``args`` with tensor positions holding the LOCAL ndarrays (Reshape's target
            shape becomes the local shape; OneHot's depth and indices move to the rank's
            class block). Must not change tensor positions' shapes.
        local_attrs: attributes to override on the primitive for the local call (Conv2D's
            out_channel becomes the local number of output channels), or None; or a callable
            ``local_attrs(site) -> dict`` when they depend on where this rank runs the call: its
            coordinates in the device matrix (Dropout's window of the whole mask) or the
            communicator of a group of ranks (SyncBatchNormOp's statistics group); see
            :class:`Site`.
    """

    strategy: tuple
    in_layouts: tuple
    out_layout: Layout
    repeat_axes: tuple = ()
    localize: object = field(default=None, compare=False)
    local_attrs: object = field(default=None, compare=False)

    @property
    def device_matrix(self):
        return self.out_layout.device_matrix


@dataclass(frozen=True)
class Decomposed:
    """The op runs as a composition of sharded ops instead: ``fn(*args)`` with the original args.

    Used where the local op alone cannot give the right answer (Softmax over a cut class axis
    needs a global max and sum). ``fn`` calls primitives with explicit ``.shard()``
    strategies, so it behaves the same in SEMI_AUTO and AUTO modes; their gradients come from
    the primitives'.
    """

    fn: object
    description: str = ""


@dataclass(frozen=True)
class Site:
    """Where this rank runs one sharded call: what a callable ``OpSharding.local_attrs`` is given.

    The dispatcher makes it for each call, so a rule can reach a communicator without importing
    the dispatcher (rule modules never do).

    Attributes:
        coords: this rank's coordinates in the call's device matrix (``out_layout.coords(rank)``).
        group: ``group(layout, axes)`` -> the communicator of this rank and the ranks that differ
            from it only along device ``axes`` of ``layout`` (its collectives are counted by
            CommCounter), or None when that group is this rank alone.

    Example:
        >>> def local_attrs(site):      # BatchNorm's statistics over the other batch blocks
        ...     return {"group": site.group(x_layout, (batch_axis,))}
    """

    coords: tuple
    group: object = field(compare=False)


class Rule:
    """Base of sharding rules; subclasses override ``infer`` and usually the other two."""

    def infer(self, prim, args, strategy, device_num):
        raise NotImplementedError

    def data_parallel(self, prim, args, device_num):
        """Default: cut dimension 0 of every non-Parameter tensor argument of rank >= 1."""
        specs = tensor_specs(args)
        out = []
        for s in specs:
            if s.ndim == 0 or s.is_parameter:
                out.append((1,) * s.ndim)
            else:
                out.append((largest_cut(s.shape[0], device_num),) + (1,) * (s.ndim - 1))
        return tuple(out)

    def propagate(self, prim, args, layouts, device_num):
        """Default: each input keeps its current cuts (partial axes give no cut)."""
        return tuple(lay.cuts() for lay in layouts)


RULES = {}  # primitive class -> its rule (an instance)


def register(*classes):
    """Class decorator: ``@register(ops.MatMul)`` makes an instance the rule of exactly those classes.

    A subclass does not inherit its base's rule: it computes something else (BatchNormReLU is
    not BatchNorm), and a rule that would run it as its base would be silently wrong.
    """
    for c in classes:
        if not isinstance(c, type):
            raise TypeError(f"register: rules are registered for primitive classes, got {c!r}")
        if c in RULES:
            raise ValueError(f"register: {c.__module__}.{c.__qualname__} already has a rule "
                             f"({type(RULES[c]).__name__})")

    def deco(cls):
        inst = cls()
        for c in classes:
            RULES[c] = inst
        return cls
    return deco


def get_rule(prim):
    """The rule registered for the class of ``prim`` (exactly), or raises NoRuleError naming it."""
    klass = type(prim)
    rule = RULES.get(klass)
    if rule is not None:
        return rule
    base = next((b for b in klass.__mro__[1:] if b in RULES), None)
    inherited = (f"; its base {base.__name__} has one, but a subclass computes something else and needs a rule "
                 f"of its own" if base is not None else "")
    raise NoRuleError(f"{prim.name} ({klass.__module__}.{klass.__qualname__}) has no sharding rule, so it cannot run "
                      f"in SEMI_AUTO_PARALLEL / AUTO_PARALLEL mode{inherited}; operators with rules: "
                      f"{', '.join(sorted({c.__name__ for c in RULES}))}")


def tensor_specs(args):
    return tuple(a for a in args if isinstance(a, TensorSpec))


def largest_cut(n, device_num):
    """The largest cut <= device_num that divides both n and device_num (data-parallel defaults)."""
    for c in range(min(n, device_num), 0, -1):
        if n % c == 0 and device_num % c == 0:
            return c
    return 1


def device_matrix_for(cuts, device_num):
    """The device matrix of an op whose computation is cut by ``cuts`` (one per loop dimension).

    When the cuts use fewer than device_num devices, a repeat axis of size
    ``device_num // prod(cuts)`` goes first (MindSpore's convention) and every rank along it
    repeats the computation. Returns ``(device_matrix, offset, repeat_axes)``: loop dimension
    i is device axis ``i + offset``.
    """
    used = prod(cuts)
    if used > device_num:
        raise StrategyError(f"the strategy uses {used} devices (product of the cuts {tuple(cuts)}), more than "
                            f"device_num {device_num}")
    if device_num % used:
        raise StrategyError(f"the strategy uses {used} devices (product of the cuts {tuple(cuts)}), which does not "
                            f"divide device_num {device_num}")
    if used == device_num:
        return tuple(cuts), 0, ()
    return (device_num // used,) + tuple(cuts), 1, (0,)


def check_counts(strategy, args):
    """Checks one tuple per tensor argument and one cut per dimension; returns the TensorSpecs."""
    specs = tensor_specs(args)
    if len(strategy) != len(specs):
        raise StrategyError(f"the strategy has {len(strategy)} tuple(s) but the operator takes {len(specs)} tensor "
                            f"input(s)")
    for i, (s, spec) in enumerate(zip(strategy, specs)):
        if len(s) != spec.ndim:
            raise StrategyError(f"input {i} has rank {spec.ndim} (shape {spec.shape}) but its strategy {tuple(s)} "
                                f"has {len(s)} cut(s)")
    return specs


def check_strategy_shape(strategy, args):
    """Checks one tuple per tensor argument, one cut per dimension, every cut dividing its dimension."""
    specs = check_counts(strategy, args)
    for i, (s, spec) in enumerate(zip(strategy, specs)):
        for d, (c, n) in enumerate(zip(s, spec.shape)):
            if n % c:
                raise StrategyError(f"dimension {d} of input {i} has size {n}, not divisible by its cut {c}")
