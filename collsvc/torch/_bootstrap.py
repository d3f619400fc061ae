"""How a torch process group finds its collsvc job.

- Under ``collsvc run`` (``COLLSVC_COORDINATOR`` set, no ``MASTER_ADDR``): torch's ``env://``
  rendezvous joins the collsvc job and hands torch a key/value store kept by the coordinator, so
  ``dist.init_process_group("collsvc")`` needs nothing else.
- Under torchrun, ``env://``, ``tcp://`` or ``file://``: the world group's rank 0 starts an embedded
  coordinator (loopback when every rank is on its host, else all interfaces) with a fresh token and
  job id, and publishes them through the store torch hands the backend; every rank then joins it.
  The keys are named after the bootstrap (:func:`_bootstrap_prefix`): torchrun keeps its store across
  restarts, and a rank of a restarted attempt must not join the coordinator of the attempt before.
- A process that called ``collsvc.init`` itself keeps that communicator, if its rank and size agree.

Sub-groups (``new_group``, ``new_subgroups``, DeviceMesh) are sub-communicators of the world's job,
named after torch's group name, which every member computes the same way.
"""

from __future__ import annotations

import datetime
import hashlib
import importlib
import json
import logging
import os
import secrets
import socket
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch._C._distributed_c10d as c10d
import torch.distributed as dist

import collsvc
from collsvc.errors import CollsvcError, RankFailedError, RendezvousError
from collsvc.torch._errors import to_torch_error
from collsvc.torch._process_group import ProcessGroupCollsvc

if TYPE_CHECKING:  # imported by collsvc itself at run time, in its own order
    from collsvc.client.communicator import Communicator

log = logging.getLogger(__name__)

_KEY = "collsvc.torch/"
_bootstraps = 0  # store bootstraps of a world group in this process so far
_LEAVE_WAIT = datetime.timedelta(seconds=10)  # how long rank 0 keeps the embedded coordinator for the others


_Store: Any = c10d.Store  # subclassed through Any, as torch's own Python stores are

# torch keeps only the C++ half of a Python store (inside its PrefixStores); once the Python object is
# gone, every call from C++ (gloo's rendezvous, say) fails. Each store lives as long as its job.
_stores_in_use: weakref.WeakKeyDictionary[Communicator, CoordinatorStore] = weakref.WeakKeyDictionary()


def _under_collsvc_launcher() -> bool:
    # Reads the environment itself: which launcher's variables are set tells collsvc run from torchrun.
    return bool(os.environ.get("COLLSVC_COORDINATOR")) and not os.environ.get("MASTER_ADDR")


