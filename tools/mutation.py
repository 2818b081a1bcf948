"""Mutation testing of one module at a time against the tests aimed at it (mutmut; outside CI).

A mutant that survives is a change to the code (``<`` for ``<=``, a constant, a dropped argument)
that the module's own tests do not notice: either a missing test or an equivalent change. Each
run copies the working tree into a scratch folder, configures mutmut there for one target, runs
it, and prints the survivors with their diffs, so the checkout and its setup.cfg stay untouched.

    python3 -m pip install mutmut
    python3 tools/mutation.py compression sparse      # targets from TARGETS below
    python3 tools/mutation.py --list
    python3 tools/mutation.py model --functions Model._evaluate Model._metric_values   # a change's functions

docs/testing.md#mutation-testing records the latest results and why each survivor is left.
"""
import argparse
import fnmatch
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# target: (the files mutated, the tests run against them). The tests are the ones aimed at the
# code, as a developer changing it would run them, not the whole suite.
# test_elastic.py's tests that run in this process (its real job starts a launcher in a subprocess)
_ELASTIC_IN_PROCESS = ("test_hosts_are_read_as_horovods_discovery_scripts_print_them",
                       "test_each_attempt_runs_on_the_slots_discovered_then_within_min_and_max",
                       "test_too_few_slots_are_waited_for_then_refused_naming_them",
                       "test_a_host_that_comes_back_ends_the_wait", "test_a_failing_discovery_script_is_named",
                       "test_a_discovery_script_that_does_not_finish_is_named",
                       "test_the_wait_for_hosts_asks_every_interval_until_the_elastic_timeout_has_passed",
                       "test_run_refuses_elastic_options_it_cannot_honour",
                       "test_a_restart_with_more_ranks_starts_the_new_ones_from_rank_0s_state",
                       "test_a_restart_with_fewer_ranks_loads_each_ranks_own_file",
                       "test_optimizer_parallel_slices_are_cut_anew_when_four_ranks_restart_as_two",
                       "test_keeping_the_global_batch_a_shrunk_world_continues_the_uninterrupted_run",
                       "test_a_global_batch_the_new_world_cannot_split_is_refused_on_every_rank")

