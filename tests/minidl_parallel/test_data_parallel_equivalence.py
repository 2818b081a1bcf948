"""The central property: data-parallel training computes what one process computes on the global batch.

Each of n thread-ranks trains on its slice of every global batch (loss over its slice,
DistributedGradReducer across ranks, Momentum); one process trains the same initial net on
the whole batches. After k steps, the losses (reduced over ranks) and every parameter,
moving statistics included, agree in float64 to 1e-10 relative. CNNs use SyncBatchNorm on
the ranks and plain BatchNorm2d in the single process.
"""
import numpy as np
import pytest
from hypothesis import example, given, strategies as st

import minidl
from minidl import Tensor, nn
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel import run_threads
from minidl_parallel.grad_reducer import DistributedGradReducer
from minidl_parallel.sync_batchnorm import SyncBatchNorm

F64 = minidl.float64
IN_SHAPE = {"mlp": (3,), "cnn": (2, 4, 4)}


def _net(kind, bn_cls):
    if kind == "mlp":
        return nn.SequentialCell(nn.Dense(3, 5, dtype=F64), nn.Tanh(), nn.Dense(5, 4, dtype=F64), nn.ReLU(),
                                 nn.Dense(4, 2, dtype=F64))
    return nn.SequentialCell(nn.Conv2d(2, 3, 3, pad_mode="pad", padding=1, dtype=F64), bn_cls(3, dtype=F64),
                             nn.ReLU(), nn.Conv2d(3, 2, 3, stride=2, pad_mode="pad", padding=1, has_bias=True,
                                                  dtype=F64),
                             bn_cls(2, momentum=0.7, dtype=F64), nn.Flatten(), nn.Dense(8, 2, dtype=F64))


def _train(kind, bn_cls, init, xs, ys, mean, reducer_factory=None, reduce_loss=None):
    """k Momentum steps on batches xs[i], ys[i]; returns (losses, parameters by name)."""
    net = _net(kind, bn_cls)
    for name, p in net.parameters_and_names():
        p.set_data(init[name].copy())
    net.set_train(True)
    loss_fn = nn.MSELoss(reduction="mean" if mean else "sum")
    opt = nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    reducer = reducer_factory(opt.parameters) if reducer_factory else None
    losses = []
    for x, y in zip(xs, ys):
        loss, grads = grad_fn(Tensor(x), Tensor(y))
        if reducer is not None:
            grads = reducer(grads)
        opt(grads)
        losses.append(reduce_loss(loss.asnumpy()) if reduce_loss else float(loss.data))
    return losses, {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
@pytest.mark.parametrize("mean", [True, False], ids=["gradients_mean", "sum"])
@given(n=st.sampled_from([1, 2, 3, 4, 8]), per_rank=st.integers(1, 2), k=st.integers(1, 3),
       seed=st.integers(0, 2 ** 16))
@example(n=8, per_rank=2, k=3, seed=1)  # the largest world, always
@example(n=3, per_rank=1, k=2, seed=2)
def test_data_parallel_equals_one_process_on_the_global_batch(kind, n, per_rank, k, mean, seed):
    rng = np.random.default_rng(seed)
    batch = n * per_rank
    xs = rng.standard_normal((k, batch) + IN_SHAPE[kind])
    ys = rng.standard_normal((k, batch, 2))
    minidl.set_seed(seed)
    init = {name: p.asnumpy().copy() for name, p in _net(kind, nn.BatchNorm2d).parameters_and_names()}

    want_losses, want_params = _train(kind, nn.BatchNorm2d, init, xs, ys, mean)

    def rank_body():
        comm = resolve_communicator("test", None)
        part = slice(comm.rank * per_rank, (comm.rank + 1) * per_rank)
        # The global loss: mean mode averages the ranks' slice means, sum mode adds the slice sums.
        return _train(kind, SyncBatchNorm, init, xs[:, part], ys[:, part], mean,
                      reducer_factory=lambda params: DistributedGradReducer(params, mean=mean),
                      reduce_loss=lambda v: float(comm.allreduce(np.asarray(v), "mean" if mean else "sum")))

    for losses, params in run_threads(n, rank_body):
        np.testing.assert_allclose(losses, want_losses, rtol=1e-10, atol=1e-12)
        assert params.keys() == want_params.keys()
        for name, value in params.items():
            np.testing.assert_allclose(value, want_params[name], rtol=1e-10, atol=1e-12, err_msg=name)


def test_plain_batchnorm_keeps_local_statistics():
    """Without SyncBatchNorm the ranks normalise by their own slices: NOT the global-batch net.

    This is the documented behaviour (as MindSpore and PyTorch); the test guards the
    property above against passing vacuously.
    """
    rng = np.random.default_rng(3)
    xs = rng.standard_normal((1, 4) + IN_SHAPE["cnn"]) * np.arange(1, 5).reshape(1, 4, 1, 1, 1)
    ys = rng.standard_normal((1, 4, 2))
    init = {name: p.asnumpy().copy() for name, p in _net("cnn", nn.BatchNorm2d).parameters_and_names()}
    _, want = _train("cnn", nn.BatchNorm2d, init, xs, ys, True)

    def rank_body():
        r = resolve_communicator("test", None).rank
        return _train("cnn", nn.BatchNorm2d, init, xs[:, 2 * r:2 * r + 2], ys[:, 2 * r:2 * r + 2], True,
                      reducer_factory=lambda params: DistributedGradReducer(params))[1]

    got = run_threads(2, rank_body)[0]
    assert not np.allclose(got["1.moving_mean"], want["1.moving_mean"], rtol=1e-6)


@pytest.mark.parametrize("gradients_mean, mode_after_model", [(True, False), (False, False), (True, True)])
def test_model_train_under_data_parallel_equals_one_process(gradients_mean, mode_after_model):
    """Model.train reduces gradients once the mode is DATA_PARALLEL, also when the mode is set after the
    Model was built (it asks the runtime when training starts); each rank reads the shard it asks for."""
    from minidl.dataset import NumpySlicesDataset
    import minidl_parallel as mp

    n, per_rank, steps = 2, 2, 3
    rng = np.random.default_rng(5)
    X = rng.standard_normal((n * per_rank * steps,) + IN_SHAPE["cnn"])
    Y = rng.standard_normal((n * per_rank * steps, 2))
    init = {name: p.asnumpy().copy() for name, p in _net("cnn", nn.BatchNorm2d).parameters_and_names()}
    reduction = "mean" if gradients_mean else "sum"

    def set_mode():
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=gradients_mean)

    def fit(bn_cls, batch, before_train=None, shards=None):
        net = _net("cnn", bn_cls)
        for name, p in net.parameters_and_names():
            p.set_data(init[name].copy())
        model = minidl.Model(net, nn.MSELoss(reduction=reduction),
                             nn.Momentum(net.trainable_params(), learning_rate=0.05, momentum=0.9))
        if before_train is not None:
            before_train()
        ds = NumpySlicesDataset({"data": X, "label": Y}, shuffle=False, **(shards or {})).batch(batch)
        model.train(1, ds, progress=False)
        return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}

    want = fit(nn.BatchNorm2d, n * per_rank)

    def rank_body():
        if not mode_after_model:
            set_mode()
        shards = {"num_shards": mp.get_group_size(), "shard_id": mp.get_rank()}
        return fit(SyncBatchNorm, per_rank, set_mode if mode_after_model else None, shards)

    for got in run_threads(n, rank_body):
        for name, value in got.items():
            np.testing.assert_allclose(value, want[name], rtol=1e-10, atol=1e-12, err_msg=name)
