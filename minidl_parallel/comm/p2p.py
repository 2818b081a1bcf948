"""Point-to-point messages between two ranks of a communicator: what every backend shares.

``send``/``recv`` (and ``isend``/``irecv``, ``batch_isend_irecv``) are the communicator's
methods (comm/base.py); this module holds their argument checks, the numbering that pairs a
send with its receive, and the fingerprint a receive compares with its send.

Pairing: messages from one rank to another with one tag arrive in the order they were sent
(MPI's non-overtaking rule; NCCL orders a pair's device messages by stream order, and has no
tags). So the k-th ``recv`` from rank s with tag t gets the k-th ``send`` of rank s to this
rank with tag t; ``seq`` numbers them per (peer, tag) on each side, and a timeout or stall
names the message by that number.

Fingerprints: a receive knows the shape and dtype it expects. The threads backend carries
each message's fingerprint with it and always compares; the mpi backend compares the byte
count MPI received, and with ``MINIDL_DIST_DEBUG`` >= 1 sends the fingerprint (sequence
number, shape, dtype; level 2: the send's call site, named in the message) ahead of the data,
as the collectives' debug checks do, so a receive of the wrong shape or dtype raises naming both calls instead of
reading garbage or waiting forever.
"""
from collections import namedtuple

__all__ = ["P2POp", "MAX_TAG", "check_peer", "check_tag", "Fingerprint", "mismatch"]

# MPI guarantees tags up to 32767 (MPI_TAG_UB); the mpi backend uses two per user tag (data,
# and the debug fingerprint), so the user's tags stop at half of that.
MAX_TAG = 16383


class P2POp:
    """One send or receive of :meth:`Communicator.batch_isend_irecv` (PyTorch's ``P2POp``).

    Args:
        op: "send" or "recv" (or the communicator's own ``isend`` / ``irecv`` methods, PyTorch's
            spelling).
        array: the array sent, or the buffer received into (filled in place).
        peer: the other rank (its rank in the communicator).
        tag: int in [0, MAX_TAG] (default 0).
    """

    __slots__ = ("op", "array", "peer", "tag")

    def __init__(self, op, array, peer, tag=0):
        name = getattr(op, "__name__", op)
        kinds = {"send": "send", "isend": "send", "recv": "recv", "irecv": "recv"}
        if not isinstance(name, str) or name not in kinds:
            raise ValueError(f"P2POp: op must be 'send' or 'recv' (or a communicator's isend / irecv), got {op!r}")
        self.op, self.array, self.peer, self.tag = kinds[name], array, peer, tag

    def __repr__(self):
        shape = getattr(self.array, "shape", None)
        return f"P2POp({self.op!r}, shape={shape}, peer={self.peer}, tag={self.tag})"


def check_peer(peer, rank, size, who):
    """``peer`` as a rank of this communicator; raises naming the range (and a send to oneself)."""
    if isinstance(peer, bool) or not isinstance(peer, int) or not 0 <= peer < size:
        raise ValueError(f"{who}: the peer must be an int in [0, {size - 1}] (a rank of this communicator of "
                         f"size {size}), got {peer!r}")
    if peer == rank and size > 1:
        raise ValueError(f"{who}: rank {rank} cannot exchange a message with itself (peer {peer}); "
                         f"pass another rank of the {size}")
    return peer


def check_tag(tag, who):
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"{who}: tag must be an int in [0, {MAX_TAG}], got {tag!r}")
    return tag


# What a send says about its message and a receive about what it expects: the pair's sequence
# number, the shape and dtype, and (debug level 2) the call site.
Fingerprint = namedtuple("Fingerprint", "seq shape dtype site")


def mismatch(received, expected, call, peer):
    """None when ``received`` (the send's fingerprint) fits ``expected`` (the receive's), else the
    RuntimeError's message, naming both calls."""
    # The call sites differ by nature (a send's line and a receive's): they only name the send.
    if (received.seq, received.shape, received.dtype) == (expected.seq, expected.shape, expected.dtype):
        return None
    site = "" if received.site is None else f" at {received.site}"
    return (f"{call}: rank {peer}'s send #{received.seq} (shape={received.shape}, dtype={received.dtype}){site} "
            f"does not match what this rank expects: message #{expected.seq} of shape={expected.shape}, "
            f"dtype={expected.dtype} (the two ranks' sends and receives differ in order or in their arrays)")
