"""Promise 8, bounded inputs: every over-limit request is refused with RESOURCE_EXHAUSTED (a
ResourceLimitError on the client), and the daemon stays up with flat memory.

Every field's limit is tested by name in test_field_limits.py, the key/value store's in
tests/integration/test_kv.py and the peer endpoint's frame limits in test_auth_tls.py. This file
hammers one coordinator process and watches its resident memory (issue #12 item 6): oversized
requests, and Joins that never complete.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collsvc.client.rendezvous import CoordinatorClient
from collsvc.errors import AuthenticationError, CollsvcError, ResourceLimitError
from collsvc.options import Limits
from collsvc.proto.v1 import common_pb2
from collsvc.proto.v1 import coordinator_pb2 as pb
from collsvc.server.request_limits import RequestLimits
from collsvc.server.services.coordinator import SERVICE
from tests.cli._util import cli_env
from tests.harness import TOKEN, coordinator, run_ranks
from tests.security import ranks
from tests.security._util import COORDINATOR, expected_sum, raw_call

LIMITS = Limits(max_message_bytes=1 << 20, max_value_bytes=64 << 10, max_key_bytes=256, max_world_size=64)
RSS_GROWTH_LIMIT_MB = 16.0

_SERVE = f"""
import dataclasses, json, sys
from collsvc.server.app import CoordinatorThread
from collsvc.options import CoordinatorOptions, Limits
host, limits = sys.argv[1], Limits(**json.loads(sys.argv[2]))
thread = CoordinatorThread(CoordinatorOptions(host=host, port=0, token={TOKEN!r}, limits=limits))
print(thread.start(), flush=True)
sys.stdin.read()  # runs until the test closes stdin
thread.stop()
"""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@contextlib.contextmanager
def daemon_process(limits: Limits, host: str = "127.0.0.1") -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A coordinator in a process of its own, so that its RSS is its own; yields (process, port)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_SERVE), host, json.dumps(dataclasses.asdict(limits))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=cli_env(),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        yield proc, int(proc.stdout.readline())
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@pytest.fixture
def daemon() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A coordinator with small limits in a process of its own."""
    with daemon_process(LIMITS) as (proc, port):
        yield proc, f"127.0.0.1:{port}"


Case = tuple[str, Callable[[], object], type[CollsvcError]]


