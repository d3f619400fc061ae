"""Top-level rank functions for the security tests (spawned processes import them by name)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

import collsvc
from collsvc.errors import CollsvcError


def all_reduce_sum(comm: Any) -> list[float]:
    """The sum of ``arange(4) + rank`` over every rank."""
    out = comm.all_reduce(np.arange(4, dtype=np.float64) + comm.rank)
    return [float(v) for v in out]


def hold_then_all_reduce(comm: Any, release_key: str) -> list[float]:
    """Keeps the peer endpoints up until the test sets ``release_key``, then runs one all_reduce."""
    comm.job.store.get(release_key, 60.0)
    return all_reduce_sum(comm)


def env_token_and_objects(comm: Any) -> dict[str, Any]:
    """Whether this rank has a token, and what ``broadcast_object`` does (value or error text)."""
    result: dict[str, Any] = {"token": bool(os.environ.get("COLLSVC_TOKEN"))}
    try:
        result["object"] = comm.broadcast_object({"from": comm.rank}, src=0)
    except collsvc.AuthenticationError as exc:
        result["error"] = str(exc)
    return result


def advertise_huge_object(comm: Any) -> str:
    """Rank 0 advertises a 1 TiB pickled object; the others must refuse before allocating it."""
    if comm.rank == 0:
        comm.broadcast(np.array([1 << 40], dtype=np.int64), 0)
        return "sent"
    try:
        comm.broadcast_object(None, src=0)
    except CollsvcError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"
