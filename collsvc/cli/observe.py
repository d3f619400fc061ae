"""``collsvc diagnose``, ``collsvc timeline merge`` and ``collsvc status --watch``: the observability commands.

Kept apart from :mod:`collsvc.cli.main` so that ``collsvc run`` never pays for these imports.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

from collsvc.cli.common import EXIT_FAILURE, EXIT_OK, UsageError

_CLEAR = "\033[H\033[2J"


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Adds ``diagnose`` and ``timeline`` to the ``collsvc`` subcommands."""
    diagnose = sub.add_parser(
        "diagnose",
        help="what went wrong, from every rank's flight-recorder dump",
        description="Read the flight-recorder dumps (collsvc-<job>-rank<r>-<pid>.json, written to "
        "$COLLSVC_DUMP_DIR on a failure) of every rank, copied into one folder, and say which collective "
        "failed (group, sequence number, op, shapes), which ranks never entered it and what each last "
        "did, and which ranks disagreed and how.",
    )
    diagnose.add_argument("dump_dir", metavar="DUMP_DIR", help="folder holding the dumps of every rank")
    diagnose.add_argument("--json", action="store_true", help="print JSON instead of text")

    timeline = sub.add_parser("timeline", help="work with COLLSVC_TIMELINE traces")
    actions = timeline.add_subparsers(dest="action", metavar="ACTION", required=True)
    merge = actions.add_parser(
        "merge",
        help="merge the per-rank timeline parts in a folder into one Chrome-trace / Perfetto file",
        description="Merge the per-rank parts that COLLSVC_TIMELINE=trace.json makes each rank write "
        "(trace.rank<R>.json; copy every host's parts into one folder) into one trace with one track "
        "per rank. Open it in https://ui.perfetto.dev or chrome://tracing.",
    )
    merge.add_argument("dir", metavar="DIR", help="folder holding the parts")
    merge.add_argument("-o", "--output", required=True, metavar="FILE", help="the merged trace to write")
    render = actions.add_parser(
        "render",
        help="draw a merged trace as a PNG (needs matplotlib)",
        description="Draw a merged timeline as a small PNG: one row per rank, each collective split into "
        "its phases (waiting for peers, moving data), a tick where each rank arrived.",
    )
    render.add_argument("trace", metavar="TRACE", help="a merged trace (collsvc timeline merge, or collsvc run)")
    render.add_argument("-o", "--output", required=True, metavar="PNG", help="the picture to write")
    render.add_argument("--from", dest="start_ms", type=float, metavar="MS", help="first millisecond to draw")
    render.add_argument("--to", dest="end_ms", type=float, metavar="MS", help="last millisecond to draw")


def add_status_watch_args(status: argparse.ArgumentParser) -> None:
    """Adds ``--watch``, ``--interval`` and ``--count`` to ``collsvc status``."""
    status.add_argument("--watch", action="store_true", help="refresh a live per-job table until Ctrl-C")
    status.add_argument(
        "--interval", type=float, default=2.0, metavar="S", help="seconds between refreshes with --watch (default: 2)"
    )
    status.add_argument("--count", type=int, default=0, metavar="N", help="stop after N refreshes (default: never)")


def diagnose_command(args: argparse.Namespace) -> int:
    """Prints the diagnosis of every job with dumps in ``args.dump_dir``.

    Returns:
        0 when dumps were found and diagnosed; 1 when the folder holds none.

    Raises:
        UsageError: the folder does not exist.
    """
    from collsvc.observability.diagnose import DiagnosisError, diagnose_directory

    if not os.path.isdir(args.dump_dir):
        raise UsageError(f"no such folder: {args.dump_dir}")
    try:
        diagnoses = diagnose_directory(args.dump_dir)
    except DiagnosisError as exc:
        print(f"collsvc diagnose: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(json.dumps([d.to_dict() for d in diagnoses], indent=2))
    else:
        print("\n".join(line for d in diagnoses for line in d.lines()))
    return EXIT_OK


def timeline_command(args: argparse.Namespace) -> int:
    """``collsvc timeline merge DIR -o FILE`` and ``collsvc timeline render TRACE -o PNG``.

    Returns:
        0 after writing the merged trace or the picture; 1 when the folder holds no timeline part, the
        trace cannot be read, or the output cannot be written.

    Raises:
        UsageError: the folder or trace does not exist; matplotlib is missing (render).
    """
    from collsvc.observability.timeline import TimelineError, merge_directory

    if args.action == "render":
        return _render(args)

    if not os.path.isdir(args.dir):
        raise UsageError(f"no such folder: {args.dir}")
    try:
        summary = merge_directory(args.dir, args.output)
    except TimelineError as exc:
        print(f"collsvc timeline: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except OSError as exc:
        print(f"collsvc timeline: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILURE
    ranks = summary["ranks"]
    print(f"wrote {args.output}: {summary['calls']} collectives on {len(ranks)} rank track(s) {ranks}")
    return EXIT_OK


def _render(args: argparse.Namespace) -> int:
    from collsvc.observability.render import render_png

    if not os.path.isfile(args.trace):
        raise UsageError(f"no such trace: {args.trace}")
    try:
        with open(args.trace, encoding="utf-8") as handle:
            trace = json.load(handle)
        drawn = render_png(trace, args.output, start_ms=args.start_ms, end_ms=args.end_ms)
    except RuntimeError as exc:  # no matplotlib
        raise UsageError(str(exc)) from exc
    except (OSError, ValueError, KeyError) as exc:
        print(f"collsvc timeline: cannot render {args.trace}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"wrote {args.output}: {drawn} collectives")
    return EXIT_OK


def watch_status(args: argparse.Namespace) -> int:
    """Refreshes the live table every ``args.interval`` seconds until Ctrl-C (or ``args.count`` refreshes).

    Returns:
        0 when stopped; 1 when the coordinator is unreachable, too slow, or refuses the token.

    Raises:
        UsageError: a bad interval, or unreadable token or TLS files.
    """
    import grpc

    from collsvc.cli.remote import call_metadata, coordinator_target, open_channel, rpc_failure, status_to_dict
    from collsvc.observability.live import watch_table
    from collsvc.proto.v1 import coordinator_pb2, coordinator_pb2_grpc

    if not args.interval > 0:
        raise UsageError(f"--interval must be > 0, got {args.interval}")
    target = coordinator_target(args)
    metadata = call_metadata(args)
    clear = _CLEAR if sys.stdout.isatty() else ""
    previous, taken, refreshes = None, 0.0, 0
    pause = threading.Event()  # never set: wait() is an interruptible sleep between refreshes
    with open_channel(args, target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            while True:
                try:
                    response = stub.GetStatus(
                        coordinator_pb2.GetStatusRequest(job_id=args.job), timeout=args.timeout, metadata=metadata
                    )
                except grpc.RpcError as exc:
                    return rpc_failure("status", target, exc)
                now = time.monotonic()
                current = status_to_dict(response)
                stamp = time.strftime("%H:%M:%S")
                table = watch_table(current, previous, now - taken)
                print(f"{clear}collsvc status --watch {target}  {stamp}\n{table}\n", flush=True)
                previous, taken, refreshes = current, now, refreshes + 1
                if args.count and refreshes >= args.count:
                    return EXIT_OK
                pause.wait(args.interval)
        except KeyboardInterrupt:
            return EXIT_OK
