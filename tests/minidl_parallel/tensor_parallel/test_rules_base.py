"""The rule registry (rules/base.py): a rule per exact primitive class, and the Site a rule is given.

Rules are found by the primitive's exact class: a subclass computes something else
(BatchNormReLU is not BatchNorm), so it has a rule of its own or none, never its base's.
Every concrete primitive of minidl and minidl_parallel has one, or is run as it is by the
dispatcher by design (listed below, with the reason).
"""
import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import numpy as np
import pytest

import minidl
import minidl_parallel
from minidl import Tensor, ops
from minidl.ops.primitive import Primitive
from minidl_parallel import run_threads
from minidl_parallel.collectives import AllGather, AllReduce, Broadcast, ReduceScatter
from minidl_parallel.tensor_parallel.executor import Redistribute
from minidl_parallel.tensor_parallel.layout import Layout
from minidl_parallel.tensor_parallel.rules import (RULES, NoRuleError, OpSharding, Rule, Site, get_rule,
                                                   register)
from minidl_parallel.tensor_parallel.rules.base import check_strategy_shape, device_matrix_for
from minidl_parallel.tensor_parallel.rules.elementwise import dims_map

# Primitives the dispatcher runs as they are, with no rule, and why.
PASSTHROUGH = {
    AllReduce: "a collective: it already acts on this rank's block, over the group it is given",
    AllGather: "a collective: it already acts on this rank's block, over the group it is given",
    ReduceScatter: "a collective: it already acts on this rank's block, over the group it is given",
    Broadcast: "a collective: it already acts on this rank's block, over the group it is given",
    Redistribute: "the dispatcher's own move between layouts: it runs a plan on this rank's block",
    ops.ApplyMomentum: "an in-place update of this rank's block of a parameter, whose state and gradient "
                       "share its layout (a redistributed copy would lose the update)",
    ops.MultiApplyMomentum: "ApplyMomentum over several parameters' blocks at once",
}

_OPTIONAL = ("mpi4py", "cupy")  # backends whose modules need what a machine may lack


def _import_all(package):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        try:
            importlib.import_module(info.name)
        except ImportError as e:
            if not any(name in str(e) for name in _OPTIONAL):
                raise


def _concrete_primitives():
    """Every class below Primitive defined in minidl.ops or minidl_parallel, but the private bases."""
    _import_all(minidl.ops)
    _import_all(minidl_parallel)
    found, todo = set(), [Primitive]
    while todo:
        for sub in todo.pop().__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith(("minidl.ops", "minidl_parallel")) and not sub.__name__.startswith("_"):
                found.add(sub)
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def test_every_concrete_primitive_has_a_rule_for_exactly_its_class_or_is_passthrough():
    prims = _concrete_primitives()
    assert len(prims) > 50
    names = {c.__name__ for c in prims}
    assert {"BatchNormReLU", "SyncBatchNormOp", "AllReduce", "Redistribute", "KeepWhere"} <= names
    missing = [f"{c.__module__}.{c.__qualname__}" for c in prims if c not in RULES and c not in PASSTHROUGH]
    assert missing == []
    assert not set(PASSTHROUGH) & set(RULES)  # one or the other, not both


def test_every_public_op_of_minidl_ops_is_covered():
    public = {c for c in vars(ops).values() if inspect.isclass(c) and issubclass(c, Primitive) and c is not Primitive}
    assert public and all(c in RULES or c in PASSTHROUGH for c in public)


def test_passthrough_primitives_run_as_they_are_under_semi_auto():
    def rank():
        minidl_parallel.set_auto_parallel_context(parallel_mode="semi_auto_parallel")
        try:
            r = minidl_parallel.get_rank()
            x = Tensor(np.full((2, 2), float(r + 1)))
            w, v = Tensor(np.full((2, 2), float(r + 1))), Tensor(np.zeros((2, 2)))
            ops.ApplyMomentum()(w, v, 0.5, Tensor(np.ones((2, 2))), 0.9)  # on this rank's arrays, in place
            ops.MultiApplyMomentum()([w], [v], 0.5, [Tensor(np.ones((2, 2)))], 0.9)  # and once more
            return (AllReduce("sum")(x).asnumpy(), AllGather()(x).asnumpy().shape,
                    ReduceScatter("sum")(x).asnumpy().shape, Broadcast(0)(x).asnumpy(), w.asnumpy())
        finally:
            minidl_parallel.reset_auto_parallel_context()
    for r, (total, gathered, scattered, root, w) in enumerate(run_threads(2, rank)):
        np.testing.assert_array_equal(total, np.full((2, 2), 3.0))
        assert gathered == (4, 2) and scattered == (1, 2)
        np.testing.assert_array_equal(root, np.ones((2, 2)))
        np.testing.assert_allclose(w, np.full((2, 2), r + 0.5 - 0.5 * (0.9 * 1.0 + 1.0)), rtol=1e-15)  # both updates


