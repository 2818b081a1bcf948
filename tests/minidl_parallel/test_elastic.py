"""An elastic world between restarts (minidl_parallel/elastic.py, run.py's --min-np / --max-np /
--host-discovery-script): each attempt runs on the slots the discovery script names, and a restart
with another number of ranks resumes from the layout-independent checkpoint, equal bit for bit to a
run of the new size resumed from the same checkpoint."""
import os
import shutil
import subprocess
import sys
import time
import types

import numpy as np
import pytest

import minidl
import minidl_parallel as mp
from minidl import nn
from minidl.backend import to_numpy
from minidl.runtime import get_runtime
from minidl.dataset import NumpySlicesDataset
from minidl.train import Callback, CheckpointConfig, Model, ModelCheckpoint
from minidl_parallel import elastic, run
from minidl_parallel.elastic import ElasticError, ElasticWorld, parse_hosts

from test_restarts import SCRIPTS, _assert_same_state, _env, _resumed_steps

ROOT = SCRIPTS.parents[1]


def _script(tmp_path, body, name="discover.sh"):
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


# ---- discovery and sizing --------------------------------------------------------------------

def test_hosts_are_read_as_horovods_discovery_scripts_print_them():
    assert parse_hosts("node1:4\n\n  node2:2 \nnode3\n", "d.sh") == [("node1", 4), ("node2", 2), ("node3", 1)]
    assert parse_hosts("", "d.sh") == []
    for text, line in (("node1:0", "line 1 is 'node1:0'"), ("a:2\n:3", "line 2 is ':3'"), ("a:x", "line 1 is 'a:x'")):
        with pytest.raises(ElasticError, match=f"host discovery script d.sh: {line}; expected host:slots with slots "
                                               f"an int >= 1 \\(or a host alone: one slot\\)"):
            parse_hosts(text, "d.sh")


def test_each_attempt_runs_on_the_slots_discovered_then_within_min_and_max(tmp_path):
    slots = tmp_path / "slots"
    script = _script(tmp_path, f'cat "{slots}"\n')
    said = []
    world = ElasticWorld(script, 3, 2, 5, str(tmp_path), said.append)
    slots.write_text("a:4\nb:4\n")
    assert world.attempt(0)[0] == 3  # the first attempt: -n
    n, hostfile = world.attempt(1)  # a restart: as many as the hosts hold, up to --max-np
    assert n == 5 and open(hostfile).read() == "a slots=4\nb slots=4\n" and hostfile == str(tmp_path / "hostfile.1")
    slots.write_text("a:2\n")
    assert world.attempt(2)[0] == 2 and said == []


def test_too_few_slots_are_waited_for_then_refused_naming_them(tmp_path):
    slots = tmp_path / "slots"
    slots.write_text("a:1\nb:1\n")
    said = []
    world = ElasticWorld(_script(tmp_path, f'cat "{slots}"\n'), 3, 3, 3, str(tmp_path), said.append,
                         elastic_timeout=0.3, interval=0.05)
    start = time.monotonic()
    with pytest.raises(ElasticError, match=r"^only 2 slot\(s\) on the discovered hosts \(a:1, b:1\), fewer than "
                                           r"--min-np 3, for 0.3 s \(--elastic-timeout\)$"):
        world.attempt(1)
    assert 0.3 <= time.monotonic() - start < 10
    assert said == ["waiting for hosts: 2 slot(s) discovered, --min-np is 3"]
    slots.write_text("")
    with pytest.raises(ElasticError, match=r"\(none\)"):
        world.attempt(1)


def test_a_host_that_comes_back_ends_the_wait(tmp_path):
    calls = tmp_path / "calls"
    # one slot on the first two calls, then two
    script = _script(tmp_path, f'echo x >> "{calls}"\nif [ $(wc -l < "{calls}") -le 2 ]; then echo a:1; '
                               f'else echo a:2; fi\n')
    said = []
    world = ElasticWorld(script, 2, 2, 2, str(tmp_path), said.append, elastic_timeout=30, interval=0.01)
    assert world.attempt(1)[0] == 2
    assert len(said) == 1 and len(calls.read_text().splitlines()) == 3


