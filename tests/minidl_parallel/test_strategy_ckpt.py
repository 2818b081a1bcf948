"""Strategy checkpoints (MindSpore's strategy_ckpt_config): a sharded network's first call writes
its plan (each parameter's layout, each operator's strategy) as JSON; a run that loads it gives
its operators without shard() the file's strategies and trains as the saving run did; a plan
that differs from the file's raises on every rank, naming the parameter and both layouts."""
import hashlib
import json

import numpy as np
import pytest

import minidl_parallel as mp
from minidl import Parameter, Tensor, nn, ops
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel import StrategyError

from tensor_parallel.momentum_steps import momentum_steps

B, D, H = 4, 8, 16
STEPS = 3


class MegatronMLP(nn.Cell):
    """Column-parallel MatMul, ReLU, row-parallel MatMul; ``shard=False`` leaves every strategy unset,
    ``prefix`` starts the Parameters' names (a name that is not the attribute's is kept as given),
    ``spare=True`` adds a Parameter no operator uses."""

    def __init__(self, t, shard=True, row=None, second="w2", prefix="", spare=False):
        super().__init__()
        rng = np.random.default_rng(3)
        self.w1 = Parameter(rng.standard_normal((D, H)), name=f"{prefix}w1")
        setattr(self, second, Parameter(rng.standard_normal((H, D)), name=f"{prefix}{second}"))
        self.second = second
        if spare:
            self.spare = Parameter(np.zeros((2, 2)), name="spare")
        self.column, self.relu, self.row = ops.MatMul(), ops.ReLU(), ops.MatMul()
        if shard:
            self.column.shard(((1, 1), (1, t)))
            self.relu.shard(((1, t),))
            self.row.shard(row or ((1, t), (t, 1)))

    def construct(self, x):
        return self.row(self.relu(self.column(x, self.w1)), getattr(self, self.second))


def _data():
    rng = np.random.default_rng(5)
    return rng.standard_normal((B, D)), rng.standard_normal((B, D))


def _train(mode, config, net_kwargs=None):
    """One rank: trains STEPS Momentum steps with ``config`` set; returns (losses, params, layouts)."""
    mp.set_auto_parallel_context(parallel_mode=mode, dataset_strategy="full_batch", **config)
    try:
        net = MegatronMLP(mp.get_group_size(), **(net_kwargs or {}))
        losses, _, params = momentum_steps(net, *_data(), STEPS)
        return losses, params, {name: str(p.placement) for name, p in net.parameters_and_names()}
    finally:
        mp.reset_auto_parallel_context()


def _error_of(mode, config, net_kwargs=None):
    """One rank: the (type, message) its first step raises, or None."""
    try:
        _train(mode, config, net_kwargs)
    except (StrategyError, ValueError, OSError) as e:
        return type(e).__name__, str(e)
    return None


def _save(tmp_path, n, mode="semi_auto_parallel"):
    path = str(tmp_path / "strategy.json")
    return path, run_threads(n, _train, mode, {"strategy_ckpt_config": {"save_file": path}})


