"""The README's main example runs as a newcomer would run it (shortened); the GPT example on one process,
thread ranks, mpirun and python -m minidl_parallel.run."""
import functools
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import minidl
from minidl_parallel import run_threads

from cifar_files import write_cifar_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The checkout itself, so the examples import this minidl whether or not it is pip-installed.
ENV = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def test_resnet_cifar_example_runs_and_learns(tmp_path):
    log = tmp_path / "log.jsonl"
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--epochs", "2", "--num-samples", "128",
                          "--batch-size", "16", "--device", "CPU", "--log-file", str(log)], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "synthetic" in lines[0]
    losses = [float(l.split("loss is ")[1]) for l in lines if "loss is" in l]
    assert len(losses) >= 4
    assert losses[-1] < losses[0]
    assert sum("train accuracy:" in l for l in lines) == 1
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 17))  # 128 / 16 = 8 steps, 2 epochs


def test_example_rejects_bad_arguments():
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--batch-size", "0"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--batch-size must be positive" in out.stderr


def test_resnet_cifar_example_reads_cifar_binaries(tmp_path):
    data = tmp_path / "cifar-10-batches-bin"
    write_cifar_batches(data, records_per_file=16)
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--data-path", str(data), "--epochs", "1",
                          "--batch-size", "16", "--device", "CPU", "--ckpt-dir", str(tmp_path / "ckpt")],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "training resnet20 on CIFAR-10 from" in out.stdout.splitlines()[0]
    assert "5 steps per epoch" in out.stdout  # 5 files x 16 records / batch 16
    assert "accuracy" in out.stdout  # the test batch was evaluated
    assert list((tmp_path / "ckpt").glob("resnet20-1_5.ckpt"))


def test_example_reports_a_missing_data_path(tmp_path):
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--data-path", str(tmp_path / "nope")],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "nope" in out.stderr


