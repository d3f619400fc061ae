"""The ring backend: host (numpy) arrays, shared memory within a host, gRPC frames between hosts.

Which path a call takes depends only on the group's topology (identical on every member), so every
member of a call takes the same one:

- one host, shared memory available: ``LocalGroup`` collectives (all_reduce, reduce, broadcast,
  all_gather, reduce_scatter);
- several hosts with several members on some host: hierarchical all_reduce, by slices where every
  host holds as many members (each local rank all-reduces its slice with the other hosts), else
  through one leader per host (local reduce, leaders' all_reduce over gRPC, local broadcast);
- everything else: the algorithms in ``algorithms.py`` over gRPC channels.

all_reduce and reduce_scatter calls with ``compression`` compress the frames that cross hosts
(``compressed.py``): the cross-host exchanges of a hierarchical all_reduce, every frame of a flat group
over several hosts. On one host they run exactly as without it.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from collsvc.client.backends.base import Backend, Call, CallHooks, Channel, GroupSpec, PreparedCall, Signature
from collsvc.client.backends.reduction import finish_average, reduced_as
from collsvc.client.backends.ring import algorithms, compressed
from collsvc.client.backends.ring.agreement import agree
from collsvc.client.backends.ring.compression import codec
from collsvc.client.backends.ring.global_ranks import in_global_ranks
from collsvc.client.backends.ring.host_barrier import pass_for_host
from collsvc.client.backends.ring.topology import Topology, plan
from collsvc.client.backends.shm.group import LocalGroup
from collsvc.client.backends.shm.groups import CallWatch, LocalGroups
from collsvc.client.backends.shm.repeated import prepare_repeated
from collsvc.errors import CollectiveMismatchError, CollectiveTimeoutError, CollsvcError
from collsvc.types import ReduceOp

# Chunk of the hierarchical all_reduce pipeline: big enough that per-chunk overheads stay small,
# small enough that the cross-host transfer of one chunk overlaps the host-local work on the next.
PIPELINE_CHUNK_BYTES = 4 << 20
# Above this, a hierarchical all_reduce over hosts that hold as many members each goes by slices
# (``_sliced_all_reduce``); at or below it, through the hosts' leaders.
SLICED_ABOVE_BYTES = 64 << 10


class RingBackend:
    """Implements :class:`~collsvc.client.backends.base.Backend` for numpy arrays.

    Args:
        channel_for: maps a call to a gRPC channel (or the in-memory twin's, in tests).
        hosts: global rank -> host name; None treats every member as remote (flat algorithms only).
        local_groups: shared-memory groups for same-host members; None disables shared memory.
        hierarchical: "auto" (when it pays), "always" (whenever several hosts) or "never".
    """

    name = "ring"

    def __init__(
        self,
        channel_for: Callable[[Call], Channel],
        *,
        hosts: Mapping[int, str] | None = None,
        local_groups: LocalGroups | None = None,
        hierarchical: str = "auto",
        small_bytes: int | None = None,
        rooted_agreement: bool = True,
    ) -> None:
        self._channel_for = channel_for
        self._small = {} if small_bytes is None else {"small_bytes": small_bytes}
        self._rooted_agreement = rooted_agreement
        self._hosts = dict(hosts) if hosts is not None else None
        self._local_groups = local_groups
        self._hierarchical = hierarchical
        self._plans: dict[tuple[tuple[int, ...], int], Topology] = {}
        self._pipelines: dict[str, ThreadPoolExecutor] = {}  # stream -> its cross-host worker
        self._pipelines_lock = threading.Lock()

    # ---- path selection ------------------------------------------------------------------------------
    def _topology(self, group: GroupSpec) -> Topology | None:
        if self._hosts is None:
            return None
        key = (group.ranks, group.index)
        topo = self._plans.get(key)
        if topo is None:
            topo = self._plans[key] = plan(group, self._hosts)
        return topo

    def _local_ranks(self, call: Call) -> tuple[int, ...]:
        topo = self._topology(call.group)
        return topo.local if topo is not None else call.group.ranks

    def _shared(self, call: Call, topo: Topology | None) -> Any:
        """The LocalGroup for a call whose whole group is on this host (``topo``: its topology), else None."""
        if topo is None or self._local_groups is None or not topo.single_host or call.group.size == 1:
            return None
        return self._joined(call, call, topo)

    def _joined(self, call: Call, local_call: Call, topo: Topology) -> LocalGroup:
        """The LocalGroup of ``topo``'s members on this host, for ``local_call`` (``call`` itself, or its
        part on this host); made (joined by every local member) on first use.

        Raises:
            CollectiveTimeoutError: a local member did not join in time (``waiting_on``: global ranks).
        """
        assert self._local_groups is not None
        try:
            return self._local_groups.get(local_call, topo.local, topo.local_index)
        except CollectiveTimeoutError as exc:
            raise in_global_ranks(call, topo.local, exc) from exc

    def _local(self, call: Call, local: tuple[int, ...], body: Callable[[], None]) -> None:
        """Runs a shared-memory step, naming mismatches (with this rank's full call) and late ranks by
        global rank."""
        try:
            body()
        except (CollectiveMismatchError, CollectiveTimeoutError) as exc:
            raise in_global_ranks(call, local, exc) from exc

    def _run_rooted(self, call: Call, body: Callable[[Channel], Any]) -> None:
        """A rooted call over gRPC: members first agree on the call, then run ``body``.

        In rooted algorithms some members never receive anything that depends on a given member (a
        broadcast root, a leaf fed by an agreeing parent), so the per-frame signature check alone would
        let them finish a mismatched call. One all_gather of every member's signature (256 bytes each)
        makes every member raise at the call, naming every member's call. Rooted calls only: in
        all_reduce, all_gather and friends every member depends on every other, at no extra cost.
        The agreement costs one small all_gather (measured: 4 KiB broadcast over gRPC at 3 ranks
        2.2-3.3 ms -> 8.8 ms); ``rooted_agreement=False`` (``COLLSVC_ROOTED_AGREEMENT=0``) skips it.
        """

        def agreed(ch: Channel) -> None:
            agree(ch, call)
            body(ch)

        self._run(call, agreed if self._rooted_agreement else body)

    def _run(self, call: Call, body: Callable[[Channel], Any]) -> None:
        channel = self._channel_for(call)
        try:
            body(channel)
            channel.flush()
        finally:
            channel.close()

    @staticmethod
    def _sub_call(call: Call, suffix: str, ranks: tuple[int, ...], me: int) -> Call:
        spec = GroupSpec(f"{call.group.name}{suffix}", ranks, ranks.index(me))
        return dataclasses.replace(
            call, group=spec, key=f"{call.key}{suffix}", stream=call.progress_stream, members=call.all_members
        )

    # ---- collectives ---------------------------------------------------------------------------------
    def all_reduce(self, call: Call, buf: np.ndarray, op: ReduceOp) -> None:
        inner = reduced_as(op)
        topo = self._topology(call.group)
        shared = self._shared(call, topo)
        wire = self._wire(call, topo, op)
        if shared is not None:
            try:
                shared.all_reduce(buf, inner, call.deadline, digest=call.signature.digest)
            except (CollectiveMismatchError, CollectiveTimeoutError) as exc:
                raise in_global_ranks(call, self._local_ranks(call), exc) from exc
        elif topo is not None and self._use_hierarchy(topo):
            self._hierarchical_all_reduce(call, buf, inner, topo, wire)
        elif wire is not None:
            self._run(call, lambda ch: compressed.all_reduce(ch, buf, wire))
        else:
            self._run(call, lambda ch: algorithms.all_reduce(ch, buf, inner, **self._small))
        if op is ReduceOp.AVG and wire is None:  # a compressed wire averages by itself
            finish_average(buf, call.group.size)

    @staticmethod
    def _wire(call: Call, topo: Topology | None, op: ReduceOp) -> compressed.Wire | None:
        """How the call's cross-host frames are compressed: None without ``compression`` or on one host."""
        name = call.signature.compression
        if not name or (topo is not None and topo.single_host):
            return None
        return compressed.Wire(codec(name), call.group.size, op is ReduceOp.AVG)

    def existing_shared(self, group: GroupSpec, key: str) -> tuple[LocalGroup, CallWatch, tuple[int, ...]] | None:
        """The shared-memory group an earlier call of stream ``key`` of ``group`` made, with its watch and
        the global ranks of its members, when the whole group is on this host (what this backend's
        collectives would run on): :meth:`prepare` prepares repeated calls there. Else None."""
        topo = self._topology(group)
        if topo is None or self._local_groups is None or not topo.single_host or group.size == 1:
            return None
        found = self._local_groups.existing(key, topo.local)
        return None if found is None else (found[0], found[1], topo.local)

    def prepare(
        self, kind: str, signature: Signature, group: GroupSpec, hooks: CallHooks, like: Any = None
    ) -> PreparedCall | None:
        """Repeated calls of a group all on this host, on the shared-memory group an earlier call of its
        stream made (``shm/repeated.py``: the same steps and descriptors as this backend's collectives,
        so ranks may mix the two roads); None for a group across hosts, or before its shared-memory group
        exists, or once the group failed (its calls then take the general path, which raises that)."""
        try:
            found = self.existing_shared(group, hooks.stream)
            if found is None:
                return None
            return prepare_repeated(kind, signature, group, hooks, found, like)
        except CollsvcError:
            return None

    def _use_hierarchy(self, topo: Topology) -> bool:
        if self._hierarchical == "never" or topo.hosts < 2:
            return False
        return self._hierarchical == "always" or topo.hierarchical_pays

    def _hierarchical_all_reduce(
        self, call: Call, buf: np.ndarray, op: ReduceOp, topo: Topology, wire: compressed.Wire | None
    ) -> None:
        """Local reduce -> leaders' all_reduce across hosts (over ``wire`` when compressed) -> local
        broadcast, pipelined by chunk.

        For each chunk k, in the same order on every member of a host: reduce chunk k to the host
        leader, then broadcast chunk k-1 once its cross-host all_reduce finished. The leader runs the
        cross-host all_reduce of chunk k on a worker thread meanwhile, so the slow link stays busy while
        the host reduces and broadcasts neighbouring chunks.
        """
        me = call.group.ranks[call.group.index]
        shared = None
        if self._local_groups is not None and len(topo.local) > 1:
            shared = self._joined(call, self._sub_call(call, "/host", topo.local, me), topo)
            if topo.counterparts is not None and buf.nbytes > SLICED_ABOVE_BYTES:
                self._sliced_all_reduce(call, buf, op, topo, wire, shared)
                return
        step = max(1, PIPELINE_CHUNK_BYTES // max(buf.itemsize, 1))
        bounds = [(lo, min(lo + step, buf.size)) for lo in range(0, buf.size, step)] or [(0, 0)]
        crossing: list[Future[None]] = []
        # Whether the last local step of each kind outlasted the group's polling budget. A member waits
        # there for its leader's cross-host exchange of the piece before (milliseconds for megabytes):
        # polling that long takes the core from the ranks that do the work when cores are shared (two
        # ranks per host, 64 MiB: 40 ms of CPU per call on each member instead of 25). So the next
        # step of that kind sleeps at once; one that ends within the budget polls again.
        outlasted = {"reduce": False, "broadcast": False}

        def local(kind: str, k: int) -> None:
            lo, hi = bounds[k]
            part = buf[lo:hi]
            if len(topo.local) == 1:
                return
            if shared is not None:
                group, digest = shared, call.signature.digest
                spin = 0.0 if outlasted[kind] else None
                started = time.monotonic()
                if kind == "reduce":
                    run = functools.partial(group.reduce, part, op, 0, call.deadline, digest=digest, spin=spin)
                else:
                    run = functools.partial(group.broadcast, part, 0, call.deadline, digest=digest, spin=spin)
                self._local(call, topo.local, run)
                outlasted[kind] = time.monotonic() - started > group.spin_seconds
                return
            sub = self._sub_call(call, f"/host/{k}", topo.local, me)
            if kind == "reduce":
                self._run(sub, lambda ch: algorithms.reduce(ch, part, op, 0, **self._small))
            else:
                self._run(sub, lambda ch: algorithms.broadcast(ch, part, 0, **self._small))

        def cross(k: int) -> None:
            lo, hi = bounds[k]
            part = buf[lo:hi]
            sub = self._sub_call(call, f"/leaders/{k}", topo.leaders, me)
            if wire is not None:
                self._run(sub, lambda ch: compressed.all_reduce(ch, part, wire))
            else:
                self._run(sub, lambda ch: algorithms.all_reduce(ch, part, op, **self._small))

        def finish(k: int) -> None:
            if topo.leader_index is not None:
                crossing[k].result()
            local("broadcast", k)

        for k in range(len(bounds)):
            local("reduce", k)
            if topo.leader_index is not None:
                crossing.append(self._pipeline(call).submit(cross, k))
            if k >= 1:
                finish(k - 1)
        finish(len(bounds) - 1)

    def _sliced_all_reduce(
        self,
        call: Call,
        buf: np.ndarray,
        op: ReduceOp,
        topo: Topology,
        wire: compressed.Wire | None,
        shared: LocalGroup,
    ) -> None:
        """The hierarchical all_reduce where every host holds as many members (Horovod's hierarchical
        allreduce): the host's shared-memory all_reduce, in which each local rank, once it reduced its
        slice of a chunk, all-reduces that slice with the members of the same local index on the other
        hosts (``topo.counterparts``, over ``wire`` when compressed) before handing it to its local peers.
        Every member moves 1/n of the bytes across hosts (n: members per host), so the links between
        hosts carry several connections at once and no member copies the whole array twice. A chunk's
        exchange runs on the pipeline's worker thread while the member works on its neighbours.

        Raises:
            CollectiveMismatchError / CollectiveTimeoutError: naming global ranks, local or remote.
        """
        me = call.group.ranks[call.group.index]
        assert topo.counterparts is not None
        counterparts = topo.counterparts
        crossed: list[BaseException] = []

        def cross(chunk: int, lo: int, hi: int) -> None:
            part = buf[lo:hi]
            sub = self._sub_call(call, f"/across/{topo.local_index}/{chunk}", counterparts, me)
            try:
                if wire is not None:
                    self._run(sub, lambda ch: compressed.all_reduce(ch, part, wire))
                else:
                    self._run(sub, lambda ch: algorithms.all_reduce(ch, part, op, **self._small))
            except BaseException as exc:
                crossed.append(exc)  # names global ranks already
                raise

        def exchange(chunk: int, lo: int, hi: int) -> Callable[[], None]:
            return self._pipeline(call).submit(cross, chunk, lo, hi).result

        try:
            # Each wait after the first is for a local peer's exchange across hosts (milliseconds for
            # megabytes): polling through it would take the core from the ranks doing that work where
            # cores are shared, so the waits sleep at once (a wake-up is tens of microseconds).
            shared.all_reduce(buf, op, call.deadline, digest=call.signature.digest, exchange=exchange, spin=0.0)
        except (CollectiveMismatchError, CollectiveTimeoutError) as exc:
            if crossed and exc is crossed[0]:
                raise
            raise in_global_ranks(call, topo.local, exc) from exc

    def _pipeline(self, call: Call) -> ThreadPoolExecutor:
        """The worker thread of ``call``'s stream for its hierarchical all_reduce's cross-host part.

        One per stream, not one per backend: streams of different groups run at once (each on its
        own thread), and with one shared worker host a could run group A's exchange while host b runs
        group B's, each waiting for the other's that is queued behind it until the calls time out.
        A stream's own calls run one at a time, so one worker each is enough.
        """
        stream = call.progress_stream
        with self._pipelines_lock:
            pool = self._pipelines.get(stream)
            if pool is None:
                pool = self._pipelines[stream] = ThreadPoolExecutor(1, thread_name_prefix="collsvc-cross-host")
            return pool

    def _dispatch(
        self,
        call: Call,
        on_shared: Callable[[Any], None],
        on_channel: Callable[[Channel], Any],
        *,
        rooted: bool = False,
    ) -> None:
        """Runs a call through shared memory when its group is on this host, else over channels."""
        shared = self._shared(call, self._topology(call.group))
        if shared is not None:
            self._local(call, self._local_ranks(call), lambda: on_shared(shared))
        elif rooted:
            self._run_rooted(call, on_channel)
        else:
            self._run(call, on_channel)

    def reduce(self, call: Call, buf: np.ndarray, op: ReduceOp, root: int) -> None:
        inner = reduced_as(op)
        digest = call.signature.digest
        self._dispatch(
            call,
            lambda shared: shared.reduce(buf, inner, root, call.deadline, digest=digest),
            lambda ch: algorithms.reduce(ch, buf, inner, root, **self._small),
            rooted=True,
        )
        if op is ReduceOp.AVG and call.group.index == root:
            finish_average(buf, call.group.size)

    def broadcast(self, call: Call, buf: np.ndarray, root: int) -> None:
        digest = call.signature.digest
        self._dispatch(
            call,
            lambda shared: shared.broadcast(buf, root, call.deadline, digest=digest),
            lambda ch: algorithms.broadcast(ch, buf, root, **self._small),
            rooted=True,
        )

    def all_gather(self, call: Call, src: np.ndarray, out: np.ndarray) -> None:
        digest = call.signature.digest
        self._dispatch(
            call,
            lambda shared: shared.all_gather(src, out, call.deadline, digest=digest),
            lambda ch: algorithms.all_gather(ch, src, out),
        )

    def reduce_scatter(self, call: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        inner = reduced_as(op)
        digest = call.signature.digest
        wire = self._wire(call, self._topology(call.group), op)
        self._dispatch(
            call,
            lambda shared: shared.reduce_scatter(src, out, inner, call.deadline, digest=digest),
            lambda ch: (
                algorithms.reduce_scatter(ch, src, out, inner)
                if wire is None
                else compressed.reduce_scatter(ch, src, out, wire)
            ),
        )
        if op is ReduceOp.AVG and wire is None:
            finish_average(out, call.group.size)

    def gather(self, call: Call, src: np.ndarray, out: np.ndarray | None, root: int) -> None:
        digest = call.signature.digest
        self._dispatch(
            call,
            lambda shared: shared.gather(src, out, root, call.deadline, digest=digest),
            lambda ch: algorithms.gather(ch, src, out, root),
            rooted=True,
        )

    def scatter(self, call: Call, src: np.ndarray | None, out: np.ndarray, root: int) -> None:
        digest = call.signature.digest
        self._dispatch(
            call,
            lambda shared: shared.scatter(src, out, root, call.deadline, digest=digest),
            lambda ch: algorithms.scatter(ch, src, out, root),
            rooted=True,
        )

    def all_to_all(self, call: Call, src: np.ndarray, out: np.ndarray) -> None:
        digest = call.signature.digest
        self._dispatch(
            call,
            lambda shared: shared.all_to_all(src, out, call.deadline, digest=digest),
            lambda ch: algorithms.all_to_all(ch, src, out),
        )

    def send(self, call: Call, buf: np.ndarray, dst: int) -> None:
        self._run(call, lambda ch: algorithms.send(ch, buf, dst))

    def recv(self, call: Call, out: np.ndarray, src: int) -> None:
        self._run(call, lambda ch: algorithms.recv(ch, out, src))

    def barrier(self, call: Call) -> bool:
        """A barrier in the data plane where the group allows: on this host, a shared-memory barrier
        (tens of microseconds); over several hosts, a dissemination barrier over the peers' lanes among
        the hosts' leaders, each host's members meeting in shared memory first
        (``host_barrier.pass_for_host``), or among every member where each host has one or shared
        memory is off. False, at once, for a group of one host without shared memory: the caller then passes
        the coordinator's barrier."""
        topo = self._topology(call.group)
        shared = self._shared(call, topo)
        digest = call.signature.digest
        if shared is not None:
            self._local(call, self._local_ranks(call), lambda: shared.barrier(call.deadline, digest=digest))
            return True
        if topo is None or call.group.size == 1 or (self._local_groups is None and topo.hosts < 2):
            return False
        if self._local_groups is None or len(topo.leaders) == call.group.size:  # the same choice on every host
            self._run(call, algorithms.barrier)
            return True
        me = call.group.ranks[call.group.index]
        host = self._local_groups.get(self._sub_call(call, "/host", topo.local, me), topo.local, topo.local_index)
        leaders = topo.leaders  # only the host's leader (in them) crosses: across() runs there alone

        def across() -> None:
            self._run(self._sub_call(call, "/leaders", leaders, me), algorithms.barrier)

        passing = functools.partial(pass_for_host, host, topo.local, topo.local_index, across, call.deadline, digest)
        self._local(call, topo.local, passing)
        return True

    def close(self) -> None:
        with self._pipelines_lock:
            pools, self._pipelines = list(self._pipelines.values()), {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
        if self._local_groups is not None:
            self._local_groups.close()

    def abort(self, error: BaseException) -> None:
        if self._local_groups is not None:
            self._local_groups.fail(error)

    def depart(
        self, ranks: list[int], error: BaseException, finished: Mapping[int, Mapping[str, int]] | None = None
    ) -> None:
        """Ranks left the job cleanly (``finished``: their final progress, rank -> stream -> last
        finished sequence number): calls that still need them raise ``error``; the others go on."""
        if self._local_groups is not None:
            self._local_groups.depart(ranks, error, finished)


_CHECKED_AGAINST_THE_PROTOCOL: type[Backend] = RingBackend  # mypy checks every method against Backend
