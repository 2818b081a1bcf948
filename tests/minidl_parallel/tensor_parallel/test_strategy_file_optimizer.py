"""The optimizer slices of a strategy checkpoint (MindSpore's ``opt_weight_shard_size`` /
``opt_weight_shard_step``): written into the save file once the optimizer has sliced, checked
against the load file's non-zero entries, agreed on every rank.

Most tests call ``strategy_file.record_optimizer_slices`` as the optimizer-parallel reducer does
(rank by rank, after the first call wrote the save file); the last trains a TrainOneStepCell,
whose optimizer slices inside the network's first call, before the save file is written.
"""
import json

import numpy as np
import pytest

import minidl_parallel as mp
from minidl import Tensor, nn
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel import StrategyError, strategy_file

from test_optimizer_parallel_tp import FFN

FIELDS = {"field": 0, "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}


def _layouts(**items):
    return {name: {"dev_matrix": [2], "tensor_map": [-1, -1], "tensor_shape": [4, 2], **fields}
            for name, fields in items.items()}


def _file(path, layouts):
    content = {"format": strategy_file.FORMAT, "version": strategy_file.VERSION, "device_num": 2}
    if layouts is not None:
        content["parallel_layout_item"] = layouts
    path.write_text(json.dumps(content))
    return str(path)


def _record(config, slices):
    """Each rank of 2 records ``slices`` under ``config`` ({"load_file", "save_file"} by rank, or one for
    both); returns each rank's (error type, message), or None."""
    def rank():
        mine = {key: value(mp.get_rank()) if callable(value) else value for key, value in config.items()}
        try:
            strategy_file.record_optimizer_slices(mp.get_communicator(), {"strategy_ckpt_config": {
                "load_file": "", "save_file": "", **mine}}, slices)
        except (StrategyError, ValueError, OSError) as e:
            return type(e).__name__, str(e)
        return None
    return run_threads(2, rank)


@pytest.mark.parametrize("layouts", [None, _layouts(a=dict(field=0))], ids=["no_layouts", "no_fields"])
def test_a_load_file_without_the_fields_checks_nothing_and_the_save_file_gets_the_slices_of_its_own_entries(
        tmp_path, layouts):
    load = _file(tmp_path / "load.json", layouts)
    save = _file(tmp_path / "save.json", _layouts(a=FIELDS))
    assert _record({"load_file": load, "save_file": save}, {"a": (2, 1), "b": (2, 1)}) == [None, None]
    # (b has no entry in either file: MindSpore's entries are the layouts the first call made)
    assert json.loads(open(save).read())["parallel_layout_item"] == _layouts(
        a=dict(field=0, opt_weight_shard_step=1, opt_weight_shard_size=2))


def test_a_slice_that_differs_from_the_load_files_raises_naming_both_and_leaves_the_save_file_alone(tmp_path):
    # the file gives a size without its stride: stride 0, which no slicing of this run has
    load = _file(tmp_path / "load.json", _layouts(a=dict(opt_weight_shard_size=2)))
    save = _file(tmp_path / "save.json", _layouts(a=FIELDS))
    before = open(save).read()
    errors = _record({"load_file": load, "save_file": save}, {"a": (2, 1)})
    assert errors == [("StrategyError", f"strategy_ckpt_config['load_file'] {load!r}: parameter 'a' is sliced for "
                                        f"the optimizer over 2 ranks, stride 0, in the file, but over 2, stride 1, in "
                                        f"this run (parallel_optimizer_config, the world or the layout differ)")] * 2
    assert open(save).read() == before


def test_a_load_file_one_rank_cannot_read_raises_on_every_rank_naming_each_ranks_outcome(tmp_path):
    load = _file(tmp_path / "load.json", _layouts(a=FIELDS))
    missing = str(tmp_path / "missing.json")
    errors = _record({"load_file": lambda rank: missing if rank else load}, {"a": (2, 1)})
    assert errors[0] == errors[1] and errors[0][0] == "StrategyError"
    assert errors[0][1] == (
        f"strategy checkpoint (optimizer slices): the ranks differ: rank 0: fine, rank 1: FileNotFoundError: "
        f"strategy_ckpt_config['load_file'] {missing!r}: cannot read or write its optimizer slices: [Errno 2] No such "
        f"file or directory: {missing!r}; every rank must read the same file and make the same plan")


@pytest.mark.parametrize("which", ["load_file", "save_file"])
def test_a_file_that_is_no_longer_json_raises_a_value_error_naming_it(tmp_path, which):
    path = tmp_path / "torn.json"
    path.write_text('{"format": ')
    errors = _record({which: str(path)}, {"a": (2, 1)})
    assert errors == [("ValueError", f"strategy_ckpt_config[{which!r}] {str(path)!r}: cannot read or write its "
                                     f"optimizer slices: Expecting value: line 1 column 12 (char 11)")] * 2


def _train_one_step(config, shard_size=-1):
    """One rank of 4: a TrainOneStepCell's first step (its optimizer slices inside the network's first call)."""
    mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", enable_parallel_optimizer=True,
                                 parallel_optimizer_config={"parallel_optimizer_threshold": 0,
                                                            "optimizer_weight_shard_size": shard_size},
                                 strategy_ckpt_config=config)
    try:
        net = FFN()
        net.dense1.matmul.shard(((2, 1), (1, 2)))
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        step(Tensor(np.ones((4, 12))), Tensor(np.zeros((4, 6))))
    finally:
        mp.reset_auto_parallel_context()


def test_a_train_one_step_cell_records_the_slices_under_the_files_names_and_a_load_checks_them(tmp_path):
    path = str(tmp_path / "plan.json")
    run_threads(4, _train_one_step, {"save_file": path})
    items = json.loads(open(path).read())["parallel_layout_item"]
    # named from the called cell; dense1.weight's block is held by ranks {0, 2} / {1, 3}, the rest by all 4
    assert {name: (item["opt_weight_shard_size"], item["opt_weight_shard_step"]) for name, item in items.items()} == {
        "network._backbone.dense1.weight": (2, 2), "network._backbone.dense1.bias": (4, 1),
        "network._backbone.dense2.weight": (4, 1), "network._backbone.dense2.bias": (4, 1)}
    run_threads(4, _train_one_step, {"load_file": path})  # the same plan: loads
    with pytest.raises(StrategyError, match=r"parameter 'network._backbone.dense1.bias' is sliced for the optimizer "
                                            r"over 4 ranks, stride 1, in the file, but over 2, stride 1, in this run"):
        run_threads(4, _train_one_step, {"load_file": path}, 2)
