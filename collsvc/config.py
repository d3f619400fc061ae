"""With ``collsvc/launcher_env.py`` (the launchers' own variables), the module that reads environment variables;
the few reads elsewhere say why at the read, and ``tests/unit/test_env_reads.py`` lists them.

``collsvc.init`` accepts launcher environments as they are, first match wins:

- ours: ``COLLSVC_COORDINATOR``, ``COLLSVC_WORLD_SIZE``, ``COLLSVC_RANK``, ``COLLSVC_LOCAL_RANK``,
  ``COLLSVC_TOKEN``, ``COLLSVC_JOB_ID``
- torchrun / Kubeflow PyTorchJob: ``MASTER_ADDR`` + ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``
- Open MPI: ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_LOCAL_RANK``
- Slurm: ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``
- PMI (MPICH, Intel MPI): ``PMI_SIZE``, ``PMI_RANK``
- Kubeflow Trainer: ``PET_NNODES`` x ``PET_NPROC_PER_NODE`` ranks, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` +
  ``PET_MASTER_PORT`` (see :func:`operator_launch`)
- Volcano: ``VC_TASK_INDEX``, ``VC_<TASK>_NUM``, ``VC_COORDINATOR_HOSTS`` (see :func:`operator_launch`)
- Kubernetes Indexed Job: ``JOB_COMPLETION_INDEX`` as the rank

Extra knobs: ``COLLSVC_ADVERTISE_ADDRESS`` (the address peers dial to reach this rank),
``COLLSVC_HOST`` (the host name used to group ranks into nodes), ``COLLSVC_TOKEN_FILE``,
``COLLSVC_TLS_CERT``/``COLLSVC_TLS_KEY``/``COLLSVC_TLS_CA``, ``COLLSVC_HEARTBEAT_INTERVAL``,
``COLLSVC_COORDINATOR_GRACE`` (seconds a member keeps retrying a lost coordinator before failing, default 20),
``COLLSVC_SHM`` (``0`` turns off shared memory between ranks of one host),
``COLLSVC_TCP_LANE`` (``0``: ring frames between ranks go over gRPC calls instead of a plain TCP lane
per peer negotiated over gRPC; without TLS only, see ``client/backends/ring/lane_wire.py``),
``COLLSVC_LANE_PORT`` (the port that lane listens on, default 0 = any free port; the images set 29501),
``COLLSVC_SHM_BARRIERS`` (``auto``, ``memory`` or ``sockets``: how ranks of one host meet, see
:func:`shm_barriers`),
``COLLSVC_HIERARCHICAL`` (``auto``, ``always`` or ``never``: hierarchical all_reduce across hosts),
``COLLSVC_RING_SMALL_BYTES`` (messages up to this size use the latency-friendly algorithms over gRPC;
default: the measured switch point in ``ring/algorithms.py``),
``COLLSVC_ROOTED_AGREEMENT`` (``0``: rooted calls over gRPC skip the signature agreement; a member
that only sends then learns of a mismatch at its next call instead),
``COLLSVC_PEER_PORT`` (the port this rank's peer endpoint binds, default any free port),
``COLLSVC_DUMP_DIR`` (where flight-recorder dumps go, default the temp folder) and ``COLLSVC_DUMP_KEEP``
(how many dumps that folder keeps, newest first, default 32),
``COLLSVC_LEAVE_ON_SIGTERM`` (``1``: SIGTERM leaves the job cleanly before the process dies of it; set by
``collsvc run`` for its ranks),
``COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE`` (``1`` lets object collectives unpickle in a job with neither
token nor TLS; refused by default),
``COLLSVC_FAST_PATH`` (``0``: repeated all_reduce, broadcast, all_gather and reduce_scatter calls and
barriers take the general path, see :func:`fast_path_enabled`),
``COLLSVC_TIMELINE`` (the merged timeline file; each rank writes its part next to it, see
``collsvc/observability/timeline.py``),
``COLLSVC_COORDINATOR_READY_FD`` (set by ``collsvc run``: a pipe that closes once its embedded
coordinator listens, see :func:`coordinator_ready_fd`).
"""