def over_limit_requests(address: str) -> tuple[list[Case], list[Case]]:
    """(cases the servicer refuses (~1 ms each), cases gRPC refuses for size (~100-500 ms each))."""
    client = CoordinatorClient(address, "limits", token=TOKEN, tls=None, timeout=10.0)
    outsider = CoordinatorClient(address, "limits", token="wrong", tls=None, timeout=10.0)
    # Over the largest request these limits allow: refused by gRPC before the servicer.
    big = b"x" * (RequestLimits(LIMITS).max_receive_bytes(SERVICE) + 1)
    value = b"v" * (LIMITS.max_value_bytes + 1)

    def join_too_big() -> None:
        request = pb.JoinRequest(job_id="limits-join", world_size=LIMITS.max_world_size + 1, timeout_s=1)
        client._call("Join", request, "join")

    def compare_set_too_big() -> None:
        request = pb.CompareSetKeyRequest(job_id="limits", key="k", expect_absent=True, desired=value)
        client._call("CompareSetKey", request, "compare-set")

    def join_with_long_job_id() -> None:
        request = pb.JoinRequest(job_id="j" * (10 << 10), world_size=2, timeout_s=1)
        client._call("Join", request, "join")

    return [
        ("value over the limit", lambda: client.set("k", value), ResourceLimitError),
        ("10 KiB job id", join_with_long_job_id, ResourceLimitError),
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


def status_mb(pid: int, field: str) -> float:
    """A memory figure of ``/proc/PID/status`` in MB: ``VmRSS`` (now) or ``VmHWM`` (the peak so far)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no {field}")


def concurrently(count: int, address: str, method: str, body: bytes) -> list[tuple[grpc.StatusCode, str]]:
    """``count`` identical raw calls at once, each on a connection of its own; their codes and details."""
    with ThreadPoolExecutor(count) as pool:
        futures = [
            pool.submit(raw_call, address, COORDINATOR + method, body, token=TOKEN, timeout=60) for _ in range(count)
        ]
        return [(code, details) for code, details, _ in (f.result() for f in futures)]


# What the barrage below may add to the coordinator's RSS, and to its peak: each of 8 concurrent calls
# holds at most one ~2 MiB request (gRPC's buffer plus the bytes handed to Python). Measured +18 to
# +32 MB; before the fix, 8 Joins alone took it from 55 MiB to 2.0 GiB.
BARRAGE_RSS_GROWTH_LIMIT_MB = 64.0
PEAK_GROWTH_LIMIT_MB = 96.0


def test_oversized_fields_with_default_limits_are_refused_before_they_are_parsed() -> None:
    """Issue #12 item 6: 8 Joins with a 64 MiB job id took the coordinator from 55 MiB to 2.0 GiB, and
    3 refused 64 MiB SetKeys to 387 MiB. Now gRPC refuses anything over the largest request the
    protocol needs (~16 MiB), each method anything over its own budget before parsing it, and each
    field anything over its limit, naming both."""
    defaults = Limits()
    max_request = RequestLimits(defaults).max_receive_bytes(SERVICE)
    with daemon_process(defaults) as (proc, port):
        address = f"127.0.0.1:{port}"
        # Warm-up: one of each kind, so that gRPC's and Python's caches do not count as growth.
        assert concurrently(1, address, "GetStatus", b"") == [(grpc.StatusCode.OK, "")]
        before, peak_before = status_mb(proc.pid, "VmRSS"), status_mb(proc.pid, "VmHWM")
        start = time.monotonic()
        barrage = [
            ("8 Joins, 64 MiB job id", 8, "Join", pb.JoinRequest(job_id="j" * (64 << 20), world_size=2)),
            ("8 Joins, job id just under the gRPC limit", 8, "Join",
             pb.JoinRequest(job_id="j" * (max_request - 64), world_size=2)),
            ("3 SetKeys, 64 MiB value", 3, "SetKey", pb.SetKeyRequest(job_id="j", key="k", value=b"v" * (64 << 20))),
            ("3 SetKeys, value just under the gRPC limit", 3, "SetKey",
             pb.SetKeyRequest(job_id="j", key="k", value=b"v" * (max_request - 64))),
        ]  # fmt: skip
        for what, count, method, request in barrage:
            body = request.SerializeToString()
            answers = concurrently(count, address, method, body)
            assert {code for code, _ in answers} == {grpc.StatusCode.RESOURCE_EXHAUSTED}, (what, answers[0])
            if len(body) <= max_request:  # gRPC let it through; the method refused it unparsed
                assert f"{type(request).__name__} of {len(body)} bytes is over the" in answers[0][1], what
            print(f"{what}: refused; coordinator RSS {status_mb(proc.pid, 'VmRSS'):.0f} MB ({len(body)} bytes each)")
        code, details = concurrently(1, address, "Join", pb.JoinRequest(job_id="j" * (10 << 10)).SerializeToString())[0]
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert details == "JoinRequest.job_id is 10240 bytes, over the limit of 512 bytes (Limits.max_name_bytes)"
        after, peak = status_mb(proc.pid, "VmRSS"), status_mb(proc.pid, "VmHWM")
        print(
            f"oversized barrage in {time.monotonic() - start:.1f}s: coordinator RSS {before:.0f} -> {after:.0f} MB, "
            f"peak {peak_before:.0f} -> {peak:.0f} MB"
        )
        assert after - before < BARRAGE_RSS_GROWTH_LIMIT_MB
        assert peak - peak_before < PEAK_GROWTH_LIMIT_MB
        result = run_ranks(ranks.all_reduce_sum, 2, address=address)  # and it still serves jobs
        assert result.values == [expected_sum(2)] * 2


# 2,000 calls in flight at once cost gRPC about 9 KB each while they last (measured +18 MB).
FLOOD_RSS_GROWTH_LIMIT_MB = 48.0


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="needs ::1 to be a second client address")
def test_joins_that_never_complete_cannot_lock_out_other_clients() -> None:
    """Issue #12 item 6: 10,000 Joins that never complete filled the 4,096-job limit and locked every
    other job out. Now one client address may wait in at most ``max_joining_jobs_per_client`` jobs; its
    other Joins are refused at once, and it gets its share back as soon as its waiting calls end."""
    limits = Limits(max_jobs=256)  # small, so that the flood below would fill it without the cap
    cap = limits.max_joining_jobs_per_client
    flood = 2000
    auth = (("authorization", f"Bearer {TOKEN}"),)
    # Listening on every address (the token makes that allowed) lets the test be two clients:
    # the flood comes from 127.0.0.1, the legitimate job from ::1.
    with daemon_process(limits, host="::") as (proc, port):
        flooder, other_client = f"127.0.0.1:{port}", f"[::1]:{port}"
        before = status_mb(proc.pid, "VmRSS")
        lock, refused, all_refused = threading.Lock(), [], threading.Event()

        def on_done(call: Any) -> None:
            with lock:
                refused.append(call)
                if len(refused) == flood - cap:
                    all_refused.set()

        start = time.monotonic()
        with grpc.insecure_channel(flooder) as channel:
            join = channel.unary_unary(COORDINATOR + "Join", request_serializer=None, response_deserializer=None)
            calls = []
            for i in range(flood):
                request = pb.JoinRequest(job_id=f"flood-{i}", world_size=2, timeout_s=300)
                call = join.future(request.SerializeToString(), timeout=300, metadata=auth)
                call.add_done_callback(on_done)
                calls.append(call)
            assert all_refused.wait(120), f"only {len(refused)} of {flood - cap} surplus Joins were answered"
            seconds = time.monotonic() - start
            waiting = [call for call in calls if not call.done()]
            assert len(waiting) == cap
            codes = {call.code() for call in refused}
            assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert "Limits.max_joining_jobs_per_client = 64" in refused[0].details()
            after = status_mb(proc.pid, "VmRSS")
            print(
                f"{flood} Joins from one client: {flood - cap} refused in {seconds:.1f}s, {cap} waiting; "
                f"coordinator RSS {before:.0f} -> {after:.0f} MB"
            )
            assert after - before < FLOOD_RSS_GROWTH_LIMIT_MB
            # Another client still gets a job going while the flood waits.
            assert run_ranks(ranks.all_reduce_sum, 2, address=other_client).values == [expected_sum(2)] * 2
            for call in waiting:  # the flooder gives up: its calls are cancelled
                call.cancel()
        # Its share comes back once the coordinator has seen the cancellations (a moment later).
        deadline = time.monotonic() + 30.0
        while True:
            client = CoordinatorClient(flooder, "after-the-flood", token=TOKEN, tls=None, timeout=10.0)
            try:
                reply = client.join(
                    world_size=1, rank=None, host="h", peer_address="", device=common_pb2.DeviceIdentity(),
                    pid=1, local_rank_hint=None,
                )  # fmt: skip
                break
            except ResourceLimitError:
                assert time.monotonic() < deadline, "the cancelled Joins still count against their client"
            finally:
                client.close()
        assert reply.world_size == 1
