"""Optimizer parallelism (ZeRO) under DATA_PARALLEL, each level against plain data parallelism.

Plain data parallelism is itself proven equal to one process on the global batch
(test_data_parallel_equivalence.py); here every rank of an n-rank threads world trains the same
shard twice, with ``enable_parallel_optimizer`` off and on, and the parameters after k steps
must agree: bit for bit where the summation order is the same (the threads world sums in rank
order for all-reduce and reduce-scatter alike), within float64 1e-10 relative where slicing
changes it (LARS's norms add per-slice dot products; replica groups add twice; accumulated
slices add after the reduction).
"""
import math
import re

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import minidl
from minidl import Tensor, nn
from minidl.dataset import NumpySlicesDataset
from minidl.backend import to_numpy
from minidl.runtime import get_runtime
from minidl.train import CheckpointConfig, Model, ModelCheckpoint, latest_checkpoint
import minidl_parallel as mp
from minidl_parallel import run_threads
from minidl_parallel.buckets import DEFAULT_FUSION_BYTES
from minidl_parallel.optimizer_parallel import slices
from minidl_parallel.optimizer_parallel.reducer import OptimizerParallelReducer
from minidl_parallel.optimizer_parallel.slices import OptimizerSlice
from minidl_parallel.tensor_parallel import CommCounter

F64 = minidl.float64
OPTIMIZERS = {
    "sgd": lambda ps: nn.SGD(ps, 0.05, momentum=0.9, weight_decay=1e-3),
    "momentum": lambda ps: nn.Momentum(ps, 0.05, 0.9),
    "adam": lambda ps: nn.Adam(ps, 0.01, weight_decay=1e-3),
    "adamw": lambda ps: nn.AdamWeightDecay(ps, 0.01, weight_decay=0.01),
    "lars": lambda ps: nn.LARS(nn.Momentum(ps, 0.05, 0.9, weight_decay=1e-3), coefficient=0.02),
}
EXACT = {"sgd", "momentum", "adam", "adamw"}  # LARS's norms are sums of per-slice dot products


def _net(widths, dtypes=None):
    """Dense layers with Tanh between them; layer i in ``dtypes[i]`` (float64 by default)."""
    dtypes = dtypes or (F64,) * (len(widths) - 1)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i and dtypes[i] != dtypes[i - 1]:
            layers.append(_Cast(dtypes[i]))
        layers += [nn.Dense(a, b, dtype=dtypes[i]), nn.Tanh()]
    return nn.SequentialCell(*layers[:-1])


class _Cast(nn.Cell):
    def __init__(self, dtype):
        super().__init__()
        self.dtype, self.cast = dtype, minidl.ops.Cast()

    def construct(self, x):
        return self.cast(x, self.dtype)


def _context(zero, level="level1", threshold=0, shard_size=-1, gradients_mean=True, **more):
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=gradients_mean,
                                 enable_parallel_optimizer=zero, **more)
    if zero:
        mp.set_auto_parallel_context(parallel_optimizer_config={
            "optimizer_level": level, "parallel_optimizer_threshold": threshold,
            "optimizer_weight_shard_size": shard_size, "gradient_accumulation_shard": level == "level2"})


def _whole(tensor):
    return np.array(to_numpy(get_runtime().full_value(tensor))) if tensor.is_sharded else tensor.asnumpy().copy()


def _train(widths, seed, xs, ys, optimizer, clip=None, dtypes=None):
    """Trains a fresh net (the same on every rank, from the seed) on this rank's rows of each batch."""
    minidl.set_seed(seed)
    net = _net(widths, dtypes)
    opt = OPTIMIZERS[optimizer](net.trainable_params())
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
    if clip is not None:
        step = _ClippedStep(nn.WithLossCell(net, nn.MSELoss()), opt, clip)
    rank, n = mp.get_rank(), mp.get_group_size()
    per = xs.shape[1] // n
    for x, y in zip(xs, ys):
        step(Tensor(x[rank * per:(rank + 1) * per]), Tensor(y[rank * per:(rank + 1) * per]))
    params = {name: _whole(p) for name, p in net.parameters_and_names()}
    state = {name: _whole(b) for name, b in opt.parameters_and_names()}
    layouts = {name: p.placement for name, p in net.parameters_and_names()}
    return params, state, layouts


class _ClippedStep(nn.TrainOneStepCell):
    """MindSpore's pattern: reduce, clip by the global norm, update."""

    def __init__(self, network, optimizer, clip):
        super().__init__(network, optimizer)
        self.clip = clip

    def construct(self, *inputs):
        loss, grads = self._gradients(inputs, self._reducer())
        self.optimizer(minidl.ops.clip_by_global_norm(grads, self.clip))
        return loss


def _data(seed, steps, batch, widths):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((steps, batch, widths[0])), rng.standard_normal((steps, batch, widths[-1]))


def _compare(n, widths, optimizer, steps=3, seed=0, exact=True, clip=None, per_rank=2, dtypes=None, **zero):
    xs, ys = _data(seed, steps, n * per_rank, widths)
    if dtypes is not None:  # the inputs in the first layer's dtype, the labels in the last's
        xs, ys = xs.astype(dtypes[0]), ys.astype(dtypes[-1])

    def body(on):
        def rank_body():
            _context(on, **zero)
            return _train(widths, seed, xs, ys, optimizer, clip, dtypes)
        return rank_body

    plain = run_threads(n, body(False))
    sliced = run_threads(n, body(True))
    for (want_p, want_s, _), (got_p, got_s, layouts) in zip(plain, sliced):
        for want, got in ((want_p, got_p), (want_s, got_s)):
            assert want.keys() == got.keys()
            for name in want:
                assert got[name].dtype == want[name].dtype, name
                if exact:
                    np.testing.assert_array_equal(got[name], want[name], err_msg=name)
                else:
                    np.testing.assert_allclose(got[name], want[name], rtol=1e-10, atol=1e-14, err_msg=name)
    return sliced


# ---- the CI subset: threads at n = 2 and 4, every level, two optimizers -----------------------

@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_each_level_equals_plain_data_parallel_bit_for_bit(n, level, optimizer):
    sliced = _compare(n, (3, 7, 5, 2), optimizer, level=level)
    for rank, (_, _, layouts) in enumerate(sliced):
        # Every parameter is sliced (threshold 0): rank r holds rows [r*c, (r+1)*c) of (7, 3).
        placement = layouts["0.weight"]
        assert isinstance(placement, OptimizerSlice) and placement.index == rank
        assert placement.bounds() == (min(rank * math.ceil(7 / n), 7), min((rank + 1) * math.ceil(7 / n), 7))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_every_optimizer_under_level2(optimizer):
    _compare(3, (4, 5, 3), optimizer, level="level2", exact=optimizer in EXACT)


def test_level1_with_lars_at_four_ranks():
    _compare(4, (4, 6, 2), "lars", level="level1", exact=False)


