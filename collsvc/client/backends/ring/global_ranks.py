"""Errors of a shared-memory group told in global ranks.

A shared-memory group numbers its members by their place among the group's members on this host
(``local``: their global ranks in that order); users and the coordinator know global ranks only.
"""

from __future__ import annotations

from typing import Any

from collsvc.client.backends.base import Call, mismatch_error
from collsvc.errors import CollectiveMismatchError, CollectiveTimeoutError, CollsvcError


def in_global_ranks(call: Call, local: tuple[int, ...], error: CollsvcError) -> CollsvcError:
    """A shared-memory group's error (which numbers ranks by their place among the group's members on
    this host, ``local``: their global ranks in that order) naming global ranks instead: a mismatch's
    details (:func:`global_mismatch`), a timeout's ``waiting_on``. Any other error is returned as is."""
    if isinstance(error, CollectiveMismatchError):
        return global_mismatch(call, local, error)
    if isinstance(error, CollectiveTimeoutError):
        waiting = [
            {**w, "rank": local[w["rank"]]} if isinstance(w.get("rank"), int) and 0 <= w["rank"] < len(local) else w
            for w in error.waiting_on
        ]
        named = ", ".join(str(w["rank"]) for w in waiting)
        return CollectiveTimeoutError(f"{error} (global rank{'s' if len(waiting) > 1 else ''} {named})", waiting)
    return error


def global_mismatch(call: Call, local: tuple[int, ...], error: CollectiveMismatchError) -> CollectiveMismatchError:
    """A shared-memory mismatch (details keyed by local rank) keyed by global rank instead, with this
    rank's entry overlaid with its full signature."""
    details: dict[int, Any] = {
        local[key] if isinstance(key, int) and 0 <= key < len(local) else key: value
        for key, value in error.details.items()
    }
    me = call.group.ranks[call.group.index]
    mine = details.get(me)
    details[me] = {**mine, **call.signature.describe()} if isinstance(mine, dict) else call.signature.describe()
    return mismatch_error(call, details)
