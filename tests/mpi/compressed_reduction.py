"""Run under mpirun -n 2: DistributedGradReducer with fp16 and bf16 compression over MPI (MPI's
float16 sum, and minidl's bfloat16 operation on raw words) gives exactly the 16-bit sum of the
two ranks' rounded gradients, then the mean in float32; prints one line per rank."""
import ml_dtypes
import numpy as np

import minidl_parallel as mp
from minidl import Parameter, Tensor
from minidl_parallel.grad_reducer import DistributedGradReducer


def main():
    comm = mp.init("mpi")
    grads = [np.random.default_rng([5, r]).standard_normal(1000).astype(np.float32) * 10 for r in range(2)]
    failures = []
    for name, wire in (("fp16", np.float16), ("bf16", ml_dtypes.bfloat16)):
        reducer = DistributedGradReducer([Parameter(np.zeros(1000, np.float32), name="w")], compression=name)
        got = reducer((Tensor(grads[comm.rank]),))[0].asnumpy()
        a, b = (g.astype(wire).astype(np.float32) for g in grads)
        want = (a + b).astype(wire).astype(np.float32) * np.float32(0.5)  # one rounded 16-bit add
        if not np.array_equal(got, want) or reducer.overflowed():
            failures.append(f"{name}: max diff {np.max(np.abs(got - want))}")
    print(f"rank {comm.rank}: failures {failures}", flush=True)
    mp.release()


if __name__ == "__main__":
    main()
