"""The argument parser, ``bench`` dispatch, and the ``status`` table, in-process."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from collsvc.cli import main as cli
from collsvc.cli.remote import format_status, status_to_dict
from collsvc.proto.v1 import common_pb2, coordinator_pb2


def test_run_passes_everything_after_the_script_through() -> None:
    args = cli.build_parser().parse_args(["run", "-n", "4", "--job-id", "x", "train.py", "-n", "9", "--lr", "1"])
    assert (args.nproc, args.job_id, args.module) == (4, "x", False)
    assert args.target == ["train.py", "-n", "9", "--lr", "1"]
    args = cli.build_parser().parse_args(["run", "-m", "pkg.mod", "--x"])
    assert args.module and args.target == ["pkg.mod", "--x"]


def test_bench_arguments_reach_collsvc_bench(monkeypatch: pytest.MonkeyPatch) -> None:
    import collsvc.bench.harness

    seen: list[argparse.Namespace] = []

    def fake_main(args: argparse.Namespace) -> int:
        seen.append(args)
        return 7

    monkeypatch.setattr(collsvc.bench.harness, "main", fake_main)
    assert cli.main(["bench", "-n", "3", "--sizes", "1K:4K", "--json", "--check", "--plot", "p.png"]) == 7
    (args,) = seen
    assert (args.n, args.op, args.sizes, args.dtype, args.device, args.backend) == (
        3,
        "all_reduce",
        "1K:4K",
        "float32",
        "cpu",
        "auto",
    )
    assert args.json and args.check and args.plot == "p.png" and args.iters > 0 and args.warmup >= 0


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([])
    assert info.value.code == 2


def _response() -> Any:
    members = [
        common_pb2.Member(
            rank=r,
            host="h0" if r < 2 else "h1",
            local_rank=r % 2,
            local_size=2,
            node_rank=r // 2,
            pid=100 + r,
            state=common_pb2.MEMBER_STATE_ALIVE if r != 3 else common_pb2.MEMBER_STATE_FAILED,
            seconds_since_heartbeat=0.25 * r,
        )
        for r in range(4)
    ]
    progress = [
        common_pb2.Progress(group="world", started_seq=5, finished_seq=4 + (r != 3), last_op="all_reduce(f32[8], SUM)")
        for r in range(4)
    ]
    job = coordinator_pb2.JobStatus(
        job_id="train",
        world_size=4,
        state="failed",
        members=members,
        groups=[coordinator_pb2.GroupStatus(name="world", ranks=[0, 1, 2, 3])],
        progress=progress,
        failure="rank 3 (h1) missed heartbeats",
    )
    return coordinator_pb2.GetStatusResponse(jobs=[job])


def test_status_json_and_table() -> None:
    data = status_to_dict(_response())
    (job,) = data["jobs"]
    assert job["groups"] == [{"name": "world", "ranks": [0, 1, 2, 3]}]
    assert [m["state"] for m in job["members"]] == ["alive", "alive", "alive", "failed"]
    assert job["members"][3]["progress"]["finished_seq"] == 4
    text = format_status(data)
    lines = text.splitlines()
    assert lines[0] == "job train: failed, world size 4, 4 joined"
    assert "failure: rank 3 (h1) missed heartbeats" in lines[1]
    assert "groups: world [0-3]" in lines[2]
    assert lines[3].split() == ["rank", "host", "local", "node", "state", "heartbeat", "pid", "last", "op"]
    assert lines[7].split()[:7] == ["3", "h1", "1/2", "1", "failed", "0.8s", "ago"]
    assert "all_reduce(f32[8], SUM) (seq 4/5)" in lines[7]
    assert format_status({"jobs": []}) == "no jobs"


def _help_of(command: str) -> str:
    subparsers = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(subparsers.choices[command].format_help().split())


def test_help_says_what_a_new_user_needs() -> None:
    bench = _help_of("bench")
    assert "time one collective over a range of sizes" in bench  # a description, not only the usage line
    assert "where the arrays live: numpy or CuPy (default: cpu)" in bench
    assert "ring: collsvc's own data plane, which on one host moves the bytes through shared memory" in bench
    run = _help_of("run")
    assert "without -n the script runs as a world of one rank" in run
    assert "must be decorated with collsvc.elastic.run" in run