@pytest.mark.parametrize("mode", ["semi_auto_parallel", "auto_parallel"])
@pytest.mark.parametrize("n", [2, 4])
def test_the_saved_plan_names_every_layout_and_a_loading_run_without_shard_trains_identically(tmp_path, n, mode):
    path, saved = _save(tmp_path, n, mode)
    content = json.loads(open(path).read())
    # MindSpore's items: tensor maps count device axes from the right, -1 for a whole dimension.
    assert content["parallel_layout_item"] == {
        "w1": {"dev_matrix": [1, 1, n], "tensor_map": [-1, 0], "tensor_shape": [D, H], "field": 0,
               "opt_weight_shard_step": 0, "opt_weight_shard_size": 0},
        "w2": {"dev_matrix": [1, n, 1], "tensor_map": [1, -1], "tensor_shape": [H, D], "field": 0,
               "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}}
    assert content["parallel_strategy_item"] == {"MatMul_w1": {"stage": 0, "parallel_strategy": [[1, 1], [1, n]]},
                                                 "MatMul_w2": {"stage": 0, "parallel_strategy": [[1, n], [n, 1]]}}
    assert (content["device_num"], content["parallel_mode"]) == (n, mode)

    loaded = run_threads(n, _train, mode, {"strategy_ckpt_load_file": path}, {"shard": False})
    plain = run_threads(n, _train, mode, {}, {"shard": False})
    single = momentum_steps(MegatronMLP(1), *_data(), STEPS)[2]
    for (losses, params, layouts), (loaded_losses, loaded_params, loaded_layouts), (_, _, plain_layouts) in zip(
            saved, loaded, plain):
        assert layouts == loaded_layouts == {"w1": f"(-, c) on [1, 1, {n}]", "w2": f"(b, -) on [1, {n}, 1]"}
        assert plain_layouts != layouts  # without the file, the unset strategies cut otherwise
        assert loaded_losses == losses
        for name in params:
            np.testing.assert_array_equal(loaded_params[name], params[name], err_msg=name)
            np.testing.assert_allclose(params[name], single[name], rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("n", [2, 4])
def test_a_changed_shard_strategy_raises_on_every_rank_naming_the_parameter_and_both_layouts(tmp_path, n):
    path, _ = _save(tmp_path, n)
    # The row MatMul now cuts the batch and keeps w2 whole: shard() wins over the file's strategy.
    errors = run_threads(n, _error_of, "semi_auto_parallel", {"strategy_ckpt_config": {"load_file": path}},
                         {"row": ((n, 1), (1, 1))})
    assert len(set(errors)) == 1
    kind, message = errors[0]
    assert kind == "StrategyError"
    assert (f"parameter 'w2' of shape ({H}, {D}) is laid out as (-, -) on [{n}, 1, 1] here but as "
            f"(b, -) on [1, {n}, 1] in the file") in message
    assert "'w1'" not in message and path in message


def test_parameters_missing_from_the_file_or_from_the_network_are_named(tmp_path):
    path, _ = _save(tmp_path, 2)
    errors = run_threads(2, _error_of, "semi_auto_parallel", {"strategy_ckpt_config": {"load_file": path}},
                         {"second": "v2"})
    kind, message = errors[0]
    assert errors[1] == errors[0] and kind == "StrategyError"
    assert "the file lays out parameter 'w2' of shape (16, 8) as (b, -) on [1, 2, 1], but the network has no " \
           "parameter of that name" in message
    assert "parameter 'v2' of shape (16, 8) is laid out as (b, -) on [1, 2, 1] here, but the file has no layout " \
           "for it" in message


def test_a_missing_file_raises_on_every_rank_naming_it(tmp_path):
    path = str(tmp_path / "none.json")
    errors = run_threads(2, _error_of, "semi_auto_parallel", {"strategy_ckpt_config": {"load_file": path}})
    assert errors[0] == errors[1] and errors[0][0] == "FileNotFoundError"
    assert f"strategy_ckpt_config['load_file'] {path!r}: no such file" in errors[0][1]


def test_a_file_saved_for_another_world_size_raises_before_any_operator_uses_it(tmp_path):
    path, _ = _save(tmp_path, 4)
    errors = run_threads(2, _error_of, "semi_auto_parallel", {"strategy_ckpt_load_file": path}, {"shard": False})
    assert errors[0] == errors[1] and errors[0][0] == "ValueError"
    assert "the file holds the plan of 4 devices, this run has 2" in errors[0][1]


def test_ranks_that_read_different_files_all_raise_instead_of_waiting(tmp_path):
    path, _ = _save(tmp_path, 2)

    def rank():
        missing = str(tmp_path / f"only_on_rank_0_{mp.get_rank()}.json")
        return _error_of("semi_auto_parallel", {"strategy_ckpt_load_file": path if mp.get_rank() == 0 else missing})
    errors = run_threads(2, rank)
    assert errors[0] == errors[1] and errors[0][0] == "StrategyError"
    sha1 = hashlib.sha1(open(path, "rb").read()).hexdigest()
    assert f"strategy_ckpt_config['load_file']: the ranks differ: rank 0: read it (sha1 {sha1[:12]}), " in errors[0][1]
    assert "rank 1: FileNotFoundError: strategy_ckpt_config['load_file']" in errors[0][1]
    assert "only_on_rank_0_1.json': no such file" in errors[0][1]


def test_a_file_that_is_not_a_strategy_checkpoint_raises_naming_it(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("not json")
    errors = run_threads(2, _error_of, "semi_auto_parallel", {"strategy_ckpt_load_file": str(path)})
    assert errors[0][0] == "ValueError" and f"{str(path)!r}: not a JSON strategy checkpoint" in errors[0][1]
    path.write_text(json.dumps({"format": "minidl strategy checkpoint", "version": 1,
                                "parallel_layout_item": {"w1": {"dev_matrix": [2], "tensor_map": [0, -1]}}}))
    errors = run_threads(2, _error_of, "semi_auto_parallel", {"strategy_ckpt_load_file": str(path)})
    assert errors[0][0] == "ValueError" and "parallel_layout_item 'w1': not a layout entry" in errors[0][1]


def test_the_old_keys_set_the_same_entries_and_save_and_load_alike(tmp_path):
    path = str(tmp_path / "old.json")
    mp.set_auto_parallel_context(strategy_ckpt_save_file=path)
    try:
        assert mp.get_auto_parallel_context("strategy_ckpt_config") == {"load_file": "", "save_file": path,
                                                                         "only_trainable_params": True}
        mp.set_auto_parallel_context(strategy_ckpt_config={"load_file": "a.json"})  # the other entries stay
        assert mp.get_auto_parallel_context("strategy_ckpt_load_file") == "a.json"
        assert mp.get_auto_parallel_context("strategy_ckpt_save_file") == path
    finally:
        mp.reset_auto_parallel_context()
    assert mp.get_auto_parallel_context("strategy_ckpt_config")["save_file"] == ""
    saved = run_threads(2, _train, "semi_auto_parallel", {"strategy_ckpt_save_file": path})
    loaded = run_threads(2, _train, "semi_auto_parallel", {"strategy_ckpt_load_file": path}, {"shard": False})
    assert [r[2] for r in saved] == [r[2] for r in loaded]
    np.testing.assert_array_equal(saved[0][1]["w2"], loaded[0][1]["w2"])


def test_only_trainable_params_leaves_frozen_parameters_out_unless_false(tmp_path):
    def rank(only):
        path = str(tmp_path / f"frozen_{only}.json")
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch",
                                     strategy_ckpt_config={"save_file": path, "only_trainable_params": only})
        try:
            net = MegatronMLP(mp.get_group_size())
            net.w2.requires_grad = False
            net(Tensor(_data()[0]))
        finally:
            mp.reset_auto_parallel_context()
        return sorted(json.loads(open(path).read())["parallel_layout_item"])
    assert run_threads(2, rank, True) == [["w1"]] * 2
    assert run_threads(2, rank, False) == [["w1", "w2"]] * 2


def test_nothing_is_written_outside_semi_auto_and_auto_parallel(tmp_path):
    def rank():
        mp.set_auto_parallel_context(parallel_mode="data_parallel",
                                     strategy_ckpt_config={"save_file": str(tmp_path / "dp.json")})
        try:
            MegatronMLP(1, {"shard": False})(Tensor(_data()[0]))
        finally:
            mp.reset_auto_parallel_context()
    run_threads(2, rank)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(strategy_ckpt_config="s.json"), TypeError,
     r"strategy_ckpt_config must be a dict with keys from \('load_file', 'save_file', 'only_trainable_params'\), "
     r"got str 's.json'"),
    (dict(strategy_ckpt_config={"save": "s.json"}), ValueError,
     r"strategy_ckpt_config has unknown key\(s\) \['save'\]; valid keys are \('load_file'"),
    (dict(strategy_ckpt_config={"load_file": 3}), TypeError,
     r"strategy_ckpt_config\['load_file'\] must be a str \(a file path, or '' for none\), got int 3"),
    (dict(strategy_ckpt_config={"only_trainable_params": 1}), TypeError,
     r"strategy_ckpt_config\['only_trainable_params'\] must be True or False, got 1"),
    (dict(strategy_ckpt_save_file=None), TypeError, r"strategy_ckpt_save_file must be a str .*got NoneType None"),
])
def test_bad_values_raise_naming_the_key_and_what_is_expected_and_change_nothing(kwargs, error, match):
    with pytest.raises(error, match=match):
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", **kwargs)
    assert mp.get_auto_parallel_context("parallel_mode") == "stand_alone"
    assert mp.get_auto_parallel_context("strategy_ckpt_config") == {"load_file": "", "save_file": "",
                                                                     "only_trainable_params": True}


