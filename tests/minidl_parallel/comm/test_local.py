"""The world of one and the backend registry."""
import numpy as np
import pytest

from minidl_parallel.comm import create_communicator
from minidl_parallel.comm.local import LocalCommunicator


def test_local_collectives_return_copies_of_the_input():
    comm = create_communicator("local")
    assert isinstance(comm, LocalCommunicator)
    assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
    x = np.arange(6.0).reshape(2, 3)
    for out in (comm.allreduce(x, "mean"), comm.allgather(x), comm.reduce_scatter(x, "max"), comm.broadcast(x),
                comm.alltoall(x, 0, 1), comm.iallreduce_(x.copy()).wait(), comm.split([0]).allreduce(x)):
        np.testing.assert_array_equal(out, x)
        assert out is not x
    assert comm.allgather(np.float64(2.0)).shape == (1,)
    comm.barrier()
    assert comm.collective_count == 8


def test_unknown_backend_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'gloo'; expected one of \('nccl', 'mpi', 'threads'"):
        create_communicator("gloo")


def test_nccl_backend_imports_lazily_with_an_install_hint():
    import minidl_parallel.comm.nccl as nccl  # importing the module needs neither CuPy nor MPI
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'minidl\[gpu\]'"):
            nccl.import_nccl()
    else:
        pytest.skip("CuPy is installed; the missing-library message cannot be observed")
