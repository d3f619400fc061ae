"""The ``collsvc`` command: ``run``, ``coordinator``, ``status``, ``health``, ``bench``, ``diagnose``, ``timeline``.

Exit codes: 0 success; 1 failure (a rank failed, the coordinator could not bind or is unreachable,
not serving); 2 bad usage (argparse errors, an unauthenticated non-loopback coordinator, missing
files); ``collsvc run`` passes on the failed rank's exit code (128 + signal number when it was killed),
and exits 130 / 143 when interrupted by SIGINT / SIGTERM, 124 when ``--timeout`` expired.

Imports of gRPC, the server and numpy-heavy modules happen inside the subcommand that needs them, so
that ``collsvc run`` starts its ranks as early as possible.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from collsvc.bench.protocol import COLLECTIVES
from collsvc.cli.common import (
    DEFAULT_COORDINATOR,
    EXIT_USAGE,
    UsageError,
    read_token_file,
)
from collsvc.launch.spec import FORK_SERVER, START_METHODS

_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _add_log_level(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-level",
        default="WARNING",
        type=str.upper,
        choices=_LOG_LEVELS,
        help="logging level of collsvc's own messages (default: WARNING)",
    )


def _add_client_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help=f"the coordinator (default: $COLLSVC_COORDINATOR, else {DEFAULT_COORDINATOR})",
    )
    parser.add_argument(
        "--token-file",
        metavar="FILE",
        help="file holding the job token (default: $COLLSVC_TOKEN, else the file $COLLSVC_TOKEN_FILE names)",
    )
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate for mutual TLS")
    parser.add_argument("--tls-key", metavar="PEM", help="client private key for mutual TLS")
    parser.add_argument(
        "--tls-ca",
        metavar="PEM",
        help="CA that signed the coordinator's certificate (the three TLS flags default to $COLLSVC_TLS_CERT/_KEY/_CA)",
    )
    parser.add_argument("--tls-server-name", metavar="NAME", help="name to expect in the coordinator's certificate")
    parser.add_argument(
        "--timeout",
        type=_positive_float,
        default=3.0,
        metavar="S",
        help="give up after this many seconds (default: 3)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``collsvc`` command (every subcommand and flag)."""
    parser = argparse.ArgumentParser(prog="collsvc", description="Collective communication for distributed training.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = sub.add_parser(
        "run",
        help="start N local ranks of a script (with an embedded coordinator unless --coordinator)",
        description="Start N ranks of a Python script on this host. Each output line is prefixed with "
        "'[rank R] '. When one rank fails the others are stopped (SIGTERM, then SIGKILL after --grace) "
        "and run exits with that rank's exit code (128+N when killed by signal N) after one summary line. "
        "Several ranks share this host's cores: unless OMP_NUM_THREADS is set, each gets OMP_NUM_THREADS = "
        "cores / ranks (at least 1), which sizes numpy's and torch's thread pools.",
    )
    run.add_argument(
        "-n",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        default=1,
        metavar="N",
        help="ranks on this node (default: 1: without -n the script runs as a world of one rank)",
    )
    run.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default: 1)")
    run.add_argument("--node-rank", type=int, default=0, help="this node's index, from 0 (default: 0)")
    run.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="join this coordinator instead of an embedded one on 127.0.0.1 (needed for --nnodes > 1)",
    )
    run.add_argument(
        "--token-file",
        metavar="FILE",
        help="token of the --coordinator (default: $COLLSVC_TOKEN or $COLLSVC_TOKEN_FILE); "
        "the embedded coordinator uses a fresh random token",
    )
    run.add_argument("--job-id", default="default", help="job name at the coordinator (default: default)")
    run.add_argument(
        "--grace",
        type=float,
        default=3.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default: 3)",
    )
    run.add_argument(
        "--timeout",
        type=_positive_float,
        metavar="S",
        help="stop every rank when the job runs longer than this; exit 124 (default: no limit)",
    )
    run.add_argument(
        "--heartbeat-timeout",
        type=_positive_float,
        metavar="S",
        help="seconds of silence before the embedded coordinator fails a rank; ranks then heartbeat every "
        "S/5 s (default: 5, and in proportion more past 8 ranks per core, which cannot all be heard "
        "in time; not with --coordinator, whose own --heartbeat-timeout rules)",
    )
    # Elastic jobs (collsvc/elastic/launch.py).
    run.add_argument(
        "--min-ranks",
        type=int,
        metavar="M",
        help="elastic: a failed rank does not stop the others while at least M ranks remain; the script's "
        "training function must be decorated with collsvc.elastic.run for the survivors to re-form and go on "
        "(default: off)",
    )
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="elastic: start a replacement for a failed rank, up to K in total; collsvc.elastic.run admits it "
        "(default: 0)",
    )
    run.add_argument(
        "--start-method",
        choices=START_METHODS,
        default=FORK_SERVER,
        help="fork-server: one process loads numpy, gRPC and collsvc, then forks every rank of the script "
        "(starts in a fraction of the time); spawn: a fresh interpreter per rank (default: fork-server)",
    )
    run.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="the target is a module name, run as python -m MODULE [args ...]",
    )
    run.add_argument("target", nargs=argparse.REMAINDER, metavar="script.py [args ...]", help="what to run")
    _add_log_level(run)

    coord = sub.add_parser(
        "coordinator",
        help="serve a coordinator daemon",
        description="Serve the coordinator until SIGTERM or Ctrl-C. A host other than loopback needs "
        "a token (--token-file, $COLLSVC_TOKEN, $COLLSVC_TOKEN_FILE), mutual TLS, or --insecure.",
    )
    coord.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    coord.add_argument("--port", type=int, default=29400, help="port; 0 picks a free one (default: 29400)")
    coord.add_argument("--token-file", metavar="FILE", help="file holding the token every client must present")
    coord.add_argument("--tls-cert", metavar="PEM", help="server certificate (mutual TLS; with --tls-key, --tls-ca)")
    coord.add_argument("--tls-key", metavar="PEM", help="server private key")
    coord.add_argument("--tls-ca", metavar="PEM", help="CA that client certificates must be signed by")
    coord.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback host with neither token nor TLS (anyone who can connect may join)",
    )
    coord.add_argument(
        "--heartbeat-timeout",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="seconds of silence before a member is declared failed (default: 5)",
    )
    coord.add_argument(
        "--heartbeat-interval",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="the interval members are expected to beat at; the coordinator checks every S/2 seconds "
        "(members set theirs with COLLSVC_HEARTBEAT_INTERVAL; default: 1)",
    )
    coord.add_argument(
        "--metrics-port",
        type=int,
        metavar="P",
        help="also serve Prometheus /metrics on this port of --host (0 picks a free one; default: off)",
    )
    _add_log_level(coord)

    status = sub.add_parser("status", help="show jobs, groups, ranks, hosts and heartbeats of a coordinator")
    _add_client_args(status)
    status.add_argument("--job", default="", help="only this job (default: every job)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    from collsvc.cli.observe import add_parsers, add_status_watch_args

    add_status_watch_args(status)

    health = sub.add_parser(
        "health",
        help="gRPC health check of a coordinator; exit 0 when SERVING (for container HEALTHCHECKs)",
    )
    _add_client_args(health)
    health.add_argument("--service", default="", help="service name to check (default: the whole server)")

    bench = sub.add_parser(
        "bench",
        help="nccl-tests style table: size, time, algbw, busbw",
        description="Start N local ranks (an embedded coordinator) and time one collective over a range of "
        "sizes, nccl-tests style: per size the median time, the algorithm bandwidth (bytes / time) and the "
        "bus bandwidth (what each link carries, comparable across world sizes and ops).",
    )
    bench.add_argument("-n", type=int, default=2, metavar="N", help="ranks (default: 2)")
    bench.add_argument(
        "--op", default="all_reduce", help=f"what to measure: {', '.join(COLLECTIVES)} (default: all_reduce)"
    )
    bench.add_argument("--sizes", default="4K:64M", help="LOW:HIGH byte sizes, e.g. 4K:64M (default)")
    bench.add_argument("--factor", type=int, default=4, help="step between sizes (default: 4)")
    bench.add_argument("--dtype", default="float32", help="element type (default: float32)")
    bench.add_argument("--iters", type=int, default=20, help="timed iterations per size (default: 20)")
    bench.add_argument("--warmup", type=int, default=3, help="untimed iterations per size (default: 3)")
    bench.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the arrays live: numpy or CuPy (default: cpu)"
    )
    bench.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "nccl", "ring"),
        help="auto: NCCL when every rank has its own GPU and the arrays are on it, else ring; nccl: NCCL only; "
        "ring: collsvc's own data plane, which on one host moves the bytes through shared memory "
        "(COLLSVC_SHM=0 sends them over gRPC as between hosts) (default: auto)",
    )
    bench.add_argument("--json", action="store_true", help="print JSON rows instead of the table")
    bench.add_argument("--plot", metavar="FILE", help="also plot bus bandwidth to FILE (needs matplotlib)")
    bench.add_argument("--check", action="store_true", help="verify every result")
    add_parsers(sub)  # diagnose, timeline
    return parser