TARGETS = {
    "compression": (["minidl_parallel/compression.py"],
                    ["tests/minidl_parallel/test_compression.py"]),
    "sparse": (["minidl_parallel/sparse.py"],
               ["tests/minidl_parallel/test_sparse.py", "tests/minidl_parallel/test_dist_opt.py"]),
    "dist_opt": (["minidl_parallel/dist_opt.py"],
                 ["tests/minidl_parallel/test_dist_opt.py", "tests/minidl_parallel/test_dist_opt_partial_update.py"]),
    "adasum": (["minidl_parallel/adasum.py"], ["tests/minidl_parallel/test_accumulation_adasum.py"]),
    # the reducer and the modules split out of it (its buckets, accumulation, broadcast, the
    # agreement checks' messages and join's vote); adasum.py is its own target
    "grad_reducer": (["minidl_parallel/grad_reducer.py", "minidl_parallel/buckets.py",
                      "minidl_parallel/accumulation.py", "minidl_parallel/broadcast.py",
                      "minidl_parallel/agreement.py", "minidl_parallel/join.py"],
                     ["tests/minidl_parallel/test_grad_reducer.py", "tests/minidl_parallel/test_accumulation_adasum.py",
                      "tests/minidl_parallel/test_overlap.py", "tests/minidl_parallel/test_compression.py",
                      "tests/minidl_parallel/test_parameter_broadcast.py",
                      "tests/minidl_parallel/test_agreement_checks.py", "tests/minidl_parallel/test_uneven_inputs.py"]),
    "comm": (["minidl_parallel/comm/base.py", "minidl_parallel/comm/threads.py", "minidl_parallel/comm/local.py"],
             ["tests/minidl_parallel/comm", "tests/minidl_parallel/test_collectives.py"]),
    "comm_backends": (["minidl_parallel/comm/mpi.py", "minidl_parallel/comm/nccl.py"], ["tests/minidl_parallel/comm"]),
    "io": (["minidl/io"], ["tests/minidl/io"]),
    "wrappers": (["minidl/nn/wrappers.py"], ["tests/minidl/nn/test_wrappers.py"]),
    # issue 31: mixed precision (the cast levels, their op lists and policy, Model's amp rules, the
    # loss scale managers), recompute, loss scaling's cells, and the strategy checkpoint file
    "amp": (["minidl/amp/policy.py", "minidl/amp/auto.py", "minidl/amp/build.py", "minidl/amp/loss_scale.py",
             "minidl/amp/op_lists.py"], ["tests/minidl/amp"]),
    "recompute": (["minidl/nn/recompute.py"], ["tests/minidl/nn/test_recompute.py",
                                                 "tests/minidl_parallel/tensor_parallel/test_recompute_tp.py"]),
    "loss_scale_cells": (["minidl/nn/loss_scale_cells.py"],
                         ["tests/minidl/amp", "tests/minidl/nn/test_wrappers.py"]),
    "strategy_file": (["minidl_parallel/tensor_parallel/strategy_file.py"],
                      ["tests/minidl_parallel/test_strategy_ckpt.py",
                       # record_optimizer_slices: only the optimizer-parallel reducer writes it
                       "tests/minidl_parallel/tensor_parallel/test_optimizer_parallel_tp.py",
                       "tests/minidl_parallel/tensor_parallel/test_strategy_file_optimizer.py"]),
    # issue 31: optimizer parallelism (ZeRO) under DATA_PARALLEL and the tensor-parallel modes; not the
    # mpirun test (its ranks are subprocesses, "no tests" to mutmut) nor the slow matrices (deselected)
    "optimizer_parallel": (["minidl_parallel/optimizer_parallel", "minidl_parallel/optimizer_parallel_config.py"],
                           ["tests/minidl_parallel/test_optimizer_parallel.py",
                            "tests/minidl_parallel/tensor_parallel/test_optimizer_parallel_tp.py"]),
    # issue 32: pipelines (schedules, stages, the stage forward, the executor, PipelineCell, the settings)
    # and the communicators' point-to-point messages; not the mpirun tests (subprocesses: "no tests")
    # (the package's modules but those of the three targets below, which their own tests aim at)
    "pipeline": ([f"minidl_parallel/pipeline/{m}.py" for m in ("schedules", "stages", "stage_forward", "executor",
                                                               "cell", "grad_reducer")]
                 + ["minidl_parallel/pipeline_config.py"],
                 [f"tests/minidl_parallel/pipeline/test_{t}.py" for t in (
                     "schedules", "pipeline_equivalence", "pipeline_errors", "pipeline_training", "pipeline_details",
                     "pipeline_tensor_parallel", "pipeline_amp", "pipeline_mutation_details")]
                 + ["tests/minidl_parallel/test_pipeline_context.py"]),
    # issue 32's fifth session: tensor parallelism inside a stage, evaluation and per-stage checkpoints (each
    # with test_pipeline_composition_details.py, the tests its first mutation run asked for)
    "pipeline_cut": (["minidl_parallel/pipeline/stage_cut.py", "minidl_parallel/pipeline_groups.py"],
                     [f"tests/minidl_parallel/pipeline/test_{t}.py" for t in (
                         "pipeline_tensor_parallel", "pipeline_equivalence", "pipeline_composition_details")]),
    "pipeline_eval": (["minidl_parallel/pipeline/evaluation.py"],
                      [f"tests/minidl_parallel/pipeline/test_{t}.py" for t in (
                          "pipeline_eval", "pipeline_composition_details")]),
    "pipeline_checkpoint": (["minidl_parallel/pipeline/checkpoint.py"],
                            [f"tests/minidl_parallel/pipeline/test_{t}.py" for t in (
                                "pipeline_checkpoint", "pipeline_composition_details")]),
    "p2p": (["minidl_parallel/comm/p2p.py"],
            ["tests/minidl_parallel/comm/test_p2p.py", "tests/minidl_parallel/comm/test_p2p_details.py",
             "tests/minidl_parallel/comm/test_nccl_backend.py", "tests/minidl_parallel/comm/test_mpi.py"]),
    # issue 32's seams outside the pipeline package, run with --functions on the functions it changed:
    # the runtimes' checkpoint segment, loss reporting and stage-group values; the dispatcher's stage group;
    # the train-state checkpoints' stage segments
    "runtime": (["minidl/runtime.py", "minidl_parallel/runtime.py"],
                ["tests/minidl/test_runtime.py", "tests/minidl/train/test_callbacks.py",
                 "tests/minidl_parallel/tensor_parallel/test_dispatch.py"]
                + [f"tests/minidl_parallel/pipeline/test_{t}.py" for t in (
                    "pipeline_tensor_parallel", "pipeline_eval", "pipeline_checkpoint", "pipeline_composition_details",
                    "pipeline_mutation_details")]),
    # the runtime's optimizer-parallel branches (issue 31's sliced weights), held by that target's tests
    "runtime_slices": (["minidl_parallel/runtime.py"],
                       ["tests/minidl_parallel/test_optimizer_parallel.py",
                        "tests/minidl_parallel/tensor_parallel/test_optimizer_parallel_tp.py",
                        "tests/minidl_parallel/tensor_parallel/test_strategy_file_optimizer.py"]),
    "dispatch": (["minidl_parallel/tensor_parallel/dispatch.py"],
                 ["tests/minidl_parallel/tensor_parallel/test_dispatch.py",
                  "tests/minidl_parallel/tensor_parallel/test_equivalence.py",
                  # (the outermost call reads and writes strategy files and saves explain's plans)
                  "tests/minidl_parallel/test_strategy_ckpt.py", "tests/minidl_parallel/tensor_parallel/test_saved_plans.py"]
                 + [f"tests/minidl_parallel/pipeline/test_{t}.py" for t in (
                     "pipeline_tensor_parallel", "pipeline_composition_details")]),
    "train_checkpoint": (["minidl/train/checkpoint.py"],
                         ["tests/minidl/train", "tests/minidl/amp/test_model_amp.py",
                          "tests/minidl_parallel/test_checkpoint_agreement.py",
                          "tests/minidl_parallel/test_dp_checkpoint_resume.py"]
                         + [f"tests/minidl_parallel/pipeline/test_{t}.py" for t in (
                             "pipeline_checkpoint", "pipeline_checkpoint_details", "pipeline_composition_details")]),
    # issue 33: restarts. The launcher's policy, its elastic sizing and run.py's loop (in-process, with stand-in
    # workers; the real jobs run in subprocesses, which mutmut does not see), and the resume on the workers' side
    # (the in-process tests only: a launcher started in a subprocess imports the mutated copy, whose
    # trampolines fail outside mutmut's folder)
    "restarts": (["minidl_parallel/restarts.py", "minidl_parallel/elastic.py", "minidl_parallel/run.py"],
                 ["tests/minidl_parallel/test_restart_launcher.py", "tests/minidl_parallel/test_launcher_in_process.py"]
                 + [f"tests/minidl_parallel/test_restarts.py::{t}" for t in (
                     "test_the_backoff_doubles_from_the_delay_up_to_a_minute",
                     "test_restart_options_are_checked_naming_the_expected_value",
                     "test_a_job_that_fails_twice_is_restarted_with_backoff_and_says_why",
                     "test_k_plus_one_failures_return_the_last_one_with_every_cause",
                     "test_no_restarts_and_a_failure_that_cannot_be_restarted_stop_at_once",
                     "test_the_restart_log_reports_each_complete_line_once", "test_run_refuses_bad_restart_options")]
                 + [f"tests/minidl_parallel/test_elastic.py::{t}" for t in _ELASTIC_IN_PROCESS]),
    "restart_resume": (["minidl/train/restart.py"],
                       ["tests/minidl/train/test_restart.py", "tests/minidl_parallel/test_restart_resume.py"]
                       + [f"tests/minidl_parallel/test_elastic.py::{t}" for t in _ELASTIC_IN_PROCESS]),
    "resize": (["minidl/train/resize.py"],
               ["tests/minidl/train/test_resize.py", "tests/minidl/dataset/test_engine.py"]
               + [f"tests/minidl_parallel/test_elastic.py::{t}" for t in _ELASTIC_IN_PROCESS]),
    "mnist": (["minidl/dataset/mnist.py"], ["tests/minidl/dataset/test_mnist.py"]),
    "dataset_engine": (["minidl/dataset/engine.py"], ["tests/minidl/dataset/test_engine.py"]),
    "callbacks": (["minidl/train/callbacks.py"], ["tests/minidl/train/test_callbacks.py",
                                                  "tests/minidl_parallel/pipeline/test_pipeline_eval.py"]),
    "intra_op": (["minidl/kernels/cpu/threads.py", "minidl/kernels/cpu/thread_count.py"],
                 ["tests/minidl/kernels/test_threads.py", "tests/minidl/kernels/test_step_memory.py"]),
    # The launcher's tests that start workers run the launcher in a subprocess, in another folder,
    # where mutmut's trampolines cannot find their configuration: only the in-process tests.
    "spawning": (["minidl_parallel/spawning.py"],
                 [f"tests/minidl_parallel/test_launcher.py::{t}" for t in (
                     "test_run_refuses_bad_arguments_before_starting_anything",
                     "test_run_as_root_without_the_flag_names_the_variables_and_the_flag",
                     "test_spawn_puts_the_loaded_open_mpis_prte_first_on_path_or_refuses_without_one",
                     "test_spawn_checks_its_arguments_before_starting_anything",
                     "test_spawn_refuses_a_main_function_the_workers_cannot_import",
                     "test_spawn_sends_each_worker_the_job_and_returns_their_values_in_rank_order",
                     "test_spawn_raises_the_first_failure_and_frees_the_workers_in_process",
                     "test_spawn_bounds_the_start_and_the_run_in_process",
                     "test_spawn_sets_path_for_the_spawn_call_only_in_process",
                     "test_spawn_names_each_bad_argument_and_the_expected_one",
                     "test_spawn_refuses_a_fn_from_an_interactive_main_naming_it",
                     "test_spawn_tells_the_workers_how_to_import_the_main_module",
                     "test_spawn_without_mpi4py_names_the_extra_to_install",
                     "test_check_root_lets_a_user_through_and_names_each_missing_variable",
                     "test_spawn_as_root_says_how_to_set_the_variables",
                     "test_spawn_in_a_rank_of_an_mpi_job_says_where_to_call_fn",
                     "test_runtime_path_is_none_unless_open_mpi_5_needs_a_prte",
                     "test_loaded_libmpi_reads_the_library_from_the_process_maps",
                     "test_spawn_warns_when_the_workers_do_not_disconnect_in_process",
                     "test_workers_still_running_after_a_failure_get_the_grace_then_are_named",
                     "test_spawn_ends_its_local_workers_after_a_failure",
                     "test_init_mpi_turns_fault_tolerance_on_in_this_process_only",
                     "test_a_singleton_finds_the_pip_open_mpis_files_beside_the_interpreter",
                     "test_spawn_restarts_the_workers_and_returns_the_attempt_that_succeeded_in_process",
                     "test_spawn_checks_its_restart_arguments_before_starting_anything",
                     "test_each_restarted_spawn_keeps_its_bounds_and_says_where_it_resumed_in_process",
                     "test_spawn_does_not_restart_once_mpi_is_stuck_in_process")]),
    "progress": (["minidl/train/progress.py"],
                 ["tests/minidl/train/test_model.py", "tests/minidl/train/test_log_writers.py",
                  "tests/minidl/train/test_callbacks.py", "tests/minidl/train/test_progress.py"]),
    # Model's data-parallel paths (agreement on steps, sums over ranks, the broadcast) run in the
    # parallel package's tests, on the in-process threads world.
    "model": (["minidl/train/model.py"],
              ["tests/minidl/train", "tests/minidl/nn/test_wrappers.py"]
              + [f"tests/minidl_parallel/test_{t}.py" for t in (
                  "agreement_checks", "checkpoint_agreement", "data_parallel_equivalence", "model_dist_options",
                  "parallel_eval", "parallel_logs", "parameter_broadcast", "uneven_inputs",
                  "model_step_agreement")]
              + ["tests/minidl_parallel/pipeline/test_pipeline_eval.py"]),
    "sources": (["minidl/dataset/sources.py"],
                ["tests/minidl/dataset/test_sources.py", "tests/minidl/dataset/test_sharding.py",
                 "tests/minidl/dataset/test_padding_validity.py"]),
    "loss": (["minidl/nn/loss.py", "minidl/ops/loss.py"],
             ["tests/minidl/nn/test_loss.py", "tests/minidl/ops/test_loss.py"]),
    "graph_mode": (["minidl/graph_mode"],
                   ["tests/minidl/test_graph_mode.py", "tests/minidl/test_graph_mode_dense.py",
                    "tests/minidl/test_graph_mode_explain.py"]),
    # minidl/kernels in parts, each within 30 minutes on 2 cores (the whole of cpu/ is 5,500 mutants)
    "kernels": (["minidl/kernels/__init__.py", "minidl/kernels/cpu/blas.py", "minidl/kernels/cpu/dense.py",
                 "minidl/kernels/cpu/elementwise.py", "minidl/kernels/cpu/matmul.py", "minidl/kernels/cpu/updates.py"], ["tests/minidl/kernels"]),
    "kernels_conv": (["minidl/kernels/cpu/conv.py", "minidl/kernels/cpu/im2col.py", "minidl/kernels/cpu/taps.py"],
                     ["tests/minidl/kernels"]),
    "kernels_onednn": (["minidl/kernels/cpu/conv_onednn.py", "minidl/kernels/cpu/onednn.py"], ["tests/minidl/kernels"]),
    "kernels_norm": (["minidl/kernels/cpu/norm.py"], ["tests/minidl/kernels"]),
    # (test_step_memory.py traces the step's allocations, and mutmut's own call records count there)
    "kernels_buffers": (["minidl/kernels/cpu/buffers.py"], ["tests/minidl/kernels/test_buffers.py"]),
    "kernels_cuda": (["minidl/kernels/cuda"], ["tests/minidl/kernels"]),
}

