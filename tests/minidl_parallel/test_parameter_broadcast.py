"""parameter_broadcast=True: every rank starts training from rank 0's parameters and optimizer state."""
import numpy as np
import pytest

import minidl
import minidl_parallel as mp
from minidl import Parameter, Tensor, nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback
from minidl_parallel import run_threads
from minidl_parallel.broadcast import broadcast_tensors
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


def _distinct(sizes, rank, dtype=np.float64):
    """Tensors of the given numbers of values, every value distinct across tensors and ranks."""
    start = np.cumsum([0] + list(sizes))
    return [Tensor((np.arange(a, b) + 100 * rank).astype(dtype)) for a, b in zip(start, start[1:])]


def test_broadcast_tensors_fills_buffers_up_to_fusion_bytes_exactly_from_root_0_by_default():
    sizes = [2, 2, 2, 2]  # float64, fusion 32 bytes: two full buffers [2, 2] [2, 2]

    def body():
        rank = mp.get_rank()
        ts = _distinct(sizes, rank)
        count = broadcast_tensors(ts, fusion_bytes=32)
        first = [t.asnumpy().copy() for t in ts]
        again = broadcast_tensors(_distinct(sizes, rank))  # the default fusion_bytes: one buffer
        mixed = [Tensor(np.full(2, rank, d)) for d in (np.float32, np.float64, np.float32, np.int64)]
        return count, first, again, broadcast_tensors(mixed), mixed

    want = [t.asnumpy() for t in _distinct(sizes, 0)]
    for count, first, again, mixed_count, mixed in run_threads(2, body):
        assert count == 2 and again == 1
        for got, w in zip(first, want):
            np.testing.assert_array_equal(got, w)
        assert mixed_count == 3  # one buffer per dtype, never one mixed buffer
        assert [t.dtype for t in mixed] == [np.float32, np.float64, np.float32, np.int64]
        assert all(np.all(t.asnumpy() == 0) for t in mixed)


def test_broadcast_parameters_from_another_root_and_its_checks():
    from minidl_parallel.comm.local import LocalCommunicator

    def body():
        rank = mp.get_rank()
        ts = _distinct([3, 1], rank)
        reducer = DistributedGradReducer([Parameter(np.zeros(3), name="p")])
        reducer.broadcast_parameters(ts, root=1)
        alone = broadcast_tensors(_distinct([3], rank), comm=LocalCommunicator())  # nothing to send
        return [t.asnumpy() for t in ts], alone, broadcast_tensors([])

    for values, alone, empty in run_threads(2, body):
        np.testing.assert_array_equal(np.concatenate(values), np.arange(4) + 100)  # rank 1's
        assert alone == 0 and empty == 0
    assert broadcast_tensors(_distinct([3], 0)) == 0  # a world of one
    for root in (1, -1, False):
        with pytest.raises(ValueError, match=r"^broadcast_parameters: root must be a rank in \[0, 0\], got "
                                             f"{root!r}$"):
            broadcast_tensors(_distinct([3], 0), root)
    with pytest.raises(TypeError, match=r"^broadcast_parameters: tensors\[0\] must be a Tensor, got ndarray$"):
        broadcast_tensors([np.zeros(2)])
    with pytest.raises(TypeError, match=r"^broadcast_parameters: group must be a Communicator \(or None for the "
                                        r"world\), got str$"):
        broadcast_tensors(_distinct([3], 0), comm="world")


def test_ranks_broadcasting_from_different_roots_or_running_another_check_are_named():
    from minidl_parallel.agreement import disagreement

    def body(other):
        comm = mp.get_communicator()
        try:
            if comm.rank == 1 and other:
                return disagreement(comm, "strategy", ())
            broadcast_tensors(_distinct([2], 0), root=comm.rank)
        except ValueError as e:
            return str(e)

    message = run_threads(2, body, False)[0]
    assert message.startswith("broadcast_parameters: the ranks reduce gradients with different settings: rank 0: "
                              "root=0, rank 1: root=1; "), message
    assert run_threads(2, body, True)[0] == (
        "broadcast_parameters: the ranks are running different checks at the same point (rank 0: 'parameters', "
        "rank 1: 'strategy'): they run different programs or parallel modes; every rank must make the same calls")


def test_on_the_device_host_tensors_get_buffers_of_their_own(on_the_double):
    """Optimizer state kept on the host (global_step) is never packed with device tensors."""
    cp = on_the_double

    def body():
        rank = mp.get_rank()
        device = Tensor(np.full(3, rank, np.float32))
        host = Parameter(np.zeros(1, np.float32), name="global_step")
        host.data = np.full(1, rank, np.float32)  # as optimizer.py's _host_parameter keeps it
        count = broadcast_tensors([device, host])
        return count, device.data, host.data

    for count, device, host in run_threads(2, body):
        assert count == 2
        assert isinstance(device, cp.ndarray) and isinstance(host, np.ndarray)
        assert np.all(cp.asnumpy(device) == 0) and np.all(host == 0)
