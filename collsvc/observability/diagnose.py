"""``collsvc diagnose``: what went wrong, from the flight-recorder dumps of every rank.

Each rank that sees a failure writes ``collsvc-<job>-rank<r>-<pid>.json`` (see
``ProgressTracker.dump``): its error and its last collectives (group, sequence number, the call with
dtype and shape, start time, seconds, outcome). Copy the dumps of every host into one folder and
:func:`diagnose_directory` finds, per job:

- the collective that failed first (group, sequence number, op, dtypes and shapes),
- the ranks that never entered it, and what each last did (from its own dump, or, for a rank that left
  no dump, from the coordinator's view that a timeout error carries),
- the ranks that disagreed about it (a mismatch), grouped by what each called.
"""

from __future__ import annotations

import ast
import glob
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from collsvc.errors import CollsvcError
from collsvc.observability.files import read_json

# "waiting on ranks 2 (node-c; last completed: all_reduce(float64[4], SUM)), 3 (...)" in a timeout message.
_WAITING = re.compile(r"(\d+) \(([^;()]*); last completed: ((?:[^()]|\([^()]*\))*)\)")
_MAX_ERROR_CHARS = 240  # the first error's text in the diagnosis (the dumps hold all of it)
_ERROR = re.compile(r"^(\w+)\((.*)\)$", re.DOTALL)


class DiagnosisError(CollsvcError):
    """The folder holds no flight-recorder dump."""


@dataclass
class RankDump:
    """One rank's flight-recorder dump."""

    job: str
    rank: int
    error_type: str
    error: str
    recent: list[dict[str, Any]]
    path: str

    def call(self, group: str, seq: int) -> dict[str, Any] | None:
        for record in self.recent:
            if record.get("group") == group and record.get("seq") == seq:
                return record
        return None

    def last(self) -> dict[str, Any] | None:
        return self.recent[-1] if self.recent else None


@dataclass
class Diagnosis:
    """What went wrong in one job (see :func:`diagnose`)."""

    job: str
    ranks_with_dumps: list[int]
    group: str = ""
    seq: int = 0
    calls: dict[str, list[int]] = field(default_factory=dict)  # what was called -> ranks that called it
    errors: dict[str, list[int]] = field(default_factory=dict)  # error type -> ranks that raised it
    never_entered: dict[int, str] = field(default_factory=dict)  # rank -> what it last did
    first_error: str = ""

    @property
    def disagreed(self) -> bool:
        return len(self.calls) > 1

    def lines(self) -> list[str]:
        """The diagnosis as a few lines of text."""
        dumps = ", ".join(str(r) for r in self.ranks_with_dumps)
        out = [
            f"job {self.job}: flight-recorder dumps from rank{'s' if len(self.ranks_with_dumps) > 1 else ''} {dumps}"
        ]
        if not self.group:
            out.append("  no failed collective in the dumps")
            return out
        what = next(iter(self.calls)) if len(self.calls) == 1 else "call"
        raised = "; ".join(f"{kind} on {_ranks(ranks)}" for kind, ranks in self.errors.items())
        out.append(f"  failed: {what} #{self.seq} in group '{self.group}' ({raised})")
        if self.disagreed:
            said = "; ".join(f"{_ranks(ranks)} called {call}" for call, ranks in self.calls.items())
            out.append(f"  ranks disagreed: {said}")
        for rank, last in self.never_entered.items():
            out.append(f"  never entered: rank {rank}; {last}")
        if self.first_error:
            out.append(f"  first error: {self.first_error}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "ranks_with_dumps": self.ranks_with_dumps,
            "group": self.group,
            "seq": self.seq,
            "calls": self.calls,
            "errors": self.errors,
            "disagreed": self.disagreed,
            "never_entered": {str(r): text for r, text in self.never_entered.items()},
            "first_error": self.first_error,
        }


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks)}"


def _parse_error(text: str) -> tuple[str, str]:
    """(type name, message) of a dumped ``repr(error)``."""
    match = _ERROR.match(text.strip())
    if not match:
        return "", text
    try:
        message = ast.literal_eval(f"({match.group(2)},)")[0]
    except (ValueError, SyntaxError, IndexError):
        message = match.group(2)
    return match.group(1), str(message)


