"""A silent network partition: one host's cable is pulled mid-training (no FIN, no RST, no ICMP).

Two namespaces, one rank each; the coordinator runs on host "a" next to rank 0. Both ranks loop
(all_reduce, send/recv, or barriers); the test takes host "b"'s bridge port down (with static ARP
entries, so not even address resolution fails) and asserts that

- the survivor (rank 0) raises RankFailedError naming rank 1 within the heartbeat timeout plus about
  a second, and
- the cut-off rank (rank 1) raises too (it lost the coordinator, or cannot reach rank 0) within the
  heartbeat timeout plus the coordinator grace,

each with a margin for a loaded 2-core machine. Nothing may hang: every process has a hard bound and
is killed at the end, and the namespaces are removed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.netns import topology
from tests.netns.rank_processes import (
    clean_env,
    failure_with_logs,
    result_of,
    start,
    start_ranks,
    stop,
    wait_training,
)

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "netns-partition-token"

HEARTBEAT_INTERVAL = 0.3
HEARTBEAT_TIMEOUT = 2.0
GRACE = 3.0
# The targets, and what a loaded 2-core machine may add to them (scheduling, gRPC's own timers).
SURVIVOR_TARGET = HEARTBEAT_TIMEOUT + 1.0
CUT_OFF_TARGET = HEARTBEAT_TIMEOUT + GRACE
LOAD_MARGIN = 2.0
START_BOUND = 60.0  # coordinator up, both ranks joined and training
RESULT_BOUND = 30.0  # after the cut; far below the 60 s collective timeout the ranks run with

reason = topology.available()
if reason:
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture
def hosts() -> Iterator[dict[str, topology.Host]]:
    with topology.hosts(["a", "b"]) as made:
        topology.pin_neighbours(made)  # no failed address resolution gives the cut away
        yield made


@pytest.mark.parametrize(
    ("op", "nbytes"),
    [
        ("all_reduce", 64 << 10),
        ("all_reduce", 8 << 20),
        # The survivor waits for its sends to be delivered over the dead path, the cut-off rank
        # only receives: nothing but the coordinator's word ends the one, its loss the other.
        ("send_recv", 8 << 20),
        # Both wait in the coordinator: the survivor hears the verdict, the cut-off rank's call must
        # notice the dead path by itself.
        ("barrier", 0),
    ],
    ids=["all_reduce-64KiB", "all_reduce-8MiB", "send_recv-8MiB", "barrier"],
)
def test_pulled_cable_fails_both_sides_in_bounded_time(
    hosts: dict[str, topology.Host], tmp_path: Path, op: str, nbytes: int
) -> None:
    a, b = hosts["a"], hosts["b"]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    base = clean_env()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        coordinator = start(
            [
                sys.executable,
                "-m",
                "collsvc",
                "coordinator",
                "--host",
                a.address,
                "--port",
                "29400",
                "--token-file",
                str(token_file),
                "--heartbeat-interval",
                str(HEARTBEAT_INTERVAL),
                "--heartbeat-timeout",
                str(HEARTBEAT_TIMEOUT),
                "--log-level",
                "INFO",
            ],
            a,
            tmp_path / "coordinator.log",
            base,
        )
        procs.append(coordinator)
        env = dict(
            base,
            COLLSVC_COORDINATOR=f"{a.address}:29400",
            COLLSVC_TOKEN=TOKEN,
            COLLSVC_JOB_ID="partition",
            COLLSVC_HEARTBEAT_INTERVAL=str(HEARTBEAT_INTERVAL),
            COLLSVC_COORDINATOR_GRACE=str(GRACE),
        )
        ranks = start_ranks(["train", op, str(nbytes)], [a, b], env, tmp_path)
        procs.extend(ranks)
        outputs = wait_training(ranks, START_BOUND)

        cut_at = time.monotonic()
        b.cut()
        results = [result_of(output, cut_at + RESULT_BOUND) for output in outputs]
    except AssertionError as exc:
        raise failure_with_logs(exc, procs, tmp_path) from None
    finally:
        stop(procs)

    survivor, cut_off = results
    survivor_s = survivor["raised_at"] - cut_at
    cut_off_s = cut_off["raised_at"] - cut_at
    print(
        f"\npartition ({nbytes} B {op}, heartbeat {HEARTBEAT_INTERVAL:g}/{HEARTBEAT_TIMEOUT:g} s, grace "
        f"{GRACE:g} s): survivor raised {survivor['error']} after {survivor_s:.2f} s, cut-off rank raised "
        f"{cut_off['error']} after {cut_off_s:.2f} s\n  survivor: {survivor['message']}\n"
        f"  cut-off: {cut_off['message']}"
    )
    assert survivor["error"] == "RankFailedError", survivor
    assert survivor["ranks"] == [1] and survivor["hosts"] == ["host-b"], survivor
    assert survivor_s < SURVIVOR_TARGET + LOAD_MARGIN, survivor
    assert cut_off["error"] in ("RendezvousError", "RankFailedError"), cut_off
    assert cut_off_s < CUT_OFF_TARGET + LOAD_MARGIN, cut_off
