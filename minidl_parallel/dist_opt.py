"""SINGA's ``DistOpt``, spelled as SINGA spells it, on minidl's optimizers and reducer.

    sgd = DistOpt(nn.Momentum(net.trainable_params(), 0.005, 0.9, weight_decay=1e-5))
    out = net(x); loss = loss_fn(out, y)
    sgd.backward_and_update(loss)                 # averaged fp32 gradients, fused buckets
    sgd(loss)                                     # SINGA's shorthand for backward_and_update(loss)
    sgd.backward_and_update_half(loss)            # the same in fp16 on the wire
    sgd.backward_and_partial_update(loss)         # local update, then one chunk of parameters averaged
    sgd.backward_and_sparse_update(loss, topK=True, spars=0.01, corr=True)

Each ``backward_and_*`` runs ``loss.backward()`` and takes the parameters' ``.grad`` (then
clears them), as SINGA's do. ``threshold`` is SINGA's: elements per fused buffer (the
reducer's ``fusion_bytes`` is threshold times the gradient's item size); the partial update
forms its chunks of about ``threshold`` elements the same way.

- ``backward_and_update``: the DistributedGradReducer's averaged all-reduce.
- ``backward_and_update_half(loss, clipping=False, clip_Value=100)``: gradients clipped to
  [-clip_Value, clip_Value] first when ``clipping``, then reduced with Compression.fp16; a
  step whose reduction overflowed is skipped with a warning (SINGA applies it silently).
- ``backward_and_partial_update``: every rank updates with its own gradients; then one chunk
  of the parameters (round robin, the same schedule on every rank) is averaged over the ranks.
  A full rotation without further local change leaves every rank with the same parameters.
- ``backward_and_sparse_update(spars, topK, corr)``: minidl_parallel/sparse.py selects and
  sends; with ``corr`` what a rank did not send is kept as a residual and added to its next
  gradient (error feedback), so sent + residual always adds up to every gradient computed;
  without it the rest is dropped. The sum of the sent parts is averaged over the ranks.
"""
import warnings

import numpy

from minidl.backend import get_array_module
from minidl.tensor import Tensor

from . import sparse
from .compression import Compression
from .context import get_local_rank
from .grad_reducer import DistributedGradReducer
from .tensor_parallel.counter import record
from .tensor_parallel.plan import comm_bytes
from .world import init

__all__ = ["DistOpt"]

_WHO = "DistOpt"
_DEFAULT_THRESHOLD = 2097152  # SINGA's default: elements per fused buffer