def test_the_file_is_written_once_per_network_and_setting_and_again_for_a_new_one(tmp_path):
    """The plan is made at a network's first call: later calls of the same network with the same
    setting leave the file alone; a new save_file, or another network, writes again."""
    import os

    def rank():
        first, second = str(tmp_path / f"first_{mp.get_rank()}.json"), str(tmp_path / f"second_{mp.get_rank()}.json")
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch",
                                     strategy_ckpt_config={"save_file": first})
        try:
            net, x = MegatronMLP(mp.get_group_size()), Tensor(_data()[0])
            net(x)
            written = [os.path.exists(first)]
            os.remove(first)
            net(x)
            written.append(os.path.exists(first))  # (the same network and setting: not again)
            mp.set_auto_parallel_context(strategy_ckpt_config={"save_file": second})
            net(x)
            written.append(os.path.exists(second))
            mp.set_auto_parallel_context(strategy_ckpt_config={"save_file": first})
            MegatronMLP(mp.get_group_size())(x)
            written.append(os.path.exists(first))  # (another network)
        finally:
            mp.reset_auto_parallel_context()
        return written
    assert run_threads(2, rank) == [[True, False, True, True]] * 2


def _layout(tensor_map):
    return {"dev_matrix": [2], "tensor_map": tensor_map, "tensor_shape": [4, 2]}


