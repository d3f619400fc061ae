"""COLLSVC_TIMELINE: per-rank parts, merged by ``collsvc run`` or ``collsvc timeline merge``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.observability.timeline import build_trace, part_path
from tests.cli._util import run_cli, script
from tests.harness import coordinator, run_ranks

STRAGGLER_SCRIPT = """
import time
import numpy as np
import pytest
import collsvc

comm = collsvc.init()
x = np.ones(1024, dtype=np.float32)
for step in range(5):
    if step == 2 and comm.rank == 2:
        time.sleep(0.5)  # simulated slow work on rank 2 before call #3: the straggler
    comm.all_reduce(x)
comm.all_gather(x)
collsvc.destroy()
"""


def tracks(trace: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """The collective slices of each rank's track, in time order."""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    out: dict[int, list[dict[str, Any]]] = {pid: [] for pid in names}
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and event["name"] not in ("waiting for peers", "moving data", "reducing"):
            out[event["pid"]].append(event)
    return {pid: sorted(events, key=lambda e: e["ts"]) for pid, events in out.items()}


def test_collsvc_run_merges_one_track_per_rank(tmp_path: Path) -> None:
    target = tmp_path / "trace.json"
    path = script(tmp_path, "straggler.py", STRAGGLER_SCRIPT)
    result = run_cli("run", "-n", "3", path, timeout=90, COLLSVC_TIMELINE=str(target))
    assert result.returncode == 0, result.stderr
    assert "timeline of 18 collectives on 3 ranks" in result.stderr
    assert not list(tmp_path.glob("trace.rank*.json"))  # the parts were merged and removed
    trace = json.loads(target.read_text())
    by_rank = tracks(trace)
    assert sorted(by_rank) == [0, 1, 2]
    for rank, slices in by_rank.items():
        assert [(s["name"], s["args"]["seq"]) for s in slices] == [("all_reduce", i) for i in range(1, 6)] + [
            ("all_gather", 6)
        ], rank
        assert all(s["args"]["group"] == "world" and s["args"]["outcome"] == "ok" for s in slices)
        assert slices[0]["args"]["bytes"] == 4096 and slices[0]["args"]["call"] == "all_reduce(float32[1024], SUM)"
    # Call #3: rank 2 arrived last (it waited for nobody); the others waited for it.
    third = {rank: slices[2]["args"]["waited_ms"] for rank, slices in by_rank.items()}
    assert third[2] == 0 and third[0] > 0 and third[1] > 0, third
    arrivals = [e for e in trace["traceEvents"] if e.get("ph") == "i" and e["name"] == "arrived all_reduce #3"]
    assert max(arrivals, key=lambda e: e["ts"])["pid"] == 2
    phases = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert {"waiting for peers", "moving data", "reducing"} <= phases
    # The reduction kernels' time is measured per call: all_reduce has some, all_gather none.
    for slices in by_rank.values():
        assert all(s["args"]["reducing_ms"] > 0 for s in slices[:5]), slices
        assert slices[5]["args"]["reducing_ms"] == 0, slices[5]


def timeline_job(comm: collsvc.Communicator) -> None:
    x = np.ones(8)
    comm.all_reduce(x)
    comm.broadcast(x, src=0)
    comm.barrier()


def test_timeline_merge_command(tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    with coordinator() as (_, address):
        run_ranks(timeline_job, 2, address=address, env={"COLLSVC_TIMELINE": str(parts / "trace.json")})
    assert sorted(p.name for p in parts.iterdir()) == ["trace.rank0.json", "trace.rank1.json"]
    (parts / "unrelated.json").write_text("[1, 2]")  # other files in the folder are skipped
    out = tmp_path / "merged.json"
    result = run_cli("timeline", "merge", str(parts), "-o", str(out), timeout=60)
    assert result.returncode == 0, result.stderr
    assert "2 rank track(s) [0, 1]" in result.stdout
    by_rank = tracks(json.loads(out.read_text()))
    for slices in by_rank.values():
        assert [s["name"] for s in slices] == ["all_reduce", "broadcast", "barrier"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("timeline", "merge", str(empty), "-o", str(out), timeout=60).returncode == 1


def test_phases_from_arrivals() -> None:
    # Rank 0 arrives at 0 ms, rank 1 at 3 ms; both finish at 5 ms.
    ms = 1_000_000
    parts = [
        {"rank": 0, "host": "a", "calls": [["world", "world", 1, "all_reduce", "d", 8, 0, 5 * ms, "ok"]]},
        {"rank": 1, "host": "b", "calls": [["world", "world", 1, "all_reduce", "d", 8, 3 * ms, 5 * ms, "ok"]]},
    ]
    events = build_trace(parts)["traceEvents"]
    phases = {(e["pid"], e["name"]): (e["ts"], e["dur"]) for e in events if e.get("ph") == "X"}
    assert phases[(0, "waiting for peers")] == (0, 3000)
    assert phases[(0, "moving data")] == (3000, 2000)
    assert (1, "waiting for peers") not in phases and phases[(1, "moving data")] == (3000, 2000)
    assert part_path("out/trace.json", 3) == "out/trace.rank3.json"


def test_timeline_render_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    ms = 1_000_000
    parts = [
        {"rank": r, "host": "h", "calls": [["world", "world", 1, "all_reduce", "d", 8, r * ms, 5 * ms, "ok"]]}
        for r in range(2)
    ]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(build_trace(parts)))
    png = tmp_path / "trace.png"
    result = run_cli("timeline", "render", str(trace), "-o", str(png), timeout=120)
    assert result.returncode == 0, result.stderr
    assert "2 collectives" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
