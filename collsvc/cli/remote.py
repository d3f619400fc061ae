"""``collsvc coordinator``, ``collsvc status`` and ``collsvc health``: the subcommands that talk gRPC.

Kept apart from :mod:`collsvc.cli.main` so that ``collsvc run`` never pays for these imports.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import os
import socket
import sys
from typing import Any

import grpc

from collsvc import config, launcher_env
from collsvc.cli.common import DEFAULT_COORDINATOR, EXIT_FAILURE, EXIT_OK, UsageError, read_token_file
from collsvc.client.join_report import describe_not_joined, ranks_text
from collsvc.options import CoordinatorOptions, TlsFiles

# -- coordinator -----------------------------------------------------------------------------------


def _tls_from_args(args: argparse.Namespace) -> TlsFiles | None:
    given = [args.tls_cert, args.tls_key, args.tls_ca]
    if not any(given):
        try:
            return config.tls_from_env(os.environ)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    if not all(given):
        raise UsageError("give all of --tls-cert, --tls-key and --tls-ca for TLS, or none")
    for path in given:
        if not os.path.isfile(path):
            raise UsageError(f"no such TLS file: {path}")
    return TlsFiles(cert=args.tls_cert, key=args.tls_key, ca=args.tls_ca)


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def coordinator_options(args: argparse.Namespace) -> CoordinatorOptions:
    """The :class:`CoordinatorOptions` for ``collsvc coordinator`` arguments.

    Raises:
        UsageError: unreadable token file, incomplete TLS flags, a bad port, or a non-loopback host
            with neither a token, TLS nor ``--insecure``.
    """
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in [0, 65535], got {args.port}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise UsageError(f"--metrics-port must be in [0, 65535], got {args.metrics_port}")
    token = read_token_file(args.token_file)
    tls = _tls_from_args(args)
    options = CoordinatorOptions(
        host=args.host,
        port=args.port,
        token=token,
        tls=tls,
        insecure=args.insecure,
        heartbeat_interval=args.heartbeat_interval,
        heartbeat_timeout=args.heartbeat_timeout,
        metrics_port=args.metrics_port,
    )
    from collsvc.server.app import check_security

    try:
        check_security(options)
    except ValueError as exc:  # names --token-file, the TLS flags and --insecure
        why = str(exc).rstrip(".")
        raise UsageError(f"{why}; the token may also come from $COLLSVC_TOKEN or $COLLSVC_TOKEN_FILE") from exc
    return options


def _port_in_use(host: str, port: int) -> str | None:
    """A message when ``host:port`` is already bound, else None.

    gRPC reports a failed bind with a multi-line C-core log before the exception; probing first with
    a plain socket (SO_REUSEADDR, as gRPC binds) lets the common case fail with one clear line.
    """
    if port == 0:
        return None
    try:
        infos = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return None  # let the server report the bad address
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return (
                        f"cannot listen on {_hostport(host, port)}: address already in use "
                        "(is another coordinator running? pick another --port)"
                    )
    return None


def coordinator_command(args: argparse.Namespace) -> int:
    """Serves a coordinator until SIGTERM or SIGINT (both drain and exit 0).

    Returns:
        0 after a clean stop; 1 when it could not start listening (port in use, bad address).

    Raises:
        UsageError: see :func:`coordinator_options`.
    """
    options = coordinator_options(args)
    in_use = _port_in_use(options.host, options.port)
    if in_use:
        print(f"collsvc coordinator: {in_use}", file=sys.stderr)
        return EXIT_FAILURE
    from collsvc.server.app import serve

    listening = False

    def ready(port: int) -> None:
        nonlocal listening
        listening = True
        print(f"collsvc coordinator listening on {_hostport(options.host, port)}", file=sys.stderr, flush=True)

    def metrics_ready(port: int) -> None:
        where = _hostport(options.host, port)
        print(f"collsvc coordinator metrics on http://{where}/metrics", file=sys.stderr, flush=True)

    try:
        asyncio.run(serve(options, ready=ready, metrics_ready=metrics_ready))
    except KeyboardInterrupt:  # before serve() installed its signal handlers
        return 130
    except ValueError as exc:
        if listening:
            raise
        raise UsageError(str(exc)) from exc
    except OSError as exc:  # the bind failed: port in use, address not on this host
        if listening:
            raise
        print(f"collsvc coordinator: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:
        if listening:
            raise
        where = _hostport(options.host, options.port)
        print(f"collsvc coordinator: cannot listen on {where}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    return EXIT_OK


# -- status and health -----------------------------------------------------------------------------


def coordinator_target(args: argparse.Namespace) -> str:
    """The coordinator a subcommand talks to: ``--coordinator``, else the environment, else the default."""
    return str(args.coordinator or launcher_env.coordinator_from_env(os.environ) or DEFAULT_COORDINATOR)


def open_channel(args: argparse.Namespace, target: str) -> grpc.Channel:
    """A channel to ``target``, with TLS when the arguments name certificates (shared with ``observe``)."""
    tls = _tls_from_args(args)
    if tls is None:
        return grpc.insecure_channel(target)
    try:
        with open(tls.ca, "rb") as ca, open(tls.key, "rb") as key, open(tls.cert, "rb") as cert:
            creds = grpc.ssl_channel_credentials(ca.read(), key.read(), cert.read())
    except OSError as exc:
        raise UsageError(f"cannot read TLS files: {exc}") from exc
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(target, creds, options=options)


def call_metadata(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The authorization metadata of each call (empty without a token)."""
    token = read_token_file(args.token_file)
    return [("authorization", f"Bearer {token}")] if token else []


