"""SyncBatchNorm: batch normalisation whose training statistics span every rank's batch.

With plain ``BatchNorm2d`` each rank normalises with its own batch's statistics, so a
data-parallel net is NOT the single-process net on the global batch (MindSpore and PyTorch
behave so too). SyncBatchNorm makes it so, with ``ops.BatchNorm`` itself: its op changes only
``BatchNorm.sum_over_batch``, the one seam through which every per-channel sum passes:

- forward all-reduces the per-channel sums and counts (mean), then the per-channel sums of
  centred squares (variance, two passes as the local op does, for float32 accuracy);
- backward all-reduces the per-channel ``sum(gy)`` and ``sum(gy * xhat)`` that the input
  gradient needs, so gx is the gradient of the global loss (the sum of the ranks' losses);
- gamma and beta get the LOCAL sums: the grad reducer adds the ranks' contributions;
- the moving statistics are updated on every rank from the global mean and the global
  unbiased variance, so they stay identical across ranks.

Inference (or ``use_batch_statistics=False``) is plain BatchNorm on the moving statistics,
without communication. Per training step it costs 2 all-reduces forward and 1 backward,
each of 2C or C + 1 values; on the GPU one more, of the count on the host (``count_over_batch``),
so that no BatchNorm reads a device value back (a host synchronisation per layer).

Example:
    >>> from minidl_parallel.sync_batchnorm import SyncBatchNorm
    >>> net = nn.SequentialCell(nn.Conv2d(3, 8, 3), SyncBatchNorm(8), nn.ReLU())
"""
import numpy

from minidl import kernels
from minidl.kernels.cpu.norm import BatchNormBlocked, batchnorm_cases
from minidl.nn import BatchNorm2d
from minidl.ops import BatchNorm

from .collectives import resolve_communicator


class SyncBatchNormOp(BatchNorm):
    """``ops.BatchNorm(is_training=True)`` with statistics and backward sums over a group's ranks.

    Everything is BatchNorm's but :meth:`sum_over_batch`, its seam for the per-channel sums:
    here they are all-reduced over the group (2 all-reduces forward, 1 backward, every rank
    alike).

    Args:
        epsilon, momentum, data_format: as ops.BatchNorm (momentum weighs the NEW statistic).
        group: a Communicator, or None for the context's world (looked up at each call).
    """

    def __init__(self, epsilon=1e-5, momentum=0.1, data_format="NCHW", group=None):
        super().__init__(True, epsilon, momentum, data_format)
        self.group = group

    def sum_over_batch(self, sums):
        """The per-channel sums of every rank of the group (one all-reduce)."""
        return resolve_communicator("SyncBatchNorm", self.group).allreduce(sums, "sum")

    def count_over_batch(self, count):
        """The group's values per channel (GPU path): a host all-reduce of one int, so no device
        synchronisation (the nccl backend sends host arrays over MPI)."""
        comm = resolve_communicator("SyncBatchNorm", self.group)
        return int(comm.allreduce(numpy.array([count], dtype=numpy.int64), "sum")[0])


@kernels.register
class SyncBatchNormBlocked(BatchNormBlocked):
    """BatchNorm's blocked CPU kernel for SyncBatchNormOp (the table looks up exact classes): the
    same passes, its statistics through the op's sum_over_batch seam, i.e. the all-reduces."""

    op = SyncBatchNormOp

    def cases(self):
        # Outside a parallel world the group is the world of one: the sums stay this process's.
        return batchnorm_cases(SyncBatchNormOp, with_residual=False, modes=(True,),
                               factory=lambda training: SyncBatchNormOp(1e-5, 0.1))


class SyncBatchNorm(BatchNorm2d):
    """BatchNorm2d whose training statistics are those of the global batch (all ranks).

    Args:
        num_features, eps, momentum, affine, gamma_init, beta_init, moving_mean_init,
        moving_var_init, use_batch_statistics, data_format, dtype: as nn.BatchNorm2d
            (momentum weighs the OLD moving statistic, MindSpore's convention).
        process_groups: MindSpore's list of world-rank lists (e.g. ``[[0, 1], [2, 3]]``):
            each rank synchronises with the ranks of its list only (the group is split off
            the world at the first training call). None: all ranks.
        group: a Communicator to synchronise over instead (exclusive with process_groups);
            None with no process_groups uses the context's world at each call.

    Example:
        >>> bn = SyncBatchNorm(16)
        >>> y = bn(x)     # x: this rank's (N, 16, H, W); statistics over all ranks' N
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.9, affine=True, gamma_init="ones",
                 beta_init="zeros", moving_mean_init="zeros", moving_var_init="ones",
                 use_batch_statistics=None, process_groups=None, data_format="NCHW", dtype=None, group=None):
        kwargs = {} if dtype is None else {"dtype": dtype}
        super().__init__(num_features, eps, momentum, affine, gamma_init, beta_init, moving_mean_init,
                         moving_var_init, use_batch_statistics, data_format, **kwargs)
        if group is not None and not hasattr(group, "allreduce"):
            raise TypeError(f"SyncBatchNorm: group must be a Communicator or None, got {type(group).__name__}")
        if group is not None and process_groups is not None:
            raise ValueError("SyncBatchNorm: give either process_groups or group, not both")
        self.process_groups = _check_process_groups(process_groups)
        self.group = group
        self._split = None  # (world communicator, its split) for process_groups
        self.bn_train = SyncBatchNormOp(self.eps, 1.0 - self.momentum, data_format, group)

    def construct(self, x):
        if self.process_groups is not None:
            self.bn_train.group = self._group_of_this_rank()
        return super().construct(x)

    def _group_of_this_rank(self):
        world = resolve_communicator("SyncBatchNorm", None)
        if self._split is None or self._split[0] is not world:
            mine = [g for g in self.process_groups if world.rank in g]
            if not mine:
                raise ValueError(f"SyncBatchNorm: rank {world.rank} is in none of process_groups "
                                 f"{self.process_groups}")
            if max(mine[0]) >= world.size:
                raise ValueError(f"SyncBatchNorm: process_groups {self.process_groups} name ranks beyond the "
                                 f"world of {world.size}")
            self._split = (world, world.split(mine[0]))
        return self._split[1]


def _check_process_groups(groups):
    if groups is None:
        return None
    try:
        groups = [[int(r) for r in g] for g in groups]
    except TypeError:
        raise TypeError(f"SyncBatchNorm: process_groups must be a list of lists of ranks, got {groups!r}") from None
    flat = [r for g in groups for r in g]
    if not groups or not all(groups) or len(set(flat)) != len(flat) or min(flat) < 0:
        raise ValueError(f"SyncBatchNorm: process_groups must be non-empty, disjoint lists of non-negative "
                         f"ranks, got {groups!r}")
    return groups


__all__ = ["SyncBatchNorm", "SyncBatchNormOp"]
