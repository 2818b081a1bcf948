"""Cross-rank agreement checks: every rank compares a small description of what it is about to do.

A collective whose ranks bring different buffers (one rank's model has a Dense(8, 4), another's
a Dense(8, 3)) or ask for different groups (different ``shard()`` strategies) does not fail
cleanly: MPI reports MPI_ERR_TRUNCATE or corrupts memory, NCCL and ``split`` hang. So before
the first such collective, every rank describes what it will do (parameter names, shapes and
dtypes; an operator's strategy and the parallel context) and :func:`disagreement` compares the
descriptions over the communicator: one ``allgather_object`` of a digest, and a second one of
the whole descriptions only when the digests differ, so that the check costs one small exchange
when the ranks agree and the error can still name every rank's value when they do not.

Callers run a check once per (communicator, description) and raise on every rank, since
every rank sees the same gathered list.

Example:
    >>> found = disagreement(comm, "parameters", (("w", (4, 8), "float32"),))
    >>> found is None        # every rank described the same thing
    True
"""
import hashlib

__all__ = ["disagreement", "first_difference", "describe_ranks"]


def disagreement(comm, kind, description):
    """None when every rank of ``comm`` passed the same ``description``, else every rank's one.

    Every rank of ``comm`` must call it at the same point (it is collective). ``kind`` names
    the check ("parameters", "strategy"): ranks running different checks at the same point
    (different parallel modes) are reported as disagreeing too.

    Args:
        comm: the Communicator (needs ``allgather_object``).
        kind: a short string naming what is compared.
        description: a picklable value whose ``repr`` is deterministic (tuples of str/int).

    Returns:
        None, or the list, in rank order, of every rank's ``(kind, description)``.
    """
    if comm.size == 1:
        return None
    digest = hashlib.sha1(repr((kind, description)).encode()).hexdigest()
    digests = comm.allgather_object(digest)
    if all(d == digests[0] for d in digests):
        return None
    return comm.allgather_object((kind, description))


def first_difference(entries):
    """The first index at which the ranks' sequences ``entries`` (one per rank) differ, or None."""
    longest = max(len(e) for e in entries)
    for i in range(longest):
        values = [e[i] if i < len(e) else None for e in entries]
        if any(v != values[0] for v in values):
            return i
    return None


def describe_ranks(values, show=repr):
    """``"rank 0: a, rank 1: b"``, each rank's value through ``show``."""
    return ", ".join(f"rank {r}: {show(v)}" for r, v in enumerate(values))
