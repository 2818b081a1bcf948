"""set_context(save_graphs=True, save_graphs_path=...): each rank writes the parallel plan of a
network's first call (and of each new input signature), the text explain() prints; mode= is
accepted and changes no result."""
import os

import numpy as np
import pytest

import minidl
from minidl import Tensor, nn, ops, Parameter
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel import explain


class _Column(nn.Cell):
    def __init__(self, t):
        super().__init__()
        self.w = Parameter(np.arange(32.0).reshape(4, 8) / 10, name="w")
        self.matmul = ops.MatMul().shard(((1, 1), (1, t)))
        self.relu = ops.ReLU()

    def construct(self, x):
        return self.relu(self.matmul(x, self.w))


@pytest.fixture
def saving(tmp_path):
    before = {k: minidl.get_context(k) for k in ("save_graphs", "save_graphs_path", "mode")}
    minidl.set_context(save_graphs=True, save_graphs_path=str(tmp_path))
    yield tmp_path
    minidl.set_context(**before)


def _rank(shapes):
    import minidl_parallel as mp
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch")
    try:
        # explain() of a fresh network (what its first step does: the parameter is placed), which
        # itself saves nothing
        plan = explain(_Column(mp.get_group_size()), Tensor(np.ones(shapes[0])), rank0_only=False)
        net = _Column(mp.get_group_size())
        outs = [net(Tensor(np.ones(s))).asnumpy() for s in shapes]
        return outs, plan
    finally:
        mp.reset_auto_parallel_context()


def test_each_rank_writes_the_plan_of_each_new_input_signature_once(saving):
    results = run_threads(2, _rank, [(3, 4), (3, 4), (5, 4)])
    for rank, (_, plan) in enumerate(results):
        folder = saving / f"rank_{rank}"
        files = sorted(os.listdir(folder))
        assert files == ["parallel_plan_01__Column.txt", "parallel_plan_02__Column.txt"]
        first = (folder / files[0]).read_text()
        assert first.startswith(f"# _Column on rank {rank}: semi_auto_parallel, inputs (3, 4) float64\n")
        assert first.split("\n", 1)[1].strip() == plan.strip()  # the text explain() gives
        assert "strategy ((1, 1), (1, 2)) [shard]" in first and "parameter placed as (-, c)" in first
        assert "(5, 4) float64" in (folder / files[1]).read_text()


def test_nothing_is_written_unless_asked(tmp_path):
    minidl.set_context(save_graphs_path=str(tmp_path))
    run_threads(2, _rank, [(3, 4)])
    assert os.listdir(tmp_path) == []


def test_graph_mode_runs_the_same_as_pynative(saving):
    x = np.linspace(-1, 1, 12).reshape(3, 4)
    minidl.set_context(mode=minidl.PYNATIVE_MODE)
    eager = _Column(1)(Tensor(x)).asnumpy()
    minidl.set_context(mode=minidl.GRAPH_MODE)
    assert minidl.get_context("mode") == minidl.GRAPH_MODE == 0
    np.testing.assert_array_equal(_Column(1)(Tensor(x)).asnumpy(), eager)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(mode=2), ValueError, r"mode must be minidl.GRAPH_MODE \(0\) or minidl.PYNATIVE_MODE \(1\), got 2"),
    (dict(mode=True), ValueError, "got True"),
    (dict(save_graphs=4), ValueError, "save_graphs must be a bool or an int from 0 to 3, got 4"),
    (dict(save_graphs_path=3), TypeError, "save_graphs_path must be a str or a path, got int"),
])
def test_bad_context_values_are_refused_and_change_nothing(kwargs, error, match):
    before = minidl.get_context("mode"), minidl.get_context("save_graphs")
    with pytest.raises(error, match=match):
        minidl.set_context(device_target="CPU" if "mode" in kwargs else None, **kwargs)
    assert (minidl.get_context("mode"), minidl.get_context("save_graphs")) == before


def test_mode_constants_and_unknown_keys():
    assert minidl.PYNATIVE_MODE == 1
    with pytest.raises(ValueError, match="unknown key 'modes'"):
        minidl.get_context("modes")
