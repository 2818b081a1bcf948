r"""The smoke test to run first: every rank contributes its rank; all gather [[0.] [1.] ...].

    mpirun -n 4 python examples/nccl_allgather.py      # NCCL on GPUs, MPI on CPUs
    # as root / on a small machine (OpenMPI):
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        mpirun --oversubscribe -n 4 python examples/nccl_allgather.py

Rank 0 prints the gathered array (MindSpore's AllGather sample).
"""
import numpy as np

import minidl
import minidl_parallel as mp


def main():
    comm = mp.init()
    xp = minidl.backend.default_xp() if comm.backend == "nccl" else np
    x = xp.full((1, 1), float(mp.get_rank()), dtype=np.float32)
    out = mp.ops.AllGather()(minidl.Tensor(x)).data
    if mp.get_rank() == 0:
        print(minidl.backend.to_numpy(out))
    mp.release()


if __name__ == "__main__":
    main()
