"""Reduce operations, the dtype table, and the frozen option dataclasses shared by client and server."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np

try:  # ml_dtypes gives numpy a bfloat16; it is a runtime dependency but stay importable without it.
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised only in stripped installs
    BFLOAT16 = None


class ReduceOp(enum.Enum):
    """Elementwise reduction applied by all_reduce, reduce and reduce_scatter."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    AVG = "avg"

    # Members are singletons compared by identity: hash them as such, in C (Enum's own __hash__ is
    # Python code, and ops are dictionary keys on every collective's path).
    __hash__ = object.__hash__


BITWISE_OPS = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})

# Wire codes: stable small integers for signatures and frame headers.
_DTYPE_NAMES: tuple[str, ...] = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
DTYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(_DTYPE_NAMES, start=1)}
OP_CODES: dict[ReduceOp, int] = {op: code for code, op in enumerate(ReduceOp, start=1)}


# Supported dtypes seen so far -> their collsvc names (numpy's dtype.name is slow: it runs Python code).
_NAME_OF: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """The collsvc name of a numpy dtype ("bfloat16" for ml_dtypes' bfloat16).

    Raises:
        TypeError: the dtype is not one collsvc supports.
    """
    known = _NAME_OF.get(dtype)
    if known is not None:
        return known
    name = "bfloat16" if BFLOAT16 is not None and dtype == BFLOAT16 else dtype.name
    if name not in DTYPE_CODES or dtype.byteorder == ">":
        supported = ", ".join(_DTYPE_NAMES)
        raise TypeError(f"unsupported dtype {dtype!s}; supported: {supported}")
    if len(_NAME_OF) < 256:  # bounded: equal dtypes with distinct metadata hash apart
        _NAME_OF[dtype] = name
    return name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a collsvc dtype name.

    Raises:
        TypeError: unknown name, or bfloat16 without ml_dtypes.
    """
    if name == "bfloat16":
        if BFLOAT16 is None:
            raise TypeError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes")
        return BFLOAT16
    if name not in DTYPE_CODES:
        raise TypeError(f"unsupported dtype {name!r}")
    return np.dtype(name)


# (op, dtype) pairs check_op_dtype has accepted: a repeated call checks one set membership.
_ALLOWED_PAIRS: set[tuple[ReduceOp, np.dtype]] = set()


def check_op_dtype(op: ReduceOp, dtype: np.dtype) -> None:
    """Rejects reduce-op/dtype pairs that API.md forbids.

    Raises:
        TypeError: op is not a ReduceOp, the dtype is unsupported, a bitwise op on a non-integer,
            non-bool dtype, MIN/MAX on complex, or AVG on an integer or bool dtype.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a collsvc.ReduceOp, got {op!r}")
    if (op, dtype) in _ALLOWED_PAIRS:
        return
    name = dtype_name(dtype)
    kind = dtype.kind
    if op in BITWISE_OPS and kind not in "biu":
        raise TypeError(f"{op.name} needs an integer or bool array, got {name}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise TypeError(f"{op.name} is undefined for complex dtype {name}")
    if op is ReduceOp.AVG and kind in "biu":
        raise TypeError(f"AVG of integer or bool dtype {name} is not allowed; use SUM and divide")
    if len(_ALLOWED_PAIRS) < 1024:
        _ALLOWED_PAIRS.add((op, dtype))


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
    hierarchical: str = "auto"
    small_bytes: int | None = None
    rooted_agreement: bool = True
    join_timeout: float | None = None  # seconds to wait for every member at join (None: ``timeout``)
