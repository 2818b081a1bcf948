"""DistributedGradReducer on the threads backend: values, bucketing, overlap and errors."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import Parameter, Tensor
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel import run_threads
from minidl_parallel.grad_reducer import DistributedGradReducer

SHAPES = st.lists(st.lists(st.integers(1, 4), min_size=0, max_size=2).map(tuple), min_size=1, max_size=5)


def _params(shapes, dtypes=None):
    dtypes = dtypes or [np.float64] * len(shapes)
    return [Parameter(np.zeros(s, d), name=f"p{i}") for i, (s, d) in enumerate(zip(shapes, dtypes))]


def _grads(shapes, rank, seed, dtypes=None):
    rng = np.random.default_rng([seed, rank])
    dtypes = dtypes or [np.float64] * len(shapes)
    return tuple(Tensor(rng.standard_normal(s).astype(d)) for s, d in zip(shapes, dtypes))


def _expected_buckets(shapes, itemsizes, fusion_bytes):
    """Reverse order, one open bucket per dtype, closed when the next would overflow it."""
    buckets, open_ = [], {}
    for i in reversed(range(len(shapes))):
        n, k = int(np.prod(shapes[i])), itemsizes[i]
        b = open_.get(k)
        if b is None or (b["bytes"] and b["bytes"] + n * k > fusion_bytes):
            b = open_[k] = {"idx": [], "bytes": 0}
            buckets.append(b)
        b["idx"].append(i)
        b["bytes"] += n * k
    return [b["idx"] for b in buckets]


@given(shapes=SHAPES, n=st.sampled_from([1, 2, 3, 4]), mean=st.booleans(), fusion=st.integers(8, 200),
       mixed=st.booleans(), seed=st.integers(0, 1000))
def test_reduces_to_the_sum_or_mean_in_one_collective_per_bucket(shapes, n, mean, fusion, mixed, seed):
    dtypes = [np.float32 if mixed and i % 2 else np.float64 for i in range(len(shapes))]

    def body():
        comm = resolve_communicator("test", None)
        reducer = DistributedGradReducer(_params(shapes, dtypes), mean=mean, fusion_bytes=fusion)
        reducer.agree_on_parameters()  # the first use's one agreement exchange, counted apart
        before = comm.collective_count
        out = reducer(_grads(shapes, comm.rank, seed, dtypes))
        return out, comm.collective_count - before, [b.indices for b in reducer.buckets]

    results = run_threads(n, body)
    expected = _expected_buckets(shapes, [np.dtype(d).itemsize for d in dtypes], fusion)
    every = [[g.asnumpy().astype(np.float64) for g in _grads(shapes, r, seed, dtypes)] for r in range(n)]
    for out, count, buckets in results:
        assert buckets == expected
        assert count == len(expected)
        for i, g in enumerate(out):
            want = sum(e[i] for e in every) / (n if mean else 1)
            assert g.dtype == dtypes[i] and g.shape == shapes[i]
            tol = 1e-5 if dtypes[i] == np.float32 else 1e-12
            np.testing.assert_allclose(g.asnumpy(), want, rtol=tol, atol=tol)


def test_default_fusion_puts_a_small_net_in_one_bucket_last_layer_first():
    shapes = [(8, 4), (8,), (2, 8), (2,)]
    reducer = DistributedGradReducer(_params(shapes))
    assert [b.indices for b in reducer.buckets] == [[3, 2, 1, 0]]
    assert reducer.buckets[0].offsets == [0, 2, 18, 26]


def test_degree_and_none_gradients():
    shapes = [(2,), (3,)]

    def body():
        rank = resolve_communicator("test", None).rank
        reducer = DistributedGradReducer(_params(shapes), mean=True, degree=4)
        g0 = Tensor(np.full(2, rank + 1.0))
        g1 = None if rank == 0 else Tensor(np.full(3, 10.0))
        return reducer((g0, g1))

    for g0, g1 in run_threads(2, body):
        np.testing.assert_allclose(g0.asnumpy(), [0.75, 0.75])   # (1 + 2) / degree 4
        np.testing.assert_allclose(g1.asnumpy(), [2.5, 2.5, 2.5])  # (0 + 10) / 4: None counts as zeros


def test_start_finish_and_ready_overlap_the_buckets():
    shapes = [(2,), (2,), (2,), (2,)]  # float64, fusion 32 bytes: buckets [3, 2] then [1, 0]

    def body():
        comm = resolve_communicator("test", None)
        rank = comm.rank
        reducer = DistributedGradReducer(_params(shapes), mean=False, fusion_bytes=32)
        grads = _grads(shapes, rank, 7)
        reducer.agree_on_parameters()  # the first use's one agreement exchange, counted apart
        base = comm.collective_count
        counts = []
        for i in (3, 2, 1, 0):  # backward's order: last layers first
            reducer.ready(i, grads[i])
            counts.append(comm.collective_count - base)
        overlapped = reducer.finish()
        reducer.start(grads)
        started = comm.collective_count - base
        again = reducer.finish()
        return counts, started, overlapped, again

    results = run_threads(3, body)
    want = [sum(_grads(shapes, r, 7)[i].asnumpy() for r in range(3)) for i in range(4)]
    for counts, started, overlapped, again in results:
        assert counts == [0, 1, 1, 2]  # bucket 0 starts as soon as grads 3 and 2 are in
        assert started == 4
        for i in range(4):
            np.testing.assert_allclose(overlapped[i].asnumpy(), want[i], rtol=1e-12)
            np.testing.assert_allclose(again[i].asnumpy(), want[i], rtol=1e-12)


def test_buckets_start_in_order_even_when_a_later_one_fills_first():
    shapes = [(2,), (2,), (2,), (2,)]

    def body():
        comm = resolve_communicator("test", None)
        reducer = DistributedGradReducer(_params(shapes), fusion_bytes=32)
        reducer.agree_on_parameters()  # the first use's one agreement exchange, counted apart
        base = comm.collective_count
        reducer.ready(0, np.ones(2))
        reducer.ready(1, np.ones(2))  # bucket 1 complete, but bucket 0 has not started
        waiting = comm.collective_count - base
        reducer.ready(3, np.ones(2))
        reducer.ready(2, np.ones(2))
        both = comm.collective_count - base
        out = reducer.finish()
        return waiting, both, out

    for waiting, both, out in run_threads(2, body):
        assert (waiting, both) == (0, 2)
        for g in out:
            np.testing.assert_allclose(g.asnumpy(), np.ones(2))


def test_returned_gradients_survive_the_next_step():
    reducer = DistributedGradReducer(_params([(3,)]))  # a world of one without init
    first = reducer((Tensor(np.ones(3)),))
    reducer((Tensor(np.full(3, 5.0)),))
    np.testing.assert_allclose(first[0].asnumpy(), np.ones(3))


def test_errors():
    params = _params([(2,), (3,)])
    reducer = DistributedGradReducer(params)
    with pytest.raises(ValueError, match=r"DistributedGradReducer: got 1 gradient\(s\) for 2 parameter\(s\)"):
        reducer((Tensor(np.ones(2)),))
    with pytest.raises(ValueError, match=r"gradient 1 of shape \(4,\) does not match its parameter of shape \(3,\)"):
        reducer((Tensor(np.ones(2)), Tensor(np.ones(4))))
    with pytest.raises(TypeError, match="grads must be a tuple"):
        reducer(Tensor(np.ones(2)))
    with pytest.raises(RuntimeError, match="finish\\(\\) called without start"):
        reducer.finish()
    with pytest.raises(ValueError, match="index 2 is not that of one of the 2 parameters"):
        reducer.ready(2, np.ones(2))
    reducer.ready(0, np.ones(2))
    with pytest.raises(ValueError, match="the gradient of parameter 0 was already given"):
        reducer.ready(0, np.ones(2))
    with pytest.raises(RuntimeError, match="a reduction is already in flight"):
        reducer.start((np.ones(2), np.ones(3)))
    np.testing.assert_allclose(reducer.finish()[1].asnumpy(), np.zeros(3))  # never given: zeros
    with pytest.raises(ValueError, match="fusion_bytes must be a positive int"):
        DistributedGradReducer(params, fusion_bytes=0)
    with pytest.raises(ValueError, match="degree must be a positive int"):
        DistributedGradReducer(params, degree=0)
    with pytest.raises(TypeError, match="mean must be a bool"):
        DistributedGradReducer(params, mean=1)
