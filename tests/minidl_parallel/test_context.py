"""init/release, ranks, the auto-parallel context and its hooks into minidl."""
import numpy as np
import pytest

import minidl_parallel as mp
from minidl.dataset import get_default_shards, set_default_shards
from minidl.train import model as train_model
from minidl_parallel import ParallelMode
from minidl_parallel.comm.threads import run_threads


@pytest.fixture(autouse=True)
def _clean():
    mp.release()
    mp.reset_auto_parallel_context()
    yield
    mp.release()
    mp.reset_auto_parallel_context()
    set_default_shards(None, None)
    train_model.set_default_grad_reducer(None)


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


def test_data_parallel_registers_per_thread_shards_and_grad_reducer():
    def body():
        mp.set_auto_parallel_context(parallel_mode=ParallelMode.DATA_PARALLEL, gradients_mean=True)
        return get_default_shards(), mp.get_auto_parallel_context("global_rank")

    assert run_threads(3, body, timeout=20) == [((3, r), r) for r in range(3)]
    # The main thread is not data parallel: the registered provider answers "no sharding".
    assert get_default_shards() is None
    assert train_model.get_default_grad_reducer()([]) is None


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
    from minidl_parallel import context
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
