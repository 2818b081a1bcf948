"""What the sharding-rule tests share: specs, a rule's layouts as text, and runs on thread-ranks."""
import numpy as np

import minidl
from minidl_parallel import run_threads
from minidl_parallel.tensor_parallel.rules import TensorSpec, get_rule

F64 = np.dtype(np.float64)


def host(array):
    """A NumPy copy of a gathered value, from either array module (the suite also runs pinned to the GPU)."""
    return np.array(minidl.backend.to_numpy(array))


def spec(shape, param=False, dtype=F64):
    return TensorSpec(tuple(shape), np.dtype(dtype), param)


def infer(prim, args, strategy, device_num):
    return get_rule(prim).infer(prim, tuple(args), strategy, device_num)


def layouts_of(sh):
    """(input layouts, output layout, repeat axes) of an OpSharding, as text."""
    return [str(lay) for lay in sh.in_layouts], str(sh.out_layout), sh.repeat_axes


def on_ranks(n, fn, mode="semi_auto_parallel", dataset="full_batch"):
    """``fn()`` on n thread-ranks under ``mode`` and ``dataset``; the results in rank order."""
    def body():
        import minidl_parallel as mp
        mp.set_auto_parallel_context(parallel_mode=mode, dataset_strategy=dataset)
        try:
            return fn()
        finally:
            mp.reset_auto_parallel_context()
    return run_threads(n, body, timeout=60)