def rpc_failure(command: str, target: str, exc: grpc.RpcError) -> int:
    """Says on stderr why ``command`` failed at ``target`` and returns the exit code."""
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        why = f"coordinator at {target} unreachable: {detail}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        why = f"coordinator at {target} did not answer in time"
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        why = f"{target} refused the token ({detail}); pass --token-file or set COLLSVC_TOKEN"
    else:
        why = f"{target} answered {code.name}: {detail}"
    print(f"collsvc {command}: {why}", file=sys.stderr)
    return EXIT_FAILURE


def _enum_name(enum_type: Any, value: int, prefix: str) -> str:
    try:
        return str(enum_type.Name(value)).removeprefix(prefix).lower()
    except ValueError:
        return str(value)


def status_to_dict(response: Any) -> dict[str, Any]:
    """A ``GetStatusResponse`` as plain JSON-able data (the ``--json`` output)."""
    from collsvc.proto.v1 import common_pb2

    jobs = []
    for job in response.jobs:
        progress = list(job.progress) if len(job.progress) == len(job.members) else []
        world_stats = list(job.world_stats) if len(job.world_stats) == len(job.members) else []
        members = []
        for i, m in enumerate(job.members):
            entry: dict[str, Any] = {
                "rank": m.rank,
                "host": m.host,
                "local_rank": m.local_rank,
                "local_size": m.local_size,
                "node_rank": m.node_rank,
                "peer_address": m.peer_address,
                "pid": m.pid,
                "device": {"kind": m.device.kind, "uuid": m.device.uuid, "index": m.device.index},
                "state": _enum_name(common_pb2.MemberState, m.state, "MEMBER_STATE_"),
                "seconds_since_heartbeat": round(m.seconds_since_heartbeat, 3),
            }
            if progress:
                p = progress[i]
                entry["progress"] = {
                    "group": p.group,
                    "started_seq": p.started_seq,
                    "finished_seq": p.finished_seq,
                    "last_op": p.last_op,
                }
            if world_stats:  # the time each rank spent in "world" collectives (observability/live.py)
                entry["collectives"] = {"count": world_stats[i].count, "seconds": round(world_stats[i].seconds, 6)}
            members.append(entry)
        jobs.append(
            {
                "job_id": job.job_id,
                "world_size": job.world_size,
                "state": job.state,
                "failure": job.failure,
                "members": members,
                "groups": [{"name": g.name, "ranks": list(g.ranks)} for g in job.groups],
            }
        )
    return {"jobs": jobs}


def format_status(data: dict[str, Any]) -> str:
    """The readable table of :func:`status_to_dict` output."""
    if not data["jobs"]:
        return "no jobs"
    lines: list[str] = []
    for job in data["jobs"]:
        members = job["members"]
        lines.append(f"job {job['job_id']}: {job['state']}, world size {job['world_size']}, {len(members)} joined")
        if job["state"] == "joining":
            lines.append("  " + describe_not_joined(job["world_size"], [m["rank"] for m in members]))
        if job["failure"]:
            lines.append(f"  failure: {job['failure']}")
        if job["groups"]:
            groups = ", ".join(f"{g['name']} [{ranks_text(g['ranks'])}]" for g in job["groups"])
            lines.append(f"  groups: {groups}")
        header = ("rank", "host", "local", "node", "state", "heartbeat", "pid", "last op")
        rows = [header]
        for m in members:
            p = m.get("progress")
            last = f"{p['last_op']} (seq {p['finished_seq']}/{p['started_seq']})" if p and p["last_op"] else "-"
            rows.append(
                (
                    str(m["rank"]),
                    m["host"],
                    f"{m['local_rank']}/{m['local_size']}",
                    str(m["node_rank"]),
                    m["state"],
                    f"{m['seconds_since_heartbeat']:.1f}s ago",
                    str(m["pid"]),
                    last,
                )
            )
        widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
        for row in rows:
            lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return "\n".join(lines)


def status_command(args: argparse.Namespace) -> int:
    """Prints the coordinator's jobs as a table (or JSON with ``--json``; a live table with ``--watch``).

    Returns:
        0 on success; 1 when the coordinator is unreachable, too slow, or refuses the token.

    Raises:
        UsageError: unreadable token or TLS files.
    """
    from collsvc.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

    target = coordinator_target(args)
    metadata = call_metadata(args)
    with open_channel(args, target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            response = stub.GetStatus(
                coordinator_pb2.GetStatusRequest(job_id=args.job), timeout=args.timeout, metadata=metadata
            )
        except grpc.RpcError as exc:
            return rpc_failure("status", target, exc)
    data = status_to_dict(response)
    print(json.dumps(data, indent=2) if args.json else format_status(data))
    return EXIT_OK


def health_command(args: argparse.Namespace) -> int:
    """Standard ``grpc.health.v1`` Check; prints the status.

    Returns:
        0 when the answer is SERVING; 1 otherwise (not serving, unknown service, unreachable, timeout).

    Raises:
        UsageError: unreadable token or TLS files.
    """
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = coordinator_target(args)
    metadata = call_metadata(args)
    with open_channel(args, target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            response = stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout, metadata=metadata
            )
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.NOT_FOUND:
                print(f"collsvc health: {target} has no service {args.service!r}", file=sys.stderr)
                return EXIT_FAILURE
            return rpc_failure("health", target, exc)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(name)
    return EXIT_OK if response.status == health_pb2.HealthCheckResponse.SERVING else EXIT_FAILURE