def test_clip_by_global_norm_sums_the_squares_of_every_slice():
    # A clip norm far below the gradients' norm: every step is scaled by the global norm, which
    # must be the whole gradients' norm, not this rank's slices'.
    _compare(2, (3, 6, 2), "momentum", level="level2", exact=False, clip=1e-3)


def test_weight_shard_size_slices_within_groups_and_sums_across_them():
    sliced = _compare(4, (3, 6, 2), "adam", level="level2", shard_size=2, exact=False)
    for rank, (_, _, layouts) in enumerate(sliced):
        assert layouts["0.weight"].group_size == 2 and layouts["0.weight"].index == rank % 2


def test_threshold_keeps_small_parameters_whole():
    # 0.weight (8, 40) float64 is 2.5 KB: sliced at 2 KB; every bias (< 1 KB) stays whole.
    sliced = _compare(2, (40, 8, 2), "momentum", level="level2", threshold=2)
    for _, _, layouts in sliced:
        assert isinstance(layouts["0.weight"], OptimizerSlice)
        assert layouts["0.bias"] is None and layouts["2.weight"] is None


@pytest.mark.parametrize("level", ["level1", "level2"])
def test_gradient_accumulation(level):
    _compare(2, (3, 5, 2), "momentum", steps=4, level=level, exact=level == "level1", grad_accumulation_step=2)


def test_level2_without_sharded_accumulation_reduce_scatters_the_local_sum():
    xs, ys = _data(1, 4, 4, (3, 5, 2))

    def body(on):
        def rank_body():
            _context(on, level="level2", grad_accumulation_step=2)
            if on:  # level2 turned gradient_accumulation_shard on; turn it off again
                mp.set_auto_parallel_context(parallel_optimizer_config={"gradient_accumulation_shard": False})
            return _train((3, 5, 2), 1, xs, ys, "momentum")[0]
        return rank_body

    for want, got in zip(run_threads(2, body(False)), run_threads(2, body(True))):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_fp16_compression_equals_plain_data_parallel_with_it():
    _compare(2, (3, 6, 2), "momentum", level="level2", gradient_compression="fp16")


class _ProbeLoss(nn.Cell):
    """MSELoss that records, when it runs (after the network's forward, before backward), whether
    each of the network's weights is whole on this rank."""

    def __init__(self, net):
        super().__init__()
        self.loss = nn.MSELoss()
        self.seen = []
        self._net = [net]  # a list: not a sub-cell (its parameters are not the loss's)

    def construct(self, out, label):
        self.seen.append([tuple(p.data.shape) == tuple(p.shape) for p in self._net[0].trainable_params()])
        return self.loss(out, label)


