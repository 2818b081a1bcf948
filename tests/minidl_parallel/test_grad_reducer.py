"""DistributedGradReducer on the threads backend: values, bucketing, overlap and errors."""
import re
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, strategies as st

from minidl import Parameter, Tensor
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel import CommCounter, run_threads
from minidl_parallel.grad_reducer import DistributedGradReducer
from minidl_parallel.tensor_parallel.counter import CommEvent

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


# ---- settings, collectives and messages, exactly ---------------------------------------

def _raises(kind, message):
    """pytest.raises matching the whole message (nothing lost: the argument, the value, what is expected)."""
    return pytest.raises(kind, match="^" + re.escape(message) + "$")


@pytest.mark.parametrize("kwargs, kind, message", [
    ({"degree": True}, ValueError, "degree must be a positive int or None (the group size), got True"),
    ({"degree": 2.0}, ValueError, "degree must be a positive int or None (the group size), got 2.0"),
    ({"fusion_bytes": True}, ValueError, "fusion_bytes must be a positive int, got True"),
    ({"fusion_bytes": 8.0}, ValueError, "fusion_bytes must be a positive int, got 8.0"),
    ({"parameter_broadcast": 1}, TypeError, "parameter_broadcast must be a bool, got 1"),
    ({"gradient_predivide_factor": True}, ValueError,
     "gradient_predivide_factor must be a finite number > 0, got True"),
    ({"gradient_predivide_factor": -2.0}, ValueError,
     "gradient_predivide_factor must be a finite number > 0, got -2.0"),
    ({"gradient_predivide_factor": float("inf")}, ValueError,
     "gradient_predivide_factor must be a finite number > 0, got inf"),
    ({"gradient_predivide_factor": 2.0, "mean": False}, ValueError,
     "gradient_predivide_factor=2.0 divides an average; it needs mean=True (Horovod allows it with op=Average only)"),
    ({"adasum": 1}, TypeError, "adasum must be a bool, got 1"),
    ({"compression": "int8"}, ValueError,
     "compression must be Compression.none, .fp16 or .bf16 (or their names), got 'int8'"),
    ({"comm": "world"}, TypeError, "group must be a Communicator (or None for the world), got str"),
])
def test_bad_settings_name_the_argument_the_value_and_what_is_expected(kwargs, kind, message):
    with _raises(kind, f"DistributedGradReducer: {message}"):
        DistributedGradReducer(_params([(2,)]), **kwargs)


def test_every_parameter_needs_a_shape_and_a_dtype():
    with _raises(TypeError, "DistributedGradReducer: parameters[1] must be a Parameter, got SimpleNamespace"):
        DistributedGradReducer(_params([(2,)]) + [SimpleNamespace(shape=(2,))])


def test_the_smallest_settings_are_accepted():
    """degree 1 and fusion_bytes 1 (every gradient in a bucket of its own) are valid, as is any f > 0."""
    reducer = DistributedGradReducer(_params([(2,), (3,)]), degree=1, fusion_bytes=1, gradient_predivide_factor=0.5)
    assert [b.indices for b in reducer.buckets] == [[1], [0]]
    out = reducer((Tensor(np.arange(2.0)), Tensor(np.arange(3.0))))
    np.testing.assert_array_equal(out[1].asnumpy(), np.arange(3.0))  # / f, sum of one, * f / degree 1: exact


def test_ready_takes_an_int_index_and_the_grads_a_sequence():
    reducer = DistributedGradReducer(_params([(2,), (3,)]))
    for index in (True, 1.0):
        with _raises(ValueError, f"DistributedGradReducer: index {index!r} is not that of one of the 2 parameters"):
            reducer.ready(index, np.ones(3))
    with _raises(TypeError, "DistributedGradReducer: grads must be a tuple aligned with the parameters, got generator"):
        reducer(g for g in (np.ones(2), np.ones(3)))


def test_a_parameter_nobody_has_a_gradient_for_gets_zeros_in_its_own_bucket():
    reducer = DistributedGradReducer(_params([(3,)], [np.float32]))  # one parameter: a bucket of one
    (g,) = reducer((None,))
    assert g.dtype == np.float32
    np.testing.assert_array_equal(g.asnumpy(), np.zeros(3))


