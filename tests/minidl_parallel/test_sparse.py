"""minidl_parallel/sparse.py: which entries a rank sends (SINGA's ``spars``), against NumPy.

The sum-of-what-was-sent properties are in test_dist_opt.py; they hold whichever entries are
selected, so here the selection itself is held to its definition: top-K sends the entries of
largest magnitude, the threshold every |g| >= spars. ``sparse_allreduce`` is held to the
collective it picks (the one moving fewer bytes), what it puts on the wire, and its sum.
"""
import math
import re

import numpy as np
import pytest

import minidl
from minidl import Tensor, nn
from minidl_parallel import CommCounter, get_communicator, run_threads
from minidl_parallel.dist_opt import DistOpt
from minidl_parallel.sparse import check_spars, select, sparse_allreduce
from minidl_parallel.tensor_parallel.counter import CommEvent


def _top_k_reference(g, spars):
    k = min(g.size, max(1, math.ceil(spars * g.size)))
    return np.sort(np.argsort(-np.abs(g), kind="stable")[:k])


@pytest.mark.parametrize("spars", [0.01, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_selects_the_entries_of_largest_magnitude(seed, spars):
    g = np.random.default_rng(seed).standard_normal(200)
    idx = select(g, spars, topk=True)
    assert idx.dtype == np.int64
    np.testing.assert_array_equal(idx, _top_k_reference(g, spars))
    if idx.size < g.size:  # every entry sent outweighs every entry kept back
        kept_back = np.setdiff1d(np.arange(g.size), idx)
        assert np.abs(g[idx]).min() > np.abs(g[kept_back]).max()


def test_top_k_sends_at_least_one_entry():
    # 1% of 3 entries rounds up to one: the largest, whatever its sign
    np.testing.assert_array_equal(select(np.array([0.1, -3.0, 2.0]), 0.01, topk=True), [1])


def test_top_k_ties_go_to_the_lowest_indices():
    """A stable sort: among equal magnitudes the first entries are sent, the same on every run
    (the default quicksort picks others here)."""
    rng = np.random.default_rng(0)
    g = rng.integers(1, 4, 100) * rng.choice([-1.0, 1.0], 100)  # magnitudes 1, 2, 3: many ties
    by_magnitude = sorted(range(g.size), key=lambda i: -abs(g[i]))  # Python's sort is stable
    np.testing.assert_array_equal(select(g, 0.25, topk=True), sorted(by_magnitude[:25]))


@pytest.mark.parametrize("spars", [True, False, "0.1", None, np.array(0.1), math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("topk", [True, False])
def test_spars_that_is_not_a_finite_number_is_a_clear_error(spars, topk):
    with pytest.raises(ValueError, match=re.escape(f"DistOpt.f: spars must be a finite number, got {spars!r}")):
        check_spars(spars, topk, "DistOpt.f")
    check_spars(1, topk, "DistOpt.f")  # an int is a number
    check_spars(0.5, topk, "DistOpt.f")


def test_the_threshold_selects_every_entry_at_or_above_it():
    g = np.array([0.5, -2.0, 0.1, -0.5, 3.0, 0.0])
    np.testing.assert_array_equal(select(g, 0.5, topk=False), [0, 1, 3, 4])


@pytest.mark.parametrize("n", [1, 2])
def test_sparse_update_moves_each_parameter_by_the_mean_of_the_ranks_top_k_entries(n):
    """Plain SGD with lr 1 and no error feedback: the step is minus the mean over ranks of each
    rank's gradient restricted to its ceil(spars * size) largest-magnitude entries."""
    spars = 0.1
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4 * n, 3)), rng.standard_normal((4 * n, 2))
    loss_fn = nn.MSELoss(reduction="mean")

    def rank():
        minidl.set_seed(0)
        f64 = minidl.float64
        net = nn.SequentialCell(nn.Dense(3, 5, dtype=f64), nn.Tanh(), nn.Dense(5, 2, dtype=f64))
        sgd = DistOpt(nn.SGD(net.trainable_params(), 1.0))
        rows = slice(4 * sgd.global_rank, 4 * sgd.global_rank + 4)
        grad_fn = minidl.value_and_grad(lambda a, c: loss_fn(net(a), c), None, sgd.parameters)
        dense = np.concatenate([g.asnumpy().ravel() for g in grad_fn(Tensor(x[rows]), Tensor(y[rows]))[1]])
        start = np.concatenate([p.asnumpy().ravel() for p in sgd.parameters])
        sgd.backward_and_sparse_update(loss_fn(net(Tensor(x[rows])), Tensor(y[rows])), spars=spars, topK=True,
                                       corr=False)
        end = np.concatenate([p.asnumpy().ravel() for p in sgd.parameters])
        return dense, start - end

    results = run_threads(n, rank)
    want = np.zeros_like(results[0][0])
    for dense, _ in results:
        sent = np.zeros_like(dense)
        top = _top_k_reference(dense, spars)
        sent[top] = dense[top]
        want += sent
    want /= n
    for _, step in results:
        np.testing.assert_allclose(step, want, rtol=1e-12, atol=1e-15)


class _Spy:
    """The communicator, noting the dtype of each array it all-gathers."""

    def __init__(self, comm):
        self._comm, self.gathered = comm, []

    def allgather(self, x, axis=0):
        self.gathered.append(x.dtype)
        return self._comm.allgather(x, axis)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def _sparse_allreduce_on_two_ranks(flats, idxs):
    """Per rank: (the sum, the collectives counted, the dtypes all-gathered)."""
    def rank():
        comm = _Spy(get_communicator())
        r = comm.rank
        with CommCounter() as counter:
            total = sparse_allreduce(comm, flats[r], np.asarray(idxs[r], dtype=np.int64))
        return total, counter.events, comm.gathered

    want = np.zeros_like(flats[0])
    for flat, idx in zip(flats, idxs):
        want[idx] += flat[idx]
    return run_threads(2, rank), want


@pytest.mark.parametrize("widest, event", [
    # float64, 16 entries, 2 ranks: a dense all-reduce sends 2 * (2 - 1) / 2 * 128 = 128 bytes per rank; the
    # all-gathers widest * (8 + 8) bytes per rank, padded to the widest rank's count, to 1 other rank
    (3, CommEvent("allgather", 2, 3 * 16, "gradients")),
    (4, CommEvent("allreduce", 2, 128, "gradients")),  # as many bytes: the one dense collective
    (16, CommEvent("allreduce", 2, 128, "gradients")),
])
def test_sparse_allreduce_runs_the_collective_that_sends_fewer_bytes_and_sums_what_was_sent(widest, event):
    rng = np.random.default_rng(0)
    flats = [rng.standard_normal(16) for _ in range(2)]
    idxs = [[0], sorted(rng.choice(np.arange(1, 16), widest - 1, replace=False).tolist() + [0])]
    # rank 0 sends index 0 alone: its padding (index 0, value 0) must not be added over its value
    results, want = _sparse_allreduce_on_two_ranks(flats, idxs)
    for total, events, _ in results:
        assert events == [event]
        assert total.dtype == np.float64
        np.testing.assert_allclose(total, want, rtol=1e-15, atol=0)


def test_sparse_allreduce_sends_the_values_in_the_gradients_dtype():
    flats = [np.arange(1, 33, dtype=np.float32) * s for s in (1, -1)]
    idxs = [[0], [3, 7]]  # 2 * (8 + 4) bytes to 1 rank, against 2 * (2 - 1) / 2 * 128 for a dense all-reduce
    results, want = _sparse_allreduce_on_two_ranks(flats, idxs)
    for total, events, gathered in results:
        assert events == [CommEvent("allgather", 2, 2 * 12, "gradients")]
        assert gathered == [np.int64, np.int64, np.float32]  # the counts, the indices, the values
        assert total.dtype == np.float32
        np.testing.assert_array_equal(total, want)


def test_on_the_device_the_selection_and_the_sums_stay_device_arrays(on_the_double):
    """minidl's GPU path on the strict device double (which refuses a silent host copy): both
    paths of sparse_allreduce and top-K's selection build their arrays with the gradient's module."""
    cp = on_the_double
    rng = np.random.default_rng(1)
    flats = [rng.standard_normal(16) for _ in range(2)]
    idx = select(cp.asarray(flats[0]), 0.25, True)
    assert isinstance(idx, cp.ndarray)
    np.testing.assert_array_equal(cp.asnumpy(idx), np.sort(np.argsort(-np.abs(flats[0]), kind="stable")[:4]))
    for idxs in ([[0], [3, 7]], [list(range(16))] * 2):  # the all-gathers, then the dense all-reduce
        want = np.zeros(16)
        for flat, ix in zip(flats, idxs):
            want[ix] += flat[ix]

        def rank():
            r = get_communicator().rank
            return sparse_allreduce(get_communicator(), cp.asarray(flats[r]), cp.asarray(idxs[r], dtype=np.int64))

        for total in run_threads(2, rank):
            assert isinstance(total, cp.ndarray)
            np.testing.assert_allclose(cp.asnumpy(total), want, rtol=1e-15, atol=0)