class DistOpt:
    """SINGA's distributed optimizer around a minidl optimizer.

    Args:
        opt: the optimizer (``nn.Momentum``, ``nn.SGD``...).
        nccl_id, local_rank, world_size: SINGA's arguments for processes it started itself:
            ``nccl_id`` joins the nccl backend with that unique id (``init("nccl",
            unique_id=...)``), ``world_size`` and ``local_rank`` are checked against the world
            (a world that differs raises).
        buffSize: accepted for SINGA's signature (minidl sizes its buffers per call).
    """

    def __init__(self, opt, nccl_id=None, local_rank=None, world_size=None, buffSize=4194304):
        if not callable(opt) or not isinstance(getattr(opt, "parameters", None), tuple):
            raise TypeError(f"{_WHO}: opt must be a minidl optimizer (callable, with .parameters), got "
                            f"{type(opt).__name__}")
        self.opt = opt
        # SINGA's nccl_id: the NCCL id its launcher made; minidl's ranks are MPI processes
        # (mpirun, minidl_parallel.run or spawn), which the id then joins over NCCL.
        self.communicator = init("nccl", world_size=world_size, unique_id=nccl_id) if nccl_id is not None \
            else init(world_size=world_size)
        if local_rank is not None and local_rank != get_local_rank():
            raise ValueError(f"{_WHO}: local_rank={local_rank} was given, but this process is local rank "
                             f"{get_local_rank()} of its machine; pass local_rank=None")
        self._reducers = {}
        self._partition = 0  # the next chunk backward_and_partial_update averages
        self.residuals = {}  # dtype -> this rank's unsent gradient (backward_and_sparse_update, corr=True)
        self.skipped_steps = 0

    @property
    def global_rank(self):
        return self.communicator.rank

    @property
    def local_rank(self):
        return self.communicator.local_rank

    @property
    def world_size(self):
        return self.communicator.size

    @property
    def parameters(self):
        return self.opt.parameters

    def __getattr__(self, name):  # learning rate, global_step, ... of the wrapped optimizer
        if name == "opt":
            raise AttributeError(name)
        return getattr(self.opt, name)

    # ---- SINGA's four update modes ------------------------------------------------------

    def __call__(self, loss):
        # SINGA's DistOpt.__call__ is backward_and_update(loss) with the default threshold:
        # its examples/cnn trains with ``self.optimizer(loss)`` for plain fp32.
        self.backward_and_update(loss)

    def backward_and_update(self, loss, threshold=_DEFAULT_THRESHOLD):
        self.opt(self._reducer(threshold, Compression.none)(self._backward(loss)))

    def backward_and_update_half(self, loss, threshold=_DEFAULT_THRESHOLD, clipping=False, clip_Value=100):
        grads = self._backward(loss)
        if clipping:
            if not clip_Value > 0:
                raise ValueError(f"{_WHO}.backward_and_update_half: clip_Value must be > 0, got {clip_Value!r}")
            grads = [None if g is None else get_array_module(g).clip(g, -clip_Value, clip_Value) for g in grads]
        reducer = self._reducer(threshold, Compression.fp16)
        reduced = reducer(grads)
        if reducer.overflowed():
            self.skipped_steps += 1
            warnings.warn(f"{_WHO}.backward_and_update_half: the fp16 reduction overflowed (inf or NaN); the step "
                          f"is skipped ({self.skipped_steps} so far); clipping=True bounds each gradient",
                          RuntimeWarning, stacklevel=2)
            return
        self.opt(reduced)

    def backward_and_partial_update(self, loss, threshold=_DEFAULT_THRESHOLD):
        self.opt(tuple(self._backward(loss)))
        chunks = self._chunks(threshold)
        chunk = chunks[self._partition % len(chunks)]
        self._partition = (self._partition + 1) % len(chunks)
        params = [self.opt.parameters[i] for i in chunk]
        xp = get_array_module(params[0].data)
        flat = xp.concatenate([xp.ravel(p.data) for p in params])
        comm = self.communicator
        record("allreduce", comm.size, comm_bytes("allreduce", flat.nbytes, comm.size), phase="gradients")
        flat = comm.allreduce(flat, "mean")
        off = 0
        for p in params:
            p.data[...] = flat[off:off + p.data.size].reshape(p.data.shape)
            off += p.data.size
        return chunk

    def backward_and_sparse_update(self, loss, threshold=_DEFAULT_THRESHOLD, spars=0.05, topK=False, corr=True):
        sparse.check_spars(spars, topK, f"{_WHO}.backward_and_sparse_update")
        grads = self._backward(loss)
        params = self.opt.parameters
        out = [None] * len(params)
        by_dtype = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(numpy.dtype(p.dtype), []).append(i)
        comm = self.communicator
        for dtype, members in by_dtype.items():
            xp = get_array_module(params[members[0]].data)
            flat = xp.concatenate([xp.zeros(p.data.size, dtype) if g is None else xp.ravel(g).astype(dtype)
                                   for g, p in ((grads[i], params[i]) for i in members)])
            if corr and dtype in self.residuals:
                flat += self.residuals[dtype]
            idx = sparse.select(flat, spars, topK)
            total = sparse.sparse_allreduce(comm, flat, idx)
            if corr:
                flat[idx] = 0
                self.residuals[dtype] = flat  # what was not sent waits for the next step
            total /= dtype.type(comm.size)
            off = 0
            for i in members:
                n = params[i].data.size
                out[i] = Tensor(total[off:off + n].reshape(params[i].data.shape))
                off += n
        self.opt(tuple(out))

    # ---- helpers --------------------------------------------------------------------------

    def _backward(self, loss):
        if not isinstance(loss, Tensor):
            raise TypeError(f"{_WHO}: loss must be the Tensor the network's loss returned, got {type(loss).__name__}")
        for p in self.opt.parameters:
            p.grad = None
        loss.backward()
        grads = []
        for p in self.opt.parameters:
            g = p.grad
            grads.append(None if g is None else (g.data if isinstance(g, Tensor) else g))
            p.grad = None
        return grads

    def _reducer(self, threshold, compression):
        key = (threshold, compression.name)
        if key not in self._reducers:
            if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
                raise ValueError(f"{_WHO}: threshold must be a positive int (elements per fused buffer), "
                                 f"got {threshold!r}")
            itemsize = max(numpy.dtype(p.dtype).itemsize for p in self.opt.parameters)
            self._reducers[key] = DistributedGradReducer(self.opt.parameters, mean=True, comm=self.communicator,
                                                         fusion_bytes=threshold * itemsize, compression=compression)
        return self._reducers[key]

    def _chunks(self, threshold):
        """Parameter indices in chunks of about ``threshold`` elements, in order (SINGA's partitions)."""
        chunks, current, size = [], [], 0
        for i, p in enumerate(self.opt.parameters):
            n = int(numpy.prod(p.shape))
            if current and size + n > threshold:
                chunks.append(current)
                current, size = [], 0
            current.append(i)
            size += n
        chunks.append(current)
        return chunks
