"""Runs a function on N real rank processes under ``dist.init_process_group("collsvc")``.

Three ways of starting, as users start jobs:

- ``"file"``: torch's ``file://`` init method; rank 0 starts the embedded coordinator and publishes it
  through torch's store.
- ``"env"``: torchrun's environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``).
- ``"collsvc"``: ``collsvc run``'s environment (``COLLSVC_*``, a real coordinator, no ``MASTER_ADDR``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from tests.harness import JobResult, coordinator, run_ranks

NO_COORDINATOR = "127.0.0.1:1"  # never dialled: the store bootstrap starts its own coordinator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def torch_rank(
    rank: int, fn: Callable[..., Any], world_size: int, init_method: str | None, timeout: float, args: tuple[Any, ...]
) -> Any:
    """Rank body: joins through torch, runs ``fn(rank, world_size, *args)``, destroys the group."""
    import torch
    import torch.distributed as dist

    import collsvc.torch  # noqa: F401 - registers the backend

    torch.manual_seed(1234)
    torch.set_num_threads(1)
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout)}
    if init_method is not None:
        kwargs.update(init_method=init_method, rank=rank, world_size=world_size)
    dist.init_process_group("collsvc", **kwargs)
    try:
        return fn(dist.get_rank(), dist.get_world_size(), *args)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _launch_env(mode: str, world_size: int) -> Iterator[tuple[str, dict[str, str], str | None]]:
    """(coordinator address for the harness, extra env, torch init_method) for ``mode``."""
    if mode == "collsvc":
        with coordinator() as (_, address):
            yield address, {"MASTER_ADDR": ""}, None
    elif mode == "env":
        env = {"COLLSVC_COORDINATOR": "", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
        env["WORLD_SIZE"] = str(world_size)
        yield NO_COORDINATOR, env, None
    elif mode == "file":
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "store")
            yield NO_COORDINATOR, {"COLLSVC_COORDINATOR": "", "MASTER_ADDR": ""}, f"file://{path}"
    else:
        raise ValueError(f"unknown mode {mode!r}")


def run_torch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    mode: str = "file",
    args: tuple[Any, ...] = (),
    collective_timeout: float = 60.0,
    timeout: float = 120.0,
    allow_failures: bool = False,
    env: dict[str, str] | None = None,
    rank_env: Callable[[int], dict[str, str]] | None = None,
) -> JobResult:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` processes inside a collsvc process group.

    Args:
        mode: ``"file"``, ``"env"`` or ``"collsvc"`` (see the module docstring).
        collective_timeout: the ``timeout`` given to ``init_process_group``, in seconds.
        timeout: bound on the whole job.
        rank_env: rank -> more environment for that rank (``COLLSVC_HOST``: fake hosts).
    """

    def per_rank(rank: int) -> dict[str, str]:
        return {**({"RANK": str(rank)} if mode == "env" else {}), **(rank_env(rank) if rank_env else {})}

    with _launch_env(mode, world_size) as (address, extra, init_method):
        merged = {"OMP_NUM_THREADS": "1", **extra, **(env or {})}
        return run_ranks(
            torch_rank,
            world_size,
            address=address,
            args=(fn, world_size, init_method, collective_timeout, args),
            timeout=timeout,
            env=merged,
            rank_env=per_rank if mode == "env" or rank_env else None,
            use_init=False,
            allow_failures=allow_failures,
        )