@pytest.mark.parametrize("level", ["level1", "level3"])
def test_level3_holds_weights_whole_only_while_their_cell_runs(level):
    def rank_body():
        _context(True, level=level)
        minidl.set_seed(0)
        net = _net((3, 6, 4))
        probe = _ProbeLoss(net)
        step = nn.TrainOneStepCell(nn.WithLossCell(net, probe), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        for _ in range(3):
            step(Tensor(np.ones((2, 3))), Tensor(np.zeros((2, 4))))
        return probe.seen

    for seen in run_threads(2, rank_body):
        assert seen[0] == [True] * 4  # the first step runs before the plan slices anything
        # Afterwards level1 holds the gathered weights through backward; level3 has given them back.
        assert seen[1:] == [[level == "level1"] * 4] * 2


# ---- memory: what a rank holds between steps -------------------------------------------------

def test_weights_and_optimizer_state_between_steps_are_the_formulas_slices():
    n, widths = 4, (5, 9, 3)

    def rank_body():
        _context(True, level="level2")
        minidl.set_seed(0)
        net = _net(widths)
        opt = nn.Adam(net.trainable_params(), 0.01)
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
        x = np.ones((2, widths[0]))
        step(Tensor(x), Tensor(np.ones((2, widths[-1]))))
        rank = mp.get_rank()
        expected = 0
        for p in net.trainable_params():
            rows = math.ceil(p.shape[0] / n)
            held = max(0, min(p.shape[0], (rank + 1) * rows) - rank * rows)
            expected += held * math.prod(p.shape[1:]) * 8
        weights = sum(p.data.nbytes for p in net.trainable_params())
        moments = sum(b.data.nbytes for name, b in opt.parameters_and_names() if name.startswith("moment"))
        return weights, moments, expected

    for weights, moments, expected in run_threads(n, rank_body):
        assert weights == expected
        assert moments == 2 * expected  # moment1 and moment2, sliced like their parameter


# ---- checkpoints: whole tensors, resumable at another world size -----------------------------

def _model_run(directory, n_steps_stop=None, resume=None, zero=True):
    """Model.train on this rank's shard with ModelCheckpoint; returns whole parameters and state."""
    _context(zero, level="level2")
    rank, size = mp.get_rank(), mp.get_group_size()
    minidl.set_seed(3)
    net = _net((4, 6, 2))
    opt = nn.Adam(net.trainable_params(), 0.01)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((16, 4)), rng.standard_normal((16, 2))
    ds = NumpySlicesDataset({"x": x, "y": y}, shuffle=False, num_shards=size, shard_id=rank).batch(8 // size)
    callbacks = []
    if directory is not None:
        config = CheckpointConfig(save_checkpoint_steps=1, keep_checkpoint_max=10)
        callbacks.append(ModelCheckpoint(prefix="net", directory=str(directory), config=config))
    if n_steps_stop is not None:
        callbacks.append(_StopAt(n_steps_stop))
    Model(net, nn.MSELoss(), opt).train(2, ds, callbacks=callbacks, progress=False, resume_from=resume)
    return {name: _whole(p) for name, p in net.parameters_and_names()}, \
        {name: _whole(b) for name, b in opt.parameters_and_names()}


class _StopAt(minidl.train.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num >= self.step:
            run_context.request_stop()


def test_a_sliced_run_saves_whole_tensors_and_resumes_at_another_world_size(tmp_path):
    want_params, want_state = run_threads(2, lambda: _model_run(None, zero=False))[0]
    run_threads(4, lambda: _model_run(tmp_path / "ckpt", n_steps_stop=2))
    path = latest_checkpoint(str(tmp_path / "ckpt"), prefix="net")  # rank 0's: every rank saved the same tensors
    saved = minidl.load_checkpoint(path)
    assert tuple(saved["0.weight"].shape) == (6, 4)  # whole, not rank 0's rows
    assert tuple(saved["moment1.0.weight"].shape) == (6, 4)
    for params, state in run_threads(2, lambda: _model_run(None, resume=path)):
        for name in want_params:
            np.testing.assert_allclose(params[name], want_params[name], rtol=1e-10, atol=1e-14, err_msg=name)
        for name in want_state:
            np.testing.assert_allclose(state[name], want_state[name], rtol=1e-10, atol=1e-14, err_msg=name)


# ---- configuration: MindSpore's keys and rules, and what minidl refuses ----------------------

def test_config_defaults_and_mindspore_rules():
    def rank_body():
        assert mp.get_auto_parallel_context("enable_parallel_optimizer") is False
        assert mp.get_auto_parallel_context("parallel_optimizer_config") == {
            "gradient_accumulation_shard": False, "parallel_optimizer_threshold": 64,
            "optimizer_weight_shard_size": -1, "optimizer_level": "level1"}
        mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level2"})
        assert mp.get_auto_parallel_context("parallel_optimizer_config")["gradient_accumulation_shard"] is True
        with pytest.raises(ValueError, match="gradient_accumulation_shard is True, which needs optimizer_level "
                                             "'level2', got 'level1'"):
            mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level1"})
        with pytest.raises(ValueError, match="unknown key"):
            mp.set_auto_parallel_context(parallel_optimizer_config={"level": "level1"})
        with pytest.raises(ValueError, match="parallel_optimizer_threshold'\\] must be an int >= 0"):
            mp.set_auto_parallel_context(parallel_optimizer_config={"parallel_optimizer_threshold": -1})
        with pytest.raises(ValueError, match="must be -1 .* or an int >= 1, got 0"):
            mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_weight_shard_size": 0})
        with pytest.raises(ValueError, match="needs optimizer_level 'level2', got 'level3'"):
            mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level3"})
        mp.set_auto_parallel_context(parallel_optimizer_config={"gradient_accumulation_shard": False})
        mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level3"})
        assert mp.get_auto_parallel_context("parallel_optimizer_config")["optimizer_level"] == "level3"
        with pytest.raises(ValueError, match="gradient_accumulation_shard=True is optimizer_level 'level2'"):
            mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level3",
                                                                    "gradient_accumulation_shard": True})
        mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level2"})
        with pytest.raises(ValueError, match="enable_parallel_optimizer must be True or False"):
            mp.set_auto_parallel_context(enable_parallel_optimizer=1)
        config = mp.get_auto_parallel_context("parallel_optimizer_config")
        config["optimizer_level"] = "changed"  # a copy: the setting does not change
        assert mp.get_auto_parallel_context("parallel_optimizer_config")["optimizer_level"] == "level2"

    run_threads(1, rank_body)


def test_a_shard_size_that_does_not_divide_the_world_raises_on_every_rank():
    def rank_body():
        _context(True, shard_size=3)
        return _train((3, 4, 2), 0, *_data(0, 1, 4, (3, 4, 2)), "momentum")

    with pytest.raises(ValueError, match=r"^rank \d of 4: OptimizerParallelReducer: parallel_optimizer_config"
                                         r"\['optimizer_weight_shard_size'\] = 3 must divide the data-parallel "
                                         r"world size 4"):
        run_threads(4, rank_body)


def _uneven_run(zero, level, threshold=0, **more):
    """Model.train(uneven_inputs=True): rank r has 4 - 2r batches of 2 rows."""
    _context(zero, level=level, threshold=threshold, **more)
    rank = mp.get_rank()
    minidl.set_seed(0)
    net = _net((3, 5, 2))
    rng = np.random.default_rng(rank)
    rows = 2 * (4 - 2 * rank)
    ds = NumpySlicesDataset({"x": rng.standard_normal((rows, 3)), "y": rng.standard_normal((rows, 2))},
                            shuffle=False).batch(2)
    opt = nn.Adam(net.trainable_params(), 0.01)
    Model(net, nn.MSELoss(), opt).train(2, ds, progress=False, uneven_inputs=True)
    return {name: _whole(p) for name, p in net.parameters_and_names()}, \
        {name: _whole(b) for name, b in opt.parameters_and_names()}


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_uneven_inputs_equal_plain_data_parallel_with_them(level):
    plain = run_threads(2, _uneven_run, False, level)
    sliced = run_threads(2, _uneven_run, True, level)
    for (want_p, want_s), (got_p, got_s) in zip(plain, sliced):
        for want, got in ((want_p, got_p), (want_s, got_s)):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # every rank ends with the same weights: the shadowed steps updated rank 1 as rank 0
    for name in plain[0][0]:
        np.testing.assert_array_equal(sliced[0][0][name], sliced[1][0][name])


def _step_at_level3():
    _context(True, level="level3", threshold=0)
    minidl.set_seed(0)
    net = _net((3, 5, 2))
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params(), 0.01))
    step(Tensor(np.ones((2, 3))), Tensor(np.zeros((2, 2))))


def test_at_level3_a_rank_shadows_the_others_per_cell_gathers_as_its_last_step_made_them():
    """Rank 1's data ends after 2 of rank 0's 4 steps: its shadowed steps replay each cell's gathers
    (forward and backward), so the two ranks' collectives pair up, counted per rank."""
    def body():
        with CommCounter() as counted:
            _uneven_run(True, "level3")
        return counted.count("allgather", phase="weights")

    gathers = run_threads(2, body)
    assert gathers[0] == gathers[1] > 0


def test_at_level3_a_rank_shadows_a_weight_gathered_for_one_op_and_steps_that_gathered_nothing():
    """The tied head's table is gathered for that op alone (with_whole): a shadowing rank replays that
    gather too. Above the threshold nothing is sliced: the steps gather nothing, and shadow nothing."""
    tokens = np.array([1, 2, 6, 0, 5, 3, 4, 1, 2, 2, 3, 6], dtype=np.int32)
    labels = np.random.default_rng(0).standard_normal((12, 7))

    def body(on, threshold):
        def rank_body():
            _context(on, level="level3", threshold=threshold)
            minidl.set_seed(0)
            net = _TiedHead()
            opt = nn.Adam(net.trainable_params(), 0.01)
            rank = mp.get_rank()
            rows = 8 if rank == 0 else 4  # rank 0: 4 steps of 2 rows, rank 1: 2
            ds = NumpySlicesDataset({"x": tokens[rank * 8:rank * 8 + rows], "y": labels[rank * 8:rank * 8 + rows]},
                                    shuffle=False).batch(2)
            with CommCounter() as counted:
                Model(net, nn.MSELoss(), opt).train(1, ds, progress=False, uneven_inputs=True)
            return {name: _whole(p) for name, p in net.parameters_and_names()}, counted.count("allgather",
                                                                                                phase="weights")
        return rank_body

    plain = run_threads(2, body(False, 0))
    for threshold, gathered in ((0, True), (10**6, False)):
        sliced = run_threads(2, body(True, threshold))
        assert sliced[0][1] == sliced[1][1] and (sliced[0][1] > 0) == gathered  # every gather paired
        for (want, _), (got, _) in zip(plain, sliced):
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_outside_a_join_block_no_step_votes(monkeypatch):
    from minidl_parallel.optimizer_parallel import reducer as reducer_module
    votes = []
    monkeypatch.setattr(reducer_module, "count_ranks_with_data", lambda comm, has: votes.append(has) or comm.size)
    run_threads(2, _step_at_level3)
    assert votes == []


