"""Running plans on thread-ranks: every block exact, the gradient adjoint, groups cached, bytes counted."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import Tensor
from minidl_parallel import get_communicator
from minidl_parallel.comm.local import LocalCommunicator
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel.counter import CommCounter
from minidl_parallel.tensor_parallel.executor import GroupCache, Redistribute, execute, gather_full, local_block
from minidl_parallel.tensor_parallel.layout import Layout
from minidl_parallel.tensor_parallel.redistribution import plan_redistribution

from layout_strategies import WORLDS, layout_pairs  # shared with test_redistribution.py


def _source_blocks(x, src, rng):
    """Every rank's block of x under src; partial axes hold random parts that reduce to x exactly.

    sum: integer addends; max: parts <= x, one of them equal (element-wise).
    """
    blocks = [np.array(local_block(x, src.without_partial(), r)) for r in range(src.device_num)]
    axes = src.partial_axes()
    if not axes:
        return blocks
    op = src.partial[0][1]
    for group in sorted({src.group(r, axes) for r in range(src.device_num)}):
        whole = blocks[group[0]]
        if op == "sum":
            parts = [rng.integers(-5, 6, whole.shape).astype(whole.dtype) for _ in group[1:]]
            parts.insert(0, whole - sum(parts, np.zeros_like(whole)))
        else:
            holder = rng.integers(0, len(group), whole.shape)
            parts = [np.where(holder == i, whole, whole - rng.integers(1, 5, whole.shape)).astype(whole.dtype)
                     for i in range(len(group))]
        for r, part in zip(group, parts):
            blocks[r] = part
    return blocks


def _reduced(results, layout, rank):
    """The logical block of ``rank``: its result reduced over the layout's partial axes."""
    axes = layout.partial_axes()
    if not axes:
        return results[rank]
    parts = [results[r] for r in layout.group(rank, axes)]
    return sum(parts[1:], parts[0]) if layout.partial[0][1] == "sum" else np.maximum.reduce(parts)


