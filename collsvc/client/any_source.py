"""Receiving from whichever rank sends first (``Communicator.recv_any``, torch's ``recv(src=None)``).

A message from rank s to this rank with tag t is the next sequence number of the stream s->me/t, and
its first frame lands in the mailbox under a key known in advance. So the receiver waits until the
first frame of the next message of any candidate stream is there, and then receives that message
with a normal ``recv`` from that rank: the sequence numbers of every stream stay what the senders
count, and a later ``recv(src=s)`` gets the message after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from collsvc.client.backends.ring import frames
from collsvc.client.backends.ring.algorithms_common import PHASE_P2P, step_id
from collsvc.client.backends.ring.mailbox import FrameKey, Mailbox
from collsvc.client.ops import GroupView, check_tag, p2p_stream
from collsvc.errors import CollectiveTimeoutError


def first_sender(group: GroupView, mailbox: Mailbox, next_seq: Callable[[str], int], tag: int, timeout: float) -> int:
    """The group rank whose next message with ``tag`` to this rank arrived first (ties: lowest rank).

    Args:
        group: the communicator's view; this rank is ``group.rank``.
        mailbox: where arriving frames wait for their receiver.
        next_seq: the sequence number the next message of a stream will have here.
        tag: the message tag.
        timeout: seconds to wait for a message.

    Raises:
        ValueError: a bad tag, or no other rank in the group.
        CollectiveTimeoutError: no message came within ``timeout``; names the ranks waited on.
        RankFailedError, AbortedError: the job failed meanwhile, or every other rank left.
    """
    check_tag(tag)
    senders = [rank for rank in range(group.size) if rank != group.rank]
    if not senders:
        raise ValueError("recv_any needs another rank in the group")
    first_step = step_id(PHASE_P2P, 0)
    keys: dict[FrameKey, int] = {}
    for rank in senders:
        stream = p2p_stream(group, rank, group.rank, tag)
        keys[(frames.key_hash(stream), next_seq(stream), first_step, group.global_ranks[rank])] = rank
    found = mailbox.first_present(list(keys), time.monotonic() + timeout)
    if found is None:
        raise CollectiveTimeoutError(
            f"recv_any (tag {tag}) in group '{group.name}' on rank {group.rank}: no message from any other "
            f"rank within {timeout:g}s",
            [{"rank": rank} for rank in senders],
        )
    return keys[found]
