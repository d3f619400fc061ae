"""What ``collsvc run`` starts (:class:`LaunchSpec`) and the environment each of its ranks gets.

Standard library only: ``collsvc run`` imports this before it starts its ranks.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import collsvc
from collsvc.config import thread_defaults

# How `collsvc run` starts a Python script's ranks (--start-method).
FORK_SERVER = "fork-server"  # forked from one process that loaded what they load: collsvc/launch/fork_server.py
SPAWN = "spawn"  # a fresh interpreter each
START_METHODS = (FORK_SERVER, SPAWN)


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What ``collsvc run`` starts.

    Attributes:
        command: the argv of one rank (``[sys.executable, "train.py", ...]``).
        nproc: ranks on this node.
        nnodes: nodes in the job; the world size is ``nnodes * nproc``.
        node_rank: this node's index; its ranks are ``node_rank * nproc + i``.
        coordinator: ``host:port`` of an external coordinator, or None for an embedded one.
        token: the job token for an external coordinator (the embedded one makes its own).
        job_id: passed to the ranks as ``COLLSVC_JOB_ID``.
        grace: seconds between SIGTERM and SIGKILL when stopping ranks.
        timeout: seconds the whole job may run before it is stopped, or None for no limit.
        min_ranks: elastic: failed ranks do not stop the job while this many remain (None: not elastic).
        max_restarts: elastic: replacements started for failed ranks, in total.
        start_method: ``"fork-server"`` (a Python command's ranks fork from one process that loaded
            numpy, gRPC and collsvc once: collsvc/launch/fork_server.py) or ``"spawn"`` (a fresh process each).
    """

    command: Sequence[str]
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    coordinator: str | None = None
    token: str | None = None
    job_id: str = "default"
    grace: float = 3.0
    timeout: float | None = None
    # Elastic supervision (collsvc/elastic/launch.py): --min-ranks, --max-restarts.
    min_ranks: int | None = None
    max_restarts: int = 0
    start_method: str = FORK_SERVER

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"-n must be >= 1, got {self.nproc}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is outside [0, {self.nnodes})")
        if self.nnodes > 1 and self.coordinator is None:
            raise ValueError("--nnodes > 1 needs --coordinator HOST:PORT (a coordinator every node can reach)")
        if self.grace < 0:
            raise ValueError(f"--grace must be >= 0, got {self.grace}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"--timeout must be > 0, got {self.timeout}")
        if not self.command:
            raise ValueError("no command to run")
        if self.start_method not in START_METHODS:
            raise ValueError(f"--start-method must be one of {', '.join(START_METHODS)}, got {self.start_method!r}")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.min_ranks is not None and not 1 <= self.min_ranks <= self.nproc:
            raise ValueError(f"--min-ranks must be between 1 and -n ({self.nproc}), got {self.min_ranks}")

    @property
    def elastic(self) -> bool:
        """Whether failed ranks may be dropped or replaced (``--min-ranks`` / ``--max-restarts``)."""
        return self.min_ranks is not None or self.max_restarts > 0


def rank_env(
    base: Mapping[str, str], spec: LaunchSpec, coordinator: str, token: str | None, local_rank: int
) -> dict[str, str]:
    """The environment of local rank ``local_rank``: ``base`` plus the ``COLLSVC_*`` variables init reads."""
    env = dict(base)
    env.update(thread_defaults(base, spec.nproc))
    env.update(
        COLLSVC_COORDINATOR=coordinator,
        COLLSVC_WORLD_SIZE=str(spec.nnodes * spec.nproc),
        COLLSVC_RANK=str(spec.node_rank * spec.nproc + local_rank),
        COLLSVC_LOCAL_RANK=str(local_rank),
        COLLSVC_JOB_ID=spec.job_id,
        COLLSVC_LEAVE_ON_SIGTERM="1",  # the launcher stops ranks with SIGTERM: they leave, not fail
        PYTHONUNBUFFERED="1",
    )
    if token:
        env["COLLSVC_TOKEN"] = token
    else:
        env.pop("COLLSVC_TOKEN", None)
    # Ranks must import the launcher's collsvc, also from a source tree only on the launcher's path
    # (python -m collsvc in a checkout); never for site-packages, which would precede the standard library.
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(collsvc.__file__)))
    if os.path.basename(package_parent) not in ("site-packages", "dist-packages"):
        parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if package_parent not in parts:
            env["PYTHONPATH"] = os.pathsep.join([package_parent, *parts])
    return env
