"""The optimizer-parallel gradient reducer (ZeRO over the data-parallel ranks).

The DATA_PARALLEL runtime hands ``Model.train`` and ``nn.TrainOneStepCell`` this reducer when
``enable_parallel_optimizer`` is on. Per optimizer step, for each parameter the plan slices:

- level1: the gradient is all-reduced whole (the plain reducer's buckets), then this rank keeps
  its rows; communication: an all-reduce plus the weights' all-gather (1.5x an all-reduce);
- level2: the gradients are reduce-scattered (each rank receives only the sum of its rows),
  then all-reduced across the shard groups' replicas when ``optimizer_weight_shard_size`` is
  smaller than the world; communication: one all-reduce's worth (1x). With
  ``gradient_accumulation_shard`` each accumulating call reduce-scatters and keeps only its rows;
- level3: as level2, and each cell's weights are whole only while the cell runs
  (optimizer_parallel/level3.py): 1.5x.

After the reduction the weights become their slices again (the optimizer updates slices and its
state follows: ``Optimizer._follow_parameter_layouts``); the next call of a Cell gathers them
(:meth:`gather_weights`, from the runtime's ``call_cell``; at level3 each cell gathers its own). Parameters under
``parallel_optimizer_threshold`` are reduced whole by a plain DistributedGradReducer.

Under SEMI_AUTO_PARALLEL / AUTO_PARALLEL (``tensor_parallel=True``) each block is sliced over the
ranks holding the same block. At level1 the operators' backward all-reduced each block's gradient
already and each rank keeps its rows; at level2/3 the operators leave a sliced parameter's
gradient partial over its slice group (``dispatch.defer_gradient_reduction``) and it is
reduce-scattered here.

The mean's 1/degree is folded into the packing copy, as the plain reducer does, so with the same
summation order (the threads world) level1 and level2 are bit-identical to plain data
parallelism; MPI may sum in another order (within rounding).
"""
import math
import weakref

import numpy

from minidl import backend
from minidl.tensor import Tensor

from ..agreement import require_same_tensors
from ..broadcast import broadcast_tensors
from ..buckets import DEFAULT_FUSION_BYTES
from ..collectives import resolve_communicator
from ..compression import Compression
from ..grad_reducer import DistributedGradReducer
from ..join import Join, count_ranks_with_data
from ..tensor_parallel.counter import record
from ..context import current_world
from ..tensor_parallel import strategy_file
from ..tensor_parallel.dispatch import defer_gradient_reduction, groups, reduction_state
from ..tensor_parallel.plan import comm_bytes
from . import slices

__all__ = ["OptimizerParallelReducer"]

_WHO = "OptimizerParallelReducer"


def _stride(placement):
    """MindSpore's ``opt_weight_shard_step``: the world-rank distance between two ranks of the group."""
    ranks = placement.ranks
    return int(ranks[1] - ranks[0]) if ranks is not None and len(ranks) > 1 else 1


