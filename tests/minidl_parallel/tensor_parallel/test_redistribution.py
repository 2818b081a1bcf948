"""The planner alone (no communication): plan contents, bytes, caching, printing and errors."""
from math import prod

import pytest
from hypothesis import given, strategies as st

from minidl_parallel.tensor_parallel.layout import Layout
from minidl_parallel.tensor_parallel.redistribution import COLLECTIVES, Plan, Step
from minidl_parallel.tensor_parallel.redistribution import comm_bytes, naive_bytes, plan_redistribution

from layout_strategies import layout_pairs  # shared with test_executor.py


@given(layout_pairs(), st.sampled_from((4, 8)))
def test_plan_steps_chain_src_to_dst_and_send_no_more_than_the_naive_route(pair, itemsize):
    src, dst, shape = pair
    plan = plan_redistribution(src, dst, shape, itemsize)
    assert plan_redistribution(src, dst, list(shape), itemsize) is plan  # cached
    assert (plan.src, plan.dst, plan.shape, plan.itemsize) == (src, dst, shape, itemsize)
    layout = src
    for step in plan.steps:
        assert step.before == layout
        assert step.local_shape_in == step.before.local_shape(shape)
        assert step.local_shape_out == step.after.local_shape(shape)
        if step.kind == "relabel":
            assert step.local_shape_in == step.local_shape_out and step.bytes_per_rank == 0
        else:
            assert step.after.device_matrix == step.before.device_matrix
            assert step.group_size > 1  # a group of one would be a step that does nothing
            assert step.bytes_per_rank == comm_bytes(step.kind, prod(step.local_shape_in) * itemsize,
                                                     step.group_size)
        layout = step.after
    assert layout == dst
    assert plan.bytes_per_rank == sum(s.bytes_per_rank for s in plan.steps)
    assert plan.bytes_per_rank <= naive_bytes(src, dst, shape, itemsize)
    assert plan.num_collectives == sum(s.kind in COLLECTIVES for s in plan.steps)
    assert len(str(plan).splitlines()) == max(1, len(plan.steps))


@given(layout_pairs())
def test_plan_of_a_layout_to_itself_is_empty(pair):
    src, _, shape = pair
    plan = plan_redistribution(src, src, shape)
    assert plan.steps == () and plan.bytes_per_rank == 0 and not plan.moves_data
    assert str(plan) == f"no change: {src}"


def test_size_one_axes_do_not_make_a_plan():
    a = Layout((2, 1, 4), ((0,), (1, 2)), ((1, "sum"),))
    b = Layout((2, 1, 4), ((0,), (2,)))
    assert a == b
    assert plan_redistribution(a, b, (4, 8)).steps == ()


def test_plan_only_renaming_the_device_matrix_is_one_relabel_and_moves_nothing():
    plan = plan_redistribution(Layout((8,), ((0,), ())), Layout((2, 4, 1), ((0, 1), ())), (16, 3))
    assert [s.kind for s in plan.steps] == ["relabel"] and not plan.moves_data and plan.bytes_per_rank == 0


# ---- one primitive each ---------------------------------------------------------------------

S0 = Layout((4,), ((0,), ()))
S1 = Layout((4,), ((), (0,)))
R = Layout((4,), ((), ()))
P_SUM = Layout((4,), ((), ()), ((0, "sum"),))
P_MAX = Layout((4,), ((), ()), ((0, "max"),))
IN = 8 * 12 * 4  # bytes of the whole (8, 12) float32 tensor


