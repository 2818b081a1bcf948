"""The nccl backend's watchdog, with stand-ins for CuPy's CUDA events and NCCL communicator (no
GPU here): a collective whose event never completes is warned about, then ends the job naming
it; an asynchronous NCCL error ends the job at once; completed collectives leave the queue."""
import threading
import time

import pytest

from minidl_parallel.comm import nccl as nccl_backend
from minidl_parallel.comm.base import CallInfo, Communicator


class _Event:
    def __init__(self, done):
        self.done = done


class _Stream:
    def __init__(self, done):
        self._done = done

    def record(self):
        return _Event(self._done)


class _Cuda:
    def __init__(self, done):
        self._done = done

    def Device(self, device):  # noqa: N802 - CuPy's name
        return type("Device", (), {"use": lambda self: None})()

    def get_current_stream(self):
        return _Stream(self._done)


class _Cupy:
    def __init__(self, done):
        self.cuda = _Cuda(done)


class _NcclComm:
    def __init__(self, error=None):
        self.error, self.aborted = error, False

    def check_async_error(self):
        if self.error is not None:
            raise RuntimeError(self.error)

    def abort(self):
        self.aborted = True


class _InnerMpi:
    def _serve_peers(self, call):
        pass


def _communicator(done, error=None, timeout=0.4, stall_warning=0.1):
    """A NcclCommunicator as __init__ leaves it, on stand-ins; _end_job records instead of aborting MPI."""
    comm = nccl_backend.NcclCommunicator.__new__(nccl_backend.NcclCommunicator)
    Communicator.__init__(comm, 0, 2, timeout=timeout, stall_warning=stall_warning)
    comm._cupy, comm.comm, comm._mpi, comm.device = _Cupy(done), _NcclComm(error), _InnerMpi(), 0
    comm._pending, comm._watchdog = nccl_backend.collections.deque(), None
    comm.ended = threading.Event()

    def end_job(message):
        comm.end_message = message
        comm.comm.abort()
        comm.comm = None  # what the abort leaves: the watchdog stops
        comm.ended.set()
    comm._end_job = end_job
    return comm


def test_a_collective_that_never_completes_is_warned_about_then_ends_the_job(capfd):
    comm = _communicator(done=False)
    comm._call = CallInfo("allreduce", 7, (3, 5), "float32")
    started = time.monotonic()
    comm._follow()
    assert comm.ended.wait(5), "the watchdog did not end the job"
    assert 0.4 <= time.monotonic() - started < 2.0
    assert "allreduce #7(shape=(3, 5), dtype=float32) timed out after 0.4 s" in comm.end_message
    assert "aborting NCCL and the MPI job" in comm.end_message
    assert "allreduce #7(shape=(3, 5), dtype=float32) has waited" in capfd.readouterr().err


def test_an_asynchronous_nccl_error_ends_the_job_at_once():
    comm = _communicator(done=False, error="unhandled system error", timeout=60, stall_warning=0)
    comm._call = CallInfo("allgather", 2, (4,), "float64")
    comm._follow()
    assert comm.ended.wait(5)
    assert "NCCL reported an error during allgather #2" in comm.end_message
    assert "unhandled system error" in comm.end_message


def test_completed_collectives_leave_the_queue_and_end_nothing():
    comm = _communicator(done=True, timeout=0.2, stall_warning=0.1)
    for seq in range(3):
        comm._call = CallInfo("allreduce", seq, (2,), "float32")
        comm._follow()
    deadline = time.monotonic() + 2
    while comm._pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not comm._pending
    time.sleep(0.3)  # past the timeout: nothing is in flight, so nothing ends
    assert not comm.ended.is_set()
    comm.comm = None  # stops the watchdog


def test_without_timeout_and_warning_no_watchdog_starts():
    comm = _communicator(done=False, timeout=0, stall_warning=0)
    comm._call = CallInfo("allreduce", 0, (2,), "float32")
    comm._follow()
    assert comm._watchdog is None and not comm._pending


def test_stop_watchdogs_ends_the_threads_before_mpi_finalizes():
    comm = _communicator(done=False, timeout=60, stall_warning=0)
    comm._call = CallInfo("allreduce", 0, (2,), "float32")
    comm._follow()
    assert comm._watchdog.is_alive()
    nccl_backend.stop_watchdogs()
    assert not comm._watchdog.is_alive()
    assert not comm.ended.is_set()


@pytest.fixture(autouse=True)
def _watchdogs_may_run():
    nccl_backend._stopping.clear()
    yield
