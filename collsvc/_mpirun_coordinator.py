"""The coordinator of a job started by Open MPI's ``mpirun`` with none given: ``mpirun -np 4 python x.py``.

Local rank 0 starts a coordinator on ``127.0.0.1`` inside its own process, on a free port with a fresh
token (or ``COLLSVC_TOKEN``), and publishes ``{address, token}`` in a file only this user can read,
named after the mpirun job (``launcher_env.mpirun_local_job``) in mpirun's session folder; the other ranks
wait for that file (bounded by ``init``'s timeout) and dial it. Each of them marks its departure there
at exit, and local rank 0 keeps the coordinator up at its own exit until every other rank has left or
died (bounded by :data:`LINGER`), so that a rank finishing first does not take the coordinator from
the others. Only for ranks on one host: across hosts ``launcher_env.mpirun_local_job`` raises.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import threading
import time
from typing import Any

from collsvc.errors import RendezvousError
from collsvc.launcher_env import mpirun_local_job

LINGER = 60.0  # seconds local rank 0 keeps its coordinator for ranks still running at its exit
_POLL = 0.02
_lock = threading.Lock()
_found: tuple[str, str] | None = None


def coordinator_for_mpirun(timeout: float, token: str | None) -> tuple[str, str] | None:
    """``(address, token)`` of the job's coordinator under mpirun with none given, starting it on local
    rank 0; the same answer for every later call in this process. None when not under such an mpirun.

    Raises:
        ValueError: the ranks span hosts (see ``launcher_env.mpirun_local_job``).
        RendezvousError: local rank 0 published no coordinator within ``timeout`` seconds.
        OSError, RuntimeError: local rank 0 could not start its coordinator.
    """
    global _found
    with _lock:
        if _found is not None:
            return _found
        job = mpirun_local_job()
        if job is None:
            return None
        key, local_rank, folder = job
        path = os.path.join(folder, f"collsvc-coordinator-{os.getuid()}-{key}.json")
        _found = _start(path, token) if local_rank == 0 else _find(path, timeout, local_rank)
        return _found


def _start(path: str, token: str | None) -> tuple[str, str]:
    from collsvc.config import read_token
    from collsvc.options import CoordinatorOptions
    from collsvc.server.app import CoordinatorThread

    token = token or read_token(None, os.environ) or secrets.token_hex(16)
    server = CoordinatorThread(CoordinatorOptions(host="127.0.0.1", port=0, token=token))
    port = server.start()
    address = f"127.0.0.1:{port}"
    partial = f"{path}.{os.getpid()}.tmp"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        json.dump({"address": address, "token": token, "pid": os.getpid()}, handle)
    os.replace(partial, path)  # the others never read a half-written file
    atexit.register(_stop_when_others_left, server, path)
    return address, token


def _find(path: str, timeout: float, local_rank: int) -> tuple[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        found = _read(path)
        if found is not None:
            break
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"under mpirun without a coordinator, local rank 0 starts one; none was published at {path} "
                f"within {timeout:g}s (did local rank 0 fail, or not call collsvc.init?)"
            )
        time.sleep(_POLL)
    with open(f"{path}.rank{local_rank}", "w", encoding="utf-8") as handle:
        handle.write(str(os.getpid()))
    atexit.register(_mark_left, f"{path}.rank{local_rank}")
    return found


def _read(path: str) -> tuple[str, str] | None:
    try:
        with open(path, encoding="utf-8") as handle:
            record: dict[str, Any] = json.load(handle)
        os.kill(int(record["pid"]), 0)  # a file left by a dead process is not this job's
    except (OSError, ValueError, KeyError):
        return None
    return str(record["address"]), str(record["token"])


def _mark_left(marker: str) -> None:
    # Registered after init's own exit handler, so it runs after this rank left the job.
    with contextlib.suppress(OSError):
        os.replace(marker, f"{marker}.left")


def _stop_when_others_left(server: Any, path: str) -> None:
    from collsvc.launcher_env import int_from

    size = int_from(os.environ, ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE")) or 1
    deadline = time.monotonic() + LINGER
    waiting = set(range(1, size))
    while waiting and time.monotonic() < deadline:
        waiting = {r for r in waiting if not _gone(f"{path}.rank{r}")}
        if waiting:
            time.sleep(_POLL)
    server.stop()
    for name in [path, *(f"{path}.rank{r}{end}" for r in range(1, size) for end in ("", ".left"))]:
        with contextlib.suppress(OSError):
            os.unlink(name)


def _gone(marker: str) -> bool:
    """Whether the rank of ``marker`` left, or died after finding the coordinator."""
    if os.path.exists(f"{marker}.left"):
        return True
    try:
        with open(marker, encoding="utf-8") as handle:
            os.kill(int(handle.read()), 0)
    except FileNotFoundError:
        return False  # it has not found the coordinator yet
    except (OSError, ValueError):
        return True
    return False
