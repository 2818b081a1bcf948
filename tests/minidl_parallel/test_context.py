"""init/release, ranks, the auto-parallel context and the runtime it installs into minidl."""
import multiprocessing

import numpy as np

import minidl
import pytest

import minidl_parallel as mp
from minidl.runtime import LOCAL, get_runtime
from minidl_parallel import ParallelMode
from minidl_parallel import run_threads
from minidl_parallel.runtime import ParallelRuntime


@pytest.fixture(autouse=True)
def _clean():
    mp.release()
    mp.reset_auto_parallel_context()
    yield
    mp.release()
    mp.reset_auto_parallel_context()


def test_world_of_one_before_and_after_init(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert (mp.get_rank(), mp.get_group_size(), mp.get_local_rank(), mp.get_local_rank_size()) == (0, 1, 0, 1)
    assert not mp.is_initialized()
    comm = mp.init()
    assert comm.backend == "local" and mp.init() is comm and mp.is_initialized()
    with pytest.raises(RuntimeError, match="already initialised with backend 'local'"):
        mp.init("mpi")
    mp.release()
    with pytest.raises(RuntimeError, match="call minidl_parallel.init"):
        mp.get_communicator()


def test_a_gpu_process_outside_a_launcher_gets_a_world_of_one(monkeypatch):
    """Outside mpirun init() never picks nccl (which would need mpi4py and join no one), even
    when minidl's device is the GPU; under mpirun the device picks nccl or mpi."""
    from minidl import backend
    from minidl_parallel import world
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(backend, "get_device_target", lambda: "GPU")
    assert world._default_backend() == "local"
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert world._default_backend() == "nccl"
    monkeypatch.setattr(backend, "get_device_target", lambda: "CPU")
    assert world._default_backend() == "mpi"


def test_init_rejects_unknown_backends():
    with pytest.raises(ValueError, match=r"unknown backend_name 'gloo'; expected one of .*'threads'"):
        mp.init("gloo")


def test_auto_parallel_context_defaults_set_and_reset():
    assert mp.get_auto_parallel_context("parallel_mode") == ParallelMode.STAND_ALONE
    assert mp.get_auto_parallel_context("device_num") == 1 and mp.get_auto_parallel_context("global_rank") == 0
    mp.set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True, device_num=8)
    assert mp.get_auto_parallel_context("gradients_mean") is True
    assert mp.get_auto_parallel_context("device_num") == 8
    mp.reset_auto_parallel_context()
    assert mp.get_auto_parallel_context("gradients_mean") is False


@pytest.mark.parametrize("kwargs, match", [
    ({"parallel_mode": "pipeline"}, r"parallel_mode must be one of \('stand_alone', 'data_parallel'"),
    ({"gradients_mean": 1}, "gradients_mean must be True or False, got 1"),
    ({"device_num": 0}, "device_num must be None or an int >= 1, got 0"),
    ({"global_rank": -1}, "global_rank must be None or an int >= 0, got -1"),
    ({"fusion": True}, r"unknown key 'fusion'; valid keys are \('parallel_mode'"),
])
def test_auto_parallel_context_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mp.set_auto_parallel_context(**kwargs)
    with pytest.raises(ValueError, match="get_auto_parallel_context: unknown key 'x'"):
        mp.get_auto_parallel_context("x")


def test_init_installs_a_runtime_and_release_removes_it(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert get_runtime().placing is LOCAL
    mp.set_auto_parallel_context(gradients_mean=True)  # before init: carried into the world
    mp.init()
    runtime = get_runtime().placing
    assert isinstance(runtime, ParallelRuntime) and runtime.scope == "process"
    assert (runtime.rank(), runtime.group_size()) == (0, 1) and runtime.world.settings["gradients_mean"] is True
    mp.release()
    assert get_runtime().placing is LOCAL and mp.get_auto_parallel_context("gradients_mean") is True


def test_each_thread_rank_has_its_own_runtime_and_the_main_thread_none():
    def body():
        runtime = get_runtime().placing
        return type(runtime).__name__, runtime.scope, runtime.rank(), runtime.group_size()

    assert run_threads(3, body, timeout=20) == [("ParallelRuntime", "thread", r, 3) for r in range(3)]
    assert get_runtime().placing is LOCAL


def test_data_parallel_grad_reducer_is_resolved_per_thread_when_asked():
    def body():
        params = [minidl.Parameter(np.ones(2), name="w")]
        before = get_runtime().grad_reducer(params)
        mp.set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True)
        after = get_runtime().grad_reducer(params)
        return before, type(after).__name__, after.mean

    assert run_threads(3, body, timeout=20) == [(None, "DistributedGradReducer", True)] * 3
    assert LOCAL.grad_reducer([]) is None


