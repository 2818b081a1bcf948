"""Horovod's spellings: ``DistributedOptimizer``, ``broadcast_parameters``,
``broadcast_optimizer_state``, the ops ``Average``/``Sum``/``Adasum`` (``Compression`` lives in
compression.py).

``DistributedOptimizer(opt, ...)`` wraps a minidl optimizer; every option is the
DistributedGradReducer's (one implementation for the loop, Model and this wrapper):

    opt = DistributedOptimizer(nn.Momentum(params, 0.01, 0.9), compression=Compression.fp16,
                               backward_passes_per_step=4, op=Average)
    broadcast_parameters(net.parameters_dict(), root_rank=0)
    broadcast_optimizer_state(opt, root_rank=0)
    loss, grads = grad_fn(x, y)
    opt(grads)          # or, PyTorch style: loss.backward(); opt.step()

A call returns True when it updated the parameters, False when it only accumulated (the
first k - 1 of ``backward_passes_per_step`` calls) or skipped a step whose compressed
reduction overflowed (counted in ``skipped_steps``, with a warning naming the step).
"""
import warnings

from .broadcast import broadcast_tensors
from .grad_reducer import DistributedGradReducer

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state", "Average", "Sum", "Adasum"]

Average, Sum, Adasum = "Average", "Sum", "Adasum"  # Horovod's reduction ops (hvd.Average, ...)
_OPS = (Average, Sum, Adasum)
_WHO = "DistributedOptimizer"


class DistributedOptimizer:
    """Reduces gradients over the ranks, then lets the wrapped optimizer update.

    Args:
        optimizer: a minidl optimizer (``nn.Momentum``, ``nn.SGD``, ...).
        named_parameters: accepted for Horovod's signature; the optimizer's parameters are used.
        compression: ``Compression.none`` / ``fp16`` / ``bf16``.
        backward_passes_per_step: reduce (and update) once per this many calls.
        op: ``Average`` (default), ``Sum`` or ``Adasum``.
        gradient_predivide_factor: Horovod's f (with ``Average``): divide by f before the
            sum and by size / f after.
        comm: a communicator; default the world's, resolved at each use.
    """

    def __init__(self, optimizer, named_parameters=None, compression=None, backward_passes_per_step=1,
                 op=Average, gradient_predivide_factor=1.0, comm=None):
        if not callable(optimizer) or not isinstance(getattr(optimizer, "parameters", None), tuple):
            raise TypeError(f"{_WHO}: optimizer must be a minidl optimizer (callable, with .parameters), got "
                            f"{type(optimizer).__name__}")
        if op not in _OPS:
            raise ValueError(f"{_WHO}: op must be Average, Sum or Adasum, got {op!r}")
        self.optimizer = optimizer
        self.op = op
        self.reducer = DistributedGradReducer(
            optimizer.parameters, mean=op == Average, comm=comm, compression=compression,
            gradient_predivide_factor=gradient_predivide_factor, backward_passes_per_step=backward_passes_per_step,
            adasum=op == Adasum)
        self.skipped_steps = 0
        self._calls = 0

    @property
    def parameters(self):
        return self.optimizer.parameters

    def __call__(self, grads):
        """Reduces ``grads`` (aligned with the parameters) and updates; see the module doc."""
        self._calls += 1
        reduced = self.reducer(grads)
        if reduced is None:
            return False
        if self.reducer.overflowed():
            self.skipped_steps += 1
            warnings.warn(f"{_WHO}: call {self._calls}: the reduced gradients hold inf or NaN "
                          f"({self.reducer.compression!r}: a 16-bit sum out of range, or a non-finite gradient "
                          f"on some rank); the step is skipped ({self.skipped_steps} so far). With fp16, "
                          f"gradient_predivide_factor=<world size> or Compression.bf16 keeps sums in range",
                          RuntimeWarning, stacklevel=2)
            return False
        self.optimizer(reduced)
        return True

    def step(self):
        """PyTorch style: reduces every parameter's ``.grad`` and updates."""
        return self([p.grad for p in self.parameters])

    def zero_grad(self):
        self.optimizer.zero_grad()

    def __getattr__(self, name):  # learning_rate, global_step, state_dict, ... of the wrapped optimizer
        if name == "optimizer":
            raise AttributeError(name)
        return getattr(self.optimizer, name)


def _tensors(params):
    """Horovod accepts a dict (sorted by name, as Horovod does), (name, tensor) pairs or tensors."""
    if isinstance(params, dict):
        return [t for _, t in sorted(params.items(), key=lambda kv: kv[0])]
    out = []
    for item in params:
        out.append(item[1] if isinstance(item, tuple) and len(item) == 2 else item)
    return out


def broadcast_parameters(params, root_rank=0, comm=None):
    """Overwrites every tensor with root_rank's values (Horovod's ``broadcast_parameters``).

    ``params``: ``net.parameters_dict()``, ``net.parameters_and_names()`` or a list of
    Parameters, the same on every rank. Returns the number of broadcasts (fused buffers).
    """
    return broadcast_tensors(_tensors(params), root=root_rank, comm=comm,
                             who="broadcast_parameters")


def broadcast_optimizer_state(optimizer, root_rank=0, comm=None):
    """Overwrites the optimizer's state (global step, momentum buffers...) with root_rank's.

    Buffers an optimizer makes at its first update (momentum) do not exist before it: call
    this after the first step, or rely on them starting at zero on every rank.
    """
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    if not hasattr(inner, "parameters_and_names"):
        raise TypeError(f"broadcast_optimizer_state: expected a minidl optimizer, got {type(optimizer).__name__}")
    return broadcast_tensors([t for _, t in inner.parameters_and_names()], root=root_rank, comm=comm,
                             who="broadcast_optimizer_state")
