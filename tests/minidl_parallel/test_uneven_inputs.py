"""Uneven inputs: differing step counts raise by default; join blocks train on like one process would."""
import numpy as np
import pytest

import minidl
import minidl_parallel as mp
from minidl import Tensor, nn
from minidl.autograd import value_and_grad
from minidl.dataset import NumpySlicesDataset
from minidl_parallel import run_threads
from minidl_parallel.grad_reducer import DistributedGradReducer

BATCH, LR = 2, 0.1


def _net():
    minidl.set_seed(3)  # the same initial parameters on every rank and in the reference
    return nn.SequentialCell(nn.Dense(3, 4, dtype=minidl.float64), nn.Tanh(), nn.Dense(4, 2, dtype=minidl.float64))


def _batches(rank, count):
    """Rank ``rank``'s ``count`` batches (x, y), distinct for every rank."""
    rng = np.random.default_rng(100 + rank)
    return [(rng.standard_normal((BATCH, 3)), rng.standard_normal((BATCH, 2))) for _ in range(count)]


def _dataset(batches):
    x = np.concatenate([b[0] for b in batches]) if batches else np.zeros((0, 3))
    y = np.concatenate([b[1] for b in batches]) if batches else np.zeros((0, 2))
    return NumpySlicesDataset({"x": x, "y": y}, shuffle=False).batch(BATCH)


def _reference(counts, mean, epochs=1):
    """One process: at step k, the sum over the ranks that still have a batch of their gradients
    (divided by the world size when mean): what DDP's join computes."""
    net = _net()
    opt = nn.SGD(net.trainable_params(), learning_rate=LR)
    loss_fn = nn.MSELoss()
    grad_fn = value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    per_rank = [_batches(r, c) for r, c in enumerate(counts)]
    for _ in range(epochs):
        for k in range(max(counts)):
            total = None
            for batches in per_rank:
                if k < len(batches):
                    _, grads = grad_fn(Tensor(batches[k][0]), Tensor(batches[k][1]))
                    arrays = [g.data for g in grads]
                    total = arrays if total is None else [t + a for t, a in zip(total, arrays)]
            if mean:
                total = [t / len(counts) for t in total]
            opt(tuple(Tensor(t) for t in total))
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


def _train_model(counts, mean, uneven_inputs, epochs=1):
    rank = mp.get_rank()
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=mean)
    net = _net()
    model = minidl.Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), learning_rate=LR))
    model.train(epochs, _dataset(_batches(rank, counts[rank])), progress=False, uneven_inputs=uneven_inputs)
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


def _each_rank(n, fn, *args):
    def body():
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - the test inspects every rank's error
            return e
    return run_threads(n, body, timeout=30)


def test_differing_step_counts_raise_on_every_rank_naming_each_count():
    errors = _each_rank(2, _train_model, [3, 2], True, False)
    assert all(isinstance(e, ValueError) for e in errors), errors
    for e in errors:
        msg = str(e)
        for part in ("Model.train", "different numbers of steps per epoch", "rank 0: 3, rank 1: 2",
                     "uneven_inputs=True"):
            assert part in msg, msg


def test_a_rank_with_no_batch_raises_the_step_counts_on_every_rank_not_alone():
    errors = _each_rank(2, _train_model, [2, 0], True, False)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "rank 0: 2, rank 1: 0" in str(errors[0]) and str(errors[0]) == str(errors[1])


def test_differing_uneven_inputs_flags_are_named():
    def fn():
        return _train_model([2, 2], True, mp.get_rank() == 1)
    errors = _each_rank(2, fn)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "disagree on uneven_inputs" in str(errors[0])


@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("counts, epochs", [([3, 2], 1), ([1, 3, 2], 2), ([2, 0], 1)])
def test_model_train_with_uneven_inputs_equals_the_one_process_sum(counts, epochs, mean):
    want = _reference(counts, mean, epochs)
    for got in run_threads(len(counts), _train_model, counts, mean, True, epochs):
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14, err_msg=name)


def test_join_block_in_a_custom_loop_shadows_the_missing_steps_with_zeros():
    counts = [1, 3, 0]  # rank 2 has no data at all: it only shadows

    def fn():
        rank = mp.get_rank()
        net = _net()
        opt = nn.SGD(net.trainable_params(), learning_rate=LR)
        loss_fn = nn.MSELoss()
        grad_fn = value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
        reducer = DistributedGradReducer(opt.parameters, mean=True)
        with mp.join(reducer, opt) as joined:
            for x, y in _batches(rank, counts[rank]):
                _, grads = grad_fn(Tensor(x), Tensor(y))
                opt(reducer(grads))
        return joined.shadowed_steps, {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}

    want = _reference(counts, True)
    results = run_threads(3, fn)
    assert [shadowed for shadowed, _ in results] == [2, 0, 3]
    for _, got in results:
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-12, atol=1e-14, err_msg=name)


def test_join_block_with_even_inputs_adds_one_vote_per_step_and_one_at_the_end():
    def fn():
        from minidl_parallel.collectives import resolve_communicator
        comm = resolve_communicator("test", None)
        reducer = DistributedGradReducer([minidl.Parameter(np.zeros(3), name="a")], mean=False)
        reducer.agree_on_parameters()
        before = comm.collective_count
        with reducer.join() as joined:
            for _ in range(4):
                reducer([np.ones(3)])
        return comm.collective_count - before, joined.shadowed_steps
    assert run_threads(2, fn) == [(4 * 2 + 1, 0)] * 2


def test_uneven_inputs_is_refused_under_tensor_parallelism_on_every_rank():
    def fn():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=2)
        net = _net()
        model = minidl.Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), learning_rate=LR))
        model.train(1, _dataset(_batches(0, 2)), progress=False, uneven_inputs=True)
    errors = _each_rank(2, fn)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "uneven_inputs=True needs data parallelism" in str(errors[0])


def test_uneven_inputs_on_one_device_trains_as_usual():
    want = _reference([3], mean=False)
    net = _net()
    model = minidl.Model(net, nn.MSELoss(), nn.SGD(net.trainable_params(), learning_rate=LR))
    model.train(1, _dataset(_batches(0, 3)), progress=False, uneven_inputs=True)
    for name, p in net.parameters_and_names():
        np.testing.assert_allclose(p.asnumpy(), want[name], rtol=1e-12, err_msg=name)
    with pytest.raises(TypeError, match="uneven_inputs must be a bool, got 'yes'"):
        model.train(1, _dataset(_batches(0, 3)), progress=False, uneven_inputs="yes")


def test_runtime_gathers_every_rank_value_and_says_when_steps_communicate():
    from minidl.runtime import Runtime, get_runtime
    assert Runtime().gather({"steps": 3}) == [{"steps": 3}] and Runtime().trains_in_lockstep() is False

    def fn():
        runtime = get_runtime()
        alone = runtime.trains_in_lockstep()
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL)
        return runtime.gather(("rank", mp.get_rank())), alone, runtime.trains_in_lockstep()
    assert run_threads(3, fn) == [([("rank", 0), ("rank", 1), ("rank", 2)], False, True)] * 3
