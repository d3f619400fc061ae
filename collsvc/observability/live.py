"""The ``collsvc status --watch`` table: per job, ranks, steps per second, the slowest rank, last calls.

A *step* here is one collective of the job's ``world`` group, the only progress every rank reports
the same way: with one gradient all_reduce per training step it is the training step. Rates come
from two successive status snapshots, so the first refresh shows no rate yet.

The slowest rank is found two ways. A rank whose finished steps lag the others by more than
:data:`LAG_STEPS` is stuck or far behind, and named with that lag. Otherwise the ranks move in
lockstep, and the straggler is the rank that spends the *least* time per step inside collectives: the
others arrive first and wait for it there. How far behind it is: how much longer the others wait per
step (from each rank's collective time, which its heartbeats carry).
"""

from __future__ import annotations

import statistics
from typing import Any

# Progress arrives with heartbeats: ranks a step or two apart are sampling noise, not a lag.
LAG_STEPS = 2


def _progress(member: dict[str, Any]) -> tuple[int, int, str]:
    p = member.get("progress") or {}
    return int(p.get("started_seq", 0)), int(p.get("finished_seq", 0)), str(p.get("last_op", ""))


def _collective_seconds(member: dict[str, Any]) -> float | None:
    totals = member.get("collectives")
    return None if totals is None else float(totals["seconds"])


def _duration(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def _slowest(finished: dict[int, int], per_step: dict[int, float], job_rate: float | None) -> tuple[int, str] | None:
    """(rank, how far behind) of the job's slowest rank, or None when no rank is known to be behind."""
    if not finished:
        return None
    lead = max(finished.values())
    laggard = min(finished, key=lambda r: (finished[r], r))
    behind = lead - finished[laggard]
    if behind > LAG_STEPS:
        when = f" (~{_duration(behind / job_rate)})" if job_rate else ""
        return laggard, f"{behind} steps behind{when}"
    if len(per_step) < 2:
        return None  # in lockstep, and no collective times yet (first refresh, or an idle job)
    straggler = min(per_step, key=lambda r: (per_step[r], r))
    others = [t for r, t in per_step.items() if r != straggler]
    wait = statistics.median(others) - per_step[straggler]
    return straggler, f"the others wait ~{_duration(wait)} per step for it"


def watch_table(current: dict[str, Any], previous: dict[str, Any] | None, seconds: float) -> str:
    """The table for ``current`` (``status_to_dict`` output), with rates against ``previous``.

    Args:
        current: the status now. previous: the status ``seconds`` earlier, or None on the first refresh.
        seconds: time between the two snapshots.
    """
    before: dict[tuple[str, int], dict[str, Any]] = {}
    for job in (previous or {}).get("jobs", []):
        for member in job["members"]:
            before[(job["job_id"], member["rank"])] = member
    if not current["jobs"]:
        return "no jobs"
    lines: list[str] = []
    for job in current["jobs"]:
        members = job["members"]
        finished = {m["rank"]: _progress(m)[1] for m in members}
        rates: dict[int, float] = {}
        per_step: dict[int, float] = {}  # seconds inside collectives per step, over the last interval
        for member in members:
            old = before.get((job["job_id"], member["rank"]))
            if old is None or seconds <= 0:
                continue
            steps = finished[member["rank"]] - _progress(old)[1]
            rates[member["rank"]] = steps / seconds
            now_in, then_in = _collective_seconds(member), _collective_seconds(old)
            if steps > 0 and now_in is not None and then_in is not None:
                per_step[member["rank"]] = (now_in - then_in) / steps
        job_rate = statistics.median(rates.values()) if rates else None
        header = f"job {job['job_id']}: {job['state']}, {len(members)}/{job['world_size']} ranks"
        header += f", {job_rate:.1f} steps/s" if job_rate is not None else ", steps/s: (next refresh)"
        lines.append(header)
        slowest = _slowest(finished, per_step, job_rate)
        if slowest is not None:
            lines.append(f"  slowest: rank {slowest[0]}, {slowest[1]}")
        elif finished:
            lines.append("  slowest: none behind" if job_rate is not None else "  slowest: (next refresh)")
        if job.get("failure"):
            lines.append(f"  failure: {job['failure']}")
        rows = [("rank", "host", "state", "steps", "steps/s", "in coll./step", "heartbeat", "last collective")]
        for member in members:
            started, done, last_op = _progress(member)
            rate, inside = rates.get(member["rank"]), per_step.get(member["rank"])
            running = f" (in #{started})" if started > done else ""
            rows.append(
                (
                    str(member["rank"]),
                    member["host"],
                    member["state"],
                    str(done),
                    "-" if rate is None else f"{rate:.1f}",
                    "-" if inside is None else _duration(inside),
                    f"{member['seconds_since_heartbeat']:.1f}s",
                    (last_op or "-") + running,
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)
