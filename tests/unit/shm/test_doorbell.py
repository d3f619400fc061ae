"""Socket barriers (the doorbell) carry each rank's barrier body to every rank as it was sent."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from collsvc.client.backends.shm.doorbell import Doorbell
from collsvc.client.backends.shm.segment import DESCRIPTOR_BYTES
from tests.unit.shm.threads import run_ranks


@pytest.mark.parametrize("size", [3, 40])
def test_every_rank_sees_every_body_even_when_their_lengths_differ(size: int) -> None:
    """Ranks out of step publish bodies of different lengths (a call's descriptor, or none); local rank
    0's release must hand each rank's on unchanged, at any group size (40 x 60 bytes is past 1 KiB)."""
    namespace = uuid.uuid4().hex
    bodies = [bytes([r % 251]) * (r * 7 % (DESCRIPTOR_BYTES + 1)) for r in range(size)]

    def rank(r: int) -> list[bytes]:
        bell = Doorbell(namespace, r, size)
        fd = os.memfd_create("doorbell-test")
        try:
            deadline = time.monotonic() + 20
            assert bell.exchange(fd, b"", deadline, lambda: None)
            assert bell.barrier(1, bodies[r], deadline, lambda: None, 0.0)
            return list(bell.bodies[1])
        finally:
            os.close(fd)
            bell.close()

    assert run_ranks(rank, range(size), size) == [bodies] * size