class CoordinatorStore(_Store):  # type: ignore[misc]
    """torch's key/value store interface over the collsvc coordinator's key/value service.

    Args:
        comm: a Communicator of the job whose keys this store holds.
        timeout: how long ``get`` and ``wait`` wait for a key by default.
    """

    def __init__(self, comm: Communicator, timeout: datetime.timedelta) -> None:
        super().__init__()
        self._client = comm.job.store
        self._wait = timeout

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._wait = timeout

    def _key(self, key: str) -> str:
        return _KEY + key

    def set(self, key: str, value: Any) -> None:
        self._client.set(self._key(key), value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        return bytes(self._client.get(self._key(key), self._wait.total_seconds()))

    def add(self, key: str, value: int) -> int:
        return int(self._client.add(self._key(key), value))

    def check(self, keys: list[str]) -> bool:
        try:
            for key in keys:
                self._client.get(self._key(key), 0.001)
        except CollsvcError:
            return False
        return True

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (timeout or self._wait).total_seconds()
        for key in keys:
            self._client.get(self._key(key), limit)


def _wrap_env_handler(original: Callable[..., Iterator[Any]]) -> Callable[..., Iterator[Any]]:
    def env_or_collsvc(url: str, timeout: datetime.timedelta = dist.constants.default_pg_timeout, **kwargs: Any) -> Any:
        if not _under_collsvc_launcher():
            yield from original(url, timeout=timeout, **kwargs)
            return
        try:
            comm = collsvc.init(timeout=timeout.total_seconds())
        except CollsvcError as exc:
            raise to_torch_error(exc) from exc
        store = CoordinatorStore(comm, timeout)
        _stores_in_use[comm] = store
        yield store, comm.rank, comm.size
        raise RuntimeError("collsvc: env:// rendezvous under collsvc run cannot re-rendezvous")

    env_or_collsvc.__collsvc__ = True  # type: ignore[attr-defined]
    return env_or_collsvc


def install_rendezvous() -> None:
    """Makes torch's ``env://`` rendezvous join the collsvc job under ``collsvc run`` (idempotent)."""
    # torch.distributed.rendezvous is shadowed by the function of that name; take the module itself.
    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    current = handlers["env"]
    if not getattr(current, "__collsvc__", False):
        handlers["env"] = _wrap_env_handler(current)


def _bootstrap_prefix() -> str:
    """The prefix of this store bootstrap's keys, the same on every rank of one world: torchrun's restart
    count (``TORCHELASTIC_RESTART_COUNT``), then how many world groups this process bootstrapped before
    (ranks create and destroy their world groups in step, as torch requires).

    torchrun's store outlives a restart: under one fixed key, a rank of the restarted attempt read the
    coordinator address of the attempt before (whose rank 0 had died with it), and the job failed to
    form ("only 1 of 2 members joined").
    """
    global _bootstraps
    _bootstraps += 1
    return f"{_KEY}{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{_bootstraps}/"


def _get(store: Any, key: str, keys: str, size: int) -> bytes:
    """``store.get(key)``; when it times out, a :class:`RendezvousError` naming the ranks that never
    reached the bootstrap (their host key is missing; rank 0 waits for all of them before it publishes
    the coordinator), rather than torch's "Timeout waiting for key: default_pg/0//cpu//...".

    Raises:
        RendezvousError: the wait timed out.
    """
    try:
        return bytes(store.get(key))
    except Exception as exc:  # noqa: BLE001 - torch's store raises plain errors (DistStoreError, RuntimeError)
        if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
            raise
        try:
            missing = [r for r in range(size) if not store.check([f"{keys}host/{r}"])]
        except Exception:  # noqa: BLE001 - the store itself may be gone; say what is known
            missing = []
        who = f"ranks {missing} of {size} never reached it" if missing else f"rank 0 never published {key!r}"
        raise RendezvousError(
            f"init_process_group: timed out waiting in torch's store for the collsvc bootstrap: {who} "
            f"(store error: {exc})"
        ) from exc


def _publish_coordinator(store: Any, keys: str, size: int) -> tuple[dict[str, str], Any]:
    """Rank 0: starts the embedded coordinator and returns what the others need to join it."""
    from collsvc.options import CoordinatorOptions
    from collsvc.server.app import CoordinatorThread

    me = socket.gethostname()
    hosts = {_get(store, f"{keys}host/{r}", keys, size).decode() for r in range(size)}
    one_host = hosts == {me}
    token = secrets.token_urlsafe(32)
    server = CoordinatorThread(CoordinatorOptions(host="127.0.0.1" if one_host else "0.0.0.0", port=0, token=token))
    port = server.start()
    reach = "127.0.0.1" if one_host else (os.environ.get("MASTER_ADDR") or socket.getfqdn())
    info = {"address": f"{reach}:{port}", "token": token, "job": f"torch-{secrets.token_hex(8)}"}
    log.info("collsvc.torch: embedded coordinator on %s for %d ranks (job %s)", info["address"], size, info["job"])
    return info, server


class CoordinatorHostWatch:
    """On the other ranks of a store bootstrap: names rank 0 as failed as soon as the coordinator it
    hosted is gone.

    The embedded coordinator lives in rank 0's process and dies with it; it can never come back, so
    the grace period in which members wait for a restarting coordinator only delays the news (20 s of
    "lost the coordinator", then a ``RendezvousError`` that names no rank). Once this member's
    heartbeat stream broke, the coordinator's port is tried: a refused connection means nothing
    listens there any more, i.e. rank 0's process is gone (or closed the coordinator on its way out),
    and the job fails with a :class:`RankFailedError` naming rank 0. A port that does not answer at
    all (a host that vanished, a path that drops packets) leaves the grace period to decide.
    """

    # How often the link is looked at while it is up (a flag read), and the bound on one probe.
    POLL_S = 0.1
    PROBE_S = 1.0

    def __init__(self, comm: Communicator, address: str) -> None:
        self._job = comm.job
        host, _, port = address.rpartition(":")
        self._target = (host.strip("[]"), int(port))
        self._address = address
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"collsvc-torch-rank0-{comm.rank}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _gone(self) -> bool:
        """Whether nothing listens on the coordinator's port any more (refused; unreachable is not gone)."""
        try:
            with socket.create_connection(self._target, timeout=self.PROBE_S):
                return False
        except ConnectionRefusedError:
            return True
        except OSError:
            return False

    def _run(self) -> None:
        job = self._job
        while not self._stop.wait(self.POLL_S):
            if job.failure is not None or job.closed:
                return
            if not job.coordinator_lost or not self._gone():
                continue
            host = job.hosts.get(0, "")
            error = RankFailedError(
                f"rank 0 ({host}) failed: its process, which hosted this job's coordinator, is gone "
                f"(nothing listens at {self._address} any more)",
                [0],
                [host],
            )
            log.error("collsvc.torch: %s", error)
            job.fail(error)
            return


class WorldSession:
    """The collsvc side of torch's default process group: its communicator and, on rank 0 of a
    store bootstrap, the embedded coordinator."""

    def __init__(
        self,
        comm: Communicator,
        store: Any,
        server: Any,
        keys: str = _KEY,
        host_watch: CoordinatorHostWatch | None = None,
    ) -> None:
        self.comm = comm
        self._store = store
        self._server = server
        self._keys = keys  # the prefix of this bootstrap's keys in ``store``
        self._host_watch = host_watch  # on the other ranks of a store bootstrap: rank 0's death, at once

    @classmethod
    def join(cls, store: Any, rank: int, size: int, timeout: float) -> WorldSession:
        """Joins (or reuses) the collsvc job of this torch world.

        Raises:
            RendezvousError: an existing collsvc communicator disagrees with torch's rank or size, or
                joining failed (also a ``DistBackendError``).
        """
        if collsvc.is_initialized():
            comm = collsvc.default_communicator()
            if (comm.rank, comm.size) != (rank, size):
                raise RendezvousError(
                    f"collsvc is initialized as rank {comm.rank} of {comm.size}, but torch.distributed "
                    f"asks for rank {rank} of {size}"
                )
            return cls(comm, store, None)
        if os.environ.get("COLLSVC_COORDINATOR"):  # reads the environment itself: only whether; init reads it
            return cls(collsvc.init(world_size=size, rank=rank, timeout=timeout), store, None)
        keys = _bootstrap_prefix()
        store.set(f"{keys}host/{rank}", socket.gethostname())
        server = None
        if rank == 0:
            info, server = _publish_coordinator(store, keys, size)
            store.set(f"{keys}coordinator", json.dumps(info))
        else:
            info = json.loads(_get(store, f"{keys}coordinator", keys, size))
        try:
            comm = collsvc.init(
                coordinator=info["address"],
                world_size=size,
                rank=rank,
                timeout=timeout,
                token=info["token"],
                job_id=info["job"],
            )
        except BaseException:
            if server is not None:
                server.stop()
            raise
        watch = CoordinatorHostWatch(comm, info["address"]) if server is None else None
        return cls(comm, store, server, keys, watch)

    def _healthy(self) -> bool:
        """Whether the job had no failure (after one, nobody needs the coordinator any longer)."""
        try:
            self.comm.job.check()
        except CollsvcError:
            return False
        return True

    def close(self) -> None:
        """Leaves the job; rank 0 of a store bootstrap then stops the coordinator once the others left
        (or after a short bound)."""
        if self._host_watch is not None:
            self._host_watch.stop()
        if collsvc.is_initialized() and collsvc.default_communicator() is self.comm:
            collsvc.destroy()
        else:
            self.comm.close()
        try:
            self._store.set(f"{self._keys}left/{self.comm.rank}", "1")
            if self._server is not None and self._healthy():
                gone = self.comm.job.departed  # ranks that left need not confirm
                others = [f"{self._keys}left/{r}" for r in range(1, self.comm.size) if r not in gone]
                self._store.wait(others, _LEAVE_WAIT)
        except Exception as exc:  # noqa: BLE001 - leaving is best effort; the others may be gone already
            log.info("collsvc.torch: not every rank confirmed leaving: %s", exc)
        finally:
            if self._server is not None:
                self._server.stop()


def subgroup_name(group_id: str, ranks: list[int]) -> str:
    """The collsvc group of torch's group ``group_id`` over global ``ranks``: torch numbers groups per
    rank, so two disjoint groups made inside different parent groups (``new_subgroups(group=...)``)
    can get the same number; the digest of the ranks tells them apart, and every member computes the
    same name."""
    digest = hashlib.blake2b(",".join(map(str, ranks)).encode(), digest_size=6).hexdigest()
    return f"torch/{group_id}/{digest}"


def create_process_group(options: Any, backend_options: Any) -> ProcessGroupCollsvc:
    """torch's backend factory (``register_backend(..., extended_api=True)``).

    Args:
        options: torch's ``_DistributedBackendOptions`` (store, group_rank, group_size, timeout,
            group_id, global_ranks_in_group).
        backend_options: unused; collsvc takes its settings from ``COLLSVC_*``.

    Raises:
        CollsvcError: joining the job failed (also a ``DistBackendError``).
    """
    timeout = options.timeout.total_seconds()
    ranks = list(options.global_ranks_in_group)
    try:
        if not ranks:
            session = WorldSession.join(options.store, options.group_rank, options.group_size, timeout)
            return ProcessGroupCollsvc(session.comm, timeout, on_shutdown=session.close)
        world = collsvc.default_communicator()
        comm = world.subgroup(subgroup_name(options.group_id, ranks), ranks)
    except CollsvcError as exc:
        raise to_torch_error(exc) from exc
    return ProcessGroupCollsvc(comm, timeout)
