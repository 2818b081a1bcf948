"""SyncBatchNorm on the threads backend equals BatchNorm2d on the concatenated batch."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

import minidl
from minidl import Tensor, nn
from minidl_parallel.collectives import resolve_communicator
from minidl_parallel import run_threads
from minidl_parallel.sync_batchnorm import SyncBatchNorm


def _bn_step(bn, x, w):
    """Forward in training mode and the gradients of sum(w * y) w.r.t. x, gamma and beta."""
    bn.set_train(True)
    params = [bn.gamma, bn.beta]
    grad_fn = minidl.value_and_grad(lambda t: (bn(t) * Tensor(w)).sum(), 0, params)
    x = Tensor(x)
    y = bn(x).asnumpy()  # the grad_fn call below is a second training step
    _, (gx, (ggamma, gbeta)) = grad_fn(x)
    return y, gx.asnumpy(), ggamma.asnumpy(), gbeta.asnumpy(), bn.moving_mean.asnumpy().copy(), bn.moving_variance.asnumpy().copy()


@given(n=st.sampled_from([1, 2, 3, 4]), per_rank=st.integers(1, 3), c=st.integers(1, 3), hw=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_matches_batchnorm_on_the_global_batch(n, per_rank, c, hw, seed):
    if n * per_rank * hw * hw < 2:
        per_rank = 2
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((n * per_rank, c, hw, hw)) * 3 + 1
    W = rng.standard_normal(X.shape)
    gamma = rng.standard_normal(c)

    def make(cls):
        bn = cls(c, momentum=0.8, dtype=minidl.float64)
        bn.gamma.set_data(gamma.copy())
        return bn

    ref = _bn_step(make(nn.BatchNorm2d), X, W)

    def body():
        r = resolve_communicator("test", None).rank
        part = slice(r * per_rank, (r + 1) * per_rank)
        return _bn_step(make(SyncBatchNorm), X[part], W[part])

    results = run_threads(n, body)
    y = np.concatenate([res[0] for res in results])
    gx = np.concatenate([res[1] for res in results])
    np.testing.assert_allclose(y, ref[0], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(gx, ref[1], rtol=1e-10, atol=1e-12)
    # gamma and beta: each rank has its local share; the grad reducer's sum gives the whole.
    np.testing.assert_allclose(sum(res[2] for res in results), ref[2], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(sum(res[3] for res in results), ref[3], rtol=1e-10, atol=1e-12)
    for res in results:  # moving statistics: global, identical on every rank
        np.testing.assert_allclose(res[4], ref[4], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(res[5], ref[5], rtol=1e-10, atol=1e-12)
        assert np.array_equal(res[4], results[0][4]) and np.array_equal(res[5], results[0][5])


def test_inference_is_plain_batchnorm_without_communication():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 2, 2)).astype(np.float32)

    def body():
        comm = resolve_communicator("test", None)
        bn = SyncBatchNorm(3, moving_mean_init="ones", moving_var_init="ones")
        bn.set_train(False)
        before = comm.collective_count
        y = bn(Tensor(x)).asnumpy()
        return y, comm.collective_count - before

    plain = nn.BatchNorm2d(3, moving_mean_init="ones", moving_var_init="ones")
    plain.set_train(False)
    want = plain(Tensor(x)).asnumpy()
    for y, count in run_threads(2, body):
        assert count == 0 and y.dtype == np.float32
        np.testing.assert_allclose(y, want, rtol=1e-6)


def test_float32_training_keeps_dtype_and_uses_three_collectives():
    x = np.random.default_rng(2).standard_normal((2, 2, 3, 3)).astype(np.float32)

    def body():
        comm = resolve_communicator("test", None)
        bn = SyncBatchNorm(2)
        bn.set_train(True)
        before = comm.collective_count
        gx, gg = minidl.grad(lambda t: (bn(t) * bn(t)).sum(), 0, [bn.gamma])(Tensor(x))
        return gx.dtype, gg[0].dtype, bn.moving_mean.dtype, comm.collective_count - before

    for dx, dg, dm, count in run_threads(2, body):
        assert dx == dg == dm == np.float32
        # two layers' calls: 2 forward + 1 backward each, and on the GPU the count on the host
        assert count == (6 if minidl.backend.get_device_target() == "CPU" else 8)


def test_needs_two_values_per_channel_over_all_ranks():
    def body():
        bn = SyncBatchNorm(2)
        bn.set_train(True)
        bn(Tensor(np.ones((1, 2, 1, 1))))

    with pytest.raises(ValueError, match=r"SyncBatchNormOp: expected more than 1 value per channel when training, got "
                                         r"1 over the ranks of its group, input of shape \(1, 2, 1, 1\) on this rank"):
        run_threads(1, body)
    run_threads(2, body)  # one value per rank, two over the world: fine


def test_process_groups_synchronise_within_each_group():
    rng = np.random.default_rng(4)
    X = rng.standard_normal((4, 2, 2, 2))
    W = rng.standard_normal(X.shape)

    def body():
        r = resolve_communicator("test", None).rank
        bn = SyncBatchNorm(2, process_groups=[[0, 2], [1, 3]], dtype=minidl.float64)
        return _bn_step(bn, X[r:r + 1], W[r:r + 1])

    results = run_threads(4, body)
    for members in ([0, 2], [1, 3]):
        ref = _bn_step(nn.BatchNorm2d(2, dtype=minidl.float64), X[members], W[members])
        for i, r in enumerate(members):
            np.testing.assert_allclose(results[r][0], ref[0][i:i + 1], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(results[r][1], ref[1][i:i + 1], rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(results[r][4], ref[4], rtol=1e-10, atol=1e-12)


def test_rejects_bad_groups():
    with pytest.raises(TypeError, match="SyncBatchNorm: group must be a Communicator"):
        SyncBatchNorm(2, group="world")
    with pytest.raises(ValueError, match="SyncBatchNorm: process_groups must be non-empty, disjoint"):
        SyncBatchNorm(2, process_groups=[[0, 1], [1, 2]])

    def outside():
        bn = SyncBatchNorm(2, process_groups=[[0]])
        bn.set_train(True)
        bn(Tensor(np.ones((2, 2, 1, 1), np.float32)))
    with pytest.raises(ValueError, match="SyncBatchNorm: rank 1 is in none of process_groups"):
        run_threads(2, outside)


def test_the_op_is_batchnorm_with_only_its_sums_changed():
    """BatchNorm exists once: SyncBatchNormOp keeps its forward and backward and changes the seam."""
    from minidl import ops
    from minidl_parallel.sync_batchnorm import SyncBatchNormOp
    own = {name for name in vars(SyncBatchNormOp) if not (name.startswith("__") and name.endswith("__"))}
    assert own == {"sum_over_batch", "count_over_batch"}
    assert SyncBatchNormOp.forward is ops.BatchNorm.forward and SyncBatchNormOp.backward is ops.BatchNorm.backward


def test_sync_batchnorm_on_the_device_never_syncs_the_host(on_the_double):
    """Its count is summed on the host (count_over_batch): reading the summed count back from the
    device would stall a real GPU at every BatchNorm layer, twice per step."""
    from minidl.testing import cupy_double
    x = np.random.default_rng(3).standard_normal((2, 2, 3, 3))

    def body():
        bn = SyncBatchNorm(2)
        bn.set_train(True)
        r = resolve_communicator("test", None).rank
        gx, = minidl.grad(lambda t: (bn(t) * bn(t)).sum(), 0)(Tensor(x[r:r + 1]))
        return gx.data, bn.moving_mean.data

    with cupy_double.count_host_syncs() as syncs:
        results = run_threads(2, body)
    assert syncs.total == 0, syncs.by_reason
    for gx, mean in results:
        assert isinstance(gx, cupy_double.ndarray)
        # two forward calls, each moving the mean 10% of the way to the GLOBAL batch's mean
        np.testing.assert_allclose(mean.get(), 0.19 * x.mean(axis=(0, 2, 3)), rtol=1e-6)  # float32 statistics


@pytest.mark.cpu_only
def test_sync_batchnorm_has_the_blocked_cpu_kernel_within_its_bound(kernels_on):
    from minidl import kernels
    from minidl.testing.gradcheck import check_kernels
    from minidl_parallel.sync_batchnorm import SyncBatchNormBlocked, SyncBatchNormOp
    (kernel,) = [k for k in kernels.registered(SyncBatchNormOp) if isinstance(k, SyncBatchNormBlocked)]
    for make, arrays in kernel.cases():
        assert kernel in check_kernels(lambda *ts: make()(*ts), arrays, arrays[0].dtype)
