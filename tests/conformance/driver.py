"""The parent side of the conformance suite: runs the cases of one (world size, transport) in as few
jobs as possible and gathers every failing case with its description.

One job runs a whole batch (process start-up dominates a case's cost). When a case leaves the job out
of step (a timeout, a failed member), the job ends and a new one runs the windows after it; that
window's cases are reported with the error.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.conformance.cases import Case, generate, group_ranks, interleave
from tests.conformance.ranks import run_batch
from tests.harness import coordinator, run_ranks

# Transports: how ranks are spread over (fake) hosts, and what that selects.
TRANSPORTS = ("shm", "grpc", "noshm", "hier")
# Ranks' own timeout for any one collective: a case that leaves ranks out of step costs this much.
CALL_TIMEOUT = 10.0
# Jobs a run may start before it reports the remaining cases as not run.
MAX_JOBS = 8
# Collectives whose result is the same on every member: their digests must agree bit for bit.
SAME_EVERYWHERE = ("all_reduce", "broadcast", "all_gather")
DEFAULT_SEED = 20261128


def level() -> str:
    """``COLLSVC_CONFORMANCE=full`` runs the whole product, ``quick`` the mutation runs' slice;
    anything else the CI slice."""
    chosen = os.environ.get("COLLSVC_CONFORMANCE", "")
    return chosen if chosen in ("full", "quick") else "ci"


def seed() -> int:
    return int(os.environ.get("COLLSVC_CONFORMANCE_SEED", str(DEFAULT_SEED)))


def rank_env(transport: str, n: int) -> Callable[[int], dict[str, str]]:
    """Per-rank environment of ``transport``: "shm" one host; "grpc" one host per rank; "noshm" one
    host without shared memory, with the ring / chain algorithms from 4 KiB; "hier" two hosts (ranks
    0..1 on one, the rest on the other), so all_reduce goes local reduce -> leaders -> local broadcast."""

    def env(rank: int) -> dict[str, str]:
        if transport == "shm":
            return {"COLLSVC_HOST": "conformance-host"}
        if transport == "grpc":
            return {"COLLSVC_HOST": f"conformance-host{rank}"}
        if transport == "noshm":
            return {"COLLSVC_HOST": "conformance-host", "COLLSVC_SHM": "0", "COLLSVC_RING_SMALL_BYTES": "4096"}
        return {"COLLSVC_HOST": "conformance-a" if rank < 2 else "conformance-b"}

    return env


@dataclass
class Report:
    world_size: int
    transport: str
    level: str
    cases: int = 0
    calls: int = 0
    jobs: int = 0
    seconds: float = 0.0
    failures: dict[str, list[str]] = field(default_factory=dict)  # case -> messages (rank, rep)
    broken: list[str] = field(default_factory=list)
    slowest: list[tuple[str, float]] = field(default_factory=list)  # rank 0's slowest cases

    def fail(self, case: str, message: str) -> None:
        self.failures.setdefault(case, []).append(message)

    def as_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "transport": self.transport,
            "level": self.level,
            "cases": self.cases,
            "calls": self.calls,
            "failed": len(self.failures),
            "passed": self.cases - len(self.failures),
            "jobs": self.jobs,
            "seconds": round(self.seconds, 1),
            "failures": self.failures,
            "broken": self.broken,
            "slowest": self.slowest,
        }


def run(n: int, transport: str, cases: list[Case] | None = None, *, job_timeout: float = 600.0) -> Report:
    """Runs ``cases`` (default: :func:`generate`'s for this level) on ``n`` ranks over ``transport``."""
    lvl = level()
    cases = generate(n, transport, lvl) if cases is None else cases
    chosen = os.environ.get("COLLSVC_CONFORMANCE_CASES")
    if chosen:  # only the cases whose description matches (to rerun a few)
        cases = [c for c in cases if re.search(chosen, c.describe())]
    # A mismatch breaks the job: such a case runs once every other case of the job ran.
    finals = [c for c in cases if c.form == "mismatch"]
    windows = interleave([c for c in cases if c.form != "mismatch"], seed() + n) or ([[]] if finals else [])
    report = Report(n, transport, lvl, cases=len(cases))
    report.calls = sum(len([g for g in group_ranks(c.group, n)]) for c in cases) * 3
    start, began = 0, time.monotonic()
    while start < len(windows):
        report.jobs += 1
        todo = windows[start:]
        with coordinator() as (_, address):
            result = run_ranks(
                run_batch,
                n,
                address=address,
                args=(todo, CALL_TIMEOUT, transport == "shm", finals),
                use_init=False,
                rank_env=rank_env(transport, n),
                timeout=job_timeout,
                allow_failures=True,
            )
        values = [o.value if o.error is None else None for o in result.outcomes]
        for outcome in result.outcomes:
            if outcome.error is not None:
                report.broken.append(f"rank {outcome.rank}: {outcome.error[-1500:]}")
        for rank, value in enumerate(values):
            if value is None:
                continue
            for case, rep, message in value["failures"]:
                report.fail(case, f"rank {rank} rep {rep}: {message}")
            if value["broken"]:
                report.broken.append(f"rank {rank}: {value['broken']}")
        _compare_digests(report, todo, values, n)
        if values and values[0] is not None:
            timing = sorted(values[0]["timing"].items(), key=lambda item: -item[1])
            slowest = report.slowest + [(k, round(v, 3)) for k, v in timing[:15]]
            report.slowest = sorted(slowest, key=lambda item: -item[1])[:15]
        done = min((v["done"] for v in values if v is not None), default=0)
        finished = all(v is not None and not v["broken"] for v in values) and done == len(todo)
        if finished:
            break
        # The window that broke the job: its cases not yet reported failed with what broke it; the
        # cases like the one that broke it (same collective and form) are not run again: each would
        # cost another timeout and job.
        reason = report.broken[-1] if report.broken else "the job ended early"
        if done < len(todo):
            for case in todo[done]:
                report.failures.setdefault(case.describe(), [f"not finished: {reason[:300]}"])
        start += done + 1
        culprit = _culprit(reason, todo[done] if done < len(todo) else [])
        rest = []
        for window in windows[start:]:
            kept = []
            for case in window:
                if culprit is not None and (case.coll, case.form) == (culprit.coll, culprit.form):
                    report.failures.setdefault(
                        case.describe(), [f"not run: like {culprit.describe()}, which broke a job"]
                    )
                else:
                    kept.append(case)
            rest.append(kept)
        windows = windows[:start] + rest
        if report.jobs >= MAX_JOBS:
            for window in windows[start:]:
                for case in window:
                    report.failures.setdefault(case.describe(), [f"not run: {MAX_JOBS} jobs broke"])
            break
    report.seconds = time.monotonic() - began
    return report


def _culprit(reason: str, window: list[Case]) -> Case | None:
    """The case of ``window`` whose description starts the error that broke the job, if any."""
    for case in window:
        if case.describe() in reason:
            return case
    return None


def _compare_digests(report: Report, windows: list[list[Case]], values: list[Any], n: int) -> None:
    """Results that are the same on every member must have the same bits on every member."""
    for window in windows:
        for case in window:
            if case.coll not in SAME_EVERYWHERE or case.expect is not None:
                continue
            name = case.describe()
            seen = {}
            for rank in group_ranks(case.group, n):
                value = values[rank]
                if value is not None and name in value["digests"]:
                    seen[rank] = tuple(value["digests"][name])
            if len(set(seen.values())) > 1:
                report.fail(name, f"results differ in their bits between ranks: {seen}")