@pytest.mark.parametrize("content, message", [
    ([1, 2], "not a 'minidl strategy checkpoint' file (its 'format' is None)"),
    ({"format": "mindspore"}, "not a 'minidl strategy checkpoint' file (its 'format' is 'mindspore')"),
    ({"format": "minidl strategy checkpoint", "version": 2}, "version 2, this minidl reads version 1"),
    ({"format": "minidl strategy checkpoint", "version": 1, "parallel_layout_item": [["w1", {}]]},
     "parallel_layout_item must be an object {name: entry}, got list [['w1', {}]]"),
    ({"format": "minidl strategy checkpoint", "version": 1, "parallel_strategy_item": None},
     "parallel_strategy_item must be an object {name: entry}, got NoneType None"),
    ({"format": "minidl strategy checkpoint", "version": 1, "parallel_strategy_item": {"MatMul_w1": {"stage": 0}}},
     "parallel_strategy_item 'MatMul_w1': not a strategy entry ({'stage': 0, 'parallel_strategy': [[...], ...]}): "
     "{'stage': 0} (KeyError: 'parallel_strategy')"),
    ({"format": "minidl strategy checkpoint", "version": 1,
      "parallel_strategy_item": {"MatMul_w1": {"parallel_strategy": [[1, True]]}}},
     "parallel_strategy_item 'MatMul_w1': every cut of parallel_strategy must be a positive int, got "
     "{'parallel_strategy': [[1, True]]}"),
    ({"format": "minidl strategy checkpoint", "version": 1,
      "parallel_strategy_item": {"MatMul_w1": {"parallel_strategy": [[1, 0]]}}},
     "parallel_strategy_item 'MatMul_w1': every cut of parallel_strategy must be a positive int, got "
     "{'parallel_strategy': [[1, 0]]}"),
    ({"format": "minidl strategy checkpoint", "version": 1, "parallel_layout_item": {"w1": _layout([[True], -1])}},
     "parallel_layout_item 'w1': not a layout entry (dev_matrix, tensor_map, tensor_shape as MindSpore writes them): "
     "{'dev_matrix': [2], 'tensor_map': [[True], -1], 'tensor_shape': [4, 2]} (ValueError: tensor_map entry [True] is "
     "not an int or a list of ints)"),
])
def test_each_malformed_part_of_a_file_is_named_with_what_was_expected(tmp_path, content, message):
    from minidl_parallel.tensor_parallel import strategy_file
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError) as raised:
        strategy_file.read(str(path))
    assert str(raised.value) == f"strategy_ckpt_config['load_file'] {str(path)!r}: {message}"


