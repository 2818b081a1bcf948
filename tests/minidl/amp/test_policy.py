"""amp/policy.py's CastPolicy, the rules of O1 and "auto", on policies made here: a fused op takes
its parts' rule when they agree (LOW, HIGH or as given), else runs as its parts; a variant made by
``inside`` belongs to its level's policy; a policy prints its level.

The levels' own policies are made at import and resolve each op once (cached), so these tests
make their own: the rules are checked on first use, in the test itself.
"""
import numpy as np
import pytest

from minidl import Tensor, amp, nn, ops
from minidl.amp.policy import HIGH, LOW, PROMOTE, SPLIT, CastPolicy
from minidl.ops.primitive import cast_policy
from minidl.tensor import float16, float32


@pytest.mark.parametrize("rules, dense_relu", [
    ({ops.Dense: LOW, ops.ReLU: LOW}, LOW),          # parts agree: one op, cast once
    ({ops.Dense: HIGH, ops.ReLU: HIGH}, HIGH),
    ({}, None),                                      # neither listed: as given, one op
    ({ops.Dense: LOW}, SPLIT),                       # LOW and as given differ: the parts, each by its rule
    ({ops.Dense: PROMOTE, ops.ReLU: PROMOTE}, SPLIT),  # (PROMOTE depends on each part's inputs)
])
def test_a_fused_op_takes_its_parts_rule_when_they_agree_else_runs_as_its_parts(rules, dense_relu):
    policy = CastPolicy("auto", rules, float16, None)
    assert policy.rule(ops.DenseReLU) == dense_relu
    assert policy.rule(ops.DenseReLU) == dense_relu  # (the second time from its cache)
    assert policy.rule(ops.Cast) is None  # (the policy's own casts are never cast)


def test_a_variant_belongs_to_its_levels_policy_and_every_op_is_low_where_asked():
    level = CastPolicy("O1", {ops.MatMul: LOW}, float16, float32)
    inside = level.inside(nn.Dense, all_low=True)
    assert level.base is level and inside.base is level  # (a cell's scope keeps a variant of its own network's)
    assert inside is level.inside(nn.Dense, all_low=True)  # (one per cell type)
    assert repr(level) == "CastPolicy('O1', low=float16)"
    assert repr(inside) == "CastPolicy('O1', low=float16, every op low)"
    assert inside.rule(ops.Exp) is LOW and level.rule(ops.Exp) is None
    assert (inside.low, inside.low_output) == (level.low, level.low_output) == (np.dtype(float16), np.dtype(float32))
    assert CastPolicy("auto", {}, float16, None).low_output is None  # ("auto" leaves LOW outputs in float16)


class PolicyProbe(nn.Cell):
    def construct(self, x):
        self.seen = repr(cast_policy.policy)
        return x


class DensePolicyProbe(nn.Dense):
    def construct(self, x):
        self.seen = repr(cast_policy.policy)
        return super().construct(x)


@pytest.mark.parametrize("level, in_dense", [("O1", ", every op low"), ("auto", "")])
def test_the_policy_a_cell_runs_under_prints_its_level_and_whether_every_op_is_low(level, in_dense, rng):
    dense, other = DensePolicyProbe(4, 4), PolicyProbe()
    net = amp.auto_mixed_precision(nn.SequentialCell(dense, other), level)
    net(Tensor(rng.standard_normal((2, 4)).astype(np.float32)))
    assert dense.seen == f"CastPolicy({level!r}, low=float16{in_dense})"
    assert other.seen == f"CastPolicy({level!r}, low=float16)"
