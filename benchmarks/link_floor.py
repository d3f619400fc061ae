"""What a link carries without collsvc: a plain TCP stream and raw-bytes gRPC calls between two hosts.

Run by benchmarks/cross_host.py, one side in each host's network namespace:

    python benchmarks/link_floor.py serve HOST          # prints "ready TCP_PORT GRPC_PORT", then serves
    python benchmarks/link_floor.py measure HOST TCP_PORT GRPC_PORT --sizes 64K,1M,16M --total 256M

``measure`` prints one JSON line: the TCP stream's rate (4 MiB writes, one connection, one direction),
the rate of each direction of one connection that carries as much both ways at once (what a two-rank
all_reduce asks of a link: each rank sends as much as it receives) and, per message size, raw-bytes
gRPC (identity serializers, no protobuf copies) as unary calls with four in flight and as one client
stream; rates in GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from collsvc.bench.harness import parse_size  # noqa: E402

OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
SERVICE = "floor.Bytes"
STREAM_WRITE = 4 << 20
HEADER = struct.Struct("<?Q")  # both ways, bytes the client sends


def serve(host: str) -> None:
    listener = socket.create_server((host, 0))
    server = grpc.server(ThreadPoolExecutor(max_workers=4), options=OPTIONS)

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""

    def stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        for _ in requests:
            pass
        return b""

    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(unary),
        "Stream": grpc.stream_unary_rpc_method_handler(stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    grpc_port = server.add_insecure_port(f"{host}:0")
    server.start()

    def drain(conn: socket.socket) -> None:
        with conn:
            header = receive_exactly(conn, HEADER.size)
            both_ways, total = HEADER.unpack(header)
            sender = threading.Thread(target=stream_out, args=(conn, total), daemon=True) if both_ways else None
            if sender is not None:
                sender.start()
            buffer = memoryview(bytearray(STREAM_WRITE))
            while conn.recv_into(buffer):
                pass
            if sender is not None:
                sender.join()
            else:
                conn.sendall(b"k")  # the whole stream arrived

    print(f"ready {listener.getsockname()[1]} {grpc_port}", flush=True)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def receive_exactly(conn: socket.socket, size: int) -> bytes:
    """``size`` bytes from ``conn``. Raises ConnectionError if it closes first."""
    data = b""
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ConnectionError("the connection closed early")
        data += more
    return data


def stream_out(conn: socket.socket, total: int) -> None:
    """Sends ``total`` bytes (whole writes of STREAM_WRITE), then ends the sending side."""
    data = bytes(STREAM_WRITE)
    for _ in range(total // STREAM_WRITE):
        conn.sendall(data)
    conn.shutdown(socket.SHUT_WR)


def tcp_rate(host: str, port: int, total: int) -> float:
    """GB/s of one stream from here to the server."""
    total = max(total // STREAM_WRITE, 1) * STREAM_WRITE
    with socket.create_connection((host, port)) as conn:
        conn.sendall(HEADER.pack(False, total))
        started = time.perf_counter()
        stream_out(conn, total)
        conn.recv(1)
        return total / (time.perf_counter() - started) / 1e9


def tcp_both_ways_rate(host: str, port: int, total: int) -> float:
    """GB/s in each direction of one connection on which both sides send ``total`` bytes at once."""
    total = max(total // STREAM_WRITE, 1) * STREAM_WRITE
    with socket.create_connection((host, port)) as conn:
        conn.sendall(HEADER.pack(True, total))
        started = time.perf_counter()
        sender = threading.Thread(target=stream_out, args=(conn, total), daemon=True)
        sender.start()
        buffer, received = memoryview(bytearray(STREAM_WRITE)), 0
        while chunk := conn.recv_into(buffer):
            received += chunk
        sender.join()
        if received != total:
            raise ConnectionError(f"received {received} of {total} bytes")
        return total / (time.perf_counter() - started) / 1e9


def grpc_rates(host: str, port: int, size: int, total: int) -> dict[str, float]:
    count = max(total // size, 8)
    data = bytes(size)
    with grpc.insecure_channel(f"{host}:{port}", options=OPTIONS) as channel:
        unary = channel.unary_unary(f"/{SERVICE}/Unary", request_serializer=None, response_deserializer=None)
        stream = channel.stream_unary(f"/{SERVICE}/Stream", request_serializer=None, response_deserializer=None)
        unary(b"")  # connected
        started = time.perf_counter()
        in_flight: list[grpc.Future[bytes]] = []
        for _ in range(count):
            in_flight.append(unary.future(data))
            if len(in_flight) >= 4:
                in_flight.pop(0).result()
        for future in in_flight:
            future.result()
        unary_rate = count * size / (time.perf_counter() - started) / 1e9
        started = time.perf_counter()
        stream(iter([data] * count))
        stream_rate = count * size / (time.perf_counter() - started) / 1e9
        started = time.perf_counter()
        for _ in range(50):
            unary(b"x" * 64)
        round_trip = (time.perf_counter() - started) / 50
    return {"bytes": size, "grpc_unary_gbs": unary_rate, "grpc_stream_gbs": stream_rate, "grpc_rtt_s": round_trip}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("serve", "measure"))
    parser.add_argument("host")
    parser.add_argument("tcp_port", nargs="?", type=int)
    parser.add_argument("grpc_port", nargs="?", type=int)
    parser.add_argument("--sizes", default="64K,1M,16M")
    parser.add_argument("--total", default="256M", help="bytes per measurement")
    args = parser.parse_args()
    if args.mode == "serve":
        serve(args.host)
        return 0
    total = parse_size(args.total)
    rows = [grpc_rates(args.host, args.grpc_port, parse_size(size), total) for size in args.sizes.split(",")]
    rates = {
        "tcp_stream_gbs": tcp_rate(args.host, args.tcp_port, total),
        "tcp_both_ways_gbs": tcp_both_ways_rate(args.host, args.tcp_port, total),
    }
    print(json.dumps({**rates, "grpc": rows}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
