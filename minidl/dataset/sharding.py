"""Which sample indices each shard (data-parallel rank) reads in an epoch.

Every rank computes its own shard from (n, seed, epoch, num_shards, shard_id) alone, so all
ranks agree without communicating. The order of an epoch is ``permutation(n)`` drawn from
(seed, epoch) when shuffling, else ``arange(n)``; shard k then takes ``order[k::num_shards]``.

- ``"pad"`` (default, MindSpore's DistributedSampler): the order wraps around to a multiple
  of num_shards, so every shard has ``ceil(n / num_shards)`` rows and ranks run the same
  number of steps (a rank with one step fewer would hang in the gradient all-reduce). Up to
  num_shards - 1 samples are then seen twice per epoch.
- ``"exact"`` (evaluation): no padding; shards are disjoint, their lengths differ by at most
  one, and their union is the dataset exactly once.

``num_samples`` caps the rows of each shard after the split.

Sharding is only ever what the user asks for: a source given neither num_shards nor shard_id
reads every row, on every rank, as in MindSpore and PyTorch. A data-parallel script shards
its datasets itself, ``num_shards=get_group_size(), shard_id=get_rank()``.

Padding repeats are marked. In "pad" mode the positions >= n of the wrapped order are
repeats of rows another position already holds; :func:`real_count` says how many leading
rows of a shard are real, and sources tag the rest, so that evaluation can count every row
of the dataset exactly once (``Dataset.epoch_iterator(..., with_validity=True)``).
"""
import numbers

import numpy

__all__ = ["resolve_shards", "check_shard_mode", "check_num_samples", "epoch_order", "shard_indices",
           "shard_size", "real_count", "shard_stream", "SHARD_MODES"]

SHARD_MODES = ("pad", "exact")

# The order's generator is seeded with 5 words ending in a non-zero tag: the per-row transform
# generators use 4 words, and numpy's SeedSequence treats [a, b] and [a, b, 0, 0] alike, so a
# shorter key could collide with some row's transform key.
_ORDER_TAG = 1


def _is_int(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _validate(num_shards, shard_id, who):
    if num_shards is None or shard_id is None:
        missing, given = ("num_shards", "shard_id") if num_shards is None else ("shard_id", "num_shards")
        raise ValueError(f"{who}: {given} was given without {missing}; give both num_shards and shard_id "
                         f"or neither")
    if not _is_int(num_shards):
        raise TypeError(f"{who}: num_shards must be an int >= 1, got {num_shards!r}")
    if num_shards < 1:
        raise ValueError(f"{who}: num_shards must be >= 1, got {num_shards}")
    if not _is_int(shard_id):
        raise TypeError(f"{who}: shard_id must be an int in [0, {int(num_shards) - 1}], got {shard_id!r}")
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"{who}: shard_id must be in [0, {int(num_shards) - 1}] for num_shards={int(num_shards)}, "
                         f"got {shard_id}")
    return int(num_shards), int(shard_id)


def resolve_shards(num_shards, shard_id, who):
    """The validated (num_shards, shard_id) a source uses: the given pair, or (1, 0) when neither is given.

    Args:
        who: the caller's name for error messages (e.g. "NumpySlicesDataset").
    """
    if num_shards is None and shard_id is None:
        return 1, 0
    return _validate(num_shards, shard_id, who)


def check_shard_mode(shard_mode, who):
    if shard_mode not in SHARD_MODES:
        raise ValueError(f"{who}: shard_mode must be one of {SHARD_MODES}, got {shard_mode!r}")
    return shard_mode


def check_num_samples(num_samples, who):
    if num_samples is None:
        return None
    if not _is_int(num_samples):
        raise TypeError(f"{who}: num_samples must be None or an int >= 1, got {num_samples!r}")
    if num_samples < 1:
        raise ValueError(f"{who}: num_samples must be None or an int >= 1, got {num_samples}")
    return int(num_samples)


def epoch_order(n, seed, epoch, shuffle):
    """The sample order of an epoch before sharding: a permutation from (seed, epoch), or arange."""
    if not shuffle:
        return numpy.arange(n)
    return numpy.random.default_rng([seed, epoch, 0, 0, _ORDER_TAG]).permutation(n)


def shard_size(n, num_shards, shard_id, mode="pad", num_samples=None):
    """Rows that shard ``shard_id`` reads per epoch from a source of n rows."""
    if mode == "pad":
        size = -(-n // num_shards)
    else:
        size = n // num_shards + (shard_id < n % num_shards)
    return size if num_samples is None else min(size, num_samples)


def real_count(n, num_shards, shard_id):
    """How many leading rows of shard ``shard_id`` are real; in "pad" mode the rest repeat other rows.

    Shard k reads the positions k, k + num_shards, ... of the (wrapped) order; those < n are
    real. This is the shard's "exact" size, whatever ``num_samples`` later keeps.

    Example:
        >>> real_count(5, 2, 1)   # pad: shard 1 reads positions 1 3 5, and 5 wraps around to row 0
        2
    """
    return shard_size(n, num_shards, shard_id, mode="exact")


def shard_indices(n, num_shards=1, shard_id=0, *, shuffle=False, seed=0, epoch=0, mode="pad", num_samples=None):
    """The sample indices shard ``shard_id`` reads in ``epoch``, in reading order.

    Example:
        >>> shard_indices(5, 2, 1).tolist()   # pad: order 0 1 2 3 4 0 -> shard 1 takes 1 3 0
        [1, 3, 0]
        >>> shard_indices(5, 2, 1, mode="exact").tolist()
        [1, 3]
    """
    order = epoch_order(n, seed, epoch, shuffle)
    if mode == "pad" and n:
        order = numpy.resize(order, -(-n // num_shards) * num_shards)  # resize repeats cyclically
    return order[shard_id::num_shards][:num_samples]


def shard_stream(rows, num_shards=1, shard_id=0, mode="pad", num_samples=None, with_validity=False):
    """Shards a stream of unknown length the way :func:`shard_indices` shards arange(n).

    Shard k keeps the rows at positions k, k + num_shards, ... In "pad" mode it also keeps the
    first num_shards - 1 rows, so that at the end of the stream, when n is known, it can wrap
    around exactly as ``shard_indices`` does.

    Args:
        with_validity: yield (row, real) pairs, real False for the rows the wrap-around repeats.
    """
    tag = (lambda row, real: (row, real)) if with_validity else (lambda row, real: row)
    head_len = num_shards - 1 if mode == "pad" else 0
    head = []
    n = 0
    taken = 0
    for row in rows:
        if n < head_len:
            head.append(row)
        if n % num_shards == shard_id:
            yield tag(row, True)
            taken += 1
            if taken == num_samples:
                return
        n += 1
    if mode == "pad" and n:
        for pos in range(n, -(-n // num_shards) * num_shards):
            if pos % num_shards == shard_id:
                yield tag(head[pos % n], False)
                taken += 1
                if taken == num_samples:
                    return
