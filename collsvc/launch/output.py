"""Copies each rank's output to the launcher's own streams, one whole line at a time, prefixed.

Used by ``collsvc run``: every line a rank writes to stdout (stderr) appears on the launcher's stdout
(stderr) as ``[rank R] line``. Lines from different ranks never interleave mid-line because each line
is written with one call under a lock shared by everyone writing to the same stream. Bytes that are not
UTF-8 are decoded with replacement characters rather than crashing the copy.
"""

from __future__ import annotations

import contextlib
import threading
from typing import IO, TextIO

_LOCKS: dict[int, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _lock_for(stream: TextIO) -> threading.Lock:
    # One lock per destination stream object, so that stdout and stderr never block each other.
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(id(stream), threading.Lock())


def write_line(stream: TextIO, text: str) -> None:
    """Writes ``text`` (which ends with a newline) to ``stream`` in one call, and flushes.

    A stream that cannot encode some characters gets them backslash-escaped; a closed or broken
    destination (the reader of our stdout went away) is ignored so that ranks keep running.
    """
    with _lock_for(stream):
        try:
            try:
                stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(stream, "encoding", None) or "ascii"
                stream.write(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))
            stream.flush()
        except (OSError, ValueError):
            pass


class LinePump(threading.Thread):
    """A daemon thread that copies lines from a child's pipe to ``dest`` with a prefix.

    Args:
        source: the binary read end of the child's stdout or stderr pipe; closed at EOF.
        dest: the text stream to copy to (looked up by the caller, usually ``sys.stdout``).
        prefix: put before every line, e.g. ``"[rank 3] "``.
    """

    def __init__(self, source: IO[bytes], dest: TextIO, prefix: str) -> None:
        super().__init__(name=f"collsvc-output {prefix.strip()}", daemon=True)
        self._source = source
        self._dest = dest
        self._prefix = prefix

    def run(self) -> None:
        """Copies until EOF (the child and everything that inherited the pipe closed it)."""
        try:
            for raw in iter(self._source.readline, b""):
                line = raw.decode("utf-8", errors="replace")
                if not line.endswith("\n"):
                    line += "\n"  # a last line without a newline still ends where the rank's did
                write_line(self._dest, self._prefix + line)
        except (OSError, ValueError):
            pass  # the pipe was closed under us: nothing more to copy
        finally:
            with contextlib.suppress(OSError):
                self._source.close()
