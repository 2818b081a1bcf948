"""minidl_parallel/sparse.py: which entries a rank sends (SINGA's ``spars``), against NumPy.

The sum-of-what-was-sent properties are in test_dist_opt.py; they hold whichever entries are
selected, so here the selection itself is held to its definition: top-K sends the entries of
largest magnitude, the threshold every |g| >= spars.
"""
import math

import numpy as np
import pytest

import minidl
from minidl import Tensor, nn
from minidl_parallel import run_threads
from minidl_parallel.dist_opt import DistOpt
from minidl_parallel.sparse import select


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