def test_a_failing_discovery_script_is_named(tmp_path):
    world = ElasticWorld(_script(tmp_path, 'echo "no inventory" >&2\nexit 3\n'), 2, 1, 2, str(tmp_path), print)
    with pytest.raises(ElasticError, match=r"host discovery script .*discover.sh exited with status 3: no inventory"):
        world.attempt(0)
    world = ElasticWorld(str(tmp_path / "absent.sh"), 2, 1, 2, str(tmp_path), print)
    with pytest.raises(ElasticError, match=r"host discovery script .*absent.sh could not be run: "):
        world.attempt(0)
    script = _script(tmp_path, 'printf "%0501d" 0 >&2\nexit 1\n', "long.sh")  # 501 characters: the last 500 kept
    with pytest.raises(ElasticError) as err:
        ElasticWorld(script, 2, 1, 2, str(tmp_path), print).attempt(0)
    assert str(err.value) == f"host discovery script {script} exited with status 1: " + "0" * 500
    script = _script(tmp_path, 'echo a:2\necho b:x\n', "bad.sh")
    with pytest.raises(ElasticError) as err:
        ElasticWorld(script, 2, 1, 2, str(tmp_path), print).attempt(0)
    assert str(err.value).startswith(f"host discovery script {script}: line 2 is 'b:x'; expected host:slots")


def test_a_discovery_script_that_does_not_finish_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(elastic, "DISCOVERY_TIMEOUT_S", 0.2)
    script = _script(tmp_path, "exec sleep 5\n")  # (exec: no child of the shell keeps its output open)
    start = time.monotonic()
    with pytest.raises(ElasticError) as err:
        ElasticWorld(script, 2, 1, 2, str(tmp_path), print).attempt(0)
    assert str(err.value) == f"host discovery script {script} did not finish within 0.2 s"
    assert time.monotonic() - start < 4


def test_the_wait_for_hosts_asks_every_interval_until_the_elastic_timeout_has_passed(tmp_path, monkeypatch):
    """On a clock that moves only in the waits: asked at 0, 0.5, 1 and 1.5 s, it gives up at 1.5 s, the
    first time more than the 1 s of --elastic-timeout has passed."""
    calls = tmp_path / "calls"
    clock = {"now": 0.0, "waits": []}

    def sleep(seconds):
        clock["waits"].append(seconds)
        clock["now"] += seconds
    monkeypatch.setattr(elastic, "time", types.SimpleNamespace(monotonic=lambda: clock["now"], sleep=sleep))
    world = ElasticWorld(_script(tmp_path, f'echo x >> "{calls}"\necho a:1\n'), 2, 2, 2, str(tmp_path),
                         print, elastic_timeout=1.0, interval=0.5)
    with pytest.raises(ElasticError, match=r"fewer than --min-np 2, for 1 s"):
        world.attempt(1)
    assert clock["waits"] == [0.5, 0.5, 0.5] and len(calls.read_text().splitlines()) == 4


RANGE = "expected 1 <= --min-np <= -n <= --max-np, "


