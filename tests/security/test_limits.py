"""Promise 8, bounded inputs: every over-limit request is refused with RESOURCE_EXHAUSTED (a
ResourceLimitError on the client), and the daemon stays up with flat memory.

The per-field limits of the key/value store are unit-tested in tests/integration/test_kv.py and the
peer endpoint's frame limits in test_auth_tls.py; this file hammers one coordinator process and watches
its resident memory.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collsvc.client.rendezvous import CoordinatorClient
from collsvc.errors import AuthenticationError, CollsvcError, ResourceLimitError
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.types import Limits
from tests.cli._util import cli_env
from tests.harness import TOKEN, coordinator, run_ranks
from tests.security import ranks
from tests.security._util import COORDINATOR, expected_sum, raw_call

LIMITS = Limits(max_message_bytes=1 << 20, max_value_bytes=64 << 10, max_key_bytes=256, max_world_size=64)
RSS_GROWTH_LIMIT_MB = 16.0

_SERVE = f"""
import sys
from collsvc.server.app import CoordinatorThread
from collsvc.types import CoordinatorOptions, Limits
limits = Limits(max_message_bytes={LIMITS.max_message_bytes}, max_value_bytes={LIMITS.max_value_bytes},
                max_key_bytes={LIMITS.max_key_bytes}, max_world_size={LIMITS.max_world_size})
thread = CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=0, token={TOKEN!r}, limits=limits))
print(thread.start(), flush=True)
sys.stdin.read()  # runs until the test closes stdin
thread.stop()
"""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
def daemon() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A coordinator with small limits in a process of its own, so its RSS is its own."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_SERVE)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield proc, f"127.0.0.1:{port}"
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


Case = tuple[str, Callable[[], object], type[CollsvcError]]


def over_limit_requests(address: str) -> tuple[list[Case], list[Case]]:
    """(cases the servicer refuses (~1 ms each), cases gRPC refuses for size (~100-500 ms each))."""
    client = CoordinatorClient(address, "limits", token=TOKEN, tls=None, timeout=10.0)
    outsider = CoordinatorClient(address, "limits", token="wrong", tls=None, timeout=10.0)
    big = b"x" * (2 << 20)  # over the 1 MiB message limit: refused by gRPC before the servicer
    value = b"v" * (LIMITS.max_value_bytes + 1)

    def join_too_big() -> None:
        request = pb.JoinRequest(job_id="limits-join", world_size=LIMITS.max_world_size + 1, timeout_s=1)
        client._call("Join", request, "join")

    def compare_set_too_big() -> None:
        request = pb.CompareSetKeyRequest(job_id="limits", key="k", expect_absent=True, desired=value)
        client._call("CompareSetKey", request, "compare-set")

    return [
        ("value over the limit", lambda: client.set("k", value), ResourceLimitError),
        ("key over the limit", lambda: client.set("k" * (LIMITS.max_key_bytes + 1), b""), ResourceLimitError),
        ("compare-set value over the limit", compare_set_too_big, ResourceLimitError),
        ("world size over the limit", join_too_big, ResourceLimitError),
        ("large body without the token", lambda: outsider.set("k", value[:-100]), AuthenticationError),
    ], [
        ("message over gRPC's limit", lambda: client.set("k", big), ResourceLimitError),
        ("oversized body without the token", lambda: outsider.set("k", big), ResourceLimitError),
    ]


def test_over_limit_requests_are_refused_and_memory_stays_flat(
    daemon: tuple[subprocess.Popen[bytes], str],
) -> None:
    proc, address = daemon
    cheap, oversized = over_limit_requests(address)
    for _, call, error in cheap + oversized:  # warm-up: the first of each fills gRPC's and Python's caches
        with pytest.raises(error):
            call()
    before = rss_mb(proc.pid)
    start = time.monotonic()
    plan = [(cheap, 80), (oversized, 8)]
    for cases, rounds in plan:
        for _ in range(rounds):
            for _, call, error in cases:
                with pytest.raises(error):
                    call()
    seconds = time.monotonic() - start
    after = rss_mb(proc.pid)
    count = sum(len(cases) * rounds for cases, rounds in plan)
    print(
        f"{count} over-limit requests in {seconds:.1f}s; coordinator RSS "
        f"{before:.1f} -> {after:.1f} MB (+{after - before:.1f})"
    )
    assert after - before < RSS_GROWTH_LIMIT_MB
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    result = run_ranks(ranks.all_reduce_sum, 2, address=address)
    assert result.values == [expected_sum(2)] * 2


def test_job_count_is_bounded_and_the_error_is_typed() -> None:
    """Jobs made by key/value calls alone count too; the next one is refused, not allocated."""
    with coordinator(limits=Limits(max_jobs=4)) as (_, address):
        for i in range(4):
            CoordinatorClient(address, f"j{i}", token=TOKEN, tls=None, timeout=5).set("k", b"v")
        with pytest.raises(ResourceLimitError, match="maximum of 4 jobs"):
            CoordinatorClient(address, "j4", token=TOKEN, tls=None, timeout=5).set("k", b"v")
        code, _, meta = raw_call(
            address, COORDINATOR + "SetKey", pb.SetKeyRequest(job_id="j5", key="k").SerializeToString(), token=TOKEN
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert meta["collsvc-error-reason"] == "ERROR_REASON_RESOURCE_EXHAUSTED"