def test_at_level3_a_rank_without_a_step_of_its_own_cannot_shadow_and_says_so():
    def rank_body():
        _context(True, level="level3", threshold=0)
        minidl.set_seed(0)
        net = _net((3, 5, 2))
        opt = nn.Adam(net.trainable_params(), 0.01)
        reducer = get_runtime().grad_reducer(opt.parameters)
        grad_fn = minidl.value_and_grad(lambda x, y: nn.MSELoss()(net(x), y), None, opt.parameters)
        x, y = Tensor(np.ones((2, 3))), Tensor(np.ones((2, 2)))
        with reducer.join(opt):
            if mp.get_rank() == 0:
                _, grads = grad_fn(x, y)
                opt(reducer(grads))

    with pytest.raises(RuntimeError, match=re.escape(
            "rank 1 has no data for its first step inside a join block at optimizer_level 'level3'")):
        run_threads(2, rank_body)


# ---- the property: models, sizes, steps drawn by hypothesis ----------------------------------

@settings(deadline=None)
@given(n=st.sampled_from([1, 2, 3, 4]), widths=st.lists(st.integers(1, 9), min_size=2, max_size=4),
       level=st.sampled_from(["level1", "level2", "level3"]), optimizer=st.sampled_from(sorted(OPTIMIZERS)),
       threshold=st.sampled_from([0, 1]), steps=st.integers(1, 3), seed=st.integers(0, 2 ** 16))
def test_drawn_models_equal_plain_data_parallel(n, widths, level, optimizer, threshold, steps, seed):
    _compare(n, tuple(widths), optimizer, steps=steps, seed=seed, exact=optimizer in EXACT, level=level,
             threshold=threshold)


# ---- the whole matrix (MINIDL_SLOW=1): every level, optimizer and world size, shard groups --------

@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("shard_size", [-1, 2])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_whole_matrix(n, level, optimizer, shard_size, accumulation):
    if shard_size != -1 and n % shard_size:
        pytest.skip("the shard size must divide the world")
    exact = optimizer in EXACT and (shard_size == -1 or shard_size == n) and (level != "level2" or accumulation == 1)
    _compare(n, (5, 9, 3, 2), optimizer, steps=4, exact=exact, level=level, shard_size=shard_size,
             grad_accumulation_step=accumulation)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(n=st.sampled_from([1, 2, 3, 4]), widths=st.lists(st.integers(1, 12), min_size=2, max_size=5),
       level=st.sampled_from(["level1", "level2", "level3"]), optimizer=st.sampled_from(sorted(OPTIMIZERS)),
       threshold=st.sampled_from([0, 1]), steps=st.integers(1, 4), seed=st.integers(0, 2 ** 16))
def test_drawn_models_equal_plain_data_parallel_thoroughly(n, widths, level, optimizer, threshold, steps, seed):
    _compare(n, tuple(widths), optimizer, steps=steps, seed=seed, exact=optimizer in EXACT, level=level,
             threshold=threshold)


