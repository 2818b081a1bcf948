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
every rank sees the same gathered list. :func:`require_same_tensors` is that check for the
tensors a collective fuses (the gradient reducer's parameters, a broadcast's tensors), with the
error that names the first tensor that differs.

Example:
    >>> found = disagreement(comm, "parameters", (("w", (4, 8), "float32"),))
    >>> found is None        # every rank described the same thing
    True
"""
import hashlib

import numpy

__all__ = ["disagreement", "first_difference", "describe_ranks", "describe_tensors", "require_same_tensors"]


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


def describe_tensors(tensors):
    """The compact description the ranks compare: (name, shape, dtype) of each tensor, in order."""
    return tuple((getattr(t, "name", None), tuple(int(d) for d in t.shape), str(numpy.dtype(t.dtype)))
                 for t in tensors)


def require_same_tensors(comm, who, tensors, **settings):
    """Raises ValueError on every rank unless every rank of ``comm`` passes the same tensors
    (names, shapes, dtypes, in order) and the same ``settings`` (collective).

    Args:
        comm: the Communicator.
        who: the caller, named at the start of the message.
        tensors: Parameters or Tensors.
        settings: values every rank must agree on (``mean``, ``degree``; a broadcast's ``root``).
    """
    found = disagreement(comm, "parameters", (tuple(sorted(settings.items())), describe_tensors(tensors)))
    if found is not None:
        raise ValueError(_mismatch_message(who, found))


def _show_tensor(entry):
    if entry is None:
        return "nothing"
    name, shape, dtype = entry
    return f"{name!r} of shape {shape} {dtype}"


def _mismatch_message(who, found):
    kinds = [kind for kind, _ in found]
    if any(k != kinds[0] for k in kinds):
        return (f"{who}: the ranks are running different checks at the same point ({describe_ranks(kinds)}): "
                f"they run different programs or parallel modes; every rank must make the same calls")
    settings = [dict(description[0]) for _, description in found]
    tensors = [description[1] for _, description in found]
    i = first_difference(tensors)
    if i is not None:
        counts = [len(t) for t in tensors]
        at = [t[i] if i < len(t) else None for t in tensors]
        count_note = "" if all(c == counts[0] for c in counts) else f" (numbers of tensors: " \
            f"{describe_ranks(counts, str)})"
        return (f"{who}: the ranks' parameters differ at tensor {i}: {describe_ranks(at, _show_tensor)}"
                f"{count_note}; every rank must build the same network (same layers, shapes and dtypes, "
                f"in the same order) before training")
    return (f"{who}: the ranks reduce gradients with different settings: "
            f"{describe_ranks(settings, lambda s: ', '.join(f'{k}={v!r}' for k, v in s.items()))}; set the same "
            f"gradients_mean (and degree) on every rank")