def test_a_gradient_in_another_dtype_is_reduced_in_the_parameters_and_returned_in_its_own():
    def body():
        rank = resolve_communicator("test", None).rank
        reducer = DistributedGradReducer(_params([(2,), (3,)]), mean=True)  # float64 parameters
        return reducer((Tensor(np.full(2, rank + 1.0, np.float32)), Tensor(np.full(3, rank + 1.0))))

    for g0, g1 in run_threads(2, body):
        assert g0.dtype == np.float32 and g1.dtype == np.float64
        np.testing.assert_array_equal(g0.asnumpy(), [1.5, 1.5])
        np.testing.assert_array_equal(g1.asnumpy(), [1.5, 1.5, 1.5])


def test_a_given_communicator_is_the_one_used():
    """comm=: the reducer and its broadcast run over that communicator, not the world (here a
    world of one inside a world of two: nothing is summed, nothing is sent)."""
    from minidl_parallel.comm.local import LocalCommunicator

    def body():
        world = resolve_communicator("test", None)
        rank = world.rank
        params = _params([(2,)])
        params[0].data[...] = rank
        reducer = DistributedGradReducer(params, mean=True, comm=LocalCommunicator())
        before = world.collective_count
        out = reducer((Tensor(np.full(2, rank + 1.0)),))
        count = reducer.broadcast_parameters(params)
        return out[0].asnumpy(), count, params[0].asnumpy(), world.collective_count - before

    for rank, (g, count, value, collectives) in enumerate(run_threads(2, body)):
        np.testing.assert_array_equal(g, [rank + 1.0] * 2)
        assert count == 0 and collectives == 0
        np.testing.assert_array_equal(value, [rank] * 2)


def test_the_predivide_factor_is_undone_after_the_sum_whatever_it_is():
    """f / degree = 2 after the sum: (g / 4 + g / 4) * 2 = the mean (f > degree is allowed)."""
    def body():
        rank = resolve_communicator("test", None).rank
        reducer = DistributedGradReducer(_params([(3,)]), mean=True, gradient_predivide_factor=4.0)
        return reducer((Tensor(np.full(3, 4.0 * (rank + 1))),))[0].asnumpy()

    for g in run_threads(2, body):
        np.testing.assert_array_equal(g, [6.0] * 3)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the fp16 sum that overflows
def test_an_overflow_in_any_bucket_is_flagged_and_none_before_the_first_reduction():
    def body():
        rank = resolve_communicator("test", None).rank
        reducer = DistributedGradReducer(_params([(3,), (3,)], [np.float32] * 2), compression="fp16", fusion_bytes=12)
        flags = [reducer.overflowed()]
        for big in ((4e4, 1.0), (1.0, 4e4), (1.0, 1.0)):  # 8e4 overflows fp16 in bucket 1, then in bucket 0
            reducer((Tensor(np.full(3, big[0], np.float32)), Tensor(np.full(3, big[1], np.float32))))
            flags.append(reducer.overflowed())
        return [b.indices for b in reducer.buckets], flags

    for buckets, flags in run_threads(2, body):
        assert buckets == [[1], [0]]
        assert flags == [False, True, True, False]


def test_a_call_blocks_start_overlaps_and_a_join_block_blocks():
    """__call__ takes the blocking all-reduce per bucket (nothing can overlap there), start()
    the non-blocking one, and inside a join block every bucket blocks (see _launch)."""
    def body():
        comm = resolve_communicator("test", None)
        calls = []
        blocking, overlapped = comm.allreduce_, comm.iallreduce_
        comm.allreduce_ = lambda x, op="sum": calls.append("blocking") or blocking(x, op)
        comm.iallreduce_ = lambda x, op="sum": calls.append("overlapped") or overlapped(x, op)
        reducer = DistributedGradReducer(_params([(2,), (2,)]), fusion_bytes=16)  # two buckets
        grads = _grads([(2,), (2,)], comm.rank, 1)
        log = []
        try:
            for step in ("start", "call", "start", "join"):
                if step == "call":
                    reducer(grads)
                elif step == "start":
                    reducer.start(grads)
                    reducer.finish()
                else:
                    with reducer.join():
                        reducer.start(grads)
                        reducer.finish()
                log.append(calls[:])
                calls.clear()
        finally:
            del comm.allreduce_, comm.iallreduce_
        return log

    for log in run_threads(2, body):
        assert log == [["overlapped"] * 2, ["blocking"] * 2, ["overlapped"] * 2, ["blocking"] * 2]


