"""The pipe through which ``collsvc run`` tells its ranks that the embedded coordinator listens."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator

import pytest

from collsvc.client.coordinator_channel import wait_for_launch_signal
from collsvc.config import COORDINATOR_READY_ENV, coordinator_ready_fd

open_ends: set[int] = set()  # the pipe's descriptors no test closed yet (none is closed twice)


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    """A pipe whose ends the fixture closes afterwards, except those a test closed (see ``close``)."""
    read_end, write_end = os.pipe()
    open_ends.update({read_end, write_end})
    yield read_end, write_end
    for end in sorted(open_ends):
        os.close(end)
    open_ends.clear()


def close(fd: int) -> None:
    open_ends.discard(fd)
    os.close(fd)


def named(fd: int) -> dict[str, str]:
    return {COORDINATOR_READY_ENV: f"{fd}:{os.fstat(fd).st_ino}"}


def test_the_named_pipe_is_found(pipe: tuple[int, int]) -> None:
    assert coordinator_ready_fd(named(pipe[0])) == pipe[0]


def test_anything_else_is_ignored(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    assert coordinator_ready_fd({}) is None
    assert coordinator_ready_fd({COORDINATOR_READY_ENV: "garbage"}) is None
    # The descriptor now belongs to another pipe (a child that did not inherit it, a second init).
    other_read, other_write = os.pipe()
    try:
        stale = {COORDINATOR_READY_ENV: f"{read_end}:{os.fstat(other_read).st_ino}"}
        assert coordinator_ready_fd(stale) is None
    finally:
        os.close(other_read)
        os.close(other_write)
    with tempfile.TemporaryFile() as handle:  # not a pipe at all
        assert coordinator_ready_fd(named(handle.fileno())) is None
    gone = named(write_end)
    close(write_end)
    assert coordinator_ready_fd(gone) is None


def test_waiting_ends_when_the_launcher_closes_its_end(pipe: tuple[int, int]) -> None:
    read_end, write_end = pipe
    closer = threading.Thread(target=close, args=(write_end,))
    closer.start()
    open_ends.discard(read_end)  # wait_for_launch_signal closes it
    wait_for_launch_signal(read_end, timeout=60.0)
    closer.join()
    with pytest.raises(OSError):
        os.fstat(read_end)  # closed: a later init finds nothing to wait for


def test_waiting_is_bounded_by_the_timeout(pipe: tuple[int, int]) -> None:
    open_ends.discard(pipe[0])  # wait_for_launch_signal closes it
    wait_for_launch_signal(pipe[0], timeout=0.01)  # returns although the write end stays open
    with pytest.raises(OSError):
        os.fstat(pipe[0])
