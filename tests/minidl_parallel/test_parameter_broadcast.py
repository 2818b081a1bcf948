"""parameter_broadcast=True: every rank starts training from rank 0's parameters and optimizer state."""
import numpy as np
import pytest

import minidl
import minidl_parallel as mp
from minidl import Parameter, Tensor, nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback
from minidl_parallel import run_threads
from minidl_parallel.grad_reducer import DistributedGradReducer


class _Snapshot(Callback):
    """Copies every parameter and optimizer state when training begins (after the broadcast)."""

    def on_train_begin(self, run_context):
        args = run_context.original_args()
        self.state = {n: p.asnumpy().copy() for n, p in args.network.parameters_and_names()}
        self.state.update({"opt." + n: p.asnumpy().copy() for n, p in args.optimizer.parameters_and_names()})
        run_context.request_stop()


def _start_state(broadcast):
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                 parameter_broadcast=broadcast)
    rank = mp.get_rank()
    minidl.set_seed(10 + rank)  # deliberately different initial parameters on every rank
    net = nn.SequentialCell(nn.Dense(3, 4), nn.ReLU(), nn.Dense(4, 2))
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.1, momentum=0.9)
    for _, m in opt.parameters_and_names():
        m.data[...] = rank + 1  # as if each rank resumed from its own optimizer state
    model = minidl.Model(net, nn.MSELoss(), opt)
    rng = np.random.default_rng(0)
    ds = NumpySlicesDataset({"x": rng.standard_normal((8, 3)).astype(np.float32),
                             "y": rng.standard_normal((8, 2)).astype(np.float32)}, shuffle=False).batch(2)
    snap = _Snapshot()
    model.train(1, ds, callbacks=[snap], progress=False)
    return snap.state


@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_starts_from_rank_0(n):
    states = run_threads(n, _start_state, True)
    assert len(states[0]) == 9  # 4 parameters, 4 moments, global_step
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        for name, value in state.items():
            np.testing.assert_array_equal(value, states[0][name], err_msg=name)
    assert np.all(states[0]["opt.moments.0.weight"] == 1)  # rank 0's state, not rank 1's


def test_without_parameter_broadcast_ranks_keep_their_own_parameters():
    a, b = run_threads(2, _start_state, False)
    assert not np.array_equal(a["0.weight"], b["0.weight"])


def test_broadcast_parameters_fuses_per_dtype_and_buffer_size():
    def body():
        rank = mp.get_rank()
        ts = [Parameter(np.full(s, rank + 1.0, dtype=d), name=f"t{i}")
              for i, (s, d) in enumerate([((3,), np.float32), ((2, 2), np.float64), ((), np.float32),
                                          ((5,), np.float64)])]
        views = [t.data for t in ts]
        reducer = DistributedGradReducer(ts, fusion_bytes=40)
        comm = mp.get_communicator()
        before = comm.collective_count
        count = reducer.broadcast_parameters(ts + [Tensor(np.arange(2) * (rank + 1))])
        return count, comm.collective_count - before, ts, views

    for count, collectives, ts, views in run_threads(3, body):
        # float32: 16 bytes in one buffer; float64: 32 + 40 bytes over 40 -> two; int64: one.
        assert count == 4 and collectives == count + 1  # + the agreement check's one exchange
        for t, v in zip(ts, views):
            assert t.data is v and np.all(t.data == 1.0)


def test_broadcast_parameters_rejects_non_tensors():
    reducer = DistributedGradReducer([Parameter(np.zeros(2), name="p")])
    with pytest.raises(TypeError, match=r"broadcast_parameters: tensors\[0\] must be a Tensor, got ndarray"):
        reducer.broadcast_parameters([np.zeros(2)])
    with pytest.raises(TypeError, match="parameter_broadcast must be a bool"):
        DistributedGradReducer([], parameter_broadcast=1)