from __future__ import annotations

import math
import os
import shlex
import socket
import stat
import sys
import tempfile
from collections.abc import Mapping
from typing import TYPE_CHECKING

from collsvc.launcher_env import (
    LOCAL_RANK_VARS,
    RANK_VARS,
    WORLD_SIZE_VARS,
    coordinator_from_env,
    int_from,
    operator_launch,
)

if TYPE_CHECKING:  # imported where used: the launcher reads its settings here before numpy is loaded
    from collsvc.options import InitOptions, TlsFiles

COORDINATOR_READY_ENV = "COLLSVC_COORDINATOR_READY_FD"
DEFAULT_DUMP_KEEP = 32  # a few failed jobs' worth of per-rank dumps on one host


# Ranges of the number-of-seconds variables: (least, most) accepted.
HEARTBEAT_INTERVAL_RANGE = (0.01, 60.0)
COORDINATOR_GRACE_RANGE = (0.0, 86400.0)
JOIN_TIMEOUT_RANGE = (0.001, 7 * 86400.0)


def seconds_from(env: Mapping[str, str], name: str, default: float | None, low: float, high: float) -> float | None:
    """The number of seconds ``env[name]`` gives (``default`` when unset or empty).

    Raises:
        ValueError: not a number, or outside ``[low, high]`` (nan and infinity included); the message
            names the variable and the range.
    """
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high:  # also false for nan
        raise ValueError(f"environment variable {name}={raw!r} must be a number of seconds in [{low:g}, {high:g}]")
    return value


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    """A yes/no variable: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (``default`` when unset).

    Raises:
        ValueError: another value (the message names the variable and what it accepts).
    """
    raw = env.get(name, "")
    if raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name}={raw!r} must be 1 or 0 (or true/false, yes/no, on/off)")


def _int_in(env: Mapping[str, str], name: str, low: int, high: int | None = None) -> int | None:
    value = int_from(env, (name,))
    if value is not None and (value < low or (high is not None and value > high)):
        accepted = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"environment variable {name}={value} must be an integer {accepted}")
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    value = env.get(name) or choices[0]
    if value not in choices:
        raise ValueError(f"environment variable {name}={value!r} must be one of {', '.join(choices)}")
    return value


def read_token(token: str | None, env: Mapping[str, str]) -> str | None:
    """The job token: the argument, else ``COLLSVC_TOKEN``, else the file named by ``COLLSVC_TOKEN_FILE``."""
    if token:
        return token
    if env.get("COLLSVC_TOKEN"):
        return env["COLLSVC_TOKEN"]
    path = env.get("COLLSVC_TOKEN_FILE")
    if path:
        with open(path, encoding="utf-8") as handle:
            return handle.read().strip() or None
    return None


def tls_from_env(env: Mapping[str, str]) -> TlsFiles | None:
    """Client TLS files from ``COLLSVC_TLS_CERT``/``_KEY``/``_CA``, or None when unset.

    Raises:
        ValueError: only some of the three are set.
    """
    from collsvc.options import TlsFiles

    names = ("COLLSVC_TLS_CERT", "COLLSVC_TLS_KEY", "COLLSVC_TLS_CA")
    values = [env.get(n, "") for n in names]
    if not any(values):
        return None
    if not all(values):
        raise ValueError(f"set all of {', '.join(names)} for TLS, or none")
    return TlsFiles(cert=values[0], key=values[1], ca=values[2])


