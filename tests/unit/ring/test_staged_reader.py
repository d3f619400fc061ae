"""The lane reader's staging: records of any size come out whole and in order, however the stream is cut."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest

from collsvc.client.backends.ring.lane_receiver import STAGE_BYTES, StagedReader


@pytest.mark.parametrize("piece", [13, 4096, 1 << 20])
def test_takes_and_reads_match_what_was_written(piece: int) -> None:
    """A stream of (head, payload) records, written in pieces of ``piece`` bytes, read back with
    take() for heads and read_into() for payloads of sizes around the staging buffer's."""
    sizes = [0, 1, 100, STAGE_BYTES - 57, STAGE_BYTES, STAGE_BYTES + 3, 3 << 20, 5, 0, 70_000]
    records = [(os.urandom(56), os.urandom(size)) for size in sizes]
    stream = b"".join(head + payload for head, payload in records)
    ours, theirs = socket.socketpair()

    def write() -> None:
        for at in range(0, len(stream), piece):
            theirs.sendall(stream[at : at + piece])

    writer = threading.Thread(target=write)
    writer.start()
    try:
        reader = StagedReader(ours)
        for head, payload in records:
            assert bytes(reader.take(len(head))) == head
            into = np.empty(len(payload), np.uint8)
            reader.read_into(memoryview(into))
            assert into.tobytes() == payload
    finally:
        writer.join()
        ours.close()
        theirs.close()


def test_a_closed_connection_ends_a_take() -> None:
    ours, theirs = socket.socketpair()
    theirs.sendall(b"abc")
    theirs.close()
    reader = StagedReader(ours)
    with pytest.raises(ConnectionError):
        reader.take(4)
    ours.close()
