"""Whom a survivor waits for when it re-forms: pure rules, on the errors the watcher builds from the
coordinator's events."""

from __future__ import annotations

import json

from collsvc.client.heartbeat import event_error
from collsvc.elastic._run import gone_for_good
from collsvc.errors import RankFailedError
from collsvc.proto.v1 import coordinator_pb2

Events = coordinator_pb2.EventKind


def left(rank: int, cause: list[int] | None = None) -> RankFailedError:
    """The error a member records for ``rank``'s departure, from the event the coordinator sends."""
    details = {"finished": {str(rank): {}}, **({"cause": cause} if cause else {})}
    event = coordinator_pb2.WatchEvent(
        kind=Events.EVENT_KIND_MEMBER_LEFT, ranks=[rank], hosts=["h"], details_json=json.dumps(details)
    )
    error = event_error(event)
    assert isinstance(error, RankFailedError)
    return error


def test_a_member_that_left_because_the_generation_failed_is_waited_for() -> None:
    # Rank 3 died; ranks 0 and 1 saw it first and left for the re-form; rank 2 finished and quit.
    departed = {0: left(0, cause=[3]), 1: left(1, cause=[3]), 2: left(2)}
    assert gone_for_good(departed) == {2}
    assert gone_for_good({}) == set()
