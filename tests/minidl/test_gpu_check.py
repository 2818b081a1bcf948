"""python -m minidl.gpu_check: the report without a GPU, the stage runner, the comparison rules.

What needs a GPU (the stages themselves) runs only where there is one; here the command must
say plainly that it checked nothing on the GPU and why, and its parts are tested with
stand-in stages (small Python commands that pass, crash, hang or lie).
"""
import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import minidl
from minidl_checks import gpu as gc, judging, stages, training
from minidl_checks import probe as probe_stage

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| \d{4}-\d{2}-\d{2} \| (.+?) \| (.+) \| (.+) \|$")


def run_check(*argv, env_extra=None, timeout=120):
    env = dict(os.environ)
    for var in ("MINIDL_DEVICE", "MINIDL_TEST_DEVICE"):  # the command picks its devices itself
        env.pop(var, None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "minidl.gpu_check", *argv], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def probe():
    """What the probe stage sees on this machine (in its own process, as gpu_check runs it)."""
    res = gc.run_stage("probe", gc.worker_argv("probe", gc.parse_args([])), 120, env=gc.stage_env())
    assert res.status == "passed", res.output_tail
    return res.data


def _need_no_gpu(probe):
    if probe["gpu_reason"] is None:
        pytest.skip("this machine has a usable GPU: the no-GPU report cannot be seen here "
                    "(python -m minidl.gpu_check itself is the check there)")
    if probe["cupy_installed"]:
        pytest.skip(f"CuPy is installed but unusable here ({probe['gpu_reason']}): "
                    "test_cupy_installed_but_cuda_fails covers that case")


def last_row(stdout):
    lines = stdout.strip().splitlines()
    assert lines[-2] == "row for docs/gpu.md:", stdout
    m = ROW.match(lines[-1])
    assert m, lines[-1]
    return m.groups()


# ---- the command on a machine without a GPU -------------------------------------------

def test_without_gpu_every_stage_is_skipped_with_the_reason(probe):
    _need_no_gpu(probe)
    start = time.monotonic()
    proc = run_check("--no-suite")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - start < 60
    out = proc.stdout
    reason = probe["gpu_reason"]
    assert "CuPy is not installed" in reason  # backend.gpu_unavailable_reason(), as the probe got it
    assert f"every GPU stage is skipped because CuPy/CUDA is unavailable: {reason}" in out
    for name in gc.GPU_STAGES:
        assert re.search(rf"^\[SKIP\] {re.escape(name)}: CuPy/CUDA is unavailable", out, re.M), name
    assert "[PASS]" not in out and "[FAIL]" not in out
    assert f"nothing on the GPU was checked: {reason}" in out
    assert f"NumPy {np.__version__}" in out and f"Python {sys.version.split()[0]}" in out
    gpu, what, result = last_row(out)
    assert gpu == "none" and reason in what and result == "nothing on the GPU was checked"


def test_require_gpu_exits_3_when_nothing_was_checked(probe):
    _need_no_gpu(probe)
    proc = run_check("--no-suite", "--require-gpu")
    assert proc.returncode == gc.EXIT_NO_GPU == 3, proc.stdout + proc.stderr
    assert "nothing on the GPU was checked" in proc.stdout


