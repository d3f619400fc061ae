"""A cut link: two hosts whose ranks can no longer reach each other, while both still reach the
coordinator on a third host (a firewall rule, a broken route between two racks).

Host "c" runs the coordinator, host "a" rank 0, host "b" rank 1 (or two ranks each). Once all
train, host "a" drops every packet to and from host "b" (iptables DROP: no RST, no ICMP), and no rank's
heartbeats stop. Each rank then raises, leaves the job as a script ending with that error does, and the
others hear of it. None may name itself or its own host: each names the other end of the link, ranks of
the host it could not reach. The issue this pins: the receiver named itself, 4 runs of 4, because the
sender left naming it; with two ranks per host a rank named its own host's leader.
"""

from __future__ import annotations

import shutil
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
TOKEN = "netns-cut-link-token"
START_BOUND = 60.0  # coordinator up, both ranks joined and training
RESULT_BOUND = 45.0  # after the cut: the data plane's own deadlines, on a loaded 2-core machine

reason = topology.available() or (None if shutil.which("iptables") else "needs iptables (apt-get install iptables)")
if reason:
    pytest.skip(reason, allow_module_level=True)


@pytest.fixture
def hosts() -> Iterator[dict[str, topology.Host]]:
    with topology.hosts(["a", "b", "c"]) as made:
        topology.pin_neighbours(made)  # no failed address resolution gives the cut away
        yield made


def drop_between(host: topology.Host, other: topology.Host) -> None:
    """Drops every packet between ``host`` and ``other``, in both directions, silently."""
    for chain, side in (("INPUT", "-s"), ("OUTPUT", "-d")):
        topology.sh(*host.command(["iptables", "-I", chain, side, other.address, "-j", "DROP"]))


@pytest.mark.parametrize(
    ("op", "per_host", "lane", "nbytes"),
    [
        ("send_recv", 1, "1", 64 << 10),
        ("all_reduce", 1, "1", 64 << 10),
        ("all_reduce", 2, "1", 64 << 10),
        ("all_reduce", 2, "0", 64 << 10),
        ("all_reduce", 2, "1", 1 << 20),
    ],
    ids=[
        "send_recv",
        "all_reduce",
        "all_reduce-2-per-host",
        "all_reduce-2-per-host-grpc",
        "all_reduce-2-per-host-sliced",
    ],
)
def test_a_cut_link_names_the_other_end_on_both_sides(
    hosts: dict[str, topology.Host], tmp_path: Path, op: str, per_host: int, lane: str, nbytes: int
) -> None:
    """With two ranks per host (shared memory within a host; at 64 KiB each host's first rank leads
    and alone crosses the link, at 1 MiB every rank crosses with its counterpart on the other host),
    every rank names ranks of the other host only: one that hears the far side's account first
    (rank 2 left: sending to rank 0 failed) learns from the coordinator that rank 0 was still running,
    so the path broke, and names the far end seen from its own host. Never itself, never a rank of its
    own host. The same over gRPC calls instead of the bulk lane (``COLLSVC_TCP_LANE=0``)."""
    world = 2 * per_host
    a, b, c = hosts["a"], hosts["b"], hosts["c"]
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    base = clean_env()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        argv = [sys.executable, "-m", "collsvc", "coordinator", "--host", c.address, "--port", "29400"]
        procs.append(start([*argv, "--token-file", str(token_file)], c, tmp_path / "coordinator.log", base))
        coordinator = f"{c.address}:29400"
        env = dict(base, COLLSVC_COORDINATOR=coordinator, COLLSVC_TOKEN=TOKEN, COLLSVC_JOB_ID="cut-link")
        env["COLLSVC_TCP_LANE"] = lane
        ranks = start_ranks(["link", op, str(nbytes)], [a] * per_host + [b] * per_host, env, tmp_path)
        procs.extend(ranks)
        outputs = wait_training(ranks, START_BOUND)
        cut_at = time.monotonic()
        drop_between(a, b)
        results = [result_of(output, cut_at + RESULT_BOUND) for output in outputs]
        for rank, proc in enumerate(ranks):  # each leaves the job and ends by itself
            assert proc.wait(30) == 0, f"rank {rank} exited {proc.returncode}"
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        raise failure_with_logs(exc, procs, tmp_path) from None
    finally:
        stop(procs)
    lines = [f"rank {r['rank']} raised {r['error']} naming {r['ranks']} after {r['raised_at'] - cut_at:.2f} s: "
             f"{r['message'][:300]}" for r in results]  # fmt: skip
    print(f"\nMEASURED cut link ({nbytes} B {op}):\n  " + "\n  ".join(lines))
    for rank, result in enumerate(results):
        assert result["rank"] == rank, result
        assert result["error"] in ("RankFailedError", "CollectiveTimeoutError"), result
        other_host = set(range(per_host, world)) if rank < per_host else set(range(per_host))
        assert result["ranks"] and set(result["ranks"]) <= other_host, (rank, result)