def load_dumps(paths: Iterable[str]) -> list[RankDump]:
    """The flight-recorder dumps among ``paths``, newest per (job, rank); other files are skipped."""
    newest: dict[tuple[str, int], tuple[float, RankDump]] = {}
    for path in paths:
        read = read_json(path)
        if read is None:
            continue
        data, mtime = read
        if not isinstance(data, dict) or not {"job", "rank", "error", "recent"} <= data.keys():
            continue
        kind, message = _parse_error(str(data["error"]))
        recent = [r for r in data["recent"] if isinstance(r, dict)]
        dump = RankDump(str(data["job"]), int(data["rank"]), kind, message, recent, path)
        key = (dump.job, dump.rank)
        if key not in newest or newest[key][0] < mtime:
            newest[key] = (mtime, dump)
    return [entry[1] for entry in sorted(newest.values(), key=lambda e: (e[1].job, e[1].rank))]


def _describe_last(dump: RankDump) -> str:
    record = dump.last()
    if record is None:
        return "its dump lists no collective"
    state = "still running" if record.get("outcome") == "running" else record.get("outcome", "")
    return f"last call: {record.get('op')} #{record.get('seq')} in group '{record.get('group')}' ({state})"


def diagnose(dumps: list[RankDump]) -> Diagnosis:
    """The diagnosis of one job's dumps (all of one job).

    The failed collective is the earliest-started call that ended in an error on some rank; a rank
    that has no record of it never entered it.
    """
    job = dumps[0].job
    result = Diagnosis(job, [d.rank for d in dumps])
    failed = [
        (record.get("started", 0.0), dump, record)
        for dump in dumps
        for record in dump.recent
        if record.get("outcome") not in ("ok", "running")
    ]
    if not failed:
        return result
    _, first_dump, first = min(failed, key=lambda item: item[0])
    result.group, result.seq = str(first["group"]), int(first["seq"])
    first_error = f"rank {first_dump.rank}: {first_dump.error_type}: {first_dump.error}"
    result.first_error = (
        first_error if len(first_error) <= _MAX_ERROR_CHARS else first_error[:_MAX_ERROR_CHARS] + " ..."
    )
    by_rank = {d.rank: d for d in dumps}
    waiting: dict[int, tuple[str, str]] = {}  # rank -> (host, last completed), from timeout messages
    for dump in dumps:
        for rank, host, last in _WAITING.findall(dump.error):
            waiting.setdefault(int(rank), (host, last))
    for dump in dumps:
        record = dump.call(result.group, result.seq)
        if record is None:
            result.never_entered[dump.rank] = _describe_last(dump)
            continue
        result.calls.setdefault(str(record.get("op")), []).append(dump.rank)
        outcome = str(record.get("outcome"))
        if outcome not in ("ok", "running"):  # running: a job event failed this rank while it waited
            result.errors.setdefault(outcome, []).append(dump.rank)
    for rank, (host, last) in sorted(waiting.items()):
        if rank not in by_rank:
            where = f" on {host}" if host else ""
            result.never_entered[rank] = f"no dump{where}; last completed (as the coordinator saw it): {last}"
    result.never_entered = dict(sorted(result.never_entered.items()))
    return result


def diagnose_directory(directory: str) -> list[Diagnosis]:
    """The diagnosis of every job whose dumps are in ``directory`` (newest job first).

    Raises:
        DiagnosisError: ``directory`` holds no flight-recorder dump.
    """
    dumps = load_dumps(sorted(glob.glob(os.path.join(glob.escape(directory), "*.json"))))
    if not dumps:
        raise DiagnosisError(f"no flight-recorder dumps (collsvc-<job>-rank<r>-<pid>.json) in {directory}")
    jobs: dict[str, list[RankDump]] = {}
    for dump in dumps:
        jobs.setdefault(dump.job, []).append(dump)

    def newest(job_dumps: list[RankDump]) -> float:
        return max(float(r.get("started", 0.0)) for d in job_dumps for r in d.recent) if job_dumps else 0.0

    ordered = sorted(jobs.values(), key=lambda d: -newest(d) if any(x.recent for x in d) else 0.0)
    return [diagnose(job_dumps) for job_dumps in ordered]