def _script_name() -> str:
    """How the user started this process, for a command line they can copy (``script.py`` or ``-m pkg``)."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if argv0 in ("", "-c", "-"):
        return "script.py"
    if argv0.endswith("__main__.py") and os.path.basename(os.path.dirname(argv0)):
        return f"-m {os.path.basename(os.path.dirname(argv0))}"
    return shlex.quote(os.path.relpath(argv0) if os.path.isabs(argv0) and _is_below_cwd(argv0) else argv0)


def _is_below_cwd(path: str) -> bool:
    try:
        return os.path.commonpath([os.getcwd(), path]) == os.getcwd()
    except ValueError:  # different drives
        return False


def flight_recorder_dir(env: Mapping[str, str] | None = None) -> str:
    """Where flight-recorder dumps go: ``COLLSVC_DUMP_DIR``, else the system temp folder."""
    env = os.environ if env is None else env
    return env.get("COLLSVC_DUMP_DIR") or tempfile.gettempdir()


def flight_recorder_keep(env: Mapping[str, str] | None = None) -> int:
    """How many flight-recorder dumps a dump folder keeps (newest first): ``COLLSVC_DUMP_KEEP``, default 32.

    Raises:
        ValueError: the variable is not a positive integer.
    """
    env = os.environ if env is None else env
    keep = int_from(env, ("COLLSVC_DUMP_KEEP",))
    if keep is None:
        return DEFAULT_DUMP_KEEP
    if keep < 1:
        raise ValueError(f"environment variable COLLSVC_DUMP_KEEP={keep} must be at least 1")
    return keep


def host_name(env: Mapping[str, str] | None = None) -> str:
    """The host name that groups ranks into nodes: ``COLLSVC_HOST``, else this machine's name."""
    env = os.environ if env is None else env
    return env.get("COLLSVC_HOST") or socket.gethostname()


def leave_on_sigterm(env: Mapping[str, str] | None = None) -> bool:
    """Whether SIGTERM should leave the job before the process dies (``COLLSVC_LEAVE_ON_SIGTERM=1``;
    ``collsvc run`` sets it for its ranks, which it stops with SIGTERM)."""
    env = os.environ if env is None else env
    return _flag(env, "COLLSVC_LEAVE_ON_SIGTERM", False)


