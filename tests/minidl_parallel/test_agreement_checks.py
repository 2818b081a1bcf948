"""Cross-rank agreement checks: ranks that built different models or strategies raise, naming the difference."""
import numpy as np
import pytest

import minidl
import minidl_parallel as mp
from minidl import Parameter, Tensor, nn, ops
from minidl.dataset import NumpySlicesDataset
from minidl_parallel import run_threads
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel.grad_reducer import DistributedGradReducer
from minidl_parallel.tensor_parallel import StrategyError


def _each_rank(n, fn, timeout=30):
    """fn() on n thread-ranks; each rank's result, or the exception it raised (every rank must raise alike)."""
    def body():
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the test inspects every rank's error
            return e
    return run_threads(n, body, timeout=timeout)


def _train_dense(out_dims, dtypes=None, parameter_broadcast=False):
    rank = mp.get_rank()
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 parameter_broadcast=parameter_broadcast)
    dtype = (dtypes or {}).get(rank, minidl.float32)
    out = out_dims[rank]
    net = nn.SequentialCell(nn.Dense(8, out, dtype=dtype), nn.ReLU(), nn.Dense(out, 2, dtype=dtype))
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    model = minidl.Model(net, nn.MSELoss(), opt)
    rng = np.random.default_rng(rank)
    np_dtype = np.float64 if dtype == minidl.float64 else np.float32
    ds = NumpySlicesDataset({"x": rng.standard_normal((4, 8)).astype(np_dtype),
                             "y": rng.standard_normal((4, 2)).astype(np_dtype)}, shuffle=False).batch(2)
    model.train(1, ds, progress=False)
    return "trained"


def test_models_differing_across_ranks_raise_naming_the_parameter_on_every_rank():
    errors = _each_rank(2, lambda: _train_dense({0: 4, 1: 3}))
    assert all(isinstance(e, ValueError) for e in errors), errors
    for e in errors:
        msg = str(e)
        for part in ("DistributedGradReducer", "rank 0: '0.weight' of shape (4, 8) float32",
                     "rank 1: '0.weight' of shape (3, 8) float32", "same network"):
            assert part in msg, msg
    assert len({str(e) for e in errors}) == 1


def test_parameter_dtypes_differing_across_ranks_are_named():
    errors = _each_rank(2, lambda: _train_dense({0: 4, 1: 4}, dtypes={1: minidl.float64}))
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "rank 0: '0.weight' of shape (4, 8) float32, rank 1: '0.weight' of shape (4, 8) float64" in str(errors[0])


def test_parameter_broadcast_checks_the_tensors_before_broadcasting():
    """parameter_broadcast runs before the first step: there the check names the mismatch too."""
    errors = _each_rank(3, lambda: _train_dense({0: 4, 1: 4, 2: 5}, parameter_broadcast=True))
    assert all(isinstance(e, ValueError) for e in errors), errors
    msg = str(errors[0])
    assert "DistributedGradReducer.broadcast_parameters" in msg, msg
    assert "rank 2: '0.weight' of shape (5, 8) float32" in msg, msg


def test_different_numbers_of_parameters_name_each_rank_count():
    def fn():
        rank = mp.get_rank()
        params = [Parameter(np.zeros(3), name="a")] + ([Parameter(np.zeros(2), name="b")] if rank else [])
        reducer = DistributedGradReducer(params, mean=False)
        return reducer([np.ones(3)] + ([np.ones(2)] if rank else []))
    errors = _each_rank(2, fn)
    assert all(isinstance(e, ValueError) for e in errors), errors
    msg = str(errors[0])
    assert "rank 0: nothing, rank 1: 'b' of shape (2,) float64" in msg and "rank 0: 1, rank 1: 2" in msg, msg


def test_differing_gradients_mean_is_named():
    def fn():
        reducer = DistributedGradReducer([Parameter(np.zeros(3), name="a")], mean=mp.get_rank() == 0)
        return reducer([np.ones(3)])
    errors = _each_rank(2, fn)
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "rank 0: degree=2, mean=True, rank 1: degree=2, mean=False" in str(errors[0])


def test_the_check_runs_once_per_communicator_not_every_step():
    def fn():
        comm = resolve_communicator("test", None)
        reducer = DistributedGradReducer([Parameter(np.zeros(3), name="a")], mean=False)
        counts = []
        for _ in range(3):
            before = comm.collective_count
            reducer([np.ones(3)])
            counts.append(comm.collective_count - before)
        return counts
    # First step: one agreement exchange (the digests agree) + one bucket; then one bucket a step.
    assert run_threads(2, fn) == [[2, 1, 1]] * 2