def _check_execute(src, dst, shape, dtype, seed):
    """Runs src -> dst on thread-ranks and compares every rank's (reduced) block with the whole array's."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-9, 10, shape).astype(dtype)  # integer values: every sum is exact
    blocks = _source_blocks(x, src, rng)
    plan = plan_redistribution(src, dst, shape, x.itemsize)
    groups = GroupCache()

    def body():
        comm = get_communicator()
        with CommCounter() as c:
            y = execute(plan, blocks[comm.rank], comm, comm.rank, groups)
        return y, c

    results = run_threads(src.device_num, body)
    ys = [y for y, _ in results]
    for r, (y, c) in enumerate(results):
        assert y.dtype == dtype and y.shape == dst.local_shape(shape)
        expected = local_block(x, dst.without_partial(), r)
        np.testing.assert_array_equal(_reduced(ys, dst, r), expected, err_msg=f"rank {r}\n{plan}")
        assert c.count() == plan.num_collectives and c.bytes() == plan.bytes_per_rank
        assert c.count(phase="backward") == 0
    return plan


@pytest.mark.parametrize("n", WORLDS)
@given(data=st.data())
def test_execute_gives_every_rank_exactly_its_block_of_dst(n, data):
    src, dst, shape = data.draw(layout_pairs(n))
    dtype = data.draw(st.sampled_from((np.float64, np.float32)))
    _check_execute(src, dst, shape, dtype, data.draw(st.integers(0, 2 ** 16)))


@pytest.mark.parametrize("src, dst, shape, kinds", [
    # matrices with no common atoms: through replicated, then relabel
    (Layout((3, 4), ((0,), (1,))), Layout((4, 3), ((1,), (0,))), (12, 24),
     ["allgather", "allgather", "relabel", "slice", "slice"]),
    (Layout((2, 3), ((1,), ()), ((0, "sum"),)), Layout((3, 2), ((), (0,)), ((1, "sum"),)), (6, 6),
     ["allreduce", "allgather", "relabel", "slice", "zero_partial"]),
    # [2, 6] and [6, 2] share the atoms [2, 3, 2]
    (Layout((2, 6), ((0, 1), ())), Layout((6, 2), ((), (0,)), ((1, "max"),)), (12, 6),
     ["relabel", "allgather", "alltoall", "zero_partial", "relabel"]),  # gathers c only, then moves ab
    # routes the search finds: a cut parked on another dimension, a reduce-scatter under a moved cut
    (Layout((2, 2), ((1,), (0,))), Layout((2, 2), ((), (1, 0))), (4, 8), ["alltoall", "alltoall"]),
    (Layout((2, 8), ((0,), ()), ((1, "sum"),)), Layout((2, 8), ((1,), ())), (16, 2),
     ["alltoall", "reduce_scatter", "allgather"]),
    # the quickstart's two moves
    (Layout.batch_split(2, 8), Layout((2, 4, 1), ((0,), (1,))), (16, 32), ["relabel", "alltoall"]),
    (Layout((2, 4, 1), ((0,), (2,)), ((1, "sum"),)), Layout((2, 4), ((0,), (1,))), (16, 16),
     ["reduce_scatter", "relabel"]),
])
def test_named_moves_run_exactly(src, dst, shape, kinds):
    plan = _check_execute(src, dst, shape, np.float64, 0)
    assert [s.kind for s in plan.steps] == kinds, str(plan)


@pytest.mark.parametrize("n", (2, 4, 8, 12))
@given(data=st.data())
def test_redistribute_gradient_is_each_rank_block_of_the_single_process_gradient(n, data):
    src, dst, shape = data.draw(layout_pairs(n))
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
    x = rng.integers(-9, 10, shape).astype(np.float64)
    w = rng.integers(-9, 10, shape).astype(np.float64)
    blocks = _source_blocks(x, src, rng)
    whole = Layout(dst.device_matrix, ((),) * len(shape))
    to_dst, to_whole = plan_redistribution(src, dst, shape, 8), plan_redistribution(dst, whole, shape, 8)

    def body():
        comm = get_communicator()
        xt = Tensor(blocks[comm.rank], requires_grad=True)
        full = Redistribute(to_whole, comm)(Redistribute(to_dst, comm)(xt))
        loss = (full * Tensor(w)).sum()  # every rank: the single-process loss sum(x * w)
        with CommCounter() as c:
            loss.backward()
        return loss.asnumpy(), xt.grad.asnumpy(), c

    for r, (loss, grad, c) in enumerate(run_threads(n, body)):
        assert loss == (x * w).sum()
        # d loss / d x = w, held as src's block (replicated over src's partial axes).
        np.testing.assert_array_equal(grad, local_block(w, src.without_partial(), r), err_msg=f"rank {r}")
        assert c.count() == c.count(phase="backward")
        assert c.count() == to_whole.adjoint().num_collectives + to_dst.adjoint().num_collectives


def test_quickstart_reduce_scatter_runs_one_collective_over_groups_of_four():
    src = Layout((2, 4, 1), ((0,), (2,)), ((1, "sum"),))
    dst = Layout((2, 4), ((0,), (1,)))
    x = np.arange(16 * 16, dtype=np.float64).reshape(16, 16)
    plan = plan_redistribution(src, dst, x.shape, 8)
    blocks = [np.array(local_block(x, src, r)) for r in range(8)]  # the value on b = 0, zeros elsewhere

    def body():
        comm = get_communicator()
        with CommCounter() as c:
            y = execute(plan, blocks[comm.rank], comm)
        return y, c.events

    for r, (y, events) in enumerate(run_threads(8, body)):
        np.testing.assert_array_equal(y, local_block(x, dst, r))
        sent = 3 * 8 * 16 * 8 // 4  # (g - 1) / g of the (8, 16) float64 block
        assert [(e.kind, e.group_size, e.bytes_per_rank) for e in events] == [("reduce_scatter", 4, sent)]


def test_redistribute_prints_its_steps_and_checks_the_block_shape():
    comm = LocalCommunicator()
    plan = plan_redistribution(Layout((1,), ((0,), ())), Layout((1, 1), ((), ())), (4, 2))
    op = Redistribute(plan, comm)
    assert op.name == "Redistribute[relabel]"
    assert repr(op) == "Redistribute((-, -) on [1] -> (-, -) on [1, 1]: relabel)"
    with pytest.raises(ValueError, match=r"execute: the block of a \(4, 2\) tensor laid out as \(-, -\) on \[1\] "
                                         r"has shape \(4, 2\), got \(2, 2\)"):
        op(Tensor(np.zeros((2, 2))))
    quick = plan_redistribution(Layout((2, 4, 1), ((0,), (2,)), ((1, "sum"),)), Layout((2, 4), ((0,), (1,))), (8, 8))
    assert Redistribute(quick, comm).name == "Redistribute[reduce_scatter(1:b), relabel]"


def test_execute_rejects_a_communicator_of_another_size():
    plan = plan_redistribution(Layout((2,), ((0,),)), Layout((2,), ((),)), (4,))
    with pytest.raises(ValueError, match=r"execute: the plan \(a,\) on \[2\] -> \(-,\) on \[2\] is for 2 ranks, but "
                                         r"the communicator has 1"):
        execute(plan, np.zeros(2), LocalCommunicator(), 0)


# ---- groups -----------------------------------------------------------------------------------

def test_group_cache_gives_the_world_none_for_one_rank_and_one_communicator_per_group():
    cache = GroupCache()  # shared by the ranks of two worlds in turn, like the dispatcher's

    def body():
        comm = get_communicator()
        r = comm.rank
        pair = (r - r % 2, r - r % 2 + 1)
        group = cache.get(comm, pair)
        reversed_world = cache.get(comm, tuple(range(comm.size))[::-1])
        return (cache.get(comm, tuple(range(comm.size))) is comm, cache.get(comm, (r,)), group is cache.get(comm, pair),
                group.size, group.rank, float(group.allreduce(np.array(r + 1.0))[()]),
                reversed_world is comm, reversed_world.rank, float(reversed_world.allgather(np.array([r]))[0]))

    for _ in range(2):  # a second world must not find the first world's groups
        for r, got in enumerate(run_threads(4, body)):
            pair_sum = (r - r % 2 + 1) + (r - r % 2 + 2)
            assert got == (True, None, True, 2, r % 2, pair_sum, False, 3 - r, 3.0)


# ---- whole arrays and blocks ------------------------------------------------------------------

def test_local_block_cuts_and_partial_values():
    x = np.arange(24.0).reshape(4, 6)
    cut = Layout((2, 3), ((0,), (1,)))
    np.testing.assert_array_equal(local_block(x, cut, 4), x[2:4, 2:4])  # rank 4 = coords (1, 1)
    summed = Layout((2, 3), ((0,), ()), ((1, "sum"),))
    np.testing.assert_array_equal(local_block(x, summed, 3), x[2:4])      # coords (1, 0)
    np.testing.assert_array_equal(local_block(x, summed, 5), np.zeros((2, 6)))
    maxed = Layout((2, 3), ((0,), ()), ((1, "max"),))
    np.testing.assert_array_equal(local_block(x, maxed, 5), x[2:4])


@pytest.mark.parametrize("layout", [
    Layout((2, 2), ((1, 0), ())),
    Layout((4,), ((), (0,))),
    Layout((2, 2), ((), (0,)), ((1, "sum"),)),
    Layout((2, 2), ((1,), ()), ((0, "max"),)),
])
def test_gather_full_gives_every_rank_the_whole_tensor_without_counting(layout):
    rng = np.random.default_rng(1)
    x = rng.integers(-9, 10, (4, 8)).astype(np.float64)
    blocks = _source_blocks(x, layout, rng)

    def body():
        comm = get_communicator()
        with CommCounter() as c:
            full = gather_full(blocks[comm.rank], layout, x.shape, comm)
        return full, c.count()

    for full, count in run_threads(4, body):
        np.testing.assert_array_equal(full, x)
        assert count == 0
