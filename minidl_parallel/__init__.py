"""minidl_parallel: distributed training for minidl (communicators, data and tensor parallel).

Its communicators, DistributedGradReducer and shard() strategies arrive with their own
issues; today the package only states the world of one process, so that scripts written
for parallel runs import and run unchanged on a single process.
"""


def get_rank():
    """The rank of this process: 0 in a world of one."""
    return 0


def get_group_size():
    """The number of processes: 1 in a world of one."""
    return 1


__all__ = ["get_rank", "get_group_size"]