def test_a_reducer_checks_again_on_another_world():
    """Parallel state is resolved at use: a reducer used again in a second world checks there too."""
    kept = DistributedGradReducer([Parameter(np.zeros(3), name="a")], mean=False)  # rank 0's, in both worlds

    def reduce_with(shape_of_rank_1):
        def fn():
            if mp.get_rank() == 0:
                return kept([np.ones(3)])[0].data.tolist()
            own = DistributedGradReducer([Parameter(np.zeros(shape_of_rank_1), name="a")], mean=False)
            return own([np.ones(shape_of_rank_1)])[0].data.tolist()
        return fn

    assert run_threads(2, reduce_with((3,))) == [[2.0] * 3] * 2
    # The second world's rank 1 differs: what the first world agreed on must not carry over.
    errors = _each_rank(2, reduce_with((2,)))
    assert all(isinstance(e, ValueError) for e in errors), errors
    assert "rank 0: 'a' of shape (3,) float64, rank 1: 'a' of shape (2,) float64" in str(errors[0])


# ---- tensor parallel: the strategy agreement before splitting ------------------------------------

class _MatMulNet(nn.Cell):
    def __init__(self):
        super().__init__()
        self.weight = Parameter(np.ones((8, 4)) / 8)
        self.matmul = ops.MatMul()

    def construct(self, x):
        return self.matmul(x, self.weight)


def _tensor_parallel(fn, **settings):
    def body():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", device_num=4, **settings)
        try:
            return fn()
        finally:
            mp.reset_auto_parallel_context()
    return _each_rank(4, body)


def test_shard_strategies_differing_across_ranks_raise_naming_each_rank_strategy():
    strategies = {0: ((2, 1), (1, 2)), 1: ((2, 1), (1, 2)), 2: ((1, 2), (2, 2)), 3: ((2, 1), (1, 2))}

    def fn():
        net = _MatMulNet()
        net.matmul.shard(strategies[mp.get_rank()])
        return net(Tensor(np.ones((2, 8)))).data
    errors = _tensor_parallel(fn)
    assert all(isinstance(e, StrategyError) for e in errors), errors
    msg = str(errors[0])
    for part in ("rank 0: MatMul (matmul) on inputs ((8, 8), (8, 4)), strategy ((2, 1), (1, 2)) (shard)",
                 "rank 2: MatMul (matmul) on inputs ((8, 8), (8, 4)), strategy ((1, 2), (2, 2)) (shard)",
                 "same strategy"):
        assert part in msg, msg


def test_parallel_contexts_differing_across_ranks_are_named_before_any_split():
    def fn():
        if mp.get_rank() == 1:
            mp.set_auto_parallel_context(dataset_strategy="full_batch")
        net = _MatMulNet()
        return net(Tensor(np.ones((8, 8)))).data
    errors = _tensor_parallel(fn)
    assert all(isinstance(e, StrategyError) for e in errors), errors
    msg = str(errors[0])
    assert "dataset_strategy is rank 0: 'data_parallel', rank 1: 'full_batch', rank 2: 'data_parallel'" in msg, msg


def test_agreeing_ranks_check_each_operator_once():
    def fn():
        comm = resolve_communicator("test", None)
        exchanged = []
        gather = comm.allgather_object

        def spy(obj):
            exchanged.append(obj)
            return gather(obj)
        comm.allgather_object = spy
        try:
            net = _MatMulNet()
            net.matmul.shard(((2, 1), (1, 2)))
            x = Tensor(np.ones((2, 8)))
            counts = []
            for _ in range(3):
                before = len(exchanged)
                net(x)
                counts.append(len(exchanged) - before)
            return counts
        finally:
            del comm.allgather_object
    # One digest exchange per call signature: the first call, the second (the weight is now
    # placed, another signature), none after.
    assert _tensor_parallel(fn) == [[1, 1, 0]] * 4


@pytest.mark.parametrize("n", [1, 2])
def test_single_rank_and_agreeing_models_train_unchanged(n):
    assert run_threads(n, lambda: _train_dense({r: 4 for r in range(n)})) == ["trained"] * n