class OptimizerParallelReducer:
    """Reduces gradients to this rank's slices and keeps the sliced weights as slices between steps.

    Args:
        parameters: the optimizer's Parameters, in the order of ``grads``.
        config: the ``parallel_optimizer_config`` dict (minidl_parallel/optimizer_parallel_config.py).
        mean, compression, gradient_predivide_factor, backward_passes_per_step,
        parameter_broadcast, fusion_bytes, comm: as DistributedGradReducer's.
    """

    collective = True

    def __init__(self, parameters, config, mean=True, compression=None, gradient_predivide_factor=1.0,
                 backward_passes_per_step=1, parameter_broadcast=False, fusion_bytes=DEFAULT_FUSION_BYTES, comm=None,
                 tensor_parallel=False):
        self.parameters = tuple(parameters)
        self.tensor_parallel = tensor_parallel
        self.level = config["optimizer_level"]
        self.threshold_kb = config["parallel_optimizer_threshold"]
        self.shard_size = config["optimizer_weight_shard_size"]
        self.accumulation_shard = config["gradient_accumulation_shard"]
        self.mean = mean
        self.compression = Compression.resolve(compression, _WHO)
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.backward_passes_per_step = backward_passes_per_step
        self.parameter_broadcast = parameter_broadcast
        self.fusion_bytes = fusion_bytes
        self._comm = comm if comm is None else resolve_communicator(_WHO, comm)
        self._plan_comm = None  # weak reference to the communicator the plan was made for
        self.placements = None  # per parameter: its OptimizerSlice, or None (kept whole)
        self._inner = None
        self._calls = 0
        self._sums = {}  # parameter index -> accumulated gradient (a slice with accumulation_shard)
        self._overflowed = False
        # Uneven inputs (minidl_parallel/join.py): the open join block, whether this step's vote is
        # still to come, and whether it came already (at the weights' gather).
        self._joined = None
        self._vote_before_reducing = True
        self._voted = False
        # level3 in a join block: this step's gathers (lists of parameters, in order) and the last
        # whole step's, which a rank whose data ended replays with its slices.
        self._gathers, self._last_gathers = [], None
        self._ids = None
        self._pending = None  # (nothing is ever in flight between calls: the join block checks it)

    @property
    def comm(self):
        return self._comm if self._comm is not None else resolve_communicator(_WHO, None)

    @property
    def degree(self):
        return self.comm.size

    # ---- the plan --------------------------------------------------------------------------

    def _slices(self, param, group_size):
        shape = tuple(param.shape)
        nbytes = math.prod(shape) * numpy.dtype(param.dtype).itemsize
        return group_size > 1 and len(shape) >= 1 and shape[0] >= 1 and nbytes >= self.threshold_kb * 1024

    def plan(self):
        """Makes (once per communicator) the slices, the shard groups and the reducer of the rest."""
        comm = self.comm
        if self._plan_comm is not None and self._plan_comm() is comm:
            return
        if comm.size > 1:  # every rank must slice alike, or the collectives below would not match
            require_same_tensors(comm, _WHO, self.parameters, mean=self.mean, level=self.level,
                                 threshold_kb=self.threshold_kb, shard_size=self.shard_size,
                                 accumulation_shard=self.accumulation_shard,
                                 passes=self.backward_passes_per_step)
        if self.tensor_parallel:
            self.placements = tuple(self._tensor_parallel_slice(p, comm) for p in self.parameters)
            self._plan_comm = weakref.ref(comm)
            if self.level != "level1":  # the operators leave these gradients partial: reduce-scattered here
                for p, s in zip(self.parameters, self.placements):
                    if s is not None:
                        defer_gradient_reduction(p, s.ranks)
            # (a strategy file, when one is configured, records or checks the slices: MindSpore's fields)
            strategy_file.record_optimizer_slices(comm, current_world().settings, {
                p.name: (s.group_size, _stride(s)) for p, s in zip(self.parameters, self.placements) if s is not None})
            return
        groups = slices.ShardGroups(comm, self.shard_size, _WHO)
        self._groups = groups
        self.placements = tuple(slices.slice_for(p.shape, groups.size, groups.index, groups.group)
                                if self._slices(p, groups.size) else None for p in self.parameters)
        # level1 all-reduces every gradient whole; level2 only those of the parameters kept whole.
        whole = [i for i, s in enumerate(self.placements) if s is None or self.level == "level1"]
        self._inner_indices = whole
        self._inner = DistributedGradReducer(
            [self.parameters[i] for i in whole], mean=self.mean, fusion_bytes=self.fusion_bytes, comm=comm,
            compression=self.compression, gradient_predivide_factor=self.gradient_predivide_factor,
            backward_passes_per_step=self.backward_passes_per_step) if whole else None
        self._plan_comm = weakref.ref(comm)

    def _tensor_parallel_slice(self, param, comm):
        """SEMI_AUTO / AUTO: the slice of ``param``'s tensor-parallel block over the ranks holding the
        same block (its layout's replica axes: the data-parallel dimension), or None."""
        tp = param.placement.inner if slices.is_sliced(param) else param.placement
        if tp is None:  # never placed by an operator: whole on every rank
            block, ranks = tuple(param.shape), tuple(range(comm.size))
        else:
            block = tuple(tp.layout.local_shape(tp.shape))
            ranks = tuple(tp.layout.group(comm.rank, tp.layout.replica_axes()))
        size = len(ranks) if self.shard_size == -1 else self.shard_size
        if len(ranks) % size:
            raise ValueError(f"{_WHO}: parallel_optimizer_config['optimizer_weight_shard_size'] = {self.shard_size} "
                             f"must divide the {len(ranks)} ranks holding the same block of parameter {param.name!r} "
                             f"({tp.layout if tp is not None else 'replicated'})")
        position = ranks.index(comm.rank)
        chunk = ranks[position - position % size:position - position % size + size]
        if not (self._slices(param, size) and len(block) >= 1 and block[0] >= 1):
            return None
        return slices.slice_for(param.shape, size, chunk.index(comm.rank), groups().get(comm, chunk), inner=tp,
                                block=block, ranks=chunk)

    # ---- weights ---------------------------------------------------------------------------

    def gather_weights(self):
        """Makes every sliced parameter whole again (one all-gather per dtype); a collective."""
        if self.placements is None:
            return
        todo = [(p, s) for p, s in zip(self.parameters, self.placements) if s is not None and slices.is_sliced(p)]
        if not todo:
            return
        if self._joined is not None and self._vote_before_reducing and not self._voted:
            # In a join block this step's vote comes first: a rank shadowing the step votes, then gathers.
            count_ranks_with_data(self.comm, True)
            self._voted = True
        params, placements = zip(*todo)
        for p, s, array in zip(params, placements, slices.gather_into(params, placements, phase="weights")):
            p.data = array
            p.placement = s.inner  # whole (None), or the tensor-parallel block again

    def _slice_weights(self):
        for p, s in zip(self.parameters, self.placements):
            if s is not None and not slices.is_sliced(p):
                p.data = slices.cut(p.data, s)
                p.placement = s

    # ---- gradients -------------------------------------------------------------------------

    def __call__(self, grads):
        """The reduced gradients: this rank's slice (a Tensor with the slice's placement) for a
        sliced parameter, the whole reduced gradient for the others; None on a call that only
        accumulates (``backward_passes_per_step``)."""
        if isinstance(grads, Tensor) or not isinstance(grads, (list, tuple)):
            raise TypeError(f"{_WHO}: grads must be a tuple aligned with the parameters, got {type(grads).__name__}")
        if len(grads) != len(self.parameters):
            raise ValueError(f"{_WHO}: got {len(grads)} gradient(s) for {len(self.parameters)} parameter(s)")
        grads = [g.data if isinstance(g, Tensor) else g for g in grads]
        if self.tensor_parallel:
            return self._cut_tensor_parallel(grads)
        # At level3 a weight is its rows outside its cell's runs, so a parameter that no op reached
        # gets value_and_grad's zeros shaped like those rows: no gradient, as None says.
        grads = [None if g is not None and slices.is_sliced(p) and tuple(g.shape) == tuple(p.data.shape)
                 != tuple(p.shape) else g for p, g in zip(self.parameters, grads)]
        for i, g in enumerate(grads):
            if g is not None and tuple(g.shape) != tuple(self.parameters[i].shape):
                raise ValueError(f"{_WHO}: gradient {i} of shape {tuple(g.shape)} does not match its parameter of "
                                 f"shape {tuple(self.parameters[i].shape)}")
        self.plan()
        if self._joined is not None:
            if not self._vote_before_reducing:  # shadowing a step: the others gathered the weights for it
                if self.level != "level3":  # (level3's gathers were each cell's: shadow_step replayed them)
                    self.gather_weights()
            elif not self._voted:
                count_ranks_with_data(self.comm, True)
                self._gathers = []
            if self._vote_before_reducing:  # a step this rank ran: its gathers, for the steps it may shadow
                self._last_gathers = self._gathers
        self._voted = False
        self._scattered_not_finite = 0.0
        self._calls += 1
        last = self._calls % self.backward_passes_per_step == 0
        out = [None] * len(self.parameters)
        inner = None
        if self._inner is not None:
            inner = self._inner(tuple(grads[i] for i in self._inner_indices))
            if inner is not None:
                for i, g in zip(self._inner_indices, inner):
                    out[i] = g
        if self.level != "level1":
            self._reduce_scatter_sliced(grads, out, last)
        if not last:
            return None
        self._calls = 0
        finite = True
        if self._rescales():
            bad = 0.0 if self._inner is None or not self._inner.overflowed() else 1.0
            bad += self._scattered_not_finite
            # Each rank saw only its rows: one small all-reduce so every rank skips the step together.
            finite = float(numpy.asarray(self.comm.allreduce(numpy.array([bad]), "sum"))[0]) == 0.0
        self._overflowed = not finite
        for i, s in enumerate(self.placements):
            if s is not None:
                g = out[i].data if isinstance(out[i], Tensor) else out[i]
                if self.level == "level1":
                    g = slices.cut(g, s)
                t = Tensor(g)
                t.placement = s
                out[i] = t
        self._slice_weights()
        return tuple(out)

    def _cut_tensor_parallel(self, grads):
        """SEMI_AUTO / AUTO: the operators' backward already all-reduced each block's gradient over
        the ranks holding it: each rank keeps its rows (and the weights become their rows)."""
        self.plan()
        out = []
        for p, s, g in zip(self.parameters, self.placements, grads):
            expected = tuple(p.data.shape) if s is None else s.block
            if g is not None and s is not None and slices.is_sliced(p) and tuple(g.shape) == tuple(p.data.shape) \
                    != expected:
                g = None  # level3: no op reached it (value_and_grad's zeros are shaped like its rows)
            # (at level3 the weight is its rows again already; its gradient is the block's)
            if g is not None and tuple(g.shape) != expected:
                raise ValueError(f"{_WHO}: the gradient of {p.name!r} has shape {tuple(g.shape)}, but the parameter "
                                 f"holds a block of shape {expected}")
            if s is None or g is None:
                out.append(None if g is None else Tensor(g))
                continue
            state = reduction_state(p)
            if state == "mixed":
                raise ValueError(f"{_WHO}: parameter {p.name!r} reached this step's backward through operators that "
                                 f"left its gradient partial over its slice group and others that reduced it over "
                                 f"other ranks; optimizer_level 'level1' reduces every gradient in the operators")
            t = Tensor(self._scatter_block(g, s) if state == "partial" else slices.cut(g, s))
            t.placement = s
            out.append(t)
        self._slice_weights()
        return tuple(out)

    def _scatter_block(self, g, s):
        """This rank's rows of the sum over its slice group of the partial block gradients ``g``."""
        xp = backend.get_array_module(g)
        padded = xp.zeros((s.group_size * s.rows,) + tuple(s.block[1:]), dtype=g.dtype)
        padded[:s.block[0]] = g
        record("reduce_scatter", s.group_size, comm_bytes("reduce_scatter", padded.nbytes, s.group_size),
               phase="gradients")
        rows = s.comm.reduce_scatter(padded, "sum", axis=0)
        lo, hi = s.bounds()
        return xp.ascontiguousarray(rows[:hi - lo])

    def _rescales(self):
        return self.compression is not Compression.none or self.gradient_predivide_factor != 1.0

    def _reduce_scatter_sliced(self, grads, out, last):
        """level2: the sliced parameters' gradients, reduce-scattered (now, or on the k-th call)."""
        sliced = [i for i, s in enumerate(self.placements) if s is not None]
        if not sliced:
            return
        if not self.accumulation_shard:  # whole gradients summed locally; one reduce-scatter on the k-th call
            for i in sliced:
                if grads[i] is not None:
                    self._sums[i] = grads[i].copy() if i not in self._sums else self._sums[i] + grads[i]
            if not last:
                return
            reduced = self._scatter({i: self._sums.pop(i, None) for i in sliced})
            for i in sliced:
                out[i] = reduced[i]
            return
        reduced = self._scatter({i: grads[i] for i in sliced})
        for i in sliced:  # the slices summed locally over the calls
            self._sums[i] = reduced[i] if i not in self._sums else self._sums[i] + reduced[i]
        if last:
            for i in sliced:
                out[i] = self._sums.pop(i)

    def _scatter(self, grads):
        """{index: whole gradient or None} -> {index: this rank's reduced rows}, per dtype in one buffer."""
        by_dtype = {}
        for i, g in grads.items():
            by_dtype.setdefault(numpy.dtype(self.parameters[i].dtype).str, []).append(i)
        result = {}
        f = self.gradient_predivide_factor
        for indices in by_dtype.values():
            dtype = numpy.dtype(self.parameters[indices[0]].dtype)
            some = next((grads[i] for i in indices if grads[i] is not None), None)
            xp = backend.get_array_module(some if some is not None else self.parameters[indices[0]].data)
            s0 = self.placements[indices[0]]
            size = s0.group_size
            widths = [self.placements[i].rows * math.prod(self.placements[i].shape[1:]) for i in indices]
            buf = xp.zeros((size, sum(widths)), dtype=dtype)
            if self._rescales():
                scale = dtype.type(1.0 / f) if self.mean and f != 1.0 else None
            else:
                scale = dtype.type(1.0 / self.degree) if self.mean and self.degree != 1 else None
            off = 0
            for i, w in zip(indices, widths):
                g = grads[i]
                if g is not None:
                    s = self.placements[i]
                    # Rank r's columns receive rows [r * rows, (r + 1) * rows) of g, zero-padded.
                    blocks = buf[:, off:off + w].reshape(size, s.rows, w // s.rows)
                    flat = g.reshape(s.shape[0], -1)
                    for r in range(size):
                        lo, hi = s.bounds(r)
                        if scale is not None:
                            xp.multiply(flat[lo:hi], scale, out=blocks[r, :hi - lo])
                        else:
                            blocks[r, :hi - lo] = flat[lo:hi]
                off += w
            wire = self.compression.compress(xp, buf, _WHO)
            group = s0.comm
            record("reduce_scatter", size, comm_bytes("reduce_scatter", wire.nbytes, size), phase="gradients")
            mine = group.reduce_scatter(wire, "sum", axis=0).reshape(-1)
            if self._groups.replicas is not None:
                replicas = self._groups.replicas
                record("allreduce", replicas.size, comm_bytes("allreduce", mine.nbytes, replicas.size),
                       phase="gradients")
                mine = replicas.allreduce(mine, "sum")
            if self._rescales():
                self._scattered_not_finite += 0.0 if bool(xp.isfinite(mine).all()) else 1.0
                reduced = xp.empty(mine.shape, dtype=dtype)
                self.compression.decompress(xp, mine, reduced)
                if self.mean:
                    post = f / self.degree
                    if post != 1.0:
                        reduced *= dtype.type(post)
                mine = reduced
            off = 0
            for i, w in zip(indices, widths):
                s = self.placements[i]
                lo, hi = s.bounds()
                rows = mine[off:off + w].reshape((s.rows,) + tuple(s.shape[1:]))
                result[i] = xp.ascontiguousarray(rows[:hi - lo]).copy()
                off += w
        return result

    def overflowed(self):
        """Whether the last reduction with compression (or a predivide factor) met an inf or NaN on any rank."""
        return self._overflowed

    # ---- the rest of the reducer interface ---------------------------------------------------

    def broadcast_parameters(self, tensors, root=0):
        """Rank ``root``'s values for every tensor not held as a slice (slices are per rank by design)."""
        whole = [t for t in tensors if not slices.is_sliced(t)]
        return broadcast_tensors(whole, root, self.comm, self.fusion_bytes, f"{_WHO}.broadcast_parameters")

    def owns(self, param):
        """Whether ``param`` is one of this reducer's parameters."""
        if self._ids is None:
            self._ids = {id(p) for p in self.parameters}
        return id(param) in self._ids

    def before_gather(self, params):
        """level3, before a cell's (or an op's) gather: in a join block the step's vote comes first,
        then the gather is recorded for ranks that shadow this step."""
        if self._joined is None or not self._vote_before_reducing:
            return
        if not self._voted:
            count_ranks_with_data(self.comm, True)
            self._voted = True
            self._gathers = []
        self._gathers.append(list(params))

    def shadow_step(self):
        """A rank whose data ended takes part in a step of the others: at level3, their gathers (its
        last step's, replayed with its slices); the reduction follows (``__call__`` with no gradients)."""
        if self.level != "level3":
            return
        if self._last_gathers is None:
            raise RuntimeError(f"{_WHO}: rank {self.comm.rank} has no data for its first step inside a join block "
                               f"at optimizer_level 'level3': a rank shadows the others' per-cell gathers as its own "
                               f"last step made them, so every rank must run one step; give it a batch, or use level1 "
                               f"or level2")
        for params in self._last_gathers:
            slices.gather_into(params, [p.placement for p in params], phase="weights")

    def agree_on_parameters(self):
        """Checks (once per communicator) that every rank slices the same parameters alike (collective)."""
        self.plan()

    def join(self, optimizer=None):
        """A join block for uneven inputs (minidl_parallel/join.py): a rank out of data shadows each
        step's vote, the weights' gathers and the reduction, then updates with ``optimizer``. At
        level3 the gathers are each cell's, in forward and backward: a rank shadows them as its own
        last step made them (so a rank must run a step before its data ends)."""
        if self.backward_passes_per_step > 1:
            raise RuntimeError(f"{_WHO}: backward_passes_per_step={self.backward_passes_per_step} inside a join block "
                               f"is not supported: a finished rank cannot tell which calls its peers reduce")
        return Join(self, optimizer)
