"""Promise 9, garbage at the ports: random bytes, raw HTTP/1.1, TLS ClientHellos, HTTP/2 noise and
malformed protobuf (valid gRPC framing, random payloads, every Coordinator method) thrown at the
coordinator and at a rank's peer endpoint. Afterwards the coordinator answers health SERVING, the job
that was running completes correctly, and a new job runs.

Deterministic seeds, bounded loops; raw-socket cases connect, send, read briefly and close.
"""

from __future__ import annotations

import contextlib
import random
import socket
import ssl
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from collsvc.client.backends.ring import frames
from collsvc.proto.v1 import coordinator_pb2 as pb
from tests.harness import TOKEN, coordinator, run_ranks
from tests.security import ranks
from tests.security._util import COORDINATOR, DELIVER, expected_sum, held_job

READ_TIMEOUT = 0.02
CALL_TIMEOUT = 0.3
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods]
STREAMING = {m.name for m in pb.DESCRIPTOR.services_by_name["Coordinator"].methods if m.client_streaming}


def client_hellos() -> list[bytes]:
    """Real TLS ClientHellos (TLS 1.2 and 1.3, with and without ALPN h2), made with the ssl module."""
    hellos = []
    for version, alpn in ((ssl.TLSVersion.TLSv1_3, True), (ssl.TLSVersion.TLSv1_2, False), (None, True)):
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        if version is not None:
            ctx.minimum_version = ctx.maximum_version = version
        if alpn:
            ctx.set_alpn_protocols(["h2"])
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = ctx.wrap_bio(incoming, outgoing, server_hostname="localhost")
        with contextlib.suppress(ssl.SSLWantReadError):  # it waits for the ServerHello
            tls.do_handshake()
        hellos.append(outgoing.read())
    return hellos


HTTP1 = [
    b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n",
    b"POST /collsvc.proto.v1.Coordinator/Join HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
    b"GET / HTTP/1.1\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\n"
    b"HTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
    b"CONNECT 127.0.0.1:1 HTTP/1.1\r\n\r\n",
    b"OPTIONS * HTTP/1.0\r\n\r\n",
    b"GET /" + b"A" * 8000 + b" HTTP/1.1\r\n\r\n",
    b"HEAD / HTTP/1.1\r\n" + b"X: y\r\n" * 500 + b"\r\n",
]
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def socket_payloads(rng: random.Random, count: int) -> list[bytes]:
    """Raw-socket cases: random bytes, HTTP/1.1, ClientHellos (whole, cut, flipped), HTTP/2 noise."""
    hellos = client_hellos()
    out: list[bytes] = []
    for i in range(count):
        kind = i % 5
        if kind == 0:
            data = rng.randbytes(rng.randrange(0, 2048))
        elif kind == 1:
            data = rng.choice(HTTP1)
            if rng.random() < 0.5:
                data = data[: rng.randrange(1, len(data) + 1)]
        elif kind == 2:
            hello = bytearray(rng.choice(hellos))
            for _ in range(rng.randrange(0, 4)):
                hello[rng.randrange(len(hello))] = rng.randrange(256)
            data = bytes(hello[: rng.randrange(1, len(hello) + 1)] if rng.random() < 0.3 else hello)
        elif kind == 3:  # HTTP/2 preface followed by random frames
            frames_ = b"".join(
                struct.pack(">I", rng.randrange(1 << 14))[1:] + bytes([rng.randrange(10), rng.randrange(256)])
                + struct.pack(">I", rng.randrange(1 << 31)) + rng.randbytes(rng.randrange(0, 64))
                for _ in range(rng.randrange(1, 6))
            )  # fmt: skip
            data = H2_PREFACE + frames_
        else:
            data = H2_PREFACE[: rng.randrange(len(H2_PREFACE))] + rng.randbytes(rng.randrange(0, 256))
        out.append(bytes(data))
    return out


def poke(address: str, data: bytes) -> None:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=2) as sock:
        sock.settimeout(READ_TIMEOUT)
        try:
            sock.sendall(data)
            sock.recv(4096)
        except OSError:  # reset, timeout: whatever the server does with garbage is fine
            pass


