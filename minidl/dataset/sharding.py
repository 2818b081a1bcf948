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

``num_samples`` caps the rows of each shard after the split. When neither num_shards nor
shard_id is given, a source asks :func:`get_default_shards`, which ``minidl_parallel.init``
fills in through :func:`set_default_shards` (minidl itself never imports minidl_parallel).
"""
import numbers

import numpy

__all__ = ["set_default_shards", "get_default_shards", "resolve_shards", "check_shard_mode",
           "check_num_samples", "epoch_order", "shard_indices", "shard_size", "shard_stream",
           "SHARD_MODES"]

SHARD_MODES = ("pad", "exact")

# The order's generator is seeded with 5 words ending in a non-zero tag: the per-row transform
# generators use 4 words, and numpy's SeedSequence treats [a, b] and [a, b, 0, 0] alike, so a
# shorter key could collide with some row's transform key.
_ORDER_TAG = 1

_default = {"shards": None}


def set_default_shards(num_shards, shard_id=None):
    """Sets the (num_shards, shard_id) that sources use when given neither; None, None clears it.

    Called by the parallel package's ``init()`` with the world size and the rank. ``num_shards``
    may instead be a zero-argument callable returning (num_shards, shard_id) or None, asked at
    each lookup (the threads backend gives every thread-rank its own shards that way).
    """
    if callable(num_shards) and shard_id is None:
        _default["shards"] = num_shards
        return
    if num_shards is None and shard_id is None:
        _default["shards"] = None
        return
    _default["shards"] = _validate(num_shards, shard_id, "set_default_shards")


def get_default_shards():
    """The (num_shards, shard_id) pair set by :func:`set_default_shards`, or None (no sharding)."""
    shards = _default["shards"]
    if callable(shards):
        pair = shards()
        return None if pair is None else _validate(*pair, "set_default_shards provider")
    return shards


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
    """The validated (num_shards, shard_id) a source uses: the given pair, else the default, else (1, 0).

    Args:
        who: the caller's name for error messages (e.g. "NumpySlicesDataset").
    """
    if num_shards is None and shard_id is None:
        return get_default_shards() or (1, 0)
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


def shard_stream(rows, num_shards=1, shard_id=0, mode="pad", num_samples=None):
    """Shards a stream of unknown length the way :func:`shard_indices` shards arange(n).

    Shard k keeps the rows at positions k, k + num_shards, ... In "pad" mode it also keeps the
    first num_shards - 1 rows, so that at the end of the stream, when n is known, it can wrap
    around exactly as ``shard_indices`` does.
    """
    head_len = num_shards - 1 if mode == "pad" else 0
    head = []
    n = 0
    taken = 0
    for row in rows:
        if n < head_len:
            head.append(row)
        if n % num_shards == shard_id:
            yield row
            taken += 1
            if taken == num_samples:
                return
        n += 1
    if mode == "pad" and n:
        for pos in range(n, -(-n // num_shards) * num_shards):
            if pos % num_shards == shard_id:
                yield head[pos % n]
                taken += 1
                if taken == num_samples:
                    return