class _TiedHead(nn.Cell):
    """An embedding whose table the head reads in this cell's construct (GPT's tied weights)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4, dtype=F64)
        self.mix = nn.Dense(4, 4, dtype=F64)
        self.head = minidl.ops.MatMul(transpose_b=True)

    def construct(self, tokens):
        return self.head(self.mix(self.embed(tokens)), self.embed.embedding_table)


@pytest.mark.parametrize("level", ["level1", "level2", "level3"])
def test_a_weight_read_outside_its_cell_is_whole_for_that_op(level):
    tokens = np.array([1, 2, 6, 0, 5, 3, 4, 1], dtype=np.int32)
    labels = np.random.default_rng(0).standard_normal((8, 7))

    def body(on):
        def rank_body():
            _context(on, level=level)
            minidl.set_seed(0)
            net = _TiedHead()
            step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params(), 0.01))
            rank = mp.get_rank()
            for _ in range(3):
                step(Tensor(tokens[4 * rank:4 * rank + 4]), Tensor(labels[4 * rank:4 * rank + 4]))
            return {name: _whole(p) for name, p in net.parameters_and_names()}
        return rank_body

    for want, got in zip(run_threads(2, body(False)), run_threads(2, body(True))):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("level", ["level1", "level3"])
def test_summon_full_params_lets_one_rank_use_the_whole_network(level):
    def rank_body():
        _context(True, level=level)
        minidl.set_seed(0)
        net = _net((3, 6, 2))
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        for _ in range(2):
            step(Tensor(np.ones((2, 3))), Tensor(np.zeros((2, 2))))
        whole = {name: _whole(p) for name, p in net.parameters_and_names()}
        with mp.summon_full_params(net):
            # rank 0 alone: no collective may run in here
            out = net(Tensor(np.ones((1, 3)))).asnumpy() if mp.get_rank() == 0 else None
            inside = {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}
            net.trainable_params()[0].data[...] = 0.5  # a change made inside the block is kept
        return whole, inside, out, net.trainable_params()[0].placement, _whole(net.trainable_params()[0])

    results = run_threads(2, rank_body)
    for whole, inside, _, placement, first in results:
        for name in whole:
            np.testing.assert_array_equal(inside[name], whole[name])
        assert isinstance(placement, OptimizerSlice)
        np.testing.assert_array_equal(first, 0.5)
    assert results[0][2].shape == (1, 2)


def test_a_resume_at_the_same_world_size_is_bit_identical(tmp_path):
    want_params, want_state = run_threads(2, lambda: _model_run(None))[0]
    run_threads(2, lambda: _model_run(tmp_path / "ckpt", n_steps_stop=3))
    path = latest_checkpoint(str(tmp_path / "ckpt"), prefix="net")
    for params, state in run_threads(2, lambda: _model_run(None, resume=path)):
        for name in want_params:
            np.testing.assert_array_equal(params[name], want_params[name], err_msg=name)
        for name in want_state:
            np.testing.assert_array_equal(state[name], want_state[name], err_msg=name)


# ---- what the mutation run (tools/mutation.py optimizer_parallel) found untested -----------------

WHO = "set_auto_parallel_context: parallel_optimizer_config"


def test_config_names_each_bad_value_and_keeps_its_types():
    def rank_body():
        with pytest.raises(TypeError) as raised:
            mp.set_auto_parallel_context(parallel_optimizer_config="level2")
        assert str(raised.value) == (f"{WHO} must be a dict with keys from ('gradient_accumulation_shard', "
                                     f"'parallel_optimizer_threshold', 'optimizer_weight_shard_size', "
                                     f"'optimizer_level'), got str 'level2'")
        with pytest.raises(TypeError) as raised:
            mp.set_auto_parallel_context(parallel_optimizer_config={"gradient_accumulation_shard": "yes"})
        assert str(raised.value) == f"{WHO}['gradient_accumulation_shard'] must be True or False, got 'yes'"
        with pytest.raises(ValueError) as raised:
            mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level4"})
        assert str(raised.value) == (f"{WHO}['optimizer_level'] must be one of ('level1', 'level2', 'level3'), "
                                     f"got 'level4'")
        for bad in (True, 1.5):  # a bool is not an int here, nor is a float
            with pytest.raises(ValueError, match=re.escape(f"must be an int >= 0 (KB), got {bad!r}")):
                mp.set_auto_parallel_context(parallel_optimizer_config={"parallel_optimizer_threshold": bad})
            with pytest.raises(ValueError, match=re.escape(f"or an int >= 1, got {bad!r}")):
                mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_weight_shard_size": bad})
        # 1 is a shard size (a group of one), and False stays False
        mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_weight_shard_size": 1,
                                                                "gradient_accumulation_shard": False})
        assert mp.get_auto_parallel_context("parallel_optimizer_config")["gradient_accumulation_shard"] is False
        mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": "level3"})
        assert mp.get_auto_parallel_context("parallel_optimizer_config") == {
            "gradient_accumulation_shard": False, "parallel_optimizer_threshold": 64,
            "optimizer_weight_shard_size": 1, "optimizer_level": "level3"}

    run_threads(1, rank_body)


def test_float32_parameters_count_four_bytes_and_keep_their_dtype():
    # Three ranks (16 rows: 6, 6 and 4, padded on the wire), a threshold of 1 KB: a float32 (16, 16)
    # weight is 1024 B, exactly the threshold: sliced; a float32 (8, 16) is 512 B: whole; the float64
    # (16, 8) is 1024 B: sliced; the biases stay whole. The reduce-scatter runs per dtype.
    f32 = minidl.float32
    sliced = _compare(3, (16, 16, 8, 16), "adam", level="level2", threshold=1, dtypes=(f32, f32, F64))
    for params, state, layouts in sliced:
        assert {name for name, s in layouts.items() if s is not None} == {"0.weight", "5.weight"}  # (4: the cast)
        assert params["0.weight"].dtype == np.float32 and state["moment1.0.weight"].dtype == np.float32
        assert params["5.weight"].dtype == np.float64


@pytest.mark.parametrize("level", ["level1", "level2"])
@pytest.mark.parametrize("reduction", [{"gradients_mean": False}, {"gradient_predivide_factor": 2.0},
                                       {"gradient_predivide_factor": 4.0}, {"gradient_compression": "fp16"}],
                         ids=["sum", "predivide2", "predivide4", "fp16"])
def test_each_reduction_option_equals_plain_data_parallel_with_it(level, reduction):
    # first dimensions 7 and 5 over 2 ranks: the last rank's rows are fewer, padded on the wire
    _compare(2, (3, 7, 5, 2), "momentum", level=level, **reduction)


def _one_step_from(x, y, threshold, layers=(16, 8, 16)):
    """Every rank's parameters before and after one level2 step with fp16 compression on (x, y)
    (rank 0's rows of x and y; rank 1's are ordinary)."""
    def rank_body():
        _context(True, level="level2", threshold=threshold, gradient_compression="fp16")
        minidl.set_seed(0)
        net = _net(layers)
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        before = {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}
        rows = (x, y) if mp.get_rank() == 0 else (np.full_like(x, 0.1), np.zeros_like(y))
        step(*map(Tensor, rows))
        return before, {name: _whole(p) for name, p in net.parameters_and_names()}

    return run_threads(2, rank_body)


@pytest.mark.filterwarnings("ignore:TrainOneStepCell. the reduced gradients hold inf")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # (NumPy's, on the inf and the casts)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("where", ["whole", "sliced", "both"])
def test_an_overflow_in_whole_or_sliced_gradients_skips_the_step_on_every_rank(where):
    # Labels of 1e7 make the biases' gradients overflow float16 (the weights', scaled by inputs of
    # 1e-4, stay in range): at a threshold of 1 KB the biases are whole (the plain reducer's),
    # the weights (1024 B) sliced; at 0 every parameter is sliced. An inf input makes every
    # gradient NaN, whole and sliced, on every rank's rows.
    x, y = np.full((2, 16), 1e-4), np.full((2, 16), 1e7)
    if where == "both":
        x[0, 0] = np.inf
    for before, after in _one_step_from(x, y, threshold=0 if where == "sliced" else 1):
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)


@pytest.mark.filterwarnings("ignore:TrainOneStepCell. the reduced gradients hold inf")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_an_overflow_in_one_dtypes_slices_skips_the_step_though_another_dtypes_are_finite():
    # No activation: inputs of 1e30 give the float32 layer a weight gradient of about 1e60 (inf in
    # float32), while the float64 layer's stay finite. The predivide factor makes the reducer check.
    def rank_body():
        _context(True, level="level2", gradient_predivide_factor=2.0)
        minidl.set_seed(0)
        net = nn.SequentialCell(nn.Dense(4, 4, dtype=minidl.float32), _Cast(F64), nn.Dense(4, 2, dtype=F64))
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        before = {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}
        scale = 1e30 if mp.get_rank() == 0 else 1.0
        step(Tensor(np.full((2, 4), scale, dtype=np.float32)), Tensor(np.zeros((2, 2))))
        return before, {name: _whole(p) for name, p in net.parameters_and_names()}

    for before, after in run_threads(2, rank_body):
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)


@pytest.mark.parametrize("setting, values", [
    ("gradients_mean", (True, False)), ("optimizer_level", ("level1", "level3")),
    ("parallel_optimizer_threshold", (0, 1)), ("optimizer_weight_shard_size", (-1, 2)),
    ("gradient_accumulation_shard", (True, False)), ("grad_accumulation_step", (1, 2))])
def test_ranks_configured_differently_raise_on_every_rank_naming_the_setting(setting, values):
    def rank_body():
        value = values[mp.get_rank()]
        config = {"optimizer_level": "level2", "parallel_optimizer_threshold": 0}
        more = {}
        if setting in ("gradients_mean", "grad_accumulation_step"):
            more[setting] = value
        else:
            config[setting] = value
        if setting == "gradient_accumulation_shard":  # (level2 turns it on: turned off afterwards)
            del config[setting]
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, enable_parallel_optimizer=True,
                                     parallel_optimizer_config=config, **more)
        if setting == "gradient_accumulation_shard":
            mp.set_auto_parallel_context(parallel_optimizer_config={setting: value})
        return _train((3, 4, 2), 0, *_data(0, 2, 4, (3, 4, 2)), "momentum")

    key = {"gradients_mean": "mean", "optimizer_level": "level", "parallel_optimizer_threshold": "threshold_kb",
           "optimizer_weight_shard_size": "shard_size", "gradient_accumulation_shard": "accumulation_shard",
           "grad_accumulation_step": "passes"}[setting]
    with pytest.raises(ValueError, match=rf"^rank \d of 2: OptimizerParallelReducer: .*{key}"):
        run_threads(2, rank_body)


def test_a_single_row_is_sliced_and_a_group_of_one_slices_nothing():
    # 0.weight (1, 3): rank 0 holds its row, rank 1 none
    for rank, (_, _, layouts) in enumerate(_compare(2, (3, 1), "momentum", level="level2")):
        assert layouts["0.weight"].bounds() == ((0, 1) if rank == 0 else (1, 1))
    for n, shard_size in ((1, -1), (2, 1)):
        for _, _, layouts in _compare(n, (3, 4, 2), "momentum", level="level2", shard_size=shard_size):
            assert set(layouts.values()) == {None}


def _allgathered_weights(level):
    """The bytes of weights one step all-gathers, once the first step has sliced them."""
    def rank_body():
        _context(True, level=level)
        minidl.set_seed(0)
        net = _net((3, 6, 4))
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        x, y = Tensor(np.ones((2, 3))), Tensor(np.zeros((2, 4)))
        step(x, y)
        with mp.CommCounter() as counter:
            step(x, y)
        return counter.bytes(kind="allgather", phase="weights")

    return run_threads(2, rank_body)


def test_level3_gathers_every_sliced_weight_for_forward_and_again_for_backward():
    once = _allgathered_weights("level1")
    assert all(b > 0 for b in once)
    assert _allgathered_weights("level3") == [2 * b for b in once]


class _Scaled(nn.Cell):
    """A cell without parameters of its own, called with a keyword argument."""

    def __init__(self):
        super().__init__()
        self.dense = nn.Dense(3, 2, dtype=F64)

    def construct(self, x, scale=1.0):
        return self.dense(x) * scale


class _CallsWithKeywords(nn.Cell):
    def __init__(self):
        super().__init__()
        self.inner = _Scaled()
        self.unused = minidl.Parameter(Tensor(np.ones((4, 3))), name="unused")  # gets no gradient

    def construct(self, x):
        return self.inner(x, scale=3.0)


@pytest.mark.parametrize("level", ["level2", "level3"])
def test_keyword_arguments_and_a_parameter_without_gradient(level):
    # (at level3 the unused weight is its rows when value_and_grad makes its zero gradient: the
    # reducer once refused that gradient's shape)
    xs, ys = _data(0, 3, 4, (3, 2))

    def body(on):
        def rank_body():
            _context(on, level=level)
            minidl.set_seed(0)
            net = _CallsWithKeywords()
            opt = nn.Momentum(net.trainable_params(), 0.1, 0.9)
            step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), opt)
            rank = mp.get_rank()
            for x, y in zip(xs, ys):
                step(Tensor(x[2 * rank:2 * rank + 2]), Tensor(y[2 * rank:2 * rank + 2]))
            return {name: _whole(p) for name, p in net.parameters_and_names()}
        return rank_body

    for want, got in zip(run_threads(2, body(False)), run_threads(2, body(True))):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_uneven_inputs_refuse_gradient_accumulation():
    with pytest.raises(RuntimeError, match=r"^rank \d of 2: OptimizerParallelReducer: backward_passes_per_step=2 "
                                           r"inside a join block is not supported: a finished rank cannot tell which "
                                           r"calls its peers reduce"):
        run_threads(2, lambda: _uneven_run(True, "level2", grad_accumulation_step=2))


def test_uneven_inputs_with_every_parameter_under_the_threshold():
    # Nothing sliced, so no gather of weights: each step's vote comes at the reduction.
    plain = run_threads(2, _uneven_run, False, "level2")
    whole = run_threads(2, lambda: _uneven_run(True, "level2", threshold=64))
    for (want, _), (got, _) in zip(plain, whole):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("level", ["level1", "level2"])
def test_parameter_broadcast_starts_every_rank_from_rank_0s_weights(level):
    xs, ys = _data(0, 2, 4, (3, 5, 2))

    def body(on):
        def rank_body():
            _context(on, level=level, parameter_broadcast=True)
            minidl.set_seed(10 + mp.get_rank())  # every rank initialises differently
            net = _net((3, 5, 2))
            step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Adam(net.trainable_params(), 0.01))
            rank = mp.get_rank()
            for x, y in zip(xs, ys):
                step(Tensor(x[2 * rank:2 * rank + 2]), Tensor(y[2 * rank:2 * rank + 2]))
            return {name: _whole(p) for name, p in net.parameters_and_names()}
        return rank_body

    for want, got in zip(run_threads(2, body(False)), run_threads(2, body(True))):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_level2_reports_its_reduce_scatter_and_the_replicas_all_reduce():
    # four ranks in shard groups of 2: 0.weight (5, 3) and 0.bias (5,) in rows of 3, 2.weight (2, 5)
    # and 2.bias (2,) in rows of 1; each rank reduce-scatters (2 x 14) float64 in its group, then
    # all-reduces its 14 values with the other group's rank holding the same rows
    def rank_body():
        _context(True, level="level2", shard_size=2)
        minidl.set_seed(0)
        net = _net((3, 5, 2))
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        x, y = Tensor(np.ones((2, 3))), Tensor(np.zeros((2, 2)))
        step(x, y)
        with mp.CommCounter() as counter:
            step(x, y)
        return [(e.kind, e.group_size, e.bytes_per_rank) for e in counter.events if e.phase == "gradients"]

    width = 3 * 3 + 3 + 1 * 5 + 1
    for events in run_threads(4, rank_body):
        assert events == [("reduce_scatter", 2, 2 * width * 8 // 2), ("allreduce", 2, 2 * width * 8 // 2)]


def test_an_optimizer_slice_reads_as_its_rows():
    s = OptimizerSlice((7, 3), 4, 2, 1)
    assert s.block == (7, 3) and s.bounds() == (4, 7) and s.bounds(0) == (0, 4)
    assert str(s) == "optimizer slice 1 of 2: rows [4:7) of (7, 3)"
    inner = OptimizerSlice((12, 10), 6, 2, 0, inner="S(1)", block=(12, 5))
    assert str(inner) == "optimizer slice 0 of 2: rows [0:6) of block (12, 5) (S(1)) of (12, 10)"


def test_optimizer_state_of_another_shape_than_its_parameter_is_refused():
    param = minidl.Parameter(Tensor(np.zeros((7, 3))), name="w")
    param.placement = OptimizerSlice((7, 3), 4, 2, 1)
    state = minidl.Parameter(Tensor(np.zeros((5, 3))), name="moment1.w")
    with pytest.raises(ValueError) as raised:
        slices.follow(param, state, 1)
    assert str(raised.value) == ("optimizer state 'moment1.w' has shape (5, 3), but its parameter 'w' is optimizer "
                                 "slice 1 of 2: rows [4:7) of (7, 3)")


# ---- the reducer called directly: an explicit communicator, its argument errors, its broadcast --------

def _direct_reducer(params, level, comm=None, threshold=1, **options):
    config = {"optimizer_level": level, "parallel_optimizer_threshold": threshold, "optimizer_weight_shard_size": -1,
              "gradient_accumulation_shard": level == "level2"}
    return OptimizerParallelReducer(params, config, comm=comm, **options)


def _pair_of(world):
    """This rank's group of two: world ranks {0, 1} or {2, 3}, split from ``world``."""
    first = world.rank - world.rank % 2
    return world.split([first, first + 1])


