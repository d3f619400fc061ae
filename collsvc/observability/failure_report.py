"""How a rank's failure reads: a short story on the rank's stderr, and a report the launcher can blame from.

A rank that dies of an uncaught collsvc error prints the user's own frames and the error, without
collsvc's internal frames and chained internal errors (``COLLSVC_DEBUG=1`` prints everything). When
``COLLSVC_REPORT_DIR`` is set (``collsvc run`` sets it), the rank also writes ``rank-<R>.json`` there:
the error's type, message and the ranks it names as the cause. ``collsvc run`` reads these reports
to name the rank at fault rather than the first victim that happened to exit.

Both act only in the process that installed them (the rank): a child forked from it reports its own
errors as Python would, and never writes the rank's report.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

REPORT_DIR_ENV = "COLLSVC_REPORT_DIR"
DEBUG_ENV = "COLLSVC_DEBUG"
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # collsvc/, not observability/
_installed = False
_installed_pid = 0  # the rank's process: its forked children do not report for it


def blamed(error: BaseException) -> list[dict[str, Any]]:
    """The ranks ``error`` names as the cause (``{"rank": R, "host": H}``); empty when it names none."""
    # Imported here: the launcher imports this module before it starts its ranks, and gRPC is slow to load.
    from collsvc.errors import CollectiveTimeoutError, RankFailedError

    if isinstance(error, RankFailedError):
        hosts = list(error.hosts) + [""] * (len(error.ranks) - len(error.hosts))
        return [{"rank": int(r), "host": h} for r, h in zip(error.ranks, hosts, strict=False)]
    if isinstance(error, CollectiveTimeoutError):
        return [{"rank": int(w["rank"]), "host": str(w.get("host", ""))} for w in error.waiting_on]
    return []


def render(error: BaseException, tb: TracebackType | None) -> str:
    """The error with the user's frames only and no chained internal errors (a few lines)."""
    frames = [f for f in traceback.extract_tb(tb) if not os.path.abspath(f.filename).startswith(_PACKAGE_DIR)]
    lines = []
    if frames:
        lines.append(f"Traceback (most recent call last; collsvc's frames hidden, {DEBUG_ENV}=1 shows them):\n")
        lines.extend(traceback.format_list(frames))
    name = type(error).__qualname__
    module = type(error).__module__
    lines.append(f"{name if module == 'builtins' else module + '.' + name}: {error}\n")
    return "".join(lines)