def test_init_refuses_a_world_size_it_cannot_build(monkeypatch):
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(RuntimeError, match=r"world_size=4 was asked, but this process was not started by a "
                                           r"launcher .* `mpirun -n 4"):
        mp.init(world_size=4)
    assert not mp.is_initialized() and get_runtime().placing is LOCAL
    with pytest.raises(RuntimeError, match="rank=1 was asked, but backend 'local' gave this process rank 0 of 1"):
        mp.init(rank=1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\] for world_size=2, got 2"):
        mp.init(rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size must be None or an int >= 1, got 0"):
        mp.init(world_size=0)
    assert mp.init(rank=0, world_size=1).size == 1


def test_init_inside_the_threads_world_checks_the_stated_world():
    def body():
        assert mp.init("threads", rank=mp.get_rank(), world_size=3) is mp.get_communicator()
        with pytest.raises(RuntimeError, match="world_size=2 was asked, but backend 'threads' built a world of 3"):
            mp.init(world_size=2)
        return True

    assert run_threads(3, body, timeout=20) == [True] * 3


def _init_in_child(rank, world_size, queue):
    import minidl_parallel
    try:
        minidl_parallel.init(rank=rank, world_size=world_size)
        queue.put((rank, "trained alone"))
    except RuntimeError as e:
        queue.put((rank, str(e)))


def test_processes_started_without_a_launcher_raise_instead_of_training_alone(monkeypatch):
    """SINGA's pattern: multiprocessing.Process workers that call init(rank=, world_size=)."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"):
        monkeypatch.delenv(var, raising=False)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_init_in_child, args=(r, 2, queue)) for r in range(2)]
    for p in procs:
        p.start()
    answers = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert sorted(answers) == [0, 1]
    for message in answers.values():
        assert "world_size=2 was asked, but this process was not started by a launcher" in message


def test_settings_are_thread_local_under_the_threads_backend():
    mp.set_auto_parallel_context(gradients_mean=True)

    def body():
        mine = mp.get_rank() % 2 == 0
        mp.set_auto_parallel_context(gradients_mean=mine)
        mp.get_communicator().barrier()
        return mp.get_auto_parallel_context("gradients_mean")

    assert run_threads(4, body, timeout=20) == [True, False, True, False]
    assert mp.get_auto_parallel_context("gradients_mean") is True


def test_threads_init_outside_run_threads_is_a_world_of_one():
    comm = mp.init("threads")
    assert (comm.rank, comm.size) == (0, 1)
    np.testing.assert_array_equal(comm.allreduce(np.ones(2), "mean"), np.ones(2))


def test_ranks_on_one_machine_share_its_cores_for_intra_op_threads(monkeypatch):
    """With 4 ranks per machine, each rank's intra-op threads drop to cores // 4 (at least 1),
    unless the user chose them (MINIDL_NUM_THREADS) or the thread count (OMP_NUM_THREADS)."""
    import os
    import minidl
    from minidl_parallel import world as context
    before = minidl.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MINIDL_NUM_THREADS", raising=False)
    monkeypatch.setitem(context._hooks, "blas", None)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    calls = []
    monkeypatch.setattr(minidl, "set_num_threads", calls.append)
    monkeypatch.setitem(__import__("sys").modules, "threadpoolctl", None)  # no threadpoolctl: import fails
    context._limit_blas_threads(4)
    assert calls == [min(2, before)]
    calls.clear()
    monkeypatch.setenv("MINIDL_NUM_THREADS", "3")
    context._limit_blas_threads(4)
    assert calls == []