@pytest.mark.parametrize("level", ["level1", "level2"])
def test_an_explicit_communicator_reduces_over_that_group_alone(level):
    # Four ranks in pairs, each pair's reducer given its pair's communicator: a (16, 16) float64 weight
    # (2 KB, sliced at 1 KB) and two small biases (whole, the plain reducer's, in buckets of fusion_bytes)
    # are the mean over the pair, not over the world. Each rank's gradients are its world rank + 1 times
    # a fixed pattern, so the pairs' means differ (1.5x and 3.5x the pattern).
    pattern = np.random.default_rng(0).standard_normal(16 * 16 + 3 + 5)

    def rank_body(fusion_bytes):
        world = mp.get_communicator()
        pair = _pair_of(world)
        params = [minidl.Parameter(Tensor(np.zeros((16, 16))), name="w"),
                  minidl.Parameter(Tensor(np.zeros(3)), name="b"), minidl.Parameter(Tensor(np.zeros(5)), name="c")]
        reducer = _direct_reducer(params, level, comm=pair, fusion_bytes=fusion_bytes)
        g = (world.rank + 1) * pattern
        grads = (g[:256].reshape(16, 16), g[256:259], g[259:])
        with mp.CommCounter() as counter:
            out = reducer(grads)
        events = [(e.kind, e.group_size) for e in counter.events if e.phase == "gradients"]
        return pair.rank, out, events

    # by default one bucket holds every whole gradient; in buckets of 40 B, b (24 B), c (40 B) and, at
    # level1, w (2 KB) go apart
    for fusion_bytes, buckets in ((DEFAULT_FUSION_BYTES, 1), (40, 3 if level == "level1" else 2)):
        for world_rank, (pair_rank, out, events) in enumerate(run_threads(4, rank_body, fusion_bytes)):
            mean = (1.5 if world_rank < 2 else 3.5) * pattern
            w, b, c = out
            assert isinstance(w.placement, OptimizerSlice) and w.placement.bounds() == (8 * pair_rank, 8 * pair_rank + 8)
            np.testing.assert_allclose(to_numpy(w.data), mean[:256].reshape(16, 16)[8 * pair_rank:8 * pair_rank + 8],
                                       rtol=1e-15, atol=0)
            np.testing.assert_allclose(to_numpy(b.data), mean[256:259], rtol=1e-15, atol=0)
            np.testing.assert_allclose(to_numpy(c.data), mean[259:], rtol=1e-15, atol=0)
            # every collective over the pair; level2 reduce-scatters the weight
            scattered = [("reduce_scatter", 2)] if level == "level2" else []
            assert sorted(events) == sorted([("allreduce", 2)] * buckets + scattered), events


