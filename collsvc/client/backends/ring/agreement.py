"""The signature agreement of rooted calls over gRPC: one small all_gather of every member's call.

In rooted algorithms some members never receive anything that depends on a given member (a broadcast
root, a leaf fed by an agreeing parent), so the per-frame signature check alone would let them finish a
mismatched call. Gathering every member's signature (256 bytes each) first makes every member raise at
the call, naming every member's call.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from collsvc.client.backends.base import Call, Channel, mismatch_error
from collsvc.client.backends.ring import algorithms

# Bytes per member in the agreement (digest + signature JSON).
AGREEMENT_BYTES = 256


def agree(ch: Channel, call: Call) -> None:
    """Returns once every member of ``ch`` called what ``call`` says.

    Raises:
        CollectiveMismatchError: some member called something else (``details``: each member's call).
        CollectiveTimeoutError, RankFailedError, AbortedError: from the channel.
    """
    mine = call.signature.encode()[: AGREEMENT_BYTES - 8]
    src = np.zeros(AGREEMENT_BYTES, np.uint8)
    src[:8] = np.frombuffer(call.signature.digest.to_bytes(8, "little"), np.uint8)
    src[8 : 8 + len(mine)] = np.frombuffer(mine, np.uint8)
    rows = np.empty(ch.size * AGREEMENT_BYTES, np.uint8)
    algorithms.all_gather(ch, src, rows)
    table = rows.reshape(ch.size, AGREEMENT_BYTES)
    digests = [int.from_bytes(table[i, :8].tobytes(), "little") for i in range(ch.size)]
    if all(d == call.signature.digest for d in digests):
        return
    details: dict[int, Any] = {}
    for i, rank in enumerate(call.group.ranks):
        raw = table[i, 8:].tobytes().rstrip(b"\0")
        try:
            details[rank] = json.loads(raw.decode())
        except ValueError:
            details[rank] = {"digest": f"{digests[i]:016x}"}
    raise mismatch_error(call, details)