def test_a_file_with_strategies_only_or_several_axes_per_dimension_reads_back(tmp_path):
    from minidl_parallel.tensor_parallel import strategy_file
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"format": "minidl strategy checkpoint", "version": 1, "device_num": 4,
                                "parallel_strategy_item": {"MatMul_w1": {"stage": 0, "parallel_strategy": [[1, 2]]}}}))
    loaded = strategy_file.read(str(path))
    assert (loaded.strategies, loaded.layouts, loaded.device_num) == ({"MatMul_w1": ((1, 2),)}, {}, 4)
    item = {"dev_matrix": [2, 2], "tensor_map": [[1, 0], -1], "tensor_shape": [4, 2], "field": 0,
            "opt_weight_shard_step": 0, "opt_weight_shard_size": 0}
    layout, shape = strategy_file.layout_from_item(item, "w")
    assert shape == (4, 2) and strategy_file.layout_item(layout, shape) == item


def test_a_save_file_in_a_new_folder_is_written_there_and_one_that_cannot_be_written_raises_on_every_rank(tmp_path):
    def rank(path, frozen):
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch",
                                     strategy_ckpt_config={"save_file": path})
        try:
            net = MegatronMLP(mp.get_group_size())
            for p in net.trainable_params() if frozen else ():
                p.requires_grad = False
            net(Tensor(_data()[0]))
        except OSError as e:
            return type(e).__name__, str(e)
        finally:
            mp.reset_auto_parallel_context()
        return open(path).read()

    path = str(tmp_path / "new" / "folder" / "plan.json")
    text = run_threads(2, rank, path, True)[0]  # (every parameter frozen: no layout to save)
    content = json.loads(text)
    assert (content["current_stage"], content["parallel_layout_item"]) == (0, {})
    assert '\n "parallel_layout_item": {}\n}' in text  # an empty section on its one line
    (tmp_path / "a_file").write_text("")
    blocked = str(tmp_path / "a_file" / "plan.json")
    errors = run_threads(2, rank, blocked, False)
    assert errors[0] == errors[1] and errors[0][0] == "OSError"
    assert errors[0][1].startswith(f"strategy_ckpt_config['save_file'] {blocked!r}: cannot write it: ")


def test_every_problem_is_named_in_the_files_order_and_a_layout_written_with_other_axes_but_the_same_blocks_loads(
        tmp_path):
    """The file names a parameter the network lacks, one no operator used, one of another shape,
    and w2 on a one-axis device matrix that gives every rank the blocks the run's [1, 2, 1] gives it."""
    def item(dev_matrix, tensor_map, shape):
        return {"dev_matrix": dev_matrix, "tensor_map": tensor_map, "tensor_shape": shape}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"format": "minidl strategy checkpoint", "version": 1, "device_num": 2,
                                "parallel_layout_item": {"ghost": item([2], [0, -1], [2, 2]),
                                                         "spare": item([2], [-1, -1], [2, 2]),
                                                         "w1": item([1, 1, 2], [-1, 0], [D, 2 * H]),
                                                         "w2": item([2], [0, -1], [H, D])}}))
    errors = run_threads(2, _error_of, "semi_auto_parallel", {"strategy_ckpt_load_file": str(path)}, {"spare": True})
    assert errors[0] == errors[1] and errors[0][0] == "StrategyError"
    assert errors[0][1] == (
        f"strategy_ckpt_config['load_file'] {str(path)!r}: this run's plan differs from the file's: "
        f"the file lays out parameter 'ghost' of shape (2, 2) as (a, -) on [2], but the network has no parameter of "
        f"that name; "
        f"parameter 'spare': the file lays it out as (-, -) on [2] (shape (2, 2)), but no sharded operator of this "
        f"call used it; "
        f"parameter 'w1' has shape ({D}, {H}) here but ({D}, {2 * H}) in the file. "
        f"Layouts read (a, -) on [2, 4]: dimension 0 cut along device axis a of a 2 x 4 device matrix; a shard() "
        f"strategy wins over the file's, so remove or change the shard() calls that differ, or save a new file")