def test_a_predivide_factor_reaches_the_parameters_kept_whole():
    # A factor of 3 is not exact in floating point: the whole parameter's mean must be the plain
    # reducer's with the same factor, bit for bit (both reduce over the same pair).
    pattern = np.random.default_rng(1).standard_normal((2, 7))

    def rank_body():
        world = mp.get_communicator()
        pair = _pair_of(world)
        g = (world.rank + 0.3) * pattern[world.rank % 2]

        def bias():
            return [minidl.Parameter(Tensor(np.zeros(7)), name="b")]

        got = _direct_reducer(bias(), "level2", comm=pair, gradient_predivide_factor=3.0)((g,))[0]
        want = mp.DistributedGradReducer(bias(), comm=pair, gradient_predivide_factor=3.0)((g,))[0]
        plain = mp.DistributedGradReducer(bias(), comm=pair)((g,))[0]
        return [to_numpy(t.data if isinstance(t, Tensor) else t) for t in (got, want, plain)]

    results = run_threads(4, rank_body)
    for got, want, _ in results:
        np.testing.assert_array_equal(got, want)
    assert any((got != plain).any() for got, _, plain in results)  # (the factor changes the rounding here)


def test_a_direct_call_names_what_is_wrong_with_the_gradients():
    params = [minidl.Parameter(Tensor(np.zeros((4, 2))), name="w"), minidl.Parameter(Tensor(np.zeros(3)), name="b")]
    reducer = _direct_reducer(params, "level2")
    who = "OptimizerParallelReducer"
    for bad, kind in ((Tensor(np.zeros(3)), "Tensor"), (None, "NoneType"), ({"w": 1, "b": 2}, "dict")):
        with pytest.raises(TypeError) as raised:
            reducer(bad)
        assert str(raised.value) == f"{who}: grads must be a tuple aligned with the parameters, got {kind}"
    with pytest.raises(ValueError) as raised:
        reducer((np.zeros((4, 2)),))
    assert str(raised.value) == f"{who}: got 1 gradient(s) for 2 parameter(s)"
    with pytest.raises(ValueError) as raised:
        reducer([np.zeros((4, 2)), np.zeros(2)])
    assert str(raised.value) == f"{who}: gradient 1 of shape (2,) does not match its parameter of shape (3,)"


def test_a_bad_communicator_or_compression_is_named():
    w = minidl.Parameter(Tensor(np.zeros((4, 2))), name="w")
    with pytest.raises(TypeError) as raised:
        _direct_reducer([w], "level2", comm="world")
    assert str(raised.value) == ("OptimizerParallelReducer: group must be a Communicator (or None for the world), "
                                 "got str")
    with pytest.raises(ValueError) as raised:
        _direct_reducer([w], "level2", compression="fp8")
    assert str(raised.value) == ("OptimizerParallelReducer: compression must be Compression.none, .fp16 or .bf16 (or "
                                 "their names), got 'fp8'")


def test_level2_with_every_parameter_sliced_makes_one_collective_per_call():
    # Nothing is kept whole, so there is no plain reducer (and none of its own agreement checks):
    # once planned, each call is the one reduce-scatter.
    def rank_body():
        world = mp.get_communicator()
        params = [minidl.Parameter(Tensor(np.zeros((16, 16))), name="w"),
                  minidl.Parameter(Tensor(np.zeros(5)), name="b")]
        reducer = _direct_reducer(params, "level2", threshold=0)
        reducer.plan()
        counts = []
        for _ in range(2):
            before = world.collective_count
            reducer((np.ones((16, 16)), np.ones(5)))
            counts.append(world.collective_count - before)
        return counts

    assert run_threads(2, rank_body) == [[1, 1], [1, 1]]


