"""minidl: a small deep-learning framework on NumPy (CPU) and CuPy (GPU).

    import minidl
    from minidl import nn, ops
"""
from .kernels.cpu.threads import get_num_threads, set_num_threads
from .backend import set_context, get_context, set_seed, get_seed, GRAPH_MODE, PYNATIVE_MODE
from .tensor import (Tensor, Parameter, no_grad, is_grad_enabled,
                     float16, float32, float64, int8, int32, int64, uint8, bool_)
from .autograd import value_and_grad, grad
from . import runtime
from . import ops
from .kernels import cpu as _cpu_kernels, cuda as _cuda_kernels  # noqa: F401  (registers the kernels)
from . import common
from . import nn
from . import dataset
from .io import save_checkpoint, load_checkpoint, load_param_into_net, load_checkpoint_metadata
from . import train
from . import amp
from .train import Model
from . import graph_mode  # noqa: F401  (installs GRAPH_MODE's layer when that mode is set)

# Opt-in, because it is process-wide: with MINIDL_MALLOC_TUNING=1 freed step buffers stay in the
# heap (a training step 1.07-1.35x faster on the CPU, measured in minidl/kernels/cpu/malloc.py);
# unset or 0, glibc's defaults are left alone.
from .kernels.cpu import malloc as _malloc  # noqa: E402
_malloc.tune_if_requested()

__version__ = "0.1.0"

__all__ = ["Tensor", "Parameter", "no_grad", "is_grad_enabled", "value_and_grad", "grad",
           "set_context", "get_context", "GRAPH_MODE", "PYNATIVE_MODE", "set_seed", "get_seed", "set_num_threads", "get_num_threads", "ops", "nn", "common", "dataset", "train", "Model",
           "save_checkpoint", "load_checkpoint", "load_param_into_net", "load_checkpoint_metadata",
           "float16", "float32", "float64", "int8", "int32", "int64", "uint8", "bool_"]