@pytest.mark.parametrize("prefix", ["", "given_"])
def test_parameters_are_named_as_a_checkpoint_of_the_called_cell_names_them(tmp_path, prefix):
    """A name other than the attribute's stays; a name the attribute gives becomes the path from the
    called cell (here a WithLossCell: "_backbone.w1"), in the layouts and in the operators' keys alike."""
    path = str(tmp_path / "plan.json")

    def rank():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch",
                                     strategy_ckpt_config={"save_file": path})
        try:
            nn.WithLossCell(MegatronMLP(mp.get_group_size(), prefix=prefix), nn.MSELoss())(*map(Tensor, _data()))
        finally:
            mp.reset_auto_parallel_context()
    run_threads(2, rank)
    content = json.loads(open(path).read())
    w1, w2 = ("given_w1", "given_w2") if prefix else ("_backbone.w1", "_backbone.w2")
    assert sorted(content["parallel_layout_item"]) == [w1, w2]
    assert sorted(content["parallel_strategy_item"]) == [f"MatMul_{w1}", f"MatMul_{w2}"]


def test_an_operator_on_a_parameter_from_outside_the_network_is_keyed_by_its_own_name_or_not_at_all(tmp_path):
    class Scaled(nn.Cell):
        def __init__(self):
            super().__init__()
            self.w = Parameter(np.ones((D, D)), name="w")
            self.inner, self.named, self.unnamed = ops.MatMul(), ops.MatMul(), ops.MatMul()

        def construct(self, x, outside, anonymous):
            return self.unnamed(self.named(self.inner(x, self.w), outside), anonymous)

    path = str(tmp_path / "plan.json")

    def rank():
        mp.set_auto_parallel_context(parallel_mode="semi_auto_parallel", dataset_strategy="full_batch",
                                     strategy_ckpt_config={"save_file": path})
        try:
            Scaled()(Tensor(_data()[0]), Parameter(np.ones((D, D)), name="outside"), Parameter(np.ones((D, D))))
        finally:
            mp.reset_auto_parallel_context()
    run_threads(2, rank)
    content = json.loads(open(path).read())
    assert sorted(content["parallel_layout_item"]) == ["w"]  # (the file describes the network's own)
    assert sorted(content["parallel_strategy_item"]) == ["MatMul_outside", "MatMul_w"]


def test_a_save_file_written_on_one_rank_only_raises_on_every_rank_naming_each_ranks_outcome(tmp_path):
    (tmp_path / "a_file").write_text("")
    blocked = str(tmp_path / "a_file" / "plan.json")

    def rank():
        path = str(tmp_path / "plan.json") if mp.get_rank() == 0 else blocked
        return _error_of("semi_auto_parallel", {"strategy_ckpt_config": {"save_file": path}})
    errors = run_threads(2, rank)
    assert errors[0] == errors[1] and errors[0][0] == "StrategyError"
    prefix = (f"strategy checkpoint: the ranks differ: rank 0: fine, rank 1: OSError: strategy_ckpt_config['save_file'] "
              f"{blocked!r}: cannot write it: ")
    assert errors[0][1].startswith(prefix), errors[0][1]
    assert errors[0][1].endswith("; every rank must read the same file and make the same plan")
