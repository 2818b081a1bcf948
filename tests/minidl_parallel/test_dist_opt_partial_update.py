"""DistOpt.backward_and_partial_update against NumPy: after each rank's local step, the chunk of
parameters it averages holds the mean over the ranks, the other parameters this rank's own values.

(test_dist_opt.py checks the round-robin schedule and that a full rotation makes the ranks
equal; that holds for any way of combining the ranks, the mean is checked here.)
"""
import numpy as np
import pytest

import minidl
from minidl import Tensor, nn
from minidl_parallel import CommCounter, run_threads
from minidl_parallel.dist_opt import DistOpt

LOSS = nn.MSELoss(reduction="mean")
LR = 0.1


def _mlp():
    minidl.set_seed(0)
    f64 = minidl.float64
    return nn.SequentialCell(nn.Dense(3, 5, dtype=f64), nn.Tanh(), nn.Dense(5, 2, dtype=f64))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("threshold, first_chunk", [(1, [0]), (20, [0, 1]), (10 ** 6, [0, 1, 2, 3])],
                         ids=["one_parameter_each", "chunks", "one_chunk"])
def test_the_averaged_chunk_is_the_mean_of_the_ranks_local_steps(n, threshold, first_chunk):
    # parameters of 15, 5, 10 and 2 elements; the first step averages the first chunk of at most
    # ``threshold`` elements (or the first parameter alone, when larger)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4 * n, 3)), rng.standard_normal((4 * n, 2))

    def rank():
        net = _mlp()
        sgd = DistOpt(nn.SGD(net.trainable_params(), LR))
        rows = slice(4 * sgd.global_rank, 4 * sgd.global_rank + 4)  # each rank its own data: different gradients
        grad_fn = minidl.value_and_grad(lambda a, c: LOSS(net(a), c), None, sgd.parameters)
        grads = grad_fn(Tensor(x[rows]), Tensor(y[rows]))[1]
        local = [p.asnumpy() - LR * g.asnumpy() for p, g in zip(sgd.parameters, grads)]  # this rank's own step
        with CommCounter() as counter:
            chunk = sgd.backward_and_partial_update(LOSS(net(Tensor(x[rows])), Tensor(y[rows])), threshold=threshold)
        return local, chunk, [p.asnumpy().copy() for p in sgd.parameters], counter.events

    results = run_threads(n, rank)
    chunk = results[0][1]
    assert all(r[1] == chunk for r in results) and chunk == first_chunk
    size = sum(results[0][0][i].size for i in chunk)
    for r in results:  # one all-reduce of the chunk's float64s: a ring sends 2 (n - 1) / n of it
        assert [(e.kind, e.group_size, e.bytes_per_rank, e.phase) for e in r[3]] == \
            [("allreduce", n, 2 * (n - 1) * size * 8 // n, "gradients")]
    for i in range(len(results[0][0])):
        steps = [local[i] for local, _, _, _ in results]
        assert any(not np.allclose(steps[0], s) for s in steps[1:])  # the ranks do differ here
        mean = np.mean(steps, axis=0)
        for r, (local, _, got, _) in enumerate(results):
            want = mean if i in chunk else local[i]
            np.testing.assert_allclose(got[i], want, rtol=1e-12, atol=1e-15, err_msg=f"rank {r}, parameter {i}")