@pytest.mark.parametrize("options, message", [
    (["--min-np", "1"], "--min-np need --host-discovery-script (the hosts each restart may use)"),
    (["--min-np", "1", "--max-np", "3"], "--min-np and --max-np need --host-discovery-script (the hosts each restart "
                                         "may use)"),
    (["--host-discovery-script", "SCRIPT", "--min-np", "3"], RANGE + "got --min-np 3, -n 2, --max-np 2"),
    (["--host-discovery-script", "SCRIPT", "--max-np", "1"], RANGE + "got --min-np 2, -n 2, --max-np 1"),
    (["--host-discovery-script", "SCRIPT", "--min-np", "0"], RANGE + "got --min-np 0, -n 2, --max-np 2"),
    (["--host-discovery-script", "SCRIPT", "--hostfile", "SCRIPT"],
     "--hostfile and --host-discovery-script do not combine: the discovery script names the hosts of each attempt "
     "(the launcher writes their hostfile)"),
    (["--host-discovery-script", "NOTEXEC"], "--host-discovery-script 'NOTEXEC': not an executable file (relative to "
                                             "{cwd})"),
    (["--host-discovery-script", "SCRIPT", "--elastic-timeout", "-1"], "--elastic-timeout must be a number of "
                                                                       "seconds >= 0 (0: no limit), got -1.0"),
])
def test_run_refuses_elastic_options_it_cannot_honour(tmp_path, options, message, capsys):
    script = _script(tmp_path, "echo localhost:2\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("")
    options = [script if o == "SCRIPT" else str(plain) if o == "NOTEXEC" else o for o in options]
    with pytest.raises(SystemExit) as err:
        run.main(["-n", "2", *options, str(SCRIPTS / "train.py")])
    assert err.value.code == 2
    message = message.replace("NOTEXEC", str(plain)).format(cwd=os.getcwd())
    assert capsys.readouterr().err.splitlines()[-1] == f"{run.PROG}: error: {message}"


# ---- resuming in a world of another size (threads) -------------------------------------------

X = np.random.default_rng(4).standard_normal((48, 4)).astype(np.float32)
Y = (X.sum(axis=1) > 0).astype(np.int32)


class _Steps(Callback):
    def __init__(self):
        self.done = []

    def on_train_step_end(self, run_context):
        self.done.append(run_context.original_args().cur_step_num)


def _train(directory, steps=None, crash_after=None, resume_from=None, zero=None, keep_batch="global"):
    """Data-parallel (when several ranks) MLP training with BatchNorm, 4 rows per rank and step, checkpointing
    every step; ``zero``: optimizer parallelism at that level (each rank holds its rows of the weights and
    momenta); ``keep_batch``: Model.train's, for a resume on another number of ranks."""
    size, rank = mp.get_group_size() if mp.is_initialized() else 1, mp.get_rank() if mp.is_initialized() else 0
    if size > 1:
        mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True,
                                     enable_parallel_optimizer=zero is not None)
        if zero is not None:
            mp.set_auto_parallel_context(parallel_optimizer_config={"optimizer_level": zero,
                                                                    "parallel_optimizer_threshold": 0})
    minidl.set_seed(3)
    net = nn.SequentialCell(nn.Dense(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dense(8, 2))
    opt = nn.Momentum(net.trainable_params(), 0.05, 0.9)
    shards = dict(num_shards=size, shard_id=rank) if size > 1 else {}
    ds = NumpySlicesDataset((X, Y), column_names=["x", "y"], shuffle=True, **shards).batch(4)
    callbacks = [ModelCheckpoint("m", str(directory), CheckpointConfig(save_checkpoint_steps=1))]
    callbacks += [steps] if steps is not None else []
    if crash_after is not None:
        callbacks.append(_Crash(crash_after))
    try:
        Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"), opt).train(
            3, ds, callbacks=callbacks, resume_from=resume_from, keep_batch=keep_batch)
    except KeyboardInterrupt:
        return None
    return {name: np.array(to_numpy(get_runtime().full_value(p))) if p.is_sharded else p.asnumpy().copy()
            for name, p in net.parameters_and_names()}  # (whole values: under zero each rank holds its rows)


class _Crash(Callback):
    def __init__(self, step):
        self.step = step

    def on_train_step_end(self, run_context):
        if run_context.original_args().cur_step_num == self.step:
            raise KeyboardInterrupt


@pytest.fixture
def job(monkeypatch):
    monkeypatch.setenv("MINIDL_RUN_ID", "elastic-job")

    def restart(count):
        monkeypatch.setenv("MINIDL_RESTART_COUNT", str(count))
    restart(0)
    return restart


@pytest.mark.parametrize("keep_batch, per_epoch, skipped", [("global", 12, 5), ("per_rank", 6, 2)])
def test_a_restart_with_more_ranks_starts_the_new_ones_from_rank_0s_state(tmp_path, job, keep_batch, per_epoch,
                                                                          skipped):
    """One process (4 rows a step, 12 steps per epoch) fails after step 5; the restart runs 2 ranks: both
    load rank 0's file and end as a 2-rank run resumed from the same checkpoint by resume_from. Keeping the
    global batch, each rank takes 2 rows a step: 12 steps per epoch, 5 skipped; keeping the per-rank batch,
    6 steps per epoch, 5 * 6 // 12 = 2 skipped."""
    _train(tmp_path / "ckpt", crash_after=5)
    job(1)

    def restarted():
        steps = _Steps()
        return _train(tmp_path / "ckpt", steps, keep_batch=keep_batch), steps.done

    def resumed():
        return _train(tmp_path / f"ref{mp.get_rank()}", resume_from=str(tmp_path / "ckpt" / "m-1_5.ckpt"),
                      keep_batch=keep_batch)

    got = mp.run_threads(2, restarted, timeout=120)
    job(0)
    want = mp.run_threads(2, resumed, timeout=120)
    for rank, ((params, done), reference) in enumerate(zip(got, want)):
        assert done[0] == 6 and len(done) == 3 * per_epoch - skipped, rank  # global steps on from 5
        for name, value in params.items():
            np.testing.assert_array_equal(value, reference[name], err_msg=name)


