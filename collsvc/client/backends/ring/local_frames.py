"""Data-plane frames between ranks of one host through shared memory instead of gRPC.

Every rank binds an *inbox*, a Linux abstract-namespace datagram socket named from the job (its token
included, so nobody outside the job can predict the name and take it first). The first frame a rank
sends to a local peer makes a :class:`~collsvc.client.backends.shm.frame_ring.FrameRing` for that
direction and passes its ``memfd`` to the peer's inbox (``SCM_RIGHTS``); from then on a frame is a
record written into the ring plus a one-byte datagram that wakes the peer. A thread per rank sleeps on
its inbox and moves every record that arrived into the :class:`Mailbox`, where receivers find frames
exactly as if gRPC had delivered them: frames are found by their key (call, sequence, step, sender),
never by order, so any frame may also take the gRPC path.

A frame goes over gRPC instead when the peer has no inbox (yet, or any more), the ring stays full
for :data:`FULL_WAIT` seconds (the peer's thread is not keeping up), or the frame is larger than half
a ring. As over gRPC, a send returns once the frame is the receiver's: here, once it is in the ring,
which lives as long as the receiver maps it, whatever happens to the sender. A peer whose inbox is gone
(its process exited or left) makes the frame take gRPC too, which reports the peer as gRPC does.

The inbox trusts a ring only from the outbox name the claimed sender binds and from a process of the
same user (``SO_PASSCRED``; as ``shm/doorbell.py`` trusts segments).
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable, Mapping

from collsvc.client.backends.ring import frames
from collsvc.client.backends.ring.mailbox import Mailbox
from collsvc.client.backends.shm.doorbell import ANCILLARY_BYTES, received_fds, sent_by_this_user
from collsvc.client.backends.shm.frame_ring import FrameRing
from collsvc.client.backends.shm.frame_ring import supported as frame_ring_supported
from collsvc.errors import RankFailedError

log = logging.getLogger(__name__)

#: data bytes of each ring (one per direction between two local ranks that exchange frames): a frame
#: over half a ring takes gRPC, so a ring holds two of the algorithms' largest frames
RING_BYTES = 8 << 20
#: how long a sender waits for room in a full ring before the frame takes gRPC
FULL_WAIT = 0.01
# After a failed attempt to reach a peer's inbox, sends to it take gRPC for this long before the next.
_RETRY_AFTER = 0.005
_MESSAGE = struct.Struct("<BxxxI")  # kind, sender's global rank
_RING, _POKE = 1, 2
_GONE = (ConnectionRefusedError, ConnectionResetError, BrokenPipeError, FileNotFoundError)


def inbox_base(job_key: str, token: str | None) -> bytes:
    """The prefix of every socket name of one job instance (``job_key``) with ``token``."""
    tag = hashlib.blake2b(f"{token or ''}|{job_key}".encode(), digest_size=12).hexdigest()
    return b"\0collsvc-frames/" + tag.encode()


class _Link:
    """This rank's sending side towards one local peer."""

    __slots__ = ("lock", "ring", "outbox", "retry_at", "sent")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent = 0  # frames that went through the ring
        self.ring: FrameRing | None = None
        self.outbox: socket.socket | None = None
        self.retry_at = 0.0