def _setup_logging(level: str) -> None:
    import logging

    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _cmd_run(args: argparse.Namespace) -> int:
    from collsvc.launch.launcher import launch
    from collsvc.launch.spec import LaunchSpec

    target: list[str] = list(args.target)
    if target and target[0] == "--":
        target = target[1:]
    if not target:
        raise UsageError("nothing to run: give a script (collsvc run -n 4 train.py) or -m MODULE")
    if args.module:
        command = [sys.executable, "-m", *target]
    else:
        if not os.path.exists(target[0]):
            raise UsageError(f"no such script: {target[0]}")
        command = [sys.executable, *target]
    token = read_token_file(args.token_file) if args.coordinator else None
    try:
        spec = LaunchSpec(
            command=command,
            nproc=args.nproc,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            coordinator=args.coordinator,
            token=token,
            job_id=args.job_id,
            grace=args.grace,
            timeout=args.timeout,
            min_ranks=args.min_ranks,
            max_restarts=args.max_restarts,
            start_method=args.start_method,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.heartbeat_timeout is not None and args.coordinator:
        raise UsageError("--heartbeat-timeout sets the embedded coordinator's; give it to `collsvc coordinator`")
    if spec.elastic:
        from collsvc.elastic.launch import ElasticLauncher

        return launch(spec, ElasticLauncher(spec), heartbeat_timeout=args.heartbeat_timeout)
    return launch(spec, heartbeat_timeout=args.heartbeat_timeout)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``collsvc`` command line.

    Args:
        argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
        The process exit status (see the module docstring).

    Raises:
        SystemExit: from argparse, for ``--help`` and bad arguments (status 0 or 2).
    """
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if getattr(args, "log_level", None):
        _setup_logging(args.log_level)
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "coordinator":
            from collsvc.cli.remote import coordinator_command

            return coordinator_command(args)
        if args.command == "status" and getattr(args, "watch", False):
            from collsvc.cli.observe import watch_status

            return watch_status(args)
        if args.command == "status":
            from collsvc.cli.remote import status_command

            return status_command(args)
        if args.command in ("diagnose", "timeline"):
            from collsvc.cli.observe import diagnose_command, timeline_command

            return diagnose_command(args) if args.command == "diagnose" else timeline_command(args)
        if args.command == "health":
            from collsvc.cli.remote import health_command

            return health_command(args)
        import collsvc.bench.harness

        return collsvc.bench.harness.main(args)
    except UsageError as exc:
        print(f"collsvc {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
