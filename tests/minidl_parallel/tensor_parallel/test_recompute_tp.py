"""Cell.recompute() under SEMI_AUTO_PARALLEL: a recomputed cell's output, and its inputs in the
re-run, keep their layouts (``placement``), so tensor-parallel training with recompute equals
the same run without it bit for bit, and one device's within float64 1e-10 relative.

The network is a Megatron MLP (column-parallel MatMul and ReLU, then row-parallel MatMul) whose
two halves are each a cell: the column half's output is a column block, and the row half's input
is that block, so both the output's layout and the re-run inputs' layouts are read.
"""
import numpy as np
import pytest

from minidl import nn, ops, Parameter
from minidl_parallel import run_threads

from momentum_steps import momentum_steps

B, D, H = 8, 6, 8
STEPS = 3
# by world size: (the column MatMul's, the ReLU's, the row MatMul's strategy); at 4 ranks the batch is cut in 2 too
STRATEGIES = {2: (((1, 1), (1, 2)), ((1, 2),), ((1, 2), (2, 1))),
              4: (((2, 1), (1, 2)), ((2, 2),), ((2, 2), (2, 1)))}


class ColumnHalf(nn.Cell):
    def __init__(self, w):
        super().__init__()
        self.w = Parameter(w)
        self.matmul, self.relu = ops.MatMul(), ops.ReLU()

    def construct(self, x):
        return self.relu(self.matmul(x, self.w))


class RowHalf(nn.Cell):
    def __init__(self, w):
        super().__init__()
        self.w = Parameter(w)
        self.matmul = ops.MatMul()

    def construct(self, h):
        return self.matmul(h, self.w)


class MegatronMLP(nn.Cell):
    def __init__(self, strategies=None, recompute=False):
        super().__init__()
        rng = np.random.default_rng(0)
        self.column = ColumnHalf(rng.standard_normal((D, H)) / 2)
        self.row = RowHalf(rng.standard_normal((H, D)) / 3)
        if strategies is not None:
            column, relu, row = strategies
            self.column.matmul.shard(column)
            self.column.relu.shard(relu)
            self.row.matmul.shard(row)
        if recompute:
            self.column.recompute()
            self.row.recompute()

    def construct(self, x):
        return self.row(self.column(x))


def _data():
    rng = np.random.default_rng(1)
    return rng.standard_normal((B, D)), rng.standard_normal((B, D))


def _rank(n, recompute):
    import minidl_parallel as mp
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
    try:
        net = MegatronMLP(STRATEGIES[n], recompute)
        trained = momentum_steps(net, *_data(), STEPS)
        return trained, tuple(net.column.w.data.shape)  # (the weight is cut at its first use)
    finally:
        mp.reset_auto_parallel_context()


@pytest.mark.parametrize("n", [2, 4])
def test_recompute_under_tensor_parallelism_equals_the_run_without_it_and_one_device(n):
    single = momentum_steps(MegatronMLP(), *_data(), STEPS)
    assert single[2]["column.w"].dtype == np.float64  # (float64: the 1e-10 below is far above its rounding)
    plain = run_threads(n, _rank, n, False)
    recomputed = run_threads(n, _rank, n, True)
    for rank, (((losses, out, params), block), ((want_losses, want_out, want_params), _)) in enumerate(
            zip(recomputed, plain)):
        assert block == (D, H // 2), f"rank {rank} holds {block}: the columns are not cut"
        assert losses == want_losses, f"rank {rank}"
        np.testing.assert_array_equal(out, want_out, err_msg=f"rank {rank}")
        assert params.keys() == want_params.keys() == single[2].keys()
        for name, value in params.items():
            np.testing.assert_array_equal(value, want_params[name], err_msg=f"rank {rank} {name}")
            np.testing.assert_allclose(value, single[2][name], rtol=1e-10, atol=1e-12, err_msg=f"rank {rank} {name}")
        np.testing.assert_allclose(losses, single[0], rtol=1e-10)
    # (it trained: a comparison of parameters that never moved proves nothing)
    assert not np.allclose(recomputed[0][0][2]["row.w"], MegatronMLP().row.w.asnumpy())
