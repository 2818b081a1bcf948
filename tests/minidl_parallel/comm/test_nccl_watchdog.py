"""The nccl backend's watchdog, with stand-ins for CuPy's CUDA events and NCCL communicator (no
GPU here): a collective whose event never completes is warned about, then ends the job naming
it; an asynchronous NCCL error ends the job at once; completed collectives leave the queue."""
import re
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
    """The inner mpi communicator: records the calls the watchdog answers the peers with."""

    def __init__(self):
        self.served = []

    def _serve_peers(self, call):
        self.served.append(call)

    def _missing_ranks(self, call):
        return [1], f"; rank 1 was asked about {call}"


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


def _stalled(capfd, timeout, stall_warning, polled=None):
    """Runs one collective that never completes until the watchdog ends the job; (comm, stderr lines)."""
    comm = _communicator(done=False, timeout=timeout, stall_warning=stall_warning)
    if polled is not None:
        comm._mpi._polled = polled
    comm._call = CallInfo("allreduce", 3, (2,), "float32")
    comm._follow()
    assert comm.ended.wait(5), "the watchdog did not end the job"
    return comm, capfd.readouterr().err.splitlines()


def test_the_stall_warning_is_written_once_per_call(capfd):
    comm, lines = _stalled(capfd, timeout=0.4, stall_warning=0.05)
    assert len(lines) == 1 and re.fullmatch(
        r"minidl_parallel: rank 0 of 2 \(nccl backend\): allreduce #3\(shape=\(2,\), dtype=float32\) has waited "
        r"0\.\d s; ranks that have not arrived: unknown", lines[0]), lines
    assert re.fullmatch(r"minidl_parallel: rank 0 of 2 \(nccl backend\): allreduce #3\(shape=\(2,\), dtype=float32\) "
                        r"timed out after 0\.\d s; ranks that have not arrived: unknown; aborting NCCL and the MPI "
                        r"job \(timeout 0\.4 s\)", comm.end_message)


def test_no_stall_warning_when_it_is_off(capfd):
    comm, lines = _stalled(capfd, timeout=0.2, stall_warning=0)
    assert lines == [] and "timed out after" in comm.end_message


def test_the_watchdog_answers_the_peers_unless_mpi_is_below_thread_multiple(capfd):
    comm, _ = _stalled(capfd, timeout=0.2, stall_warning=0)
    assert comm._mpi.served and all(str(c) == "allreduce #3(shape=(2,), dtype=float32)" for c in comm._mpi.served)
    # below MPI_THREAD_MULTIPLE only the main thread may call MPI
    comm, _ = _stalled(capfd, timeout=0.2, stall_warning=0, polled=True)
    assert comm._mpi.served == []


def test_with_the_watch_channel_the_timeout_names_the_missing_ranks(capfd, monkeypatch):
    monkeypatch.setattr(nccl_backend, "watch", lambda: object())  # made by init's world communicator
    comm, _ = _stalled(capfd, timeout=0.2, stall_warning=0)
    assert "ranks that have not arrived: [1]; rank 1 was asked about allreduce #3(shape=(2,), dtype=float32); " \
           "aborting NCCL" in comm.end_message


def test_completed_collectives_leave_the_queue_all_at_once():
    """A training step enqueues dozens of collectives between two turns of the watchdog."""
    comm = _communicator(done=True, timeout=60, stall_warning=0)
    comm._call = CallInfo("allreduce", 0, (2,), "float32")
    for _ in range(200):
        comm._pending.append((_Event(True), comm._call, time.monotonic()))
    comm._follow()
    deadline = time.monotonic() + 0.3  # a turn is 10 ms; one event a turn would take 2 s
    while comm._pending and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not comm._pending
    comm.comm = None  # stops the watchdog


def test_the_exit_hook_is_registered_once_and_stopping_waits_at_most_wait_s(monkeypatch):
    registered = []
    monkeypatch.setattr(nccl_backend, "_watchdogs", [])
    monkeypatch.setattr(nccl_backend.atexit, "register", registered.append)
    comms = [_communicator(done=False, timeout=60, stall_warning=0) for _ in range(2)]
    for comm in comms:
        comm._call = CallInfo("allreduce", 0, (2,), "float32")
        comm._follow()  # from the main thread: the watchdog must still be a daemon, never holding up the exit
        assert registered == [nccl_backend.stop_watchdogs] and comm._watchdog.daemon
    release = threading.Event()
    stuck = threading.Thread(target=release.wait, args=(10.0,), daemon=True)  # a watchdog stuck in a survey
    nccl_backend._watchdogs.append(stuck)
    stuck.start()
    try:
        start = time.monotonic()
        nccl_backend.stop_watchdogs(wait_s=0.2)
        assert time.monotonic() - start < 2.0
        assert not any(comm._watchdog.is_alive() for comm in comms) and stuck.is_alive()
    finally:
        release.set()
        stuck.join(5.0)
        nccl_backend._stopping.clear()


def test_release_waits_for_the_watchdog_at_most_the_join_bound(monkeypatch):
    monkeypatch.setattr(nccl_backend, "_WATCHDOG_JOIN_S", 0.2)
    comm = _communicator(done=False, timeout=60, stall_warning=0)
    entered, release = threading.Event(), threading.Event()
    comm._mpi._serve_peers = lambda call: (entered.set(), release.wait(10.0))  # stuck in a survey
    comm._call = CallInfo("allreduce", 0, (2,), "float32")
    comm._follow()
    dog = comm._watchdog
    try:
        assert entered.wait(5)
        start = time.monotonic()
        comm._stop_watchdog()
        assert time.monotonic() - start < 2.0
        assert comm._watchdog is None and dog not in nccl_backend._watchdogs
    finally:
        release.set()
        comm.comm = None
        dog.join(5.0)