# A mutant's tests that run longer than this (wall clock) are stopped and counted as a timeout
# (the slowest target's tests take under a minute unmutated); --stall-after changes it.
STALLED_MUTANT_S = 300

# Functions that Numba compiles cannot be mutated by mutmut: it replaces each function by a
# trampoline that Numba cannot compile. Each of these loops is held to its NumPy reference by the
# kernel tests (tests/minidl/kernels), which is what a mutant there would fail.
NOT_MUTATED = ["minidl/kernels/cpu/loss.py", "minidl/kernels/cpu/norm_loops.py", "minidl/kernels/cpu/dense_loops.py",
               "minidl/kernels/cpu/updates_loops.py"]


def working_tree_files():
    """The tracked files and the untracked ones git does not ignore (the tree as a developer has it)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


def configure(folder, sources, tests):
    lines = ["", "[mutmut]", "source_paths ="] + [f"    {s}" for s in sources]
    lines += ["pytest_add_cli_args_test_selection ="] + [f"    {t}" for t in tests]
    lines += ["do_not_mutate ="] + [f"    {f}" for f in NOT_MUTATED]
    # the mutated files' packages and the tests' helpers must be importable beside the mutants
    lines += ["also_copy =", "    minidl", "    minidl_parallel", "    minidl_checks", "    tests", "    examples",
              "    benchmarks", "    pyproject.toml"]
    # tests of a stack location fail under mutmut's trampolines whatever the mutant (tests/conftest.py)
    lines += ["pytest_add_cli_args =", "    -m", "    not call_site", "    -p", "    _mutation_plugin"]
    with open(folder / "setup.cfg", "a") as f:
        f.write("\n".join(lines) + "\n")


def stop_stalled_mutants(limit_s, finished):
    """Send SIGXCPU to each of mutmut's mutant processes that has run longer than limit_s seconds.

    mutmut bounds a mutant by CPU time only, so a mutant that deadlocks (a worker pool that never
    answers) sleeps forever. SIGXCPU is the signal mutmut's own limit sends: it records a timeout.
    """
    ticks = os.sysconf("SC_CLK_TCK")
    while not finished.wait(10):
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        for proc in Path("/proc").iterdir():
            try:
                if not proc.name.isdigit() or not (proc / "cmdline").read_bytes().startswith(b"mutmut: "):
                    continue
                # field 22 of stat (counted from 1) is the start time; the name (field 2) may hold spaces
                started = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
                if uptime - started > limit_s:
                    os.kill(int(proc.name), signal.SIGXCPU)
            except (OSError, ValueError, IndexError):
                continue  # the process ended while being read


def rerun_fresh(folder, env, mutant, stall_after):
    """Whether ``mutant`` fails its tests in a fresh pytest process (True: killed there).

    mutmut forks each mutant's run from a process that already ran the tests, so a mutant in code
    that ran before the fork (at import, or filling a cache an earlier test left, as amp's cast
    policies resolve each op class once) never takes effect there. A fresh process with the
    mutant selected from the start runs it; the tests are the ones mutmut mapped to the function.
    """
    stats = json.loads((folder / "mutants" / "mutmut-stats.json").read_text())["tests_by_mangled_function_name"]
    tests = sorted(stats.get(re.sub(r"__mutmut_\d+$", "", mutant), []))
    if not tests:
        return False
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p",
                               "_mutation_plugin", "-m", "not call_site", *tests], cwd=folder / "mutants",
                              env=dict(env, MUTANT_UNDER_TEST=mutant), capture_output=True, timeout=stall_after)
    except subprocess.TimeoutExpired:
        return True  # (as mutmut counts a timeout)
    return done.returncode not in (0, 5)  # 5: no tests collected


def mutant_patterns(functions):
    """mutmut's names for the mutants of each function: ``Class.method`` or a module-level ``function``.

    mutmut names a mutant ``<module>.x_<function>__mutmut_<n>``, or ``<module>.xǁ<Class>ǁ<method>__mutmut_<n>``.
    """
    patterns = []
    for function in functions:
        owner, _, name = function.rpartition(".")
        patterns.append(f"*.xǁ{owner}ǁ{name}__mutmut_*" if owner else f"*.x_{name}__mutmut_*")
    return patterns


def run(name, keep, stall_after=STALLED_MUTANT_S, fresh=False, functions=()):
    sources, tests = TARGETS[name]
    patterns = mutant_patterns(functions)
    folder = Path(tempfile.mkdtemp(prefix=f"minidl-mutation-{name}-"))
    for f in working_tree_files():
        (folder / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, folder / f)
    configure(folder, sources, tests)
    # PyTorch's autograd engine deadlocks in a child forked after the parent used it, and mutmut forks
    # each mutant's run from a process that ran the tests: the cross-checks with PyTorch would stall
    # every mutant they reach. A stub that cannot be imported makes them skip (importorskip), as
    # without the bench extra; the finite-difference checks still hold every op.
    support = folder / "_mutation_support"
    (support / "torch").mkdir(parents=True)
    (support / "torch" / "__init__.py").write_text(
        'raise ImportError("PyTorch is hidden from mutation runs (tools/mutation.py)")\n')
    # tqdm's default write lock is a multiprocessing semaphore, shared by every forked child: one
    # child stopped while holding it stalls all the later ones. A thread lock is each child's own.
    (support / "_mutation_plugin.py").write_text(
        '"""Loaded into mutmut\'s pytest runs by tools/mutation.py: a per-process lock for tqdm."""\n'
        "import threading\n\n"
        "try:\n    import tqdm\nexcept ImportError:\n    pass\n"
        "else:\n    tqdm.tqdm.set_lock(threading.RLock())\n")
    # CI: the bounded hypothesis profile, as in CI. (Code that only the tests' subprocesses reach, mpirun's
    # ranks or the launcher's workers, shows as "no tests": mutmut maps tests to functions in its own process.)
    env = dict(os.environ, CI="true",
               PYTHONPATH=os.pathsep.join(filter(None, [str(support), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    finished = threading.Event()
    watchdog = threading.Thread(target=stop_stalled_mutants, args=(stall_after, finished), daemon=True)
    watchdog.start()
    with open(folder / "mutmut-run.log", "w") as log:
        done = subprocess.run([sys.executable, "-m", "mutmut", "run", *patterns], cwd=folder, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    finished.set()
    seconds = time.monotonic() - start
    if done.returncode != 0:
        tail = (folder / "mutmut-run.log").read_text(errors="replace")[-3000:]
        print(f"{name}: mutmut run failed ({done.returncode}); its folder {folder} is kept:\n{tail}")
        return 1
    listing = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=folder, env=env,
                             capture_output=True, text=True).stdout
    status = [line.strip().rsplit(": ", 1) for line in listing.splitlines() if ": " in line and "__mutmut_" in line]
    if patterns:  # (the listing names every mutant of the files, run or not)
        status = [(m, v) for m, v in status if any(fnmatch.fnmatch(m, p) for p in patterns)]
        if not status:
            print(f"{name}: no mutants of {list(functions)} (names as Class.method or function)")
            return 1
    counts = {}
    for _, verdict in status:
        counts[verdict] = counts.get(verdict, 0) + 1
    print(f"== {name}{' (' + ' '.join(functions) + ')' if functions else ''}: {len(status)} mutants in {seconds:.0f} s: "
          + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    if fresh:
        killed = [m for m, v in status if v == "survived" and rerun_fresh(folder, env, m, stall_after)]
        status = [(m, "killed in a fresh process" if m in killed else v) for m, v in status]
        print(f"   (--fresh: {len(killed)} of the survivors fail in a fresh process: state set before the fork)")
    for mutant, verdict in status:
        if verdict in ("survived", "no tests", "timeout", "suspicious", "killed in a fresh process"):
            diff = subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=folder, env=env,
                                  capture_output=True, text=True).stdout
            body = [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
            print(f"-- {verdict}: {mutant}\n   " + "\n   ".join(body))
    if keep:
        print(f"(the run's folder: {folder})")
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help=f"among {', '.join(TARGETS)}")
    parser.add_argument("--list", action="store_true", help="print the targets with their files and tests")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (mutmut browse there)")
    parser.add_argument("--stall-after", type=float, default=STALLED_MUTANT_S, metavar="SECONDS",
                        help=f"stop a mutant's tests after this long, a timeout (default {STALLED_MUTANT_S}; "
                             f"intra_op's tests take 3 s and its pool's mutants deadlock: 60 there)")
    parser.add_argument("--fresh", action="store_true",
                        help="re-run each survivor in a fresh process (code run before mutmut's fork: imports, "
                             "caches filled by earlier tests) and report those it kills there")
    parser.add_argument("--functions", nargs="+", default=(), metavar="NAME",
                        help="mutate only these functions of the targets' files (Class.method or function), "
                             "as for a change to a large module")
    args = parser.parse_args()
    if args.list or not args.targets:
        for name, (sources, tests) in TARGETS.items():
            print(f"{name}: {' '.join(sources)}  <-  {' '.join(tests)}")
        return 0
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown targets {unknown}: expected some of {list(TARGETS)}")
    return max(run(name, args.keep, args.stall_after, args.fresh, args.functions) for name in args.targets)


if __name__ == "__main__":
    sys.exit(main())