def test_each_bucket_is_one_counted_gradient_collective():
    """Per bucket, one event for CommCounter: an all-reduce of its bytes, or Adasum's all-gather."""
    def body(adasum):
        reducer = DistributedGradReducer(_params([(2,), (3,)]), fusion_bytes=16, adasum=adasum)
        with CommCounter() as counter:
            reducer(_grads([(2,), (3,)], resolve_communicator("test", None).rank, 2))
        return counter.events

    for events in run_threads(2, body, False):  # float64 buckets of 3 and 2 values; 2(n-1)/n of each
        assert events == [CommEvent("allreduce", 2, 24, "gradients"), CommEvent("allreduce", 2, 16, "gradients")]
    for events in run_threads(2, body, True):  # (n-1) times each
        assert events == [CommEvent("allgather", 2, 24, "gradients"), CommEvent("allgather", 2, 16, "gradients")]


def test_adasum_on_a_world_that_is_not_a_power_of_two_names_the_reducer():
    def body():
        DistributedGradReducer(_params([(2,)]), adasum=True)((np.ones(2),))

    with pytest.raises(ValueError, match=r"^rank \d of 3: DistributedGradReducer: Adasum needs a power-of-two number "):
        run_threads(3, body)


def test_accumulation_inside_a_join_block_is_refused_with_the_reason():
    reducer = DistributedGradReducer(_params([(2,)]), backward_passes_per_step=2)
    with _raises(RuntimeError, "DistributedGradReducer: backward_passes_per_step=2 inside a join block is not "
                               "supported: a finished rank cannot tell which calls its peers reduce; use "
                               "backward_passes_per_step=1 with uneven inputs"):
        with reducer.join():
            reducer((np.ones(2),))


def test_ranks_running_different_checks_at_one_point_are_named():
    from minidl_parallel.agreement import disagreement

    def body():
        comm = resolve_communicator("test", None)
        try:
            if comm.rank == 0:
                DistributedGradReducer(_params([(2,)])).agree_on_parameters()
            else:
                return disagreement(comm, "strategy", ())
        except ValueError as e:
            return str(e)

    message, _ = run_threads(2, body)
    assert message == ("DistributedGradReducer: the ranks are running different checks at the same point (rank 0: "
                       "'parameters', rank 1: 'strategy'): they run different programs or parallel modes; every rank "
                       "must make the same calls")


def test_the_first_differing_parameter_is_named_in_full():
    def body():
        rank = resolve_communicator("test", None).rank
        try:
            DistributedGradReducer(_params([(2,), (3 + rank,)]))((np.ones(2), np.ones(3 + rank)))
        except ValueError as e:
            return str(e)

    for message in run_threads(2, body):  # as many tensors on each rank: no count note
        assert message == ("DistributedGradReducer: the ranks' parameters differ at tensor 1: rank 0: 'p1' of shape "
                           "(3,) float64, rank 1: 'p1' of shape (4,) float64; every rank must build the same network "
                           "(same layers, shapes and dtypes, in the same order) before training")


def test_on_the_device_the_buckets_stay_device_arrays(on_the_double):
    """minidl's GPU path on the strict device double (which refuses a silent host copy): each
    bucket is made with its gradients' module, or its parameters' when no rank has a gradient,
    so a reduction costs no host synchronisation and no upload."""
    from minidl.testing import cupy_double
    cp = on_the_double
    params = [_params([(2,), (3,)], [np.float32] * 2) for _ in range(2)]  # one bucket: [1, 0]
    grads = [cp.asarray(np.full(2, rank + 1.0, np.float32)) for rank in range(2)]

    def body():
        rank = resolve_communicator("test", None).rank
        reducer = DistributedGradReducer(params[rank], mean=False)
        return reducer((grads[rank], None)), reducer((None, None))

    with cupy_double.count_host_syncs() as syncs:
        results = run_threads(2, body)
    assert syncs.total == 0 and syncs.uploads == 0, (syncs.by_reason, syncs.uploads)
    for some, none in results:
        for g in some + none:
            assert isinstance(g.data, cp.ndarray) and g.dtype == np.float32
        np.testing.assert_array_equal(cp.asnumpy(some[0].data), [3.0, 3.0])
        np.testing.assert_array_equal(cp.asnumpy(some[1].data), np.zeros(3))
        np.testing.assert_array_equal(cp.asnumpy(none[0].data), np.zeros(2))


def test_bf16_on_the_device_is_refused_naming_the_reducer(on_the_double):
    cp = on_the_double
    reducer = DistributedGradReducer(_params([(2,)], [np.float32]), compression="bf16")
    with pytest.raises(TypeError, match=r"^DistributedGradReducer: Compression.bf16 needs NumPy arrays"):
        reducer((cp.asarray(np.ones(2, np.float32)),))