def protobuf_payloads(rng: random.Random, count: int) -> list[bytes]:
    """Random bytes, and random mutations of valid requests (truncated, flipped, duplicated)."""
    seeds = [
        pb.JoinRequest(job_id="fuzz", world_size=2, timeout_s=0.05).SerializeToString(),
        pb.SetKeyRequest(job_id="fuzz", key="k", value=b"v").SerializeToString(),
        pb.BarrierRequest(job_id="fuzz", group="world", rank=0, generation=1, timeout_s=0.05).SerializeToString(),
        pb.NewGroupRequest(job_id="fuzz", name="g", ranks=[0, 1]).SerializeToString(),
    ]
    out = []
    for i in range(count):
        if i % 2:
            out.append(rng.randbytes(rng.randrange(0, 512)))
            continue
        data = bytearray(rng.choice(seeds) * rng.randrange(1, 3))
        for _ in range(rng.randrange(1, 5)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        out.append(bytes(data[: rng.randrange(1, len(data) + 1)]))
    return out


def frame_payloads(rng: random.Random, count: int) -> list[bytes]:
    """Peer frames: random bytes and collsvc headers with random fields (never a real call's key)."""
    out = []
    for i in range(count):
        if i % 2:
            out.append(rng.randbytes(rng.randrange(0, 256)))
            continue
        nbytes = rng.choice([0, 8, rng.randrange(1 << 20), rng.randrange(1 << 63)])
        key, seq, step, digest = (
            rng.randrange(1 << 64),
            rng.randrange(1 << 64),
            rng.randrange(1 << 32),
            rng.randrange(1 << 64),
        )
        signature = rng.randbytes(rng.randrange(0, 64))
        header = bytearray(frames.encode_header(rng.randrange(-5, 5), key, seq, step, digest, signature, nbytes))
        if rng.random() < 0.5:
            header[rng.randrange(len(header))] = rng.randrange(256)
        out.append(bytes(header) + rng.randbytes(rng.choice([0, 8, rng.randrange(0, 512)])))
    return out


def grpc_storm(address: str, calls: list[tuple[str, bytes, str | None]]) -> dict[str, int]:
    """Fires ``(method, body, token)`` unary calls (streaming methods get two messages), counts codes."""
    codes: dict[str, int] = {}
    with grpc.insecure_channel(address) as channel:
        pending: list[Any] = []
        for method, body, token in calls:
            metadata = (("authorization", f"Bearer {token}"),) if token else ()
            if method.rsplit("/", 1)[-1] in STREAMING:
                stream = channel.stream_stream(method, request_serializer=None, response_deserializer=None)
                pending.append(stream(iter([body, body]), timeout=CALL_TIMEOUT, metadata=metadata))
            else:
                unary = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
                pending.append(unary.future(body, timeout=CALL_TIMEOUT, metadata=metadata))
            if len(pending) >= 64:
                _drain(pending, codes)
        _drain(pending, codes)
    return codes


def _drain(pending: list[Any], codes: dict[str, int]) -> None:
    for call in pending:
        try:
            if hasattr(call, "result"):
                call.result()
            else:
                for _ in call:
                    pass
            name = "OK"
        except grpc.RpcError as exc:
            name = exc.code().name
        codes[name] = codes.get(name, 0) + 1
    pending.clear()


def assert_serving(address: str) -> None:
    with grpc.insecure_channel(address) as channel:
        answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def fuzz(scale: int, seed: int) -> None:
    rng = random.Random(seed)
    with coordinator() as (_, address):
        with held_job(address, 2) as (_, table, future):
            peer = table[1].peer_address
            start = time.monotonic()
            raw = socket_payloads(rng, 250 * scale)
            targets = [address, peer]
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda item: poke(targets[item[0] % 2], item[1]), enumerate(raw + raw)))
            tokens = [TOKEN, None, "wrong"]
            bodies = protobuf_payloads(rng, 100 * scale)
            coordinator_calls = [
                (COORDINATOR + method, body, tokens[i % 3] if i % 3 else TOKEN)
                for method in METHODS for i, body in enumerate(bodies)
            ]  # fmt: skip
            codes = grpc_storm(address, coordinator_calls)
            peer_calls = [(DELIVER, body, tokens[i % 3]) for i, body in enumerate(frame_payloads(rng, 200 * scale))]
            peer_codes = grpc_storm(peer, peer_calls)
            seconds = time.monotonic() - start
            total = 2 * len(raw) + len(coordinator_calls) + len(peer_calls)
            print(
                f"fuzz seed {seed}: {total} cases in {seconds:.1f}s ({2 * len(raw)} raw-socket, "
                f"{len(coordinator_calls)} coordinator gRPC {codes}, {len(peer_calls)} peer gRPC {peer_codes})"
            )
            # Garbage is refused by name (INVALID_ARGUMENT), never a crash (INTERNAL) or gRPC's UNKNOWN.
            for found in (codes, peer_codes):
                assert "INTERNAL" not in found and "UNKNOWN" not in found, found
            assert_serving(address)
        assert future.result().values == [expected_sum(2)] * 2  # the job under fire was not disturbed
        assert run_ranks(ranks.all_reduce_sum, 2, address=address).values == [expected_sum(2)] * 2
        assert_serving(address)


def test_fuzz_ports() -> None:
    fuzz(scale=2, seed=1234)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_fuzz_ports_long(seed: int) -> None:
    fuzz(scale=10, seed=seed)