@pytest.mark.parametrize("keep_batch, per_epoch, skipped", [("global", 6, 2), ("per_rank", 12, 4)])
def test_a_restart_with_fewer_ranks_loads_each_ranks_own_file(tmp_path, job, keep_batch, per_epoch, skipped):
    """Two ranks (6 steps per epoch) fail after step 8; one process loads rank 0's file of step 8 (epoch 2,
    step 2) and ends as one process resumed from it: with the global batch kept (8 rows a step) 6 steps
    per epoch, 2 skipped; with the per-rank batch (4 rows) 12 per epoch, 4 skipped."""
    def first():
        _train(tmp_path / "ckpt", crash_after=8)
    mp.run_threads(2, first, timeout=120)
    assert (tmp_path / "ckpt" / "m-2_2_rank1.ckpt").exists()
    job(1)
    steps = _Steps()
    got = _train(tmp_path / "ckpt", steps, keep_batch=keep_batch)
    assert steps.done[0] == 9 and len(steps.done) == 2 * per_epoch - skipped
    job(0)
    want = _train(tmp_path / "ref", resume_from=str(tmp_path / "ckpt" / "m-2_2.ckpt"), keep_batch=keep_batch)
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def _train_f64(directory, crash_after=None, keep_batch="global"):
    """Data-parallel float64 MLP (no BatchNorm: it normalises each rank's batch), 4 rows per rank and step as
    the script says, shuffled, checkpointing every step; the parameters at the end."""
    mp.set_auto_parallel_context(parallel_mode=mp.ParallelMode.DATA_PARALLEL, gradients_mean=True)
    minidl.set_seed(3)
    net = nn.SequentialCell(nn.Dense(4, 8, dtype=minidl.float64), nn.Tanh(), nn.Dense(8, 2, dtype=minidl.float64))
    ds = NumpySlicesDataset((X.astype(np.float64), Y), column_names=["x", "y"], shuffle=True,
                            num_shards=mp.get_group_size(), shard_id=mp.get_rank()).batch(4)
    callbacks = [ModelCheckpoint("m", str(directory), CheckpointConfig(save_checkpoint_steps=1))]
    if crash_after is not None:
        callbacks.append(_Crash(crash_after))
    try:
        Model(net, nn.SoftmaxCrossEntropyWithLogits(sparse=True, reduction="mean"),
              nn.Momentum(net.trainable_params(), 0.1, 0.9)).train(3, ds, callbacks=callbacks, keep_batch=keep_batch)
    except KeyboardInterrupt:
        return None
    return {name: p.asnumpy().copy() for name, p in net.parameters_and_names()}


def test_keeping_the_global_batch_a_shrunk_world_continues_the_uninterrupted_run(tmp_path, job, capsys):
    """Four ranks of 4 rows a step fail after step 4 (of 3 per epoch); two ranks restart with a script
    batch of 4 rows, which Model.train resizes to 8, fail after step 6 and restart again: every later step
    trains on the rows the four ranks would have (shards take every num_shards-th row), so the parameters
    equal the uninterrupted 4-rank run's up to the order of the sums (float64, 1e-12). Keeping the per-rank batch instead (4 rows, 6
    steps per epoch) trains on other steps: far from it, which shows the comparison can fail."""
    def first():
        return _train_f64(tmp_path / "ckpt", crash_after=4)
    mp.run_threads(4, first, timeout=120)
    shutil.copytree(tmp_path / "ckpt", tmp_path / "ckpt_copy")
    want = mp.run_threads(4, lambda: _train_f64(tmp_path / f"whole{mp.get_rank()}"), timeout=120)[0]
    job(1)
    capsys.readouterr()
    mp.run_threads(2, lambda: _train_f64(tmp_path / "ckpt", crash_after=6), timeout=120)
    job(2)  # again on 2 ranks: the checkpoint's batch (8) is not the script's (4), its global batch is kept
    kept = mp.run_threads(2, lambda: _train_f64(tmp_path / "ckpt"), timeout=120)
    said = [line for line in capsys.readouterr().out.splitlines() if "keeping the global batch of 16" in line]
    assert len(said) == 2 and all("8 rows per rank on 2 shard(s), 3 steps per epoch" in line for line in said)
    for params in kept:
        for name, value in params.items():
            np.testing.assert_allclose(value, want[name], rtol=1e-12, atol=1e-14, err_msg=name)
    per_rank = mp.run_threads(2, lambda: _train_f64(tmp_path / "ckpt_copy", keep_batch="per_rank"), timeout=120)
    assert max(np.abs(per_rank[0][name] - want[name]).max() for name in want) > 1e-3


