"""What this rank started and finished in each group, and its flight recorder of recent collectives.

:class:`ProgressTracker` records, per group (stream), the last sequence number started and finished;
heartbeats carry it to the coordinator, which names the ranks a stuck collective waits on. It also
keeps the last collectives of this rank, written to the log and to a JSON file when the job fails.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from collsvc.config import flight_recorder_dir, flight_recorder_keep
from collsvc.proto.v1 import common_pb2

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OpRecord:
    group: str
    seq: int
    op: str
    started: float
    seconds: float | None = None
    outcome: str = "running"


class StreamProgress:
    """Records the calls of one group (stream) that one thread runs in order, for a caller that records
    many of them (the Communicator's fast path): no lookup and no lock per call.

    Each store is one bytecode (a list item, an attribute, a deque append), atomic under the
    interpreter lock, so the tracker's readers see either the old or the new value. Calls of one
    stream are numbered and run in order by one thread at a time, so no two writers race.
    """

    __slots__ = ("_group", "_entry", "_recent")

    def __init__(self, group: str, entry: list[Any], recent: collections.deque[OpRecord]) -> None:
        self._group, self._entry, self._recent = group, entry, recent

    def start(self, seq: int, op: str, now: float) -> OpRecord:
        """Call ``seq`` (after every earlier one of the stream), doing ``op``, started at ``now``
        (``time.time()``)."""
        record = OpRecord(self._group, seq, op, now)
        self._entry[0] = seq
        self._recent.append(record)
        return record

    def finish(self, record: OpRecord, now: float) -> None:
        """``record``'s call ended well at ``now`` (``time.time()``)."""
        record.seconds = now - record.started
        record.outcome = "ok"
        entry = self._entry
        entry[1] = record.seq
        entry[2] = record.op


class ProgressTracker:
    """Per-group sequence progress plus the last ``capacity`` collectives of this rank."""

    def __init__(self, capacity: int = 64) -> None:
        self._lock = threading.Lock()
        self._groups: dict[str, list[Any]] = {}  # group -> [started_seq, finished_seq, last_op]
        self._recent: collections.deque[OpRecord] = collections.deque(maxlen=capacity)

    def start(self, group: str, seq: int, op: str) -> OpRecord:
        record = OpRecord(group, seq, op, time.time())
        with self._lock:
            entry = self._entry(group)
            if seq > entry[0]:
                entry[0] = seq
            self._recent.append(record)
        return record

    def stream(self, group: str) -> StreamProgress:
        """A recorder of ``group``'s calls for one thread running them in order (see :class:`StreamProgress`)."""
        with self._lock:
            entry = self._entry(group)
        return StreamProgress(group, entry, self._recent)

    def finish(self, record: OpRecord, outcome: str = "ok") -> None:
        seconds = time.time() - record.started
        with self._lock:
            record.seconds = seconds
            record.outcome = outcome
            if outcome == "ok":
                entry = self._entry(record.group)
                if record.seq > entry[1]:
                    entry[1] = record.seq
                entry[2] = record.op

    def _entry(self, group: str) -> list[Any]:
        """``group``'s [started_seq, finished_seq, last_op], made if new (the caller holds the lock)."""
        entry = self._groups.get(group)
        if entry is None:
            entry = self._groups[group] = [0, 0, ""]
        return entry

    def snapshot(self) -> list[common_pb2.Progress]:
        with self._lock:
            return [
                common_pb2.Progress(group=g, started_seq=e[0], finished_seq=e[1], last_op=e[2])
                for g, e in self._groups.items()
            ]

    def recent(self) -> list[dict[str, Any]]:
        with self._lock:
            records = list(self._recent)  # one C-level copy: a StreamProgress may append meanwhile
        return [asdict(r) for r in records]

    def dump(self, job_id: str, rank: int, error: BaseException) -> str:
        """Writes the flight recorder to the log and to a JSON file; returns the file's path.

        The directory keeps only the newest ``COLLSVC_DUMP_KEEP`` dumps (see :func:`prune_dumps`), so
        failed jobs do not pile files up in the temp folder. Never raises: a dump that cannot be
        written is logged and the failure it describes goes on unchanged.
        """
        records = self.recent()
        directory = flight_recorder_dir()
        path = os.path.join(directory, f"{DUMP_PREFIX}{job_id}-rank{rank}-{os.getpid()}.json")
        try:
            with open(path, "w", encoding="utf-8") as handle:
                json.dump({"job": job_id, "rank": rank, "error": repr(error), "recent": records}, handle, indent=1)
        except OSError as exc:
            log.warning("job %s rank %d: could not write flight recorder to %s: %s", job_id, rank, path, exc)
        else:
            try:
                prune_dumps(directory, flight_recorder_keep(), keep_path=path)
            except ValueError as exc:  # a bad COLLSVC_DUMP_KEEP must not hide the failure being reported
                log.warning("job %s rank %d: old flight-recorder dumps not pruned: %s", job_id, rank, exc)
        for record in records[-8:]:
            log.debug("job %s rank %d recent: %s", job_id, rank, record)
        return path


DUMP_PREFIX = "collsvc-"


def prune_dumps(directory: str, keep: int, *, keep_path: str | None = None) -> list[str]:
    """Deletes all but the newest ``keep`` flight-recorder dumps (``collsvc-*-rank*-*.json``) in ``directory``.

    ``keep_path`` (the dump just written) is never deleted. Files another rank deletes at the same
    time are skipped. Returns the deleted paths; never raises.
    """
    try:
        names = [n for n in os.listdir(directory) if _is_dump_name(n)]
    except OSError:
        return []
    dated: list[tuple[float, str]] = []
    for name in names:
        path = os.path.join(directory, name)
        try:
            dated.append((os.stat(path).st_mtime, path))
        except OSError:
            continue  # removed meanwhile by another rank's pruning
    dated.sort(reverse=True)  # newest first; equal times fall back to the name
    deleted = []
    for _, path in dated[max(keep, 1) :]:
        if path == keep_path:
            continue
        try:
            os.remove(path)
        except OSError:
            continue
        deleted.append(path)
    return deleted


def _is_dump_name(name: str) -> bool:
    if not (name.startswith(DUMP_PREFIX) and name.endswith(".json")):
        return False
    # collsvc-<job>-rank<r>-<pid>.json: the job id may hold dashes, the last two parts may not.
    head, _, pid = name[: -len(".json")].rpartition("-")
    rank = head.rpartition("-")[2]
    return pid.isdigit() and rank.startswith("rank") and rank[4:].isdigit()
