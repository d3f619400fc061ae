"""The Communicator's repeated calls on a shared-memory group (``shm/repeated.py``), with stand-ins for
the call runner's hooks: what a failed call hands the runner to record."""

from __future__ import annotations

import time
from typing import Any

import pytest

from collsvc.client.backends.base import Call, GroupSpec, Signature
from collsvc.client.backends.shm import LocalGroup
from collsvc.client.backends.shm.repeated import prepare_repeated
from collsvc.client.progress import ProgressTracker, StreamProgress
from collsvc.errors import CollsvcError
from tests.unit.shm.threads import run_group

BARRIER = Signature.of("barrier", "", ())


class RecordingHooks:
    """``CallHooks`` that keep what :meth:`failed` is given (the runner records it; here it is kept)."""

    stream = "world"
    limit = 5.0
    recording_timeline = False

    def __init__(self) -> None:
        self._tracker = ProgressTracker(capacity=4)
        self.failures: list[tuple[Call, Any, CollsvcError]] = []

    def progress(self) -> StreamProgress:
        return self._tracker.stream(self.stream)

    def counter(self, signature: Signature, group: GroupSpec) -> None:
        return None

    def failed(self, call: Call, record: Any, span: Any, error: CollsvcError) -> CollsvcError:
        self.failures.append((call, span, error))
        return error


class FollowOnly:
    """The group's call watch, as far as a repeated call uses it (it follows each call's numbers)."""

    def follow_numbers(self, stream: str, seq: int, signature: Signature) -> None:
        self.seq = seq


def test_a_failed_repeated_call_hands_the_runner_its_call_and_a_span_of_its_start_in_ns() -> None:
    """The span is ``(call, started_ns, 0)`` (``CallHooks.failed``): the recorder times the failed call
    from it, so a start in other units would count the call as decades long."""

    def body(group: LocalGroup) -> None:
        hooks = RecordingHooks()
        spec = GroupSpec("world", (0, 1), group.rank)
        repeated = prepare_repeated("barrier", BARRIER, spec, hooks, (group, FollowOnly(), (0, 1)), None)
        assert repeated is not None
        group.barrier(time.monotonic() + 10)  # both members prepared before either fails
        boom = CollsvcError("the coordinator says the job failed")
        group.fail(boom)
        before = time.time_ns()
        with pytest.raises(CollsvcError) as info:
            repeated.run(7, None, None)
        after = time.time_ns()
        assert info.value is boom
        ((call, span, error),) = hooks.failures
        assert error is boom and (call.seq, call.group, call.signature) == (7, spec, BARRIER)
        spanned_call, started_ns, reduce_clock = span
        assert spanned_call is call and reduce_clock == 0
        # time.time() * 1e9 in a float: allow a millisecond of rounding either side.
        assert before - 1_000_000 <= started_ns <= after + 1_000_000

    run_group(2, body)
