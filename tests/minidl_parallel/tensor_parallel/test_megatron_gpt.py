"""The GPT sharded the Megatron way (GPT.shard) equals one device, with the analytical number of
collectives: per block 2 all-reduces in forward and 4 in backward (see examples/megatron_gpt.py)."""
import numpy as np
import pytest

import minidl
from minidl import Tensor, nn
from minidl.models.gpt import GPT
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel import CommCounter
from minidl_parallel.tensor_parallel.dispatch import gather_like

V, T, N = 16, 6, 4


def _data():
    rng = np.random.default_rng(0)
    return [(rng.integers(0, V, (N, T)).astype(np.int32), rng.integers(0, V, (N, T)).astype(np.int32))
            for _ in range(2)]


def _train(t, layers, tie):
    minidl.set_seed(0)
    net = GPT(V, block_size=T, n_layer=layers, n_head=4, n_embd=8, tie_weights=tie, dtype=minidl.float64)
    if t > 1:
        net.shard(t)
    loss_fn = nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean")
    opt = nn.Adam(net.trainable_params(), learning_rate=0.05)
    grad_fn = minidl.value_and_grad(lambda x, y: loss_fn(net(x).reshape(-1, V), y.reshape(-1)), None, opt.parameters)
    losses, counters = [], []
    for x, y in _data():
        with CommCounter() as counter:
            loss, grads = grad_fn(Tensor(x), Tensor(y))
            opt(grads)
        losses.append(float(loss.asnumpy()))
        counters.append(counter)
    params = {p.name: np.array(minidl.backend.to_numpy(gather_like(p.data, p) if t > 1 else p.data))
              for p in net.trainable_params()}
    return losses, params, counters


def _rank(layers, tie):
    import minidl_parallel as mp
    mp.set_auto_parallel_context(parallel_mode="auto_parallel", dataset_strategy="full_batch")
    try:
        return _train(mp.get_group_size(), layers, tie)
    finally:
        mp.reset_auto_parallel_context()


@pytest.mark.parametrize("n, layers, tie", [(2, 1, True), (4, 2, True), (2, 2, False)])
def test_sharded_gpt_trains_like_one_device(n, layers, tie):
    ref_losses, ref_params, _ = _train(1, layers, tie)
    for rank, (losses, params, counters) in enumerate(run_threads(n, _rank, layers, tie)):
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-10, err_msg=f"rank {rank}")
        for name, value in ref_params.items():
            np.testing.assert_allclose(params[name], value, rtol=1e-9, atol=1e-12, err_msg=f"rank {rank}: {name}")
        for c in counters:
            assert c.count() == c.count("allreduce"), c.summary()  # nothing is gathered or scattered
            assert c.count(phase="forward") == 1 + 2 * layers + 3, c.summary()
            # the untied head's weight is a Dense parameter, the tied one the embedding: both column-parallel
            assert c.count(phase="backward") == 4 * layers + 2, c.summary()


def test_the_embedding_table_holds_its_vocabulary_rows_only():
    def body():
        import minidl_parallel as mp
        mp.set_auto_parallel_context(parallel_mode="auto_parallel", dataset_strategy="full_batch")
        try:
            net = GPT(V, block_size=T, n_layer=1, n_head=4, n_embd=8).shard(mp.get_group_size())
            net(Tensor(_data()[0][0]))
            return (tuple(net.wte.embedding_table.data.shape), tuple(net.blocks[0].attn.q_proj.weight.data.shape),
                    tuple(net.blocks[0].mlp.proj.weight.data.shape), tuple(net.wpe.embedding_table.data.shape))
        finally:
            mp.reset_auto_parallel_context()
    assert run_threads(4, body) == [((V // 4, 8), (2, 8), (8, 8), (T, 8))] * 4