@pytest.mark.cpu_only  # a fresh process: it would look for the machine's own CuPy, not the device double
def test_gpt_char_example_learns_and_samples():
    out = subprocess.run([sys.executable, "examples/gpt_char.py", "--steps", "40", "--eval-every", "20",
                          "--sample", "20"], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    train = [float(l.split("train loss ")[1].split()[0]) for l in out.stdout.splitlines() if "train loss" in l]
    assert len(train) == 3 and train[-1] < train[0] - 0.5  # from ln(56) = 4.0 towards the text's statistics
    sample = out.stdout.split("--- sample ---\n")[1]
    assert sample.startswith("From fairest cre") and len(sample) == 16 + 20 + 1  # prompt, sample, print's newline


# ---- examples/gpt_char.py: data parallel, --recompute, --loss-scale ------------------------------------------

GPT_TINY = ["--steps", "3", "--eval-every", "1", "--sample", "0", "--layers", "1", "--embd", "16", "--heads", "2",
            "--block", "8"]
# float32: each rank averages its half of the tokens and the halves' means are averaged, where one process
# averages all at once (a reordered sum, ~1e-7 relative). AdamWeightDecay turns gradients that are zero up to
# rounding (the attention's key bias: softmax ignores it) into steps of lr * |g| / eps ~ 1e-7 whatever their
# sign, hence an absolute bound on parameters of scale 0.02 to 1 (measured: 2.3e-7 after 3 steps).
GPT_PARAM_ATOL = 1e-6
GPT_LOSS_RTOL = 1e-6


def _gpt_char():
    """examples/gpt_char.py as a module, so its main(argv) runs in this process (and in run_threads)."""
    spec = importlib.util.spec_from_file_location("gpt_char_example", os.path.join(ROOT, "examples", "gpt_char.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _assert_same_params(got, ref):
    assert sorted(got) == sorted(ref)
    for name in ref:
        np.testing.assert_allclose(got[name], ref[name], rtol=0, atol=GPT_PARAM_ATOL, err_msg=name)


def test_gpt_char_data_parallel_on_two_thread_ranks_equals_one_process_on_the_global_batch():
    gpt_char = _gpt_char()
    one = gpt_char.main(GPT_TINY + ["--batch", "4"])
    ranks = run_threads(2, gpt_char.main, GPT_TINY + ["--batch", "2"])
    for rank in ranks:  # every rank prints (rank 0) and holds the global batch's losses and parameters
        assert sorted(rank["losses"]) == [1, 2, 3]
        for step, (train, val) in one["losses"].items():
            assert rank["losses"][step] == pytest.approx((train, val), rel=GPT_LOSS_RTOL)
        _assert_same_params(rank["params"], one["params"])
    # The bound tells batches apart: one process on a rank's half of the windows ends elsewhere.
    half = gpt_char.main(GPT_TINY + ["--batch", "2"])
    assert max(np.abs(half["params"][n] - one["params"][n]).max() for n in one["params"]) > 100 * GPT_PARAM_ATOL


def test_gpt_char_recompute_and_loss_scaling_change_nothing_bit_for_bit():
    gpt_char = _gpt_char()
    plain = gpt_char.main(GPT_TINY + ["--batch", "4"])
    for extra in (["--recompute"], ["--loss-scale", "dynamic"], ["--loss-scale", "fixed", "--recompute"]):
        run = gpt_char.main(GPT_TINY + ["--batch", "4"] + extra)
        assert run["losses"] == plain["losses"], extra
        for name, value in plain["params"].items():
            assert np.array_equal(run["params"][name], value), (extra, name)


def test_gpt_char_zero_levels_equal_plain_data_parallel_bit_for_bit():
    gpt_char = _gpt_char()
    tiny = GPT_TINY + ["--batch", "2"]
    plain = run_threads(2, gpt_char.main, tiny)
    for level in ("level1", "level2", "level3"):
        # (the default threshold, 64 KB, would keep every parameter of the tiny model whole)
        for want, got in zip(plain, run_threads(2, gpt_char.main, tiny + ["--zero", level, "--zero-threshold", "0"])):
            assert got["losses"] == want["losses"], level
            for name, value in want["params"].items():
                assert np.array_equal(got["params"][name], value), (level, name)


def test_gpt_char_amp_o2_stays_near_float32():
    gpt_char = _gpt_char()
    plain = gpt_char.main(GPT_TINY + ["--batch", "4"])
    # (a fixed scale: the dynamic one starts at 2**24, and its first steps overflow and are skipped)
    cast = gpt_char.main(GPT_TINY + ["--batch", "4", "--amp", "O2", "--loss-scale", "fixed"])
    for step, (train, val) in plain["losses"].items():
        assert cast["losses"][step] == pytest.approx((train, val), rel=0.05)
    assert all(value.dtype == np.float32 for value in cast["params"].values())  # float32 master weights


def test_gpt_char_rejects_bad_arguments():
    out = subprocess.run([sys.executable, "examples/gpt_char.py", "--batch", "0"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--batch must be positive, got 0" in out.stderr


def _mpirun_gpt(tmp_path, launcher):
    """examples/gpt_char.py on 2 ranks started by ``launcher`` (mpirun or python -m minidl_parallel.run)."""
    if launcher == "mpirun":
        sys.path.insert(0, os.path.join(ROOT, "tests", "minidl_parallel"))  # as test_mpirun_example_log.py
        from test_mpirun_training import mpirun  # its skips, root variables and one BLAS thread per rank
        save = tmp_path / "mpirun.safetensors"
        return mpirun(2, "examples/gpt_char.py", *GPT_TINY, "--batch", "2", "--sample", "5", "--recompute",
                      "--loss-scale", "dynamic", "--zero", "level3", "--zero-threshold", "0", "--save", save,
                      timeout=120), save
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'minidl[mpi]')")
    save = tmp_path / "run.safetensors"
    env = {k: v for k, v in ENV.items() if k not in ("MINIDL_DIST_DEBUG", "MINIDL_DEVICE")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "minidl_parallel.run", "-n", "2", "--allow-run-as-root", "--timeout", "110",
           "--log-dir", str(tmp_path / "logs"), "examples/gpt_char.py", *GPT_TINY, "--batch", "2", "--sample", "5",
           "--zero", "level2", "--zero-threshold", "0", "--save", str(save)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120), save


@pytest.mark.cpu_only  # fresh processes: they would import the machine's own CuPy, not the device double
@pytest.mark.parametrize("launcher", ["mpirun", "minidl_parallel.run"])
def test_gpt_char_under_a_launcher_trains_data_parallel_as_one_process(tmp_path, launcher):
    # (with optimizer parallelism: level3 under mpirun, level2 under the launcher; the checkpoint is whole)
    proc, save = _mpirun_gpt(tmp_path, launcher)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # rank 0 alone prints: each line once
    assert out.count("data parallel on 2 ranks: batch 2 per rank, global batch 4") == 1
    assert out.count("train loss") == 3 and out.count("--- sample ---") == 1 and "[rank" not in out
    if launcher == "mpirun":
        assert out.count("loss scale 1.67772e+07, 0 of 3 steps skipped (overflow)") == 1
    one = _gpt_char().main(GPT_TINY + ["--batch", "4"])
    printed = [float(l.split("train loss ")[1].split()[0]) for l in out.splitlines() if "train loss" in l]
    assert printed == [round(one["losses"][step][0], 3) for step in (1, 2, 3)]
    saved = {name: p.asnumpy() for name, p in minidl.load_checkpoint(str(save)).items()}
    _assert_same_params(saved, one["params"])


# ---- the examples cut into pipeline stages (--pipeline P, --micro-batches M, --schedule) ---------------------

# Two blocks, so that --pipeline 2 has one per stage; the head is tied to the embedding (stages 0 and 1 share it).
GPT_TINY_2 = GPT_TINY[:GPT_TINY.index("--layers")] + ["--layers", "2"] + GPT_TINY[GPT_TINY.index("--layers") + 2:]
# A printed loss has 3 decimals: one equal up to float32 rounding prints within half a unit of the last one.
PRINTED_ATOL = 5e-4 + 1e-6


def _printed_losses(out, marker):
    return [float(line.split(marker)[1].split()[0].rstrip(",")) for line in out.splitlines() if marker in line]


def test_gpt_char_pipeline_on_two_thread_ranks_equals_its_micro_batches_on_one_process():
    gpt_char = _gpt_char()
    plain = gpt_char.main(GPT_TINY_2 + ["--batch", "4"])
    micro = gpt_char.main(GPT_TINY_2 + ["--batch", "4", "--micro-batches", "2"])
    ranks = run_threads(2, gpt_char.main, GPT_TINY_2 + ["--batch", "4", "--pipeline", "2"])
    # The micro-batches' mean loss is the batch's: the same training as without them, up to float32 rounding.
    for step, (train, val) in plain["losses"].items():
        assert micro["losses"][step] == pytest.approx((train, val), rel=GPT_LOSS_RTOL)
    _assert_same_params(micro["params"], plain["params"])
    # Every stage prints (rank 0) and ends with the same losses and, gathered from the stages, the whole model.
    # (Not bit for bit: the tied table's gradient adds the embedding's and the head's parts in another order.)
    for rank in ranks:
        assert sorted(rank["losses"]) == [1, 2, 3]
        for step, (train, val) in micro["losses"].items():
            assert rank["losses"][step] == pytest.approx((train, val), rel=GPT_LOSS_RTOL)
        _assert_same_params(rank["params"], micro["params"])
    # --recompute re-runs each block of a stage in its backward: the same numbers, bit for bit.
    recomputed = run_threads(2, gpt_char.main, GPT_TINY_2 + ["--batch", "4", "--pipeline", "2", "--recompute"])
    for want, got in zip(ranks, recomputed):
        assert got["losses"] == want["losses"]
        for name, value in want["params"].items():
            assert np.array_equal(got["params"][name], value), name


def test_gpt_char_pipeline_with_mixed_precision_and_a_loss_scale_trains_as_its_micro_batches_on_one_process():
    """--amp O2 --loss-scale fixed: the tied head's float16 cast of the table is shared by the two stages.
    The table's float32 gradient adds the stages' parts in another order. Adam turns gradients that are pure
    float16 rounding noise (a key bias's, zero in exact arithmetic) into whole steps, so the weights are not
    compared; the losses agree within float16's precision (2**-10). The exact proof, in float64, is
    test_pipeline_amp.py's tied head under O2."""
    gpt_char = _gpt_char()
    flags = GPT_TINY_2 + ["--batch", "4", "--amp", "O2", "--loss-scale", "fixed"]
    micro = gpt_char.main(flags + ["--micro-batches", "2"])
    for rank in run_threads(2, gpt_char.main, flags + ["--pipeline", "2"]):
        for step, (train, val) in micro["losses"].items():
            assert rank["losses"][step] == pytest.approx((train, val), rel=2 ** -10)
        assert sorted(rank["params"]) == sorted(micro["params"])


@pytest.mark.parametrize("argv, message", [
    (["--pipeline", "2", "--zero", "level1"], "--pipeline 2 --micro-batches 2 does not combine with --zero"),
    (["--micro-batches", "2", "--zero", "level2"], "--pipeline 1 --micro-batches 2 does not combine with --zero"),
    (["--pipeline", "2", "--parallel", "none"], "does not combine with --parallel none"),
    (["--pipeline", "4", "--micro-batches", "2"], "--micro-batches must be >= --pipeline (4), as MindSpore's"),
    (["--batch", "6", "--micro-batches", "4"], "--batch 6 must be a multiple of --micro-batches 4"),
    (["--pipeline", "3", "--layers", "2", "--batch", "6"], "--pipeline 3 needs at least as many --layers (blocks to cut), got 2"),
    (["--pipeline", "0"], "--pipeline must be positive, got 0"),
])
def test_gpt_char_refuses_pipeline_combinations_when_parsing(capsys, argv, message):
    with pytest.raises(SystemExit):
        _gpt_char().parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.cpu_only  # a fresh process: it would look for the machine's own CuPy, not the device double
def test_gpt_char_pipeline_alone_says_how_to_launch_it():
    out = subprocess.run([sys.executable, "examples/gpt_char.py", *GPT_TINY_2, "--pipeline", "2"], cwd=ROOT, env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--pipeline 2 needs 2 x D processes, one per stage and replica: launch with mpirun -n 2" in out.stderr


def _launch(tmp_path, launcher, n, script, *argv):
    """``script`` on n ranks started by ``launcher`` (mpirun or python -m minidl_parallel.run)."""
    if launcher == "mpirun":
        sys.path.insert(0, os.path.join(ROOT, "tests", "minidl_parallel"))  # as test_mpirun_example_log.py
        from test_mpirun_training import mpirun  # its skips, root variables and one BLAS thread per rank
        return mpirun(n, script, *argv, timeout=120)
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (pip install 'minidl[mpi]')")
    env = {k: v for k, v in ENV.items() if k not in ("MINIDL_DIST_DEBUG", "MINIDL_DEVICE")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "minidl_parallel.run", "-n", str(n), "--allow-run-as-root", "--timeout", "110",
           "--log-dir", str(tmp_path / "logs"), script, *map(str, argv)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.cpu_only  # fresh processes: they would import the machine's own CuPy, not the device double
@pytest.mark.parametrize("launcher, n", [("mpirun", 2), ("minidl_parallel.run", 2), ("mpirun", 4)])
def test_gpt_char_pipeline_under_a_launcher_trains_as_one_process(tmp_path, launcher, n):
    # 2 stages (x 2 data-parallel replicas at n = 4, each --batch 2 of the global 4), both schedules.
    batch, schedule = ("4", "1f1b") if n == 2 else ("2", "gpipe")
    save = tmp_path / "pipeline.safetensors"
    proc = _launch(tmp_path, launcher, n, "examples/gpt_char.py", *GPT_TINY_2, "--batch", batch, "--pipeline", "2",
                   "--schedule", schedule, "--sample", "5", "--save", save)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    replicas = n // 2
    assert out.count(f"pipeline of 2 stages x {replicas} data-parallel replicas on {n} ranks: batch {batch} per "
                     f"replica, global batch 4, 2 micro-batches of {int(batch) // 2}") == 1
    assert out.count(str(_launched_schedule(schedule))) == 1  # rank 0 alone prints: each line once
    assert out.count("train loss") == 3 and out.count("--- sample ---") == 1 and "[rank" not in out
    one = _gpt_char().main(GPT_TINY_2 + ["--batch", "4", "--micro-batches", "2"])
    assert _printed_losses(out, "train loss ") == pytest.approx([one["losses"][s][0] for s in (1, 2, 3)],
                                                                abs=PRINTED_ATOL)
    assert _printed_losses(out, "held-out loss ") == pytest.approx([one["losses"][s][1] for s in (1, 2, 3)],
                                                                   abs=PRINTED_ATOL)
    # The checkpoint rank 0 wrote holds every stage's trained parameters, gathered at the end.
    saved = {name: p.asnumpy() for name, p in minidl.load_checkpoint(str(save)).items()}
    _assert_same_params(saved, one["params"])


def _launched_schedule(scheduler):
    from minidl_parallel import pipeline_schedule
    return pipeline_schedule(2, 2, scheduler)


RESNET_TINY = ["--epochs", "1", "--num-samples", "64", "--batch-size", "16", "--device", "CPU"]


@functools.lru_cache(maxsize=1)
def _resnet_on_one_process_in_micro_batches():
    """The ResNet example on one process with --micro-batches 2 (run once for both launchers)."""
    one = subprocess.run([sys.executable, "examples/resnet_cifar.py", *RESNET_TINY, "--micro-batches", "2"], cwd=ROOT,
                         env=ENV, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    return one


@pytest.mark.cpu_only  # fresh processes: they would import the machine's own CuPy, not the device double
@pytest.mark.parametrize("launcher", ["mpirun", "minidl_parallel.run"])
def test_resnet_cifar_pipeline_under_a_launcher_equals_its_micro_batches_on_one_process(tmp_path, launcher):
    ckpt = tmp_path / "ckpt"
    proc = _launch(tmp_path, launcher, 2, "examples/resnet_cifar.py", *RESNET_TINY, "--pipeline", "2",
                   "--ckpt-dir", str(ckpt))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Each stage saved its part: the two files make the whole network, as one process trained it.
    for stage, name in enumerate(["resnet20-1_4.ckpt", "resnet20-1_4_rank1.ckpt"]):
        meta = minidl.load_checkpoint_metadata(str(ckpt / name))
        assert (meta["pipeline_stages"], meta["pipeline_stage"]) == ("2", str(stage)), meta  # (metadata: strings)
    out = proc.stdout
    assert out.count("pipeline of 2 stages x 1 data-parallel replicas on 2 ranks: batch 16 per replica") == 1
    assert out.count(str(_launched_schedule("1f1b"))) == 1
    one = _resnet_on_one_process_in_micro_batches()
    # Stage 1's BatchNorm sees the same micro-batches as one process running them in turn: the same losses,
    # and the same accuracy of the network gathered from the stages.
    losses = _printed_losses(out, "loss is ")
    assert len(losses) == 4 and np.isfinite(losses).all()
    assert losses == pytest.approx(_printed_losses(one.stdout, "loss is "), rel=1e-6)
    accuracy = [line for line in out.splitlines() if "train accuracy:" in line]
    assert accuracy == [line for line in one.stdout.splitlines() if "train accuracy:" in line] and len(accuracy) == 1


def test_resnet_cifar_refuses_a_pipeline_without_parallelism():
    out = subprocess.run([sys.executable, "examples/resnet_cifar.py", "--pipeline", "2", "--parallel", "none"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--pipeline 2 does not combine with --parallel none" in out.stderr