def test_broadcast_parameters_sends_the_groups_root_values_to_the_whole_parameters_only():
    # Pairs {0, 1} and {2, 3}: after one reduction the (16, 16) weight is each rank's rows (kept as
    # they are), the bias whole: it gets the pair's root's value (world rank 0 or 2), not rank 0's.
    def rank_body():
        world = mp.get_communicator()
        pair = _pair_of(world)
        w = minidl.Parameter(Tensor(np.zeros((16, 16))), name="w")
        b = minidl.Parameter(Tensor(np.zeros(3)), name="b")
        reducer = _direct_reducer([w, b], "level2", comm=pair)
        reducer((np.ones((16, 16)), np.ones(3)))
        assert slices.is_sliced(w)
        w.data[...] = world.rank
        b.data[...] = world.rank
        reducer.broadcast_parameters([w, b])
        with pytest.raises(ValueError) as raised:
            reducer.broadcast_parameters([b], root=2)  # a rank of the world, not of the pair
        return to_numpy(w.data).copy(), to_numpy(b.data).copy(), str(raised.value)

    for rank, (w, b, message) in enumerate(run_threads(4, rank_body)):
        np.testing.assert_array_equal(w, np.full((8, 16), rank))
        np.testing.assert_array_equal(b, np.full(3, rank - rank % 2))
        assert message == "OptimizerParallelReducer.broadcast_parameters: root must be a rank in [0, 1], got 2"


@pytest.mark.filterwarnings("ignore:TrainOneStepCell. the reduced gradients hold inf")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_an_overflow_in_the_whole_parameters_alone_skips_the_step_on_every_rank():
    # One layer (16, 16): its weight (2 KB) sliced at 1 KB, its bias whole. Labels of 1e7 make the
    # bias's gradient (about -6e5 per rank after the mean's 1/2) overflow float16; the weight's, scaled
    # by inputs of 1e-4, is about -60: finite. Only the plain reducer of the whole bias sees the inf.
    x, y = np.full((2, 16), 1e-4), np.full((2, 16), 1e7)
    for before, after in _one_step_from(x, y, threshold=1, layers=(16, 16)):
        for name in before:
            np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    # (the same step with labels in range updates every parameter)
    for before, after in _one_step_from(x, np.full((2, 16), 1.0), threshold=1, layers=(16, 16)):
        for name in before:
            assert (after[name] != before[name]).any(), name


@pytest.mark.parametrize("level", ["level1", "level2"])
def test_fp16_compression_of_float32_gradients_gives_float32_slices(level):
    # The compressed sum (float16 on the wire) is decompressed into the parameter's dtype, not float64.
    f32 = minidl.float32

    def rank_body():
        _context(True, level=level, gradient_compression="fp16")
        minidl.set_seed(0)
        net = _net((3, 6, 2), (f32, f32))
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9),
                                   return_grad=True)
        x, y = Tensor(np.ones((2, 3), dtype=np.float32)), Tensor(np.zeros((2, 2), dtype=np.float32))
        step(x, y)
        _, grads = step(x, y)
        return {name: (g.dtype, g.placement) for name, g in grads.items()}

    for grads in run_threads(2, rank_body):
        assert {name: dtype for name, (dtype, _) in grads.items()} == dict.fromkeys(grads, f32)
        assert all(isinstance(placement, OptimizerSlice) for _, placement in grads.values())


class _TwoOps(nn.Cell):
    """A dense layer as two ops (MatMul, Add), each reading one of the cell's own weights."""

    def __init__(self, rows, cols):
        super().__init__()
        self.weight = minidl.Parameter(Tensor(np.random.default_rng(rows).standard_normal((rows, cols))))
        self.bias = minidl.Parameter(Tensor(np.zeros(cols)))  # (unnamed: named by their attribute path)
        self.matmul, self.add = minidl.ops.MatMul(), minidl.ops.Add()

    def construct(self, x):
        return self.add(self.matmul(x, self.weight), self.bias)


def test_level3_gathers_each_cells_weights_in_one_all_gather_for_forward_and_one_for_backward():
    # Two cells of two ops each: the cell's context gathers its weight and bias together (one dtype,
    # one group), once for forward and once for the re-run in backward: 2 all-gathers per cell and step.
    def rank_body():
        _context(True, level="level3")
        net = nn.SequentialCell(_TwoOps(3, 6), nn.Tanh(), _TwoOps(6, 4))
        step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.1, 0.9))
        x, y = Tensor(np.ones((2, 3))), Tensor(np.zeros((2, 4)))
        step(x, y)  # the first step slices
        with mp.CommCounter() as counter:
            step(x, y)
        return counter.count(kind="allgather", phase="weights")

    assert run_threads(2, rank_body) == [4, 4]


def test_uneven_inputs_where_a_rank_has_no_data_at_all():
    # Rank 1 has no batch: it only shadows rank 0's steps (its vote and the reduction each step). Every
    # rank ends with the plain data-parallel run's weights.
    def run(zero):
        _context(zero, level="level2")
        rank = mp.get_rank()
        minidl.set_seed(0)
        net = _net((3, 5, 2))
        rng = np.random.default_rng(0)
        rows = 4 if rank == 0 else 0
        ds = NumpySlicesDataset({"x": rng.standard_normal((4, 3))[:rows], "y": rng.standard_normal((4, 2))[:rows]},
                                shuffle=False).batch(2)
        Model(net, nn.MSELoss(), nn.Adam(net.trainable_params(), 0.01)).train(1, ds, progress=False,
                                                                              uneven_inputs=True)
        return {name: _whole(p) for name, p in net.parameters_and_names()}

    plain = run_threads(2, run, False)
    for want, got in zip(plain, run_threads(2, run, True)):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


class _WeightFirst(nn.Cell):
    """A root cell whose own weight is read before any cell below it runs."""

    def __init__(self):
        super().__init__()
        self.w = minidl.Parameter(Tensor(np.random.default_rng(1).standard_normal((6, 6))), name="w")
        self.matmul = minidl.ops.MatMul()
        self.out = nn.Dense(6, 3, dtype=F64)

    def construct(self, x):
        return self.out(self.matmul(x, self.w))


@pytest.mark.parametrize("level", ["level1", "level2"])
def test_the_outermost_call_makes_sliced_weights_whole_before_its_own_ops(level):
    # Between steps each rank holds its rows of w: calling the network (outermost, no wrapper) gathers every
    # sliced weight once, before its first op reads w.
    x, y = _data(0, 2, 4, (6, 3))

    def body(on):
        def rank_body():
            _context(on, level=level)
            minidl.set_seed(0)
            net = _WeightFirst()
            step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()), nn.Momentum(net.trainable_params(), 0.05, 0.9))
            rank = mp.get_rank()
            for xb, yb in zip(x, y):
                step(Tensor(xb[2 * rank:2 * rank + 2]), Tensor(yb[2 * rank:2 * rank + 2]))
            sliced_between_steps = slices.is_sliced(net.w)
            with CommCounter() as counted:
                out = net(Tensor(x[0])).asnumpy()
            return out, sliced_between_steps, counted.count("allgather", phase="weights")
        return rank_body

    for (want, _, _), (got, sliced, gathers) in zip(run_threads(2, body(False)), run_threads(2, body(True))):
        assert sliced
        np.testing.assert_array_equal(got, want)
        assert gathers == 1  # every weight at once (one dtype), not one gather per op that reads one