def resolve_init(
    coordinator: str | None,
    world_size: int | None,
    rank: int | None,
    backend: str,
    timeout: float,
    token: str | None,
    job_id: str | None,
    env: Mapping[str, str] | None = None,
) -> InitOptions:
    """Merges ``collsvc.init`` arguments with the environment (arguments win).

    Raises:
        ValueError: no coordinator or world size can be found (the message names the variables to set),
            a variable is not an integer, or a value is out of range (the message names the variable
            and the range: ``COLLSVC_HEARTBEAT_INTERVAL`` in [0.01, 60] seconds,
            ``COLLSVC_COORDINATOR_GRACE`` in [0, 86400], ``COLLSVC_JOIN_TIMEOUT`` in (0, 604800],
            ``COLLSVC_PEER_PORT`` in [0, 65535]; yes/no variables take 1/0, true/false, yes/no, on/off).
    """
    from collsvc.options import InitOptions

    env = os.environ if env is None else env
    operator_coordinator, operator_world, operator_rank = operator_launch(env)
    coordinator = coordinator or coordinator_from_env(env) or operator_coordinator
    if not coordinator:
        raise ValueError(
            "no coordinator given: pass coordinator='host:port' or set COLLSVC_COORDINATOR "
            f"(or MASTER_ADDR and MASTER_PORT). To run this script on N local ranks, start it with "
            f"`collsvc run -n N {_script_name()}`"
        )
    if world_size is None:
        world_size = int_from(env, WORLD_SIZE_VARS)
    if world_size is None:
        world_size = operator_world
    if world_size is None:
        raise ValueError(f"no world size given: pass world_size= or set one of {', '.join(WORLD_SIZE_VARS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if rank is None:
        rank = int_from(env, RANK_VARS[:-1])  # all but JOB_COMPLETION_INDEX, which comes after the operators
    if rank is None:
        # An operator's pod index is not the rank when its pods run several processes each.
        rank = operator_rank if operator_world is not None else int_from(env, ("JOB_COMPLETION_INDEX",))
    if rank is not None and not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if backend not in ("auto", "nccl", "ring"):
        raise ValueError(f"backend must be 'auto', 'nccl' or 'ring', got {backend!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    heartbeat = seconds_from(env, "COLLSVC_HEARTBEAT_INTERVAL", 1.0, *HEARTBEAT_INTERVAL_RANGE)
    grace = seconds_from(env, "COLLSVC_COORDINATOR_GRACE", 20.0, *COORDINATOR_GRACE_RANGE)
    join_timeout = seconds_from(env, "COLLSVC_JOIN_TIMEOUT", None, *JOIN_TIMEOUT_RANGE)
    assert heartbeat is not None and grace is not None  # they have defaults
    return InitOptions(
        coordinator=coordinator,
        world_size=world_size,
        rank=rank,
        local_rank_hint=int_from(env, LOCAL_RANK_VARS),
        backend=backend,
        timeout=float(timeout),
        token=read_token(token, env),
        job_id=job_id or env.get("COLLSVC_JOB_ID") or "default",
        host=host_name(env),
        advertise_address=env.get("COLLSVC_ADVERTISE_ADDRESS") or None,
        tls=tls_from_env(env),
        heartbeat_interval=heartbeat,
        allow_pickle=_flag(env, "COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE", False),
        peer_port=_int_in(env, "COLLSVC_PEER_PORT", 0, 65535) or 0,
        coordinator_grace=grace,
        shared_memory=_flag(env, "COLLSVC_SHM", True),
        tcp_lane=_flag(env, "COLLSVC_TCP_LANE", True),
        lane_port=_int_in(env, "COLLSVC_LANE_PORT", 0, 65535) or 0,
        small_bytes=_int_in(env, "COLLSVC_RING_SMALL_BYTES", 0),
        rooted_agreement=_flag(env, "COLLSVC_ROOTED_AGREEMENT", True),
        hierarchical=_choice(env, "COLLSVC_HIERARCHICAL", ("auto", "always", "never")),
        join_timeout=join_timeout,
    )


def thread_defaults(env: Mapping[str, str], local_ranks: int) -> dict[str, str]:
    """Thread-pool sizes for ``local_ranks`` ranks sharing this host's cores, where ``env`` sets none.

    Every numpy import starts an OpenBLAS thread per core and torch an OpenMP thread per core; N
    ranks on one host would then run N times as many threads as there are cores, which slows their
    start (numpy's pool alone costs ~90 ms of CPU per rank) and their math. Like torchrun, a launcher
    of several local ranks sets ``OMP_NUM_THREADS`` unless the user did: to the cores this process
    may run on divided among the ranks (at least 1). OpenBLAS reads ``OMP_NUM_THREADS`` too, unless
    ``OPENBLAS_NUM_THREADS`` is set.

    Args:
        env: the environment the ranks inherit.
        local_ranks: how many ranks the launcher starts on this host.

    Returns:
        The variables to add (empty for a single rank, or when ``OMP_NUM_THREADS`` is set).
    """
    if local_ranks <= 1 or env.get("OMP_NUM_THREADS"):
        return {}
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return {"OMP_NUM_THREADS": str(max(1, cores // local_ranks))}


def coordinator_ready_fd(env: Mapping[str, str] | None = None) -> int | None:
    """The pipe ``collsvc run`` closes once its embedded coordinator listens, or None.

    ``collsvc run`` starts its ranks while its coordinator starts, and passes each the read end of a
    pipe, named ``FD:INODE`` in ``COLLSVC_COORDINATOR_READY_FD``. None when the variable is unset, or
    when that descriptor is no longer that pipe: already used by an earlier ``init``, or not inherited
    by a child process (the inode tells a reused descriptor number apart).
    """
    env = os.environ if env is None else env
    fd_text, _, inode_text = env.get(COORDINATOR_READY_ENV, "").partition(":")
    try:
        fd, inode = int(fd_text), int(inode_text)
        found = os.fstat(fd)
    except (ValueError, OSError):
        return None
    return fd if stat.S_ISFIFO(found.st_mode) and found.st_ino == inode else None


def timeline_target(env: Mapping[str, str] | None = None) -> str | None:
    """The merged timeline file ``COLLSVC_TIMELINE`` names, or None when no timeline is wanted."""
    env = os.environ if env is None else env
    return env.get("COLLSVC_TIMELINE") or None


def shm_spin_seconds(env: Mapping[str, str] | None = None) -> float | None:
    """``COLLSVC_SHM_SPIN_US``: microseconds a shared-memory wait polls before it sleeps, as seconds;
    None when unset (the shared-memory groups then choose from the cores, see ``shm/spin.py``).

    Raises:
        ValueError: the variable is not a non-negative number.
    """
    env = os.environ if env is None else env
    raw = env.get("COLLSVC_SHM_SPIN_US")
    if not raw:
        return None
    try:
        micros = float(raw)
    except ValueError:
        micros = -1.0
    if not micros >= 0:
        raise ValueError(f"environment variable COLLSVC_SHM_SPIN_US={raw!r} must be a number of microseconds >= 0")
    return micros / 1e6


SHM_BARRIER_KINDS = ("auto", "memory", "sockets")


def fast_path_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``COLLSVC_FAST_PATH``: whether repeated synchronous all_reduce, broadcast, all_gather and
    reduce_scatter calls of numpy arrays, and barriers, on one host skip the general layers
    (``client/fast_path.py``);
    ``0`` turns it off, to compare or to rule it out."""
    return _flag(os.environ if env is None else env, "COLLSVC_FAST_PATH", True)


def debug_enabled(env: Mapping[str, str] | None = None) -> bool:
    """``COLLSVC_DEBUG=1``: full tracebacks through collsvc's own frames, and internal faults' full
    records in their messages."""
    return (os.environ if env is None else env).get("COLLSVC_DEBUG", "") not in ("", "0")


def shm_barriers(env: Mapping[str, str] | None = None) -> str:
    """``COLLSVC_SHM_BARRIERS``: how the ranks of one host meet in their shared-memory steps.

    ``memory``: through words in the shared segments (x86-64 only); ``sockets``: through datagrams;
    ``auto`` (the default): memory where the CPU supports it. Every rank of a host must agree.

    Raises:
        ValueError: another value.
    """
    return _choice(os.environ if env is None else env, "COLLSVC_SHM_BARRIERS", SHM_BARRIER_KINDS)


def nccl_blocking_wait(env: Mapping[str, str] | None = None) -> bool:
    """Whether a GPU collective on NCCL waits on the host until the GPU finished it
    (``COLLSVC_NCCL_BLOCKING_WAIT=1``, like torch's ``TORCH_NCCL_BLOCKING_WAIT``); by default it returns
    once enqueued and a watchdog thread watches completion and the deadline (docs/gpu.md)."""
    return (os.environ if env is None else env).get("COLLSVC_NCCL_BLOCKING_WAIT", "") not in ("", "0")


DEFAULT_ELASTIC_REFORM_TIMEOUT = 10.0


def elastic_reform_timeout(env: Mapping[str, str] | None = None) -> float:
    """``COLLSVC_ELASTIC_TIMEOUT``: seconds one re-form of an elastic job may take (default 10).

    Raises:
        ValueError: not a number of seconds in [0.1, 86400]; the message names the variable.
    """
    seconds = seconds_from(os.environ if env is None else env, "COLLSVC_ELASTIC_TIMEOUT", None, 0.1, 86400.0)
    return DEFAULT_ELASTIC_REFORM_TIMEOUT if seconds is None else seconds
