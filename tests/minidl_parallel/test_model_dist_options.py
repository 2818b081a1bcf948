"""Model.train under DATA_PARALLEL with the reducer's options set through the auto-parallel
context (grad_accumulation_step, gradient_compression), against one device, threads backend."""
import warnings

import numpy as np

import minidl
from minidl import nn
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback, Model
import minidl_parallel as mp


def _mlp(seed):
    minidl.set_seed(seed)
    f64 = minidl.float64
    return nn.SequentialCell(nn.Dense(4, 6, dtype=f64), nn.Tanh(), nn.Dense(6, 2, dtype=f64))


class _Steps(Callback):
    def __init__(self):
        self.count = 0

    def on_train_step_end(self, run_context):
        self.count += 1


def _train(net, data, label, batch, lr=0.05, loss_scale=1.0, **shards):
    loss = nn.MSELoss(reduction="mean")
    opt = nn.SGD(net.trainable_params(), lr, momentum=0.9)
    model = Model(net, lambda logits, y: loss(logits, y) * loss_scale, opt)
    ds = NumpySlicesDataset({"data": data, "label": label}, shuffle=False, **shards).batch(batch)
    steps = _Steps()
    with mp.CommCounter() as counter:
        model.train(1, ds, callbacks=[steps], progress=False)
    return ({k: v.asnumpy() for k, v in net.parameters_and_names()}, opt.global_step, steps.count,
            counter.count("allreduce", "gradients"))


def test_grad_accumulation_step_equals_one_device_on_the_k_times_larger_batch():
    n, k, b, big_steps = 2, 3, 2, 2
    rng = np.random.default_rng(4)
    data, label = rng.standard_normal((n * k * b * big_steps, 4)), rng.standard_normal((n * k * b * big_steps, 2))
    # one device: batches of n*k*b rows; the ranks: micro-batches of b rows, rank r's shard
    # holding rows r, r+n, ... so that every k of its micro-batches with the other rank's
    # make exactly one of those big batches
    order = np.concatenate([np.arange(s * n * k * b, (s + 1) * n * k * b) for s in range(big_steps)])
    want, want_updates, _, _ = _train(_mlp(0), data[order], label[order], n * k * b)

    def rank():
        r = mp.get_rank()
        mine = np.concatenate([np.arange(s * n * k * b + (j * n + r) * b, s * n * k * b + (j * n + r + 1) * b)
                               for s in range(big_steps) for j in range(k)])
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     grad_accumulation_step=k)
        try:
            return _train(_mlp(0), data[mine], label[mine], b, loss_scale=1.0 / k)
        finally:
            mp.reset_auto_parallel_context()

    for got, updates, steps, reductions in mp.run_threads(n, rank):
        assert steps == k * big_steps and updates == want_updates == big_steps and reductions == big_steps
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-10, atol=1e-12, err_msg=name)


def test_gradient_compression_fp16_trains_close_to_fp32_and_skips_an_overflowed_step():
    rng = np.random.default_rng(5)
    data, label = rng.standard_normal((16, 4)), rng.standard_normal((16, 2))

    def rank(compression, loss_scale):
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     gradient_compression=compression)
        try:
            return _train(_mlp(0), data, label, 4, loss_scale=loss_scale, num_shards=2, shard_id=mp.get_rank())
        finally:
            mp.reset_auto_parallel_context()

    fp32 = mp.run_threads(2, lambda: rank(None, 1.0))
    fp16 = mp.run_threads(2, lambda: rank("fp16", 1.0))
    for (a, *_), (b, updates, _, _) in zip(fp32, fp16):
        assert updates == 2
        for name in a:
            np.testing.assert_allclose(b[name], a[name], rtol=2e-3, atol=2e-3, err_msg=name)
            assert not np.array_equal(b[name], a[name]) or a[name].size < 3  # fp16 did round something
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        huge = mp.run_threads(2, lambda: rank("fp16", 1e9))  # gradients beyond fp16's range
    assert all(updates == 0 for _, updates, _, _ in huge)
    assert sum("the optimizer skips this step" in str(w.message) for w in caught) == 2 * 2  # 2 ranks, 2 steps
