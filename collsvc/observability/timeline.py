"""The timeline: each rank writes its calls to a part file; merging the parts makes one Chrome trace.

With ``COLLSVC_TIMELINE=out/trace.json`` every rank writes ``out/trace.rank<R>.json`` when it leaves
the job (or exits). :func:`merge_parts` turns the parts into one Chrome-trace / Perfetto JSON file
with one track per rank. Each collective is a slice (op, bytes, group, sequence number) with its
phases: *waiting for peers*, from this rank's arrival until the last member of the call arrived,
*moving data*, from then until the call returned on this rank, and *reducing*: the time the
reduction kernels took (host backends), which run chunk by chunk between the transfers, drawn as
their total at the end of the call. An instant marker shows when each rank
arrived, so a straggler stands out: its marker lines up with the end of everyone else's wait.

Arrivals are compared on the wall clock (``time.time_ns``): exact between ranks of one host, as good
as the hosts' clock synchronisation between hosts.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from collsvc.errors import CollsvcError
from collsvc.observability.files import read_json

PART_MARKER = "collsvc_timeline_part"
# A rank keeps at most this many calls (each holds its small Signature, ~0.5 KB); later ones are
# counted, not kept.
MAX_CALLS = 200_000

# One recorded call: stream, group, seq, op, description, bytes, start_ns, end_ns, outcome, reducing_ns
# (nanoseconds of reduction kernels inside the call; parts written without it read as 0).
CallEntry = tuple[str, str, int, str, str, int, int, int, str, int]


class TimelineError(CollsvcError):
    """Timeline parts are missing or unreadable."""


def part_path(target: str, rank: int) -> str:
    """Where rank ``rank`` writes its part for the merged file ``target`` (``trace.json`` -> ``trace.rank3.json``)."""
    root, ext = os.path.splitext(target)
    return f"{root}.rank{rank}{ext or '.json'}"


def part_pattern(target: str) -> str:
    """The glob of every rank's part for ``target``."""
    root, ext = os.path.splitext(target)
    return f"{glob.escape(root)}.rank*{ext or '.json'}"


def write_part(path: str, *, job: str, rank: int, host: str, calls: Iterable[CallEntry], dropped: int) -> None:
    """Writes one rank's part file (atomically: a half-written part is never merged).

    Raises:
        OSError: the file cannot be written.
    """
    data = {
        PART_MARKER: 1,
        "job": job,
        "rank": rank,
        "host": host,
        "pid": os.getpid(),
        "dropped": dropped,
        "calls": [list(c) for c in calls],
    }
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, separators=(",", ":"))
    os.replace(temporary, path)


def load_parts(paths: list[str]) -> list[dict[str, Any]]:
    """The timeline parts among ``paths`` (other JSON files are skipped), newest part per rank.

    Raises:
        TimelineError: none of the files is a timeline part.
    """
    by_rank: dict[int, tuple[float, dict[str, Any]]] = {}
    for path in paths:
        read = read_json(path)
        if read is None:
            continue
        data, mtime = read
        if not isinstance(data, dict) or data.get(PART_MARKER) != 1:
            continue
        rank = int(data["rank"])
        if rank not in by_rank or by_rank[rank][0] < mtime:
            by_rank[rank] = (mtime, data)
    if not by_rank:
        raise TimelineError("none of the files is a collsvc timeline part (COLLSVC_TIMELINE writes them)")
    return [by_rank[r][1] for r in sorted(by_rank)]


def _arrivals(parts: list[dict[str, Any]]) -> dict[tuple[str, int], int]:
    """The last arrival (start_ns) of every (stream, seq) over every rank that has it."""
    last: dict[tuple[str, int], int] = {}
    for part in parts:
        for call in part["calls"]:
            stream, seq, start = call[0], call[2], call[6]
            key = (stream, seq)
            if last.get(key, -1) < start:
                last[key] = start
    return last