def write_report(error: BaseException, rank: int | None = None, environ: Mapping[str, str] = os.environ) -> None:
    """Writes ``error``'s report for the launcher when ``COLLSVC_REPORT_DIR`` is set; never raises."""
    directory = environ.get(REPORT_DIR_ENV)  # reads the environment itself: collsvc run wrote both for its ranks
    if not directory:
        return
    if rank is None:
        try:
            rank = int(environ.get("COLLSVC_RANK", ""))
        except ValueError:
            return
    report = {"rank": rank, "type": type(error).__name__, "message": str(error), "blamed": blamed(error)}
    path = os.path.join(directory, f"rank-{rank}.json")
    with contextlib.suppress(OSError), open(path + ".tmp", "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    with contextlib.suppress(OSError):
        os.replace(path + ".tmp", path)


def _excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
    from collsvc.errors import CollsvcError  # loaded already: install() runs when a rank joins

    if isinstance(error, CollsvcError) and os.getpid() == _installed_pid:
        write_report(error)
        from collsvc.config import debug_enabled  # loaded already, like the errors

        if not debug_enabled():
            with contextlib.suppress(Exception):
                sys.stderr.write(render(error, tb))
                sys.stderr.flush()
                return
    _previous(kind, error, tb)


_previous = sys.excepthook


def install() -> None:
    """Makes uncaught collsvc errors print as :func:`render` and write their report (idempotent)."""
    global _installed, _installed_pid, _previous
    _installed_pid = os.getpid()
    if _installed:
        return
    _installed = True
    _previous = sys.excepthook
    sys.excepthook = _excepthook


# -- the launcher's side ---------------------------------------------------------------------------


@dataclass
class Report:
    """What one rank said about its failure."""

    rank: int
    type: str
    message: str
    blamed: list[dict[str, Any]] = field(default_factory=list)


def read_reports(directory: str) -> dict[int, Report]:
    """The readable reports in ``directory``, by rank (unreadable files are skipped)."""
    reports: dict[int, Report] = {}
    try:
        names = os.listdir(directory)
    except OSError:
        return reports
    for name in names:
        if not (name.startswith("rank-") and name.endswith(".json")):
            continue
        try:
            with open(os.path.join(directory, name), encoding="utf-8") as handle:
                raw = json.load(handle)
            report = Report(int(raw["rank"]), str(raw["type"]), str(raw["message"]), list(raw.get("blamed", [])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        reports[report.rank] = report
    return reports


@dataclass
class Blame:
    """Who caused a failed job, as the failed ranks' reports tell it."""

    culprits: dict[int, str]  # rank -> host ("" where unknown)
    victims: list[int]  # failed ranks whose report names a culprit, not themselves named
    story: str  # the first victim's error, "Type: message"

    def who(self) -> str:
        return ", ".join(f"rank {r}" + (f" on host {h}" if h else "") for r, h in self.culprits.items())

    def because(self) -> str:
        """`` (ranks 0, 2 failed because of it)``, or "" without victims."""
        if not self.victims:
            return ""
        plural = "s" if len(self.victims) > 1 else ""
        return f" (rank{plural} {', '.join(map(str, self.victims))} failed because of it)"


def at_fault(reports: Mapping[int, Report], failed: Sequence[int]) -> Blame | None:
    """The rank(s) at fault when the failed ranks' reports blame others; None when none names a cause.

    Args:
        reports: rank -> report.
        failed: the ranks that exited non-zero, first failure first.
    """
    accusers = [r for r in failed if r in reports and reports[r].blamed]
    if not accusers:
        return None
    named: dict[int, str] = {}
    for rank in accusers:
        for entry in reports[rank].blamed:
            named.setdefault(int(entry["rank"]), str(entry.get("host") or ""))
    culprits = {r: h for r, h in named.items() if r not in accusers} or named
    first = reports[accusers[0]]
    victims = sorted(r for r in accusers if r not in culprits)
    return Blame(culprits, victims, f"{first.type}: {first.message}")


def failure_summary(
    reports: Mapping[int, Report],
    failed: Sequence[int],
    failed_by_itself: set[int],
    exits: Mapping[int, str],
    host: str,
) -> str:
    """The launcher's summary line of a failed job: the rank at fault and why.

    Args:
        reports: rank -> report. failed: ranks that exited non-zero, first failure first (not empty).
        failed_by_itself: the failed ranks not killed by the launcher's own signals.
        exits: rank -> how it exited, in words ("exit code 1"). host: this launcher's host name.
    """
    blame = at_fault(reports, failed)
    culprit = next(iter(blame.culprits), None) if blame is not None else None
    if blame is not None and len(blame.culprits) == 1 and culprit in failed_by_itself and culprit in exits:
        # The culprit failed by itself (a crash, an error of its own): its exit, and its victims.
        return f"collsvc run: rank {culprit} on host {host} failed: {exits[culprit]}{blame.because()}"
    if blame is not None:
        # The culprit did not fail by itself (stuck, absent, gone early): what its victims saw.
        verb = "is" if len(blame.culprits) == 1 else "are"
        return f"collsvc run: {blame.who()} {verb} at fault{blame.because()}: {blame.story}"
    first = failed[0]
    report = reports.get(first)
    said = f": {report.type}: {report.message}" if report is not None else ""
    return f"collsvc run: rank {first} on host {host} failed: {exits.get(first, 'failed')}{said}"