def test_a_subclass_does_not_inherit_its_base_rule():
    class Scaled(ops.BatchNorm):
        """Computes something else than BatchNorm: running it with BatchNorm's rule would be wrong."""

    with pytest.raises(NoRuleError, match=r"Scaled \(.*Scaled\) has no sharding rule.*its base BatchNorm has one, "
                                          r"but a subclass computes something else"):
        get_rule(Scaled())
    assert type(get_rule(ops.BatchNormReLU())).__name__ == "BatchNormReLURule"
    assert get_rule(ops.BatchNormReLU()) is not get_rule(ops.BatchNorm())


def test_register_takes_classes_once():
    with pytest.raises(TypeError, match="rules are registered for primitive classes, got 'MatMul'"):
        register("MatMul")
    with pytest.raises(ValueError, match=r"minidl.ops.linalg.MatMul already has a rule \(ProductRule\)"):
        register(ops.MatMul)


# ---- rules never import the dispatcher ---------------------------------------------------------

RULES_DIR = Path(minidl_parallel.__file__).parent / "tensor_parallel" / "rules"


def _imports(path):
    """(module, names) of every import in a file, relative ones resolved against the rules package."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "minidl_parallel.tensor_parallel.rules".split(".")
            module = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                if node.level else node.module
            out.append((module, tuple(alias.name for alias in node.names)))
    return out


@pytest.mark.parametrize("path", sorted(RULES_DIR.glob("*.py")), ids=lambda p: p.name)
def test_no_rule_module_imports_the_dispatcher(path):
    for module, names in _imports(path):
        assert not module.endswith("dispatch") and "dispatch" not in names, (path.name, module, names)


# ---- Site: what a callable local_attrs is given -----------------------------------------------

class _GroupProbe(Primitive):
    """x + 10 a + 100 b at coordinates (a, b), plus the sum of the world ranks of a group (test-only)."""

    def forward(self, x):
        a, b = self.site.coords
        rank = np.array([float(minidl_parallel.get_rank())])
        return x + 10 * a + 100 * b + self.site.group(self.layout, (0,)).allreduce(rank, "sum")[0]


class _GroupProbeRule(Rule):
    def infer(self, prim, args, strategy, device_num):
        check_strategy_shape(strategy, args)
        s = tuple(strategy[0])
        dm, off, rep = device_matrix_for(s, device_num)
        lay = Layout(dm, dims_map(off, range(len(s))))
        return OpSharding((s,), (lay,), lay, rep, local_attrs=lambda site: {"site": site, "layout": lay})


def test_a_callable_local_attrs_gets_the_site_with_coords_and_counted_groups():
    RULES[_GroupProbe] = _GroupProbeRule()
    try:
        def rank():
            minidl_parallel.set_auto_parallel_context(parallel_mode="semi_auto_parallel",
                                                      dataset_strategy="full_batch")
            try:
                with minidl_parallel.CommCounter() as counter:
                    out = _GroupProbe().shard(((2, 2),))(Tensor(np.zeros((4, 4))))
                return minidl_parallel.get_rank(), out.asnumpy().copy(), counter.count("allreduce")
            finally:
                minidl_parallel.reset_auto_parallel_context()
        for r, block, allreduces in run_threads(4, rank):
            # Rank r sits at (r // 2, r % 2) of [2, 2]; the ranks that differ only along axis 0 are
            # r % 2 and r % 2 + 2, whose sum is 2 (r % 2) + 2.
            a, b = r // 2, r % 2
            np.testing.assert_array_equal(block, np.full((2, 2), 10.0 * a + 100 * b + 2 * b + 2))
            assert allreduces == 1  # the site's groups report to CommCounter
    finally:
        del RULES[_GroupProbe]


def test_site_is_a_small_value():
    site = Site((1, 0), group=None)
    assert site.coords == (1, 0) and site == Site((1, 0), group=lambda layout, axes: None)