def build_trace(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome-trace JSON object of ``parts`` (one process track per rank, in rank order)."""
    starts = [c[6] for p in parts for c in p["calls"]]
    origin = min(starts) if starts else 0
    last_arrival = _arrivals(parts)
    events: list[dict[str, Any]] = []

    def us(ns: int) -> float:
        return round((ns - origin) / 1000.0, 3)

    def dur(start_ns: int, end_ns: int) -> float:
        return round((end_ns - start_ns) / 1000.0, 3)

    for part in parts:
        rank = int(part["rank"])
        label = f"rank {rank}" + (f" ({part['host']})" if part.get("host") else "")
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "collectives"}})
        for call in part["calls"]:
            stream, group, seq, op, description, nbytes, start, end, outcome = call[:9]
            reducing = min(int(call[9]) if len(call) > 9 else 0, end - start)
            everyone_in = min(max(last_arrival.get((stream, seq), start), start), end)
            args = {
                "call": description,
                "bytes": nbytes,
                "group": group,
                "seq": seq,
                "outcome": outcome,
                "waited_ms": round((everyone_in - start) / 1e6, 3),
                "reducing_ms": round(reducing / 1e6, 3),
            }
            common = {"pid": rank, "tid": 0, "cat": "collective"}
            events.append({**common, "ph": "X", "name": op, "ts": us(start), "dur": dur(start, end), "args": args})
            events.append({**common, "ph": "i", "s": "t", "name": f"arrived {op} #{seq}", "ts": us(start)})
            if everyone_in > start:
                events.append(
                    {
                        **common,
                        "ph": "X",
                        "name": "waiting for peers",
                        "ts": us(start),
                        "dur": dur(start, everyone_in),
                    }
                )
            if end > everyone_in:
                events.append(
                    {
                        **common,
                        "ph": "X",
                        "name": "moving data",
                        "ts": us(everyone_in),
                        "dur": dur(everyone_in, end),
                    }
                )
            if reducing > 0:
                # Reduction kernels run chunk by chunk between transfers; their total is drawn as one
                # slice at the end of the call, inside "moving data" where it fits.
                reduce_from = max(end - reducing, everyone_in)
                events.append(
                    {
                        **common,
                        "ph": "X",
                        "name": "reducing",
                        "ts": us(reduce_from),
                        "dur": dur(reduce_from, end),
                        "args": {"note": "total of the reduction kernels, which run between the transfers"},
                    }
                )
    meta = {
        "ranks": [int(p["rank"]) for p in parts],
        "jobs": sorted({str(p.get("job", "")) for p in parts}),
        "dropped_calls": sum(int(p.get("dropped", 0)) for p in parts),
        "origin_unix_ns": origin,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"collsvc": meta}}


def merge_parts(paths: Iterable[str], output: str) -> dict[str, Any]:
    """Merges the timeline parts among ``paths`` into ``output``; returns the trace's summary.

    Raises:
        TimelineError: no timeline part among ``paths``.
        OSError: ``output`` cannot be written.
    """
    parts = load_parts(list(paths))
    trace = build_trace(parts)
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    temporary = f"{output}.{os.getpid()}.tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(trace, handle, separators=(",", ":"))
    os.replace(temporary, output)
    summary: dict[str, Any] = trace["otherData"]["collsvc"]
    summary["calls"] = sum(len(p["calls"]) for p in parts)
    return summary


def merge_directory(directory: str, output: str) -> dict[str, Any]:
    """Merges every timeline part in ``directory`` (parts copied from several hosts, say) into ``output``.

    Raises:
        TimelineError: ``directory`` holds no timeline part.
        OSError: ``output`` cannot be written.
    """
    output_path = os.path.abspath(output)
    paths = [
        p
        for p in sorted(glob.glob(os.path.join(glob.escape(directory), "*.json")))
        if os.path.abspath(p) != output_path
    ]
    if not paths:
        raise TimelineError(f"no JSON files in {directory}")
    return merge_parts(paths, output)


def merge_after_run(target: str, *, keep_parts: bool) -> dict[str, Any] | None:
    """What ``collsvc run`` does after the job: merge ``target``'s parts into ``target``.

    Returns:
        The summary, or None when no rank wrote a part (the script never called ``collsvc.init``).

    Raises:
        OSError: ``target`` cannot be written.
    """
    paths = sorted(glob.glob(part_pattern(target)))
    if not paths:
        return None
    try:
        summary = merge_parts(paths, target)
    except TimelineError:
        return None
    if not keep_parts:
        for path in paths:
            os.unlink(path)
    return summary


def merge_after_launch(*, several_nodes: bool) -> str | None:
    """What ``collsvc run`` does once its ranks exited: merges their parts into ``COLLSVC_TIMELINE``.

    With several nodes each node merges its own ranks and keeps the parts, to merge all nodes' later.

    Returns:
        A line for the user (where the timeline is, or why it could not be written), or None when no
        timeline was asked for or no part was written. Never raises: a timeline does not fail a run.
    """
    from collsvc.config import timeline_target

    target = timeline_target()
    if not target:
        return None
    try:
        summary = merge_after_run(target, keep_parts=several_nodes)
    except OSError as exc:
        return f"cannot write the timeline {target}: {exc.strerror or exc}"
    if summary is None:
        return None
    return f"timeline of {summary['calls']} collectives on {len(summary['ranks'])} ranks in {target}"