class LocalFrames:
    """This rank's inbox, its rings to local peers and the thread that empties the rings it receives.

    :meth:`send` may be called from any thread.
    """

    def __init__(self, rank: int, local_peers: Iterable[int], base: bytes, mailbox: Mailbox, max_payload: int) -> None:
        """Binds this rank's inbox and starts its thread.

        Raises:
            OSError: the inbox name is taken or sockets are unavailable.
        """
        self._rank, self._base, self._mailbox, self._max_payload = rank, base, mailbox, max_payload
        self._links = {peer: _Link() for peer in local_peers if peer != rank}
        self._readers: dict[int, FrameRing] = {}
        self._closed = False
        self._inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._inbox.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # see sent_by_this_user
            self._inbox.bind(self._inbox_name(rank))
        except OSError:
            self._inbox.close()
            raise
        self._poke = _MESSAGE.pack(_POKE, rank)
        self._thread = threading.Thread(target=self._receive, name="collsvc-local-frames", daemon=True)
        self._thread.start()

    def _inbox_name(self, rank: int) -> bytes:
        return self._base + b"/%d" % rank

    def _outbox_name(self, src: int, dst: int) -> bytes:
        return self._base + b"/%d>%d" % (src, dst)

    # -- sending ---------------------------------------------------------------------------------

    def send(self, dst: int, parts: tuple[bytes | memoryview, ...], nbytes: int) -> bool:
        """Puts one frame (``parts`` joined, ``nbytes`` in all) in global rank ``dst``'s ring; False when
        it must go over gRPC instead (see the module docstring). Never blocks longer than
        :data:`FULL_WAIT`."""
        link = self._links.get(dst)
        if link is None or self._closed:
            return False
        with link.lock:
            ring = link.ring or self._connect(dst, link)
            if ring is None or not ring.fits(nbytes):
                return False
            if not ring.put(parts, nbytes) and not self._wait_for_room(dst, link, ring, parts, nbytes):
                return False
            if not self._wake(dst, link):
                return False
            link.sent += 1
            return True

    @property
    def frames_sent(self) -> int:
        """How many frames went to local peers through the rings so far."""
        return sum(link.sent for link in self._links.values())

    def _connect(self, dst: int, link: _Link) -> FrameRing | None:
        """Makes the ring towards ``dst`` and hands it over; None when ``dst`` has no inbox now."""
        now = time.monotonic()
        if now < link.retry_at:
            return None
        outbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        ring = None
        try:
            outbox.bind(self._outbox_name(self._rank, dst))
            outbox.connect(self._inbox_name(dst))
            ring, fd = FrameRing.create(RING_BYTES)
            try:
                fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
                outbox.sendmsg([_MESSAGE.pack(_RING, self._rank)], fds)
            finally:
                os.close(fd)
        except OSError as exc:  # no inbox yet, a full queue, or no memory: gRPC for now, retried later
            log.debug("rank %d: frames to local rank %d take gRPC for now: %s", self._rank, dst, exc)
            outbox.close()
            if ring is not None:
                ring.close()
            link.retry_at = now + _RETRY_AFTER
            return None
        link.ring, link.outbox = ring, outbox
        return ring

    def _wait_for_room(
        self, dst: int, link: _Link, ring: FrameRing, parts: tuple[bytes | memoryview, ...], nbytes: int
    ) -> bool:
        """Wakes the peer's thread and retries the put for up to :data:`FULL_WAIT`, yielding the core."""
        if not self._wake(dst, link):
            return False
        until = time.monotonic() + FULL_WAIT
        while time.monotonic() < until:
            os.sched_yield()
            if ring.put(parts, nbytes):
                return True
        return False

    def _wake(self, dst: int, link: _Link) -> bool:
        """Tells ``dst``'s thread there is news; False (and the link dropped) when its inbox is gone."""
        assert link.outbox is not None
        try:
            link.outbox.send(self._poke)
        except BlockingIOError:
            pass  # its queue is full of wake-ups: its thread wakes anyway
        except _GONE:
            self._drop(link)
            return False
        return True

    @staticmethod
    def _drop(link: _Link) -> None:
        if link.outbox is not None:
            link.outbox.close()
        if link.ring is not None:
            link.ring.close()
        link.ring = link.outbox = None
        link.retry_at = float("inf")  # the peer's inbox went away: it does not come back in this job

    # -- receiving -------------------------------------------------------------------------------

    def _receive(self) -> None:
        sources = {self._outbox_name(peer, self._rank): peer for peer in self._links}
        while True:
            try:
                data, ancillary, _, source = self._inbox.recvmsg(64, ANCILLARY_BYTES)
            except OSError as exc:
                if not self._closed:
                    self._inbox_failed(exc)
                return
            fds = received_fds(ancillary)
            if self._closed:  # close() shut the inbox down: an empty read
                for fd in fds:
                    os.close(fd)
                return
            try:
                sender = sources.get(source) if sent_by_this_user(ancillary) else None
                if sender is not None and len(data) == _MESSAGE.size and data[0] == _RING and fds:
                    self._attach(sender, fds.pop(0))
                self._empty_rings()
            except Exception:  # a bug here must not end the thread: every later frame would wait
                log.exception("rank %d: moving local frames into the mailbox failed", self._rank)
            finally:
                for fd in fds:
                    os.close(fd)

    def _inbox_failed(self, error: OSError) -> None:
        """The inbox broke while open (never seen: reading a bound datagram socket fails only through a
        bug). Frames from local peers cannot arrive any more, so this rank's waits fail now, naming this
        rank, rather than time out later blaming the peers that sent them."""
        log.error("rank %d: the inbox of frames from local ranks failed: %s", self._rank, error)
        self._mailbox.fail(
            RankFailedError(
                f"rank {self._rank} can no longer receive from the ranks of its host: its inbox of frames "
                f"failed ({error})",
                ranks=[self._rank],
            )
        )

    def _attach(self, sender: int, fd: int) -> None:
        try:
            ring = FrameRing.attach(fd)
        except (OSError, ValueError) as exc:
            log.warning("rank %d: local rank %d's frame ring is unusable: %s", self._rank, sender, exc)
            return
        finally:
            os.close(fd)
        old = self._readers.get(sender)
        if old is not None:  # the sender made a new ring (it lost the old one's inbox for a moment)
            arrived: list[tuple[frames.FrameHeader, memoryview]] = []
            self._take_from(sender, old, arrived)
            self._mailbox.deposit_all(arrived)
            old.close()
        self._readers[sender] = ring

    def _empty_rings(self) -> None:
        arrived: list[tuple[frames.FrameHeader, memoryview]] = []
        for sender, ring in self._readers.items():
            self._take_from(sender, ring, arrived)
        if arrived:
            self._mailbox.deposit_all(arrived)

    def _take_from(self, sender: int, ring: FrameRing, arrived: list[tuple[frames.FrameHeader, memoryview]]) -> None:
        for record in ring.take_all():
            try:
                header, payload = frames.decode(record, self._max_payload)
            except frames.FrameError as exc:
                log.warning("rank %d: dropped a malformed frame from local rank %d: %s", self._rank, sender, exc)
                continue
            if header.src != sender:
                log.warning("rank %d: dropped local rank %d's frame signed as rank %d", self._rank, sender, header.src)
                continue
            arrived.append((header, payload))

    def close(self) -> None:
        """Stops the thread, closes the sockets and unmaps the rings (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._inbox.shutdown(socket.SHUT_RDWR)  # ends the thread's wait (an empty read)
        self._thread.join(timeout=5.0)
        for link in self._links.values():
            with link.lock:
                self._drop(link)
        self._inbox.close()
        for ring in self._readers.values():
            ring.close()
        self._readers.clear()


def for_job(
    rank: int, hosts: Mapping[int, str], job_key: str, token: str | None, mailbox: Mailbox, max_payload: int
) -> LocalFrames | None:
    """This rank's :class:`LocalFrames` towards the members ``hosts`` puts on its host; None where there
    are none, the CPU lacks the ring's ordering (``frame_ring.supported``), or the inbox cannot be bound
    (frames then all take gRPC, as before)."""
    peers = [peer for peer, host in hosts.items() if host == hosts.get(rank) and peer != rank]
    if not peers or not frame_ring_supported() or not hasattr(os, "memfd_create"):
        return None
    try:
        return LocalFrames(rank, peers, inbox_base(job_key, token), mailbox, max_payload)
    except OSError as exc:
        log.info("rank %d: frames to local ranks take gRPC: %s", rank, exc)
        return None