def test_cupy_installed_but_cuda_fails(tmp_path):
    """An installed CuPy that cannot reach a GPU (here a stand-in whose CUDA raises, as a too
    old driver does) is a failure, with CUDA's own message, not a quiet skip."""
    pkg = tmp_path / "cupy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent('''
        __version__ = "14.2.0-standin"
        class _Runtime:
            @staticmethod
            def getDeviceCount():
                raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")
        class cuda:
            runtime = _Runtime
    '''))
    proc = run_check("--no-suite", env_extra={"PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "CuPy 14.2.0-standin; no GPU for minidl" in proc.stdout
    assert re.search(r"^\[FAIL\] cuda .*cudaErrorInsufficientDriver", proc.stdout, re.M), proc.stdout
    gpu, what, result = last_row(proc.stdout)
    assert gpu == "none" and "cudaErrorInsufficientDriver" in what
    assert result.startswith("FAILED") and result.endswith("nothing on the GPU was checked")


def test_bad_arguments_exit_2():
    proc = run_check("--steps", "0")
    assert proc.returncode == 2 and "--steps must be positive" in proc.stderr


def test_help_names_the_command_and_its_exit_statuses():
    proc = run_check("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m minidl.gpu_check ")
    assert "--no-suite" in proc.stdout and "3 --require-gpu and no CuPy" in proc.stdout


def test_importing_minidl_gpu_check_loads_nothing_of_the_tool():
    """The tool lives in minidl_checks: importing minidl (or minidl.gpu_check) must not load it,
    nor run it (a fresh process: this one has imported minidl_checks for the other tests)."""
    code = ("import sys, minidl, minidl.gpu_check; "
            "print(sorted(m for m in sys.modules if m.startswith(('minidl_checks', 'minidl_parallel', 'torch'))))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


# ---- the stage runner -----------------------------------------------------------------

def py(code):
    return [sys.executable, "-c", textwrap.dedent(code)]


def emit(status="passed", summary="ok", **data):
    line = json.dumps({"status": status, "summary": summary, "data": data})
    return f"print({stages.RESULT_MARK!r} + {json.dumps(line)})"


def test_stage_that_passes_gives_its_summary_and_data():
    res = stages.run_stage("s", py(f"print('noise'); {emit(summary='fine', steps_per_s=2.5)}"), 30)
    assert (res.status, res.summary, res.data) == ("passed", "fine", {"steps_per_s": 2.5})
    assert res.output_tail == ""  # kept only for failures


def test_stage_that_crashes_fails_with_the_signal_and_the_next_stage_still_runs():
    res = stages.run_stage("crash", py("import os, sys; print('before the crash', flush=True); os.abort()"), 30)
    assert res.status == "failed" and res.summary == "killed by signal SIGABRT"
    assert "before the crash" in res.output_tail
    after = stages.run_stage("after", py(emit()), 30)
    assert after.status == "passed"


def test_stage_that_raises_fails_with_its_traceback():
    res = stages.run_stage("raises", py("raise ValueError('the real error')"), 30)
    assert res.status == "failed" and res.summary == "exited with status 1"
    assert "ValueError: the real error" in res.output_tail


def test_stage_that_hangs_is_killed_with_its_children(tmp_path):
    """On timeout the stage's whole process group dies: a child that inherited the output
    pipe would otherwise keep the runner waiting (mpirun's ranks, pytest's workers)."""
    pid_file = tmp_path / "child.pid"
    code = f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])
        open({str(pid_file)!r}, 'w').write(str(child.pid))
        print('started', flush=True)
        time.sleep(120)
    """
    start = time.monotonic()
    res = stages.run_stage("hang", py(code), 2)
    assert time.monotonic() - start < 30
    assert res.status == "failed" and res.summary.startswith("timed out after 2 s")
    assert "started" in res.output_tail
    child = int(pid_file.read_text())
    for _ in range(100):  # killed; reaped by whoever adopted it, or left a zombie
        try:
            state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the stage's child {child} still runs after the timeout")


def test_stage_that_exits_0_without_a_result_fails():
    res = stages.run_stage("silent", py("print('nothing to report')"), 30)
    assert res.status == "failed" and res.summary == "printed 0 result(s), expected 1"


def test_stage_that_reports_failure_fails_with_its_summary():
    res = stages.run_stage("mismatch", py(emit("failed", "losses differ")), 30)
    assert (res.status, res.summary) == ("failed", "losses differ")


def test_stage_under_mpirun_needs_one_result_per_rank():
    judge = (lambda rc, out: stages.judge_worker(rc, out, expected=2))
    two = stages.run_stage("ranks", py(f"{emit(summary='rank 0 ok')}\n{emit(summary='rank 1 ok')}"), 30, judge=judge)
    one = stages.run_stage("ranks", py(emit(summary="rank 0 ok")), 30, judge=judge)
    assert two.status == "passed" and one.status == "failed"


def test_stage_that_cannot_start_fails():
    res = stages.run_stage("missing", ["/nonexistent/mpirun", "-n", "2"], 30)
    assert res.status == "failed" and res.summary.startswith("could not start /nonexistent/mpirun")


def test_skipping_worker_is_reported_as_skipped():
    res = stages.run_stage("bench-torch", py(emit("skipped", "PyTorch without CUDA")), 30)
    assert (res.status, res.summary) == ("skipped", "PyTorch without CUDA")


def test_a_crashing_stage_does_not_end_the_report(monkeypatch, capsys):
    """main() on a (stand-in) GPU machine: a stage that crashes, one that hangs and one that
    passes are all reported, the row names the failures, and the exit status is 1."""
    real_run_stage = gc.run_stage
    probe = {"gpu_reason": None, "cupy": "14.2.0", "cuda_runtime": "13.0", "cuda_driver": "13.0",
             "gpus": [{"name": "Stand-in GPU", "memory_gib": 80.0, "capability": "9.0"}], "python": "3",
             "numpy": np.__version__, "cupy_installed": True}

    def run_stage(name, argv, timeout, **kw):
        if name == "probe":
            return stages.StageResult("probe", "passed", "probed", data=probe)
        return real_run_stage(name, argv, timeout, **kw)
    standins = [("libs", lambda: real_run_stage("libs", py("import os; os.abort()"), 30)),
                ("suite", lambda: stages.skipped("suite", "--no-suite was given")),
                ("bench", lambda: real_run_stage("bench", py("import time; time.sleep(60)"), 1)),
                ("resnet20", lambda: real_run_stage("resnet20", py(emit(summary="GPU vs CPU | within")), 30))]
    monkeypatch.setattr(gc, "run_stage", run_stage)
    monkeypatch.setattr(gc, "plan", lambda args, probe: standins)
    assert gc.main(["--no-suite"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] libs" in out and "killed by signal SIGABRT" in out
    assert "[FAIL] bench" in out and "timed out after 1 s" in out
    assert "[PASS] resnet20" in out and "[SKIP] suite: --no-suite was given" in out
    assert "summary: passed 1, failed 2, skipped 1" in out
    gpu, what, result = last_row(out)
    assert gpu.startswith("1x Stand-in GPU (CUDA runtime 13.0")
    assert "libs, bench, resnet20" in what and "skipped: suite (--no-suite was given)" in what
    assert result.startswith("FAILED: libs, bench") and "GPU vs CPU \\| within" in result  # '|' escaped


def test_plan_skips_the_multi_gpu_stages_and_says_why(monkeypatch):
    args = gc.parse_args(["--no-suite"])
    one = {"gpus": [{"name": "A"}]}
    two = {"gpus": [{"name": "A"}, {"name": "A"}]}

    def skips(probe):
        # Call only the thunks that skip (stages.skipped): the others would start GPU workers.
        monkeypatch.setattr(gc, "run_stage", lambda name, *a, **k: pytest.fail(f"{name} would run"))
        out = {}
        for name, thunk in gc.plan(args, probe):
            if name in ("suite", "nccl-collectives", "nccl-dp", "example"):
                out[name] = thunk()
        return out
    got = skips(one)
    assert got["suite"].summary == "--no-suite was given"
    for name in ("nccl-collectives", "nccl-dp", "example"):
        assert got[name].status == "skipped" and got[name].summary.startswith("1 GPU visible")
    monkeypatch.setattr(gc, "find_mpirun", lambda: None)
    got = skips(two)
    assert got["nccl-dp"].status == "skipped" and "no mpirun" in got["nccl-dp"].summary
    assert [name for name, _ in gc.plan(args, one)] == list(gc.GPU_STAGES)


def test_plan_runs_each_stage_with_its_own_command(monkeypatch):
    """With 2 GPUs and an mpirun, each thunk runs its own command (no thunk sees a later
    stage's argv), the suite pinned to the GPU in the clone, the mpirun stages on every GPU."""
    ran = {}
    monkeypatch.setattr(gc, "run_stage", lambda name, argv, timeout, **kw: ran.setdefault(name, (argv, timeout, kw)))
    monkeypatch.setattr(gc, "find_mpirun", lambda: "/opt/mpi/bin/mpirun")
    monkeypatch.setattr(gc, "installed", lambda name: True)
    args = gc.parse_args(["--timeout", "77", "--suite-timeout", "999"])
    for _, thunk in gc.plan(args, {"gpus": [{"name": "A"}, {"name": "A"}]}):
        thunk()
    assert sorted(ran) == sorted(gc.GPU_STAGES)
    argv, timeout, kw = ran["suite"]
    assert argv[1:] == ["-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"] and timeout == 999
    assert kw["cwd"] == str(ROOT) and kw["env"]["MINIDL_TEST_DEVICE"] == "gpu" and kw["env"]["MINIDL_DEVICE"] == "GPU"
    for name in ("libs", "resnet20", "bench", "bench-torch", "nccl-1", "threads-gpu"):
        argv, timeout, kw = ran[name]
        # the stages that need minidl_parallel run from the module that imports it, never the report's
        module = "minidl_checks.parallel_workers" if name in ("nccl-1", "threads-gpu") else "minidl_checks.gpu"
        assert argv[:5] == [sys.executable, "-m", module, "--worker", name] and timeout == 77
        assert "MINIDL_DEVICE" not in kw["env"] and "MINIDL_TEST_DEVICE" not in kw["env"]
    for name in ("nccl-collectives", "nccl-dp"):
        argv, _, kw = ran[name]
        assert argv[:7] == ["/opt/mpi/bin/mpirun", "-n", "2", sys.executable, "-m", "minidl_checks.parallel_workers",
                            "--worker"]
        assert argv[7] == name
        assert kw["judge"](0, "") == ("failed", "printed 0 result(s), expected 2", {})
    argv, _, kw = ran["example"]
    assert argv[:3] == ["/opt/mpi/bin/mpirun", "-n", "2"] and argv[4] == str(ROOT / "examples" / "resnet_cifar.py")
    assert argv[5:] == ["--device", "GPU", "--epochs", "1", "--num-samples", "512"]


def test_judges_of_the_suite_and_the_example():
    assert judging.judge_suite(0, "....\n812 passed, 3 skipped in 300.1s\n")[:2] == \
        ("passed", "device-pinned pytest: 812 passed, 3 skipped in 300.1s")
    status, summary, _ = judging.judge_suite(1, "F..\n= 1 failed, 811 passed in 300s =\n")
    assert status == "failed" and summary.endswith("exited 1: 1 failed, 811 passed in 300s")
    assert judging.judge_example(0, "epoch: 1 step: 8, loss is 1.93\n")[0] == "passed"
    assert judging.judge_example(0, "nothing trained\n")[0] == "failed"
    assert judging.judge_example(1, "epoch: 1 step: 8, loss is 1.93\n")[0] == "failed"


# ---- the GPU-vs-CPU comparison --------------------------------------------------------

def test_training_diffs_scales_each_tensor_and_sums_the_parameters():
    want = {"w": np.array([1.0, -2.0]), "beta": np.array([1e-3, 0.0]), "loss/0": 2.0}
    got = {"w": np.array([1.0, -2.0 + 2e-6]), "beta": np.array([1e-3, 1e-6]), "loss/0": 2.0 + 2e-7}
    d = judging.training_diffs(got, want)
    assert d["where"] == "beta" and d["max_rel"] == pytest.approx(1e-3)  # 1e-6 on a tensor of scale 1e-3
    # all parameters: sqrt(2e-6^2 + 1e-6^2) / sqrt(1 + 4 + 1e-6); the loss is not a parameter
    assert d["global_rel"] == pytest.approx(np.sqrt(5e-12) / np.sqrt(5 + 1e-6))
    assert judging.training_diffs(want, want) == {"max_rel": 0.0, "where": "w", "global_rel": 0.0}


@pytest.mark.parametrize("change, where", [
    (lambda r: r.update(w=np.array([np.nan, 0.0])), "w: not finite"),
    (lambda r: r.update(w=np.array([1.0])), "w: shape (1,) != (2,)"),
    (lambda r: r.pop("loss/0"), "names differ: ['loss/0']"),
])
def test_training_diffs_is_infinite_for_broken_runs(change, where):
    want = {"w": np.array([1.0, -2.0]), "loss/0": 2.0}
    got = dict(want)
    change(got)
    d = judging.training_diffs(got, want)
    assert d["max_rel"] == d["global_rel"] == float("inf") and d["where"] == where


def test_float32_tolerance_is_the_measured_resolution_times_the_factor():
    assert judging.float32_tolerance(1e-3) == pytest.approx(judging.TRAIN_FACTOR * 1e-3) == pytest.approx(0.05)
    assert judging.float32_tolerance(0.0) == judging.TRAIN_FLOOR == pytest.approx(64 * 2.0 ** -23)
    assert np.isnan(judging.float32_tolerance(float("inf"))) and np.isnan(judging.float32_tolerance(float("nan")))


def synthetic_runs(gpu32_off=1.0, gpu64_off=0.0, cpu64=None):
    """Runs around an exact result: CPU float32 off by 1e-6 (its 'resolution'), the GPU float32
    run by gpu32_off times that in another direction, the GPU float64 run by gpu64_off."""
    exact = {"w": np.array([0.5, -1.0, 2.0]), "loss/0": 2.3}
    e = np.array([1.0, -1.0, 0.5])
    cpu32 = {"w": exact["w"] * (1 + 1e-6 * e), "loss/0": 2.3}
    gpu32 = {"w": exact["w"] * (1 - gpu32_off * 1e-6 * e[::-1]), "loss/0": 2.3}
    gpu64 = {"w": exact["w"] * (1 + gpu64_off), "loss/0": 2.3}
    return {("CPU", "float32"): cpu32, ("GPU", "float32"): gpu32, ("CPU", "float64"): cpu64 or exact,
            ("GPU", "float64"): gpu64}


def test_judge_training_accepts_rounding_and_rejects_more():
    ok, lines, numbers = judging.judge_training(synthetic_runs(gpu32_off=1.0, gpu64_off=1e-14))
    assert ok, lines
    assert numbers["tol_float32_max_rel"] == pytest.approx(judging.TRAIN_FACTOR * numbers["cpu32_vs_cpu64_max_rel"])
    assert numbers["tol_float64_max_rel"] == judging.TRAIN_TOL64
    assert any(line.startswith("GPU vs CPU float32: per-tensor max rel") for line in lines)
    # float32: a GPU 200x further from the exact result than the CPU (TF32 would be ~1e3-1e4x)
    ok, lines, _ = judging.judge_training(synthetic_runs(gpu32_off=200.0, gpu64_off=1e-14))
    assert not ok and "TOO LARGE" in next(line for line in lines if "float32:" in line)
    # float64: 1e-7 is no rounding difference
    ok, lines, _ = judging.judge_training(synthetic_runs(gpu64_off=1e-7))
    assert not ok and "TOO LARGE" in next(line for line in lines if "float64:" in line)


def test_judge_training_fails_when_a_run_is_not_finite():
    runs = synthetic_runs()
    runs[("GPU", "float64")]["loss/0"] = float("nan")
    assert not judging.judge_training(runs)[0]
    runs = synthetic_runs(cpu64={"w": np.array([np.inf, -1.0, 2.0]), "loss/0": 2.3})
    ok, lines, _ = judging.judge_training(runs)  # a broken CPU reference accepts nothing
    assert not ok and "nan" in lines[1]


def test_train_resnet_on_the_cpu_gives_losses_and_every_parameter():
    before = minidl.get_context("device_target")
    images, labels = training.resnet_data(2, 4)
    a = training.train_resnet("CPU", "float32", images, labels, 2, 4)
    b = training.train_resnet("CPU", "float64", images, labels, 2, 4)
    assert {"loss/0", "loss/1", "conv1.weight", "fc.bias", "bn1.moving_variance"} <= set(a)
    assert set(a) == set(b) and all(np.all(np.isfinite(v)) for v in a.values())
    d = judging.training_diffs(a, b)
    assert 0 < d["global_rel"] < 1e-4  # float32 is not float64, and not far from it
    assert a["conv1.weight"].dtype == np.float64  # returned as float64 for the comparison
    assert minidl.get_context("device_target") == before  # the caller's device is left as it was


def test_float64_training_does_not_depend_on_the_chunking():
    """The premise of TRAIN_TOL64: float64 training in another summation order (here the
    CPU's, chunks of 3 images instead of the whole batch) agrees far below 1e-8."""
    from minidl import kernels
    images, labels = training.resnet_data(2, 16)
    try:
        kernels.set_option("images_per_chunk", 16)  # the whole batch
        whole = training.train_resnet("CPU", "float64", images, labels, 2, 16)
        kernels.set_option("images_per_chunk", 3)
        chunked = training.train_resnet("CPU", "float64", images, labels, 2, 16)
    finally:
        kernels.set_option("images_per_chunk", None)
    d = judging.training_diffs(chunked, whole)
    assert d["max_rel"] < judging.TRAIN_TOL64, d


def test_version_codes_read_as_the_libraries_print_them():
    # cudaRuntimeGetVersion: 1000 * major + 10 * minor; NCCL_VERSION_CODE: 10000 * major +
    # 100 * minor + patch from 2.9 on, 1000 * major + 100 * minor + patch before.
    assert (probe_stage.cuda_version(12080), probe_stage.cuda_version(13000)) == ("12.8", "13.0")
    assert (probe_stage.nccl_version(22707), probe_stage.nccl_version(2804)) == ("2.27.7", "2.8.4")
