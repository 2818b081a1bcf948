"""A resume on another number of data shards (an elastic restart, or ``resume_from`` moved by hand
to another world size): which batch it keeps, and where the epoch in progress continues.

A checkpoint of ModelCheckpoint records each rank's batch and the number of shards of the
training dataset (``batch_size``, ``num_shards``); their product is the global batch. When the
resumed dataset has another number of shards, ``Model.train(..., keep_batch=...)`` chooses:

- ``"global"`` (the default, as a learning rate tuned for a global batch expects): the last
  ``.batch`` of the dataset is resized to the global batch over the new shards (4 shards of 32
  resumed on 2: 64 per rank). Shards take every num_shards-th row of the epoch's order
  (dataset/sharding.py), so step s of an epoch covers rows s*G to (s+1)*G - 1 of that order at any
  shard count: the steps per epoch, and the rows every step trains on, are those of the
  uninterrupted run. Only the order of the sums changes (and BatchNorm, which normalises each
  rank's batch: its statistics are over other rows). A global batch the new shards do not divide
  raises, naming both and the other choice.
- ``"per_rank"``: each rank keeps its batch, so the global batch follows the world size, and so
  do the steps per epoch; the epoch in progress then continues at the same share of its steps,
  rounded down (step 1 of 2 at 4 ranks is step 2 of 4 at 2 ranks), on the rows of the new shards.
"""

from ..runtime import get_runtime

__all__ = ["KEEP_BATCH", "check_keep_batch", "resume_on_these_shards"]

KEEP_BATCH = ("global", "per_rank")


def check_keep_batch(keep_batch, who):
    if keep_batch not in KEEP_BATCH:
        raise ValueError(f"{who}: keep_batch must be one of {KEEP_BATCH}, got {keep_batch!r}")


def resume_on_these_shards(path, position, dataset, batch_num, group_size, keep_batch="global", who="Model.train"):
    """``(batch_num, skip)`` for resuming ``dataset`` (``batch_num`` steps per epoch as it stands) from the
    checkpoint at ``path`` (its TrainPosition ``position``) on ``group_size`` ranks. Where ``keep_batch`` is
    "global" and the dataset's global batch is not the checkpoint's (another number of shards, or a script
    whose per-rank batch a resize changed before: a second restart), resizes the dataset's batch to it,
    saying so on rank 0 (module docstring)."""
    check_keep_batch(keep_batch, who)
    saved_batch, saved_shards = position.batch_size, position.num_shards
    shards = dataset.num_shards
    total = None if saved_batch is None or saved_shards is None else saved_batch * saved_shards
    if keep_batch == "global" and total is not None and dataset.get_batch_size() * shards != total:
        if total % shards:
            raise ValueError(f"{who}: checkpoint {path!r} was trained with a global batch of {total} ({saved_shards} "
                             f"shards of {saved_batch}), which {shards} shards cannot split evenly; resume on a number "
                             f"of shards that divides {total}, or pass keep_batch='per_rank' to train "
                             f"{dataset.get_batch_size()} rows per rank")
        try:
            dataset.resize_batch(total // shards)
        except ValueError:
            raise ValueError(f"{who}: checkpoint {path!r} was trained with a global batch of {total} ({saved_shards} "
                             f"shards of {saved_batch}); keeping it on {shards} shards needs a .batch() in "
                             f"train_dataset to resize; add one, or pass keep_batch='per_rank'") from None
        batch_num = dataset.get_dataset_size()
        runtime = get_runtime()
        if runtime.group_size() <= 1 or runtime.rank() == 0:
            print(f"{who}: keeping the global batch of {total} that checkpoint {path!r} was trained with: "
                  f"{total // shards} rows per rank on {shards} shard(s), {batch_num} steps per epoch "
                  f"(keep_batch='global')", flush=True)
    if position.batch_num == batch_num:
        return batch_num, position.skip_batches
    if position.group_size in (None, group_size) and saved_shards in (None, dataset.num_shards):
        raise ValueError(f"{who}: checkpoint {path!r} was trained with {position.batch_num} steps per epoch, "
                         f"but train_dataset has {batch_num}; resume with the same dataset, batch size and sharding")
    return batch_num, position.skip_batches * batch_num // position.batch_num