def test_a_global_batch_the_new_world_cannot_split_is_refused_on_every_rank(tmp_path, job):
    """Four ranks of 4 rows (a global batch of 16) fail; three ranks cannot take 16 rows evenly: each
    rank raises, naming the batch, the shards and the other choice, and none hangs."""
    mp.run_threads(4, lambda: _train(tmp_path / "ckpt", crash_after=2), timeout=120)
    job(1)
    errors = []

    def restarted():
        try:
            _train(tmp_path / "ckpt")
        except ValueError as e:
            errors.append(str(e))
    mp.run_threads(3, restarted, timeout=120)
    assert len(errors) == 3
    assert "a global batch of 16 (4 shards of 4), which 3 shards cannot split evenly" in errors[0]
    assert "keep_batch='per_rank' to train 4 rows per rank" in errors[0]


# ---- a real job shrinking from 4 ranks to 2 ----------------------------------------------------

RESNET = ["--epochs", "3", "--num-samples", "64", "--batch-size", "8", "--ckpt-steps", "1"]


@pytest.mark.cpu_only
def test_resnet20_shrinks_from_four_ranks_to_two_and_equals_a_two_rank_run_resumed_from_the_checkpoint(tmp_path):
    discover = _script(tmp_path, f'if [ -f "{tmp_path}/called" ]; then echo localhost:2; else touch '
                                 f'"{tmp_path}/called"; echo localhost:4; fi\n')
    launcher = [sys.executable, "-m", "minidl_parallel.run", "--allow-run-as-root", "--restart-delay", "0"]
    example = [str(SCRIPTS / "with_faults.py"), str(ROOT / "examples" / "resnet_cifar.py"), *RESNET]
    # 2 steps per epoch at 4 ranks: rank 3 killed after step 4, before its checkpoint; step 3's (epoch 2, step 1)
    # wins. At 2 ranks Model.train keeps the global batch of 32 (16 rows per rank): 2 steps per epoch, 1 skipped.
    faults = '[{"step": 4, "rank": 3, "kind": "kill"}]'
    proc = subprocess.run([*launcher, "-n", "4", "--min-np", "2", "--max-np", "4", "--host-discovery-script", discover,
                           "--max-restarts", "1", *example, "--ckpt-dir", "ckpt"], cwd=tmp_path,
                          env=dict(_env(), MINIDL_TEST_FAULTS=faults), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "starting 4 workers" in proc.stderr and "starting 2 workers" in proc.stderr
    assert _resumed_steps(proc) == [3]
    reference = subprocess.run([*launcher, "-n", "2", "--log-dir", "ref_log", *example, "--ckpt-dir", "ref",
                                "--resume-from", str(tmp_path / "ckpt" / "resnet20-2_1.ckpt")], cwd=tmp_path,
                               env=_env(), capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    assert "keeping the global batch of 32" in proc.stdout and "16 rows per rank on 2 shard(s)" in proc.stdout
    got = sorted(n for n in os.listdir(tmp_path / "ckpt") if n.startswith("resnet20_1-3_2"))
    assert got == ["resnet20_1-3_2.ckpt", "resnet20_1-3_2_rank1.ckpt"]
    _assert_same_state([tmp_path / "ckpt" / n for n in got], [tmp_path / "ref" / n.replace("_1-", "-") for n in got])


@pytest.mark.parametrize("zero", ["level1", "level2", "level3"])
def test_optimizer_parallel_slices_are_cut_anew_when_four_ranks_restart_as_two(tmp_path, job, zero):
    """Four ranks (3 steps per epoch) each holding a quarter of every weight and momentum fail after step 4;
    two ranks restart from the whole tensors ModelCheckpoint gathered, cut them in halves, and end as two
    ranks resumed from that checkpoint by resume_from."""
    def first():
        _train(tmp_path / "ckpt", crash_after=4, zero=zero)
    mp.run_threads(4, first, timeout=120)
    job(1)

    def restarted():
        return _train(tmp_path / "ckpt", zero=zero)
    got = mp.run_threads(2, restarted, timeout=120)
    job(0)

    def resumed():
        return _train(tmp_path / f"ref{mp.get_rank()}", resume_from=str(tmp_path / "ckpt" / "m-2_1.ckpt"), zero=zero)
    want = mp.run_threads(2, resumed, timeout=120)
    for params, reference in zip(got, want):
        for name, value in params.items():
            np.testing.assert_array_equal(value, reference[name], err_msg=name)
