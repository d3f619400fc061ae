"""Threads as local ranks: each thread owns a real LocalGroup (memfd segments, abstract sockets)."""

from __future__ import annotations

import threading
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from collsvc.client.backends.shm import LocalGroup

JOIN_SECONDS = 20.0


def run_ranks(fn: Callable[[int], Any], ranks: Sequence[int], size: int) -> list[Any]:
    """Runs ``fn(rank)`` on a thread per rank of ``ranks``; returns the values by rank (``size`` slots,
    None for ranks not run).

    Raises:
        AssertionError: a rank raised (with its traceback) or did not finish in JOIN_SECONDS.
    """
    results: list[Any] = [None] * size
    errors: list[str] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException:
            errors.append(f"rank {rank}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True, name=f"shm-rank-{r}") for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_SECONDS)
        assert not thread.is_alive(), f"{thread.name} did not finish in {JOIN_SECONDS} s"
    assert not errors, errors[0]
    return results


def run_group(
    size: int,
    fn: Callable[[LocalGroup], Any],
    *,
    slot_bytes: int = 4096,
    timeout: float = 5.0,
    ranks: Sequence[int] | None = None,
    namespace: str | None = None,
    **options: Any,
) -> list[Any]:
    """Runs ``fn(group)`` on ``size`` local ranks (or only ``ranks``); returns the values by rank.
    ``options`` go to every rank's LocalGroup (``spin``, ``barriers``).

    Raises:
        AssertionError: a rank raised (with its traceback) or did not finish in JOIN_SECONDS.
    """
    namespace = namespace or uuid.uuid4().hex

    def rank_main(rank: int) -> Any:
        with LocalGroup(namespace, rank, size, slot_bytes=slot_bytes, timeout=timeout, **options) as group:
            return fn(group)

    return run_ranks(rank_main, range(size) if ranks is None else ranks, size)