@pytest.mark.parametrize("src, dst, kind, dim, split_dim, op, sent", [
    (S0, R, "allgather", 0, None, None, 3 * IN // 4),
    (R, S1, "slice", 1, None, None, 0),
    (P_SUM, R, "allreduce", None, None, "sum", 2 * 3 * IN // 4),
    (P_MAX, R, "allreduce", None, None, "max", 2 * 3 * IN // 4),
    (P_SUM, S0, "reduce_scatter", 0, None, "sum", 3 * IN // 4),
    (S0, S1, "alltoall", 0, 1, None, 3 * (IN // 4) // 4),
    (R, P_SUM, "zero_partial", None, None, "sum", 0),
])
def test_single_primitive_transitions_are_exactly_one_step(src, dst, kind, dim, split_dim, op, sent):
    plan = plan_redistribution(src, dst, (8, 12), 4)
    assert len(plan.steps) == 1, str(plan)
    step = plan.steps[0]
    assert (step.kind, step.axes, step.dim, step.split_dim, step.op) == (kind, (0,), dim, split_dim, op)
    assert step.group_size == 4 and step.bytes_per_rank == sent == plan.bytes_per_rank
    assert plan.num_collectives == (kind in COLLECTIVES)


def test_quickstart_matmul_partial_output_to_the_relu_layout_is_one_reduce_scatter_over_groups_of_4():
    src = Layout((2, 4, 1), ((0,), (2,)), ((1, "sum"),))  # MatMul((2, 4), (4, 1)): out cut by a, partial over b
    dst = Layout((2, 4), ((0,), (1,)))                     # ReLU((2, 4))
    plan = plan_redistribution(src, dst, (16, 16), 4)
    (rs,) = [s for s in plan.steps if s.kind != "relabel"]
    assert plan.num_collectives == 1
    assert (rs.kind, rs.axes, rs.dim, rs.op, rs.group_size) == ("reduce_scatter", (1,), 1, "sum", 4)
    assert rs.local_shape_in == (8, 16) and rs.local_shape_out == (8, 4)
    assert rs.bytes_per_rank == 3 * 8 * 16 * 4 // 4
    assert str(plan) == (
        "reduce_scatter sum dim 1 over b (groups of 4): (a, -) on [2, 4, 1] +sum(b) -> (a, b) on [2, 4, 1]  "
        "block (8, 4)  384 B/rank\n"
        "relabel: (a, b) on [2, 4, 1] -> (a, b) on [2, 4]")
    assert plan.short() == "reduce_scatter(1:b), relabel"


def test_quickstart_batch_split_to_the_matmul_input_is_one_alltoall():
    src = Layout.batch_split(2, 8)
    dst = Layout((2, 4), ((0,), (1,)))
    plan = plan_redistribution(src, dst, (16, 32), 4)
    (a2a,) = [s for s in plan.steps if s.kind != "relabel"]
    assert plan.num_collectives == 1
    assert (a2a.kind, a2a.dim, a2a.split_dim, a2a.group_size) == ("alltoall", 0, 1, 4)
    assert a2a.local_shape_in == (2, 32) and a2a.local_shape_out == (8, 8)
    assert a2a.bytes_per_rank == 3 * 2 * 32 * 4 // 4
    assert "alltoall dim 0 -> dim 1 over b (groups of 4)" in str(plan)


def test_partial_over_an_axis_split_into_atoms_is_still_one_allreduce():
    # [2, 4] against [2, 2, 2] cuts MatMul's size-4 K axis into two atoms; one collective covers both.
    src = Layout((2, 4), ((0,), ()), ((1, "sum"),))
    dst = Layout((2, 2, 2), ((0,), ()))
    plan = plan_redistribution(src, dst, (4, 6), 8)
    (ar,) = [s for s in plan.steps if s.kind != "relabel"]
    assert (ar.kind, ar.group_size, ar.op) == ("allreduce", 4, "sum")


def test_a_cut_moving_to_another_dimension_under_a_finer_cut_gathers_only_the_finer_one():
    # (ab, -) -> (-, a): gather b only, then all-to-all a (never the whole tensor).
    plan = plan_redistribution(Layout((2, 4), ((0, 1), ())), Layout((2, 4), ((), (0,))), (16, 12), 4)
    assert [(s.kind, s.axes) for s in plan.steps] == [("allgather", (1,)), ("alltoall", (0,))]
    assert plan.bytes_per_rank < naive_bytes(plan.src, plan.dst, plan.shape, 4)


def test_a_cut_parked_on_another_dimension_beats_gathering_it():
    # (b, a) -> (-, ba): a joins b on dim 0 and both move together; two all-to-alls, no gather.
    plan = plan_redistribution(Layout((2, 2), ((1,), (0,))), Layout((2, 2), ((), (1, 0))), (4, 8), 4)
    assert [(s.kind, s.axes, s.dim, s.split_dim) for s in plan.steps] == [("alltoall", (0,), 1, 0),
                                                                          ("alltoall", (1, 0), 0, 1)]
    assert plan.bytes_per_rank == 16 + 24 < naive_bytes(plan.src, plan.dst, plan.shape, 4)


def test_a_partial_sum_reduce_scatters_onto_a_dimension_the_cut_leaves_for_a_moment():
    src = Layout((2, 8), ((0,), ()), ((1, "sum"),))
    dst = Layout((2, 8), ((1,), ()))
    plan = plan_redistribution(src, dst, (16, 2), 4)
    assert [s.kind for s in plan.steps] == ["alltoall", "reduce_scatter", "allgather"]
    assert plan.bytes_per_rank == 32 + 56 + 8  # all-reduce, gather and slice would send 176


def test_local_slices_come_before_collectives():
    # Replicated over a, partial over b -> cut by a on dim 0, whole over b: slice first, then a smaller all-reduce.
    src = Layout((2, 4), ((), ()), ((1, "sum"),))
    dst = Layout((2, 4), ((0,), ()))
    plan = plan_redistribution(src, dst, (8, 8), 4)
    assert [s.kind for s in plan.steps] == ["slice", "allreduce"]
    assert plan.steps[1].local_shape_in == (4, 8)


def test_matrices_without_common_atoms_go_through_replicated():
    src = Layout((3, 4), ((0,), (1,)))
    dst = Layout((4, 3), ((0,), (1,)))
    plan = plan_redistribution(src, dst, (12, 12), 4)
    assert [s.kind for s in plan.steps] == ["allgather", "allgather", "relabel", "slice", "slice"]
    assert plan.bytes_per_rank == naive_bytes(src, dst, (12, 12), 4) == (12 - 1) * 4 * 3 * 4


def test_naive_bytes_all_reduces_then_gathers_everything():
    src = Layout((2, 4), ((0,), ()), ((1, "sum"),))
    in_bytes = 4 * 8 * 8  # the (4, 8) float64 block
    assert naive_bytes(src, Layout((2, 4), ((), (1,))), (8, 8), 8) == 2 * 3 * in_bytes // 4 + in_bytes


def test_adjoint_goes_back_without_partial_axes():
    src = Layout((2, 4), ((0,), ()), ((1, "sum"),))
    dst = Layout((2, 4), ((0,), (1,)))
    back = plan_redistribution(src, dst, (8, 8)).adjoint()
    assert back.src == dst and back.dst == src.without_partial()
    assert [s.kind for s in back.steps] == ["allgather"]


@given(layout_pairs())
def test_adjoint_is_the_planner_s_plan_back(pair):
    src, dst, shape = pair
    back = plan_redistribution(src, dst, shape).adjoint()
    assert back == plan_redistribution(dst.without_partial(), src.without_partial(), shape)
    with pytest.raises(ValueError, match="Plan.adjoint: the plan .* has no adjoint: it is an adjoint itself"):
        back.adjoint()


def test_the_plan_module_needs_nothing_from_the_planner():
    """plan.py is data; the planner (redistribution.py) imports it, never the other way round."""
    import ast
    import minidl_parallel.tensor_parallel.plan as plan_module
    tree = ast.parse(open(plan_module.__file__).read())
    imported = [node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [m for m in imported if m and "redistribution" in m], imported


def test_steps_and_plans_are_hashable_plain_data():
    plan = plan_redistribution(S0, S1, (8, 12))
    assert isinstance(plan, Plan) and all(isinstance(s, Step) for s in plan.steps)
    assert {plan: 1}[plan_redistribution(S0, S1, (8, 12))] == 1
    assert plan.steps[0].short() == "alltoall(a:0->1)"


# ---- bytes and errors -----------------------------------------------------------------------

@pytest.mark.parametrize("kind, sent", [("allgather", 3000), ("allreduce", 1500), ("reduce_scatter", 750),
                                        ("alltoall", 750), ("slice", 0), ("zero_partial", 0), ("relabel", 0)])
def test_comm_bytes_follow_the_ring_conventions(kind, sent):
    assert comm_bytes(kind, 1000, 4) == sent
    assert comm_bytes(kind, 1000, 1) == 0


def test_comm_bytes_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="comm_bytes: kind must be one of .* got 'broadcast'"):
        comm_bytes("broadcast", 10, 2)


def test_layouts_of_different_device_counts_are_rejected_naming_both():
    with pytest.raises(ValueError, match=r"shape \(8, 8\) cannot move from \(a, -\) on \[4\] to \(a, -\) on \[8\]: "
                                         r"the layouts have 4 and 8 devices"):
        plan_redistribution(Layout((4,), ((0,), ())), Layout((8,), ((0,), ())), (8, 8))


def test_a_shape_the_cut_does_not_divide_is_rejected():
    with pytest.raises(ValueError, match=r"plan_redistribution: a tensor of shape \(6, 8\) cannot move from .* "
                                         r"dimension 0 of shape \(6, 8\) has size 6, not divisible by its cut 4"):
        plan_redistribution(Layout((4,), ((0,), ())), Layout((4,), ((), (0,))), (6, 8))


def test_a_shape_of_another_rank_is_rejected():
    with pytest.raises(ValueError, match=r"\(rank 1\) cannot take layout"):
        plan_redistribution(S0, S1, (8,))


def test_non_layouts_are_rejected():
    with pytest.raises(TypeError, match="plan_redistribution: dst must be a Layout, got tuple"):
        plan_redistribution(S0, ((0,), ()), (8, 12))
