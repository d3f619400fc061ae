"""The frozen option dataclasses shared by client and coordinator: TLS files, request limits, the
coordinator's and ``init``'s options.

No numpy here: the coordinator (also the one ``collsvc run`` starts beside its ranks) imports these and
nothing of the data plane.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for mutual TLS. ``ca`` verifies the other side's certificate."""

    cert: str
    key: str
    ca: str


@dataclass(frozen=True)
class Limits:
    """Sizes checked before anything is allocated (coordinator and peers); docs/security.md has the table.

    Attributes:
        max_world_size: members of one job (also bounds every list of ranks in a request).
        max_key_bytes: a key/value key.
        max_value_bytes: a key/value value.
        max_keys_per_job: keys (and named groups) of one job.
        max_message_bytes: the largest message a peer endpoint receives (tensor frames).
        max_jobs: jobs one coordinator holds at once.
        max_name_bytes: every other text field of a request: job ids, group names, hosts, peer
            addresses, device ids, member secrets.
        max_text_bytes: a failure report's reason and its JSON details.
        max_op_bytes: the last operation named in a progress entry.
        max_progress_groups: progress entries a member's heartbeat may describe (more are ignored).
        max_joining_jobs_per_client: jobs still gathering members in which one client address has a
            Join waiting; over it, the Join is refused instead of taking a job slot.
        max_pending_joins_per_client: members one client address may have waiting in Join calls at
            once (a JoinBatch counts each of its members).
        max_ranks_per_host: members one JoinBatch may join, and ranks one Barrier may arrive for.
    """

    max_world_size: int = 65536
    max_key_bytes: int = 8 * 1024
    max_value_bytes: int = 1024 * 1024
    max_keys_per_job: int = 100_000
    max_message_bytes: int = 64 * 1024 * 1024 + 4096
    max_jobs: int = 4096
    max_name_bytes: int = 512
    max_text_bytes: int = 256 * 1024
    max_op_bytes: int = 1024
    max_progress_groups: int = 1024
    max_joining_jobs_per_client: int = 64
    max_pending_joins_per_client: int = 65536
    max_ranks_per_host: int = 256


@dataclass(frozen=True)
class CoordinatorOptions:
    """How a coordinator daemon serves.

    ``heartbeat_timeout`` is how long a member may be silent before it is declared failed.
    """

    host: str = "127.0.0.1"
    port: int = 29400
    token: str | None = None
    tls: TlsFiles | None = None
    insecure: bool = False
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    limits: Limits = field(default_factory=Limits)
    metrics_port: int | None = None  # Prometheus /metrics on host:metrics_port (0: any free port); None: off


@dataclass(frozen=True)
class InitOptions:
    """Everything ``collsvc.init`` resolved from its arguments and the environment."""

    coordinator: str
    world_size: int
    rank: int | None
    local_rank_hint: int | None
    backend: str
    timeout: float
    token: str | None
    job_id: str
    host: str
    advertise_address: str | None = None
    tls: TlsFiles | None = None
    heartbeat_interval: float = 1.0
    allow_pickle: bool = False
    peer_port: int = 0
    coordinator_grace: float = 20.0
    shared_memory: bool = True
    tcp_lane: bool = True  # frames between hosts over a plain TCP lane where no TLS is configured
    lane_port: int = 0  # the port that lane listens on (0: any free port)
    hierarchical: str = "auto"
    small_bytes: int | None = None
    rooted_agreement: bool = True
    join_timeout: float | None = None  # seconds to wait for every member at join (None: ``timeout``)
