"""Wake-ups among the ranks of one host: Linux abstract-namespace Unix datagram sockets.

Every local rank binds an *inbox* named ``\\0collsvc-shm/<tag>/<rank>`` and, per peer, an *outbox*
named ``.../<rank>><peer>`` connected to that peer's inbox. Abstract names have no file to clean up:
the kernel drops them with the socket, also on SIGKILL. A receiver trusts a message only when its
source address is the outbox the claimed sender owns, which no other process can bind while the sender
lives; a ``HELLO`` (a segment) also only from a process of the same user (``SO_PASSCRED``: another user
who learns the names could otherwise bind an outbox name before its owner does).

Messages are tiny: ``HELLO`` carries a segment descriptor (``SCM_RIGHTS``) while the group forms,
``ARRIVE`` is a rank reaching barrier generation ``g`` (optionally with a call descriptor), ``RELEASE``
is local rank 0 ending a central barrier (with every rank's descriptor), ``WAKE`` interrupts a blocked
wait (``fail``, or a peer's arrival at a barrier of ``board.py``). The arrival state is the truth,
datagrams are its transport: the kernel's socket locks order every shared-memory write a sender made
before it sent with every read the receiver makes after it received, on any CPU architecture.

Sends never block the caller indefinitely: a peer's queue is bounded (``net.unix.max_dgram_qlen``,
often 10), so a full queue is waited on with ``poll`` while this rank keeps draining its own inbox,
which breaks the cycle of two ranks each waiting for the other's queue.
"""

from __future__ import annotations

import array
import contextlib
import hashlib
import math
import os
import select
import socket
import struct
import time
from collections.abc import Callable

from collsvc.client.backends.shm.segment import DESCRIPTOR_BYTES

HEADER = struct.Struct("<BxxxIQ")  # kind, sender local rank, generation
HELLO, ARRIVE, RELEASE, WAKE = 1, 2, 3, 4
# The smallest inbox buffer; a group's buffer also holds local rank 0's release, which carries every
# rank's barrier body (a call descriptor, at most DESCRIPTOR_BYTES) behind a one-byte length.
_MAX_MESSAGE = 1024
_GONE = (ConnectionRefusedError, ConnectionResetError, BrokenPipeError, FileNotFoundError)
_CREDENTIALS = struct.Struct("<iII")  # struct ucred: pid, uid, gid
#: ancillary space for one descriptor and the sender's credentials
ANCILLARY_BYTES = socket.CMSG_SPACE(16) + socket.CMSG_SPACE(_CREDENTIALS.size)


def _names(namespace: str) -> bytes:
    tag = hashlib.blake2b(namespace.encode(), digest_size=12).hexdigest()
    return b"\0collsvc-shm/" + tag.encode()


def _remaining_ms(deadline: float) -> int:
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))


class Doorbell:
    """One local rank's end of the group's wake-up sockets, plus what it heard from each peer.

    Attributes:
        arrived: per local rank, the highest barrier generation it announced (own entry included).
        released: the last generation local rank 0 released (central barriers).
        bodies: per generation parity, per local rank, the body of its last ``ARRIVE`` of that parity.
        gone: local ranks whose inbox no longer exists (process exited or closed the group).
    """

    def __init__(self, namespace: str, rank: int, size: int) -> None:
        """Binds this rank's inbox.

        Raises:
            OSError: the inbox name is taken (another group with the same namespace and rank).
        """
        self._base = _names(namespace)
        self._rank, self._size = rank, size
        self._inbox = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        try:
            self._inbox.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)  # HELLOs: see sent_by_this_user
            self._inbox.bind(self._inbox_name(rank))
        except OSError:
            self._inbox.close()
            raise
        self._poll = select.poll()
        self._poll.register(self._inbox, select.POLLIN)
        self._out: dict[int, socket.socket] = {}
        self._capacity = max(_MAX_MESSAGE, HEADER.size + size * (1 + DESCRIPTOR_BYTES))
        self._buf = bytearray(self._capacity)
        self._expect_fds = True
        self._wake_message = HEADER.pack(WAKE, rank, 0)
        self.arrived = [0] * size
        self.released = 0
        self.bodies: tuple[list[bytes], list[bytes]] = ([b""] * size, [b""] * size)
        self.hellos: dict[int, tuple[int, bytes]] = {}
        self.gone: set[int] = set()
        # The address a message from local rank r must come from: its outbox towards us.
        self._sources = [self._outbox_name(r, rank) for r in range(size)]

    def _inbox_name(self, rank: int) -> bytes:
        return self._base + b"/%d" % rank

    def _outbox_name(self, src: int, dst: int) -> bytes:
        return self._base + b"/%d>%d" % (src, dst)

    # -- forming the group -----------------------------------------------------------------------

    def exchange(self, fd: int, body: bytes, deadline: float, check: Callable[[], None]) -> bool:
        """Sends ``fd`` with ``body`` to every peer and collects theirs into ``hellos``.

        Peers may start at any time: a peer that is not bound yet sends its HELLO once it is, and this
        rank answers it then. Received descriptors are the caller's to close.

        Returns:
            True when every peer's HELLO arrived and ours reached every peer; False at the deadline.

        Raises:
            Whatever ``check`` raises.
        """
        peers = [p for p in range(self._size) if p != self._rank]
        sent: set[int] = set()
        while True:
            # Drain first: a HELLO from a peer that bound after our last attempt means we can reach it.
            self._drain()
            check()
            for peer in peers:
                if peer not in sent and self._connect(peer) and self._send_fd(peer, fd, body):
                    sent.add(peer)
            if len(sent) == len(peers) and len(self.hellos) == len(peers):
                self._expect_fds = False
                self._inbox.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 0)
                return True
            if time.monotonic() >= deadline:
                return False
            # A peer that binds later always sends us its HELLO, so our inbox wakes us; a peer whose
            # queue was full wakes us through its outbox becoming writable.
            poll = select.poll()
            poll.register(self._inbox, select.POLLIN)
            for peer in peers:
                if peer not in sent and peer in self._out:
                    poll.register(self._out[peer], select.POLLOUT)
            poll.poll(_remaining_ms(deadline))

    def _connect(self, peer: int) -> bool:
        if peer in self._out:
            return True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        try:
            sock.bind(self._outbox_name(self._rank, peer))
            sock.connect(self._inbox_name(peer))
        except _GONE:  # not bound yet
            sock.close()
            return False
        except OSError:
            sock.close()
            raise
        self._out[peer] = sock
        return True

    def _send_fd(self, peer: int, fd: int, body: bytes) -> bool:
        message = HEADER.pack(HELLO, self._rank, 0) + body
        fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
        try:
            self._out[peer].sendmsg([message], fds)
        except BlockingIOError:
            return False  # its queue is full: retried on the next pass
        return True

    # -- barriers --------------------------------------------------------------------------------

    def barrier(self, generation: int, body: bytes, deadline: float, check: Callable[[], None], spin: float) -> bool:
        """Barrier ``generation``: on return ``bodies[generation % 2]`` holds every rank's ``body``.

        Two ranks tell each other (one hop). Three or more use a central barrier through local rank 0:
        each rank sends to rank 0 and sleeps until rank 0's release, so a waiting rank is woken once
        per barrier rather than once per peer (on a few shared cores, wake-ups cost more than a hop).

        Returns:
            False when the deadline passed first.

        Raises:
            Whatever ``check`` raises.
        """
        parity = generation % 2
        self.arrived[self._rank] = generation
        self.bodies[parity][self._rank] = body
        if self._size == 2 or self._rank == 0:
            if self._size == 2:
                peer = 1 - self._rank
                if not self._send_fast(peer, HEADER.pack(ARRIVE, self._rank, generation) + body, deadline):
                    return False
            arrived = self.arrived
            if not self.wait(lambda: min(arrived) >= generation, deadline, check, spin):
                return False
            if self._size == 2:
                return True
            # Each body behind its length: bodies differ in length when ranks are out of step (one at a
            # call's first step with a descriptor, another without), which the receivers must see as is.
            release = HEADER.pack(RELEASE, self._rank, generation) + b"".join(
                bytes((len(b),)) + b for b in self.bodies[parity]
            )
            return self._send_all(list(self._out), release, deadline)
        if not self._send_fast(0, HEADER.pack(ARRIVE, self._rank, generation) + body, deadline):
            return False
        return self.wait(lambda: self.released >= generation, deadline, check, spin)

    def _send_fast(self, peer: int, message: bytes, deadline: float) -> bool:
        """:meth:`_send_all` to one peer, without building a list (every barrier step sends this way)."""
        return peer in self.gone or self._send(peer, self._out[peer], message, deadline)

    def _send_all(self, peers: list[int], message: bytes, deadline: float) -> bool:
        for peer in peers:
            if peer not in self.gone and not self._send(peer, self._out[peer], message, deadline):
                return False
        return True

    def _send(self, peer: int, sock: socket.socket, message: bytes, deadline: float) -> bool:
        while True:
            try:
                sock.send(message)
                return True
            except BlockingIOError:
                pass
            except _GONE:
                self.gone.add(peer)
                return True
            if time.monotonic() >= deadline:
                return False
            poll = select.poll()
            poll.register(sock, select.POLLOUT)
            poll.register(self._inbox, select.POLLIN)
            poll.poll(_remaining_ms(deadline))
            self._drain()

    def poke(self, peer: int) -> None:
        """Wakes ``peer`` if it sleeps in :meth:`wait`; never blocks. A full inbox wakes it anyway; a
        peer whose inbox is gone joins :attr:`gone`."""
        sock = self._out.get(peer)
        if sock is None or peer in self.gone:
            return
        try:
            sock.send(self._wake_message)
        except BlockingIOError:
            pass
        except _GONE:
            self.gone.add(peer)

    def wait(self, ready: Callable[[], bool], deadline: float, check: Callable[[], None], spin: float) -> bool:
        """Drains messages until ``ready()``; polls for ``spin`` seconds before it blocks.

        Returns:
            True once ready, False when the deadline passed first.

        Raises:
            Whatever ``check`` raises (it runs after every wake-up before the deadline that did not
            make ``ready()`` true).
        """
        if spin > 0:
            # Poll without sleeping, handing the core to any runnable process between polls. Failures
            # and departures are checked below, once the spin (microseconds) is over.
            spin_until = time.monotonic() + spin
            while True:
                self._drain()
                if ready():
                    return True
                if time.monotonic() >= spin_until:
                    break
                os.sched_yield()
        while True:
            self._drain()
            # What already arrived wins over a recorded failure: a peer that contributed and then left
            # cleanly must not fail a call its messages completed (later calls still fail fast).
            if ready():
                return True
            # A call whose deadline passed timed out, whatever happened since: a peer that timed out
            # in the same call a moment earlier and then left must not be blamed for it.
            if time.monotonic() >= deadline:
                return False
            check()
            self._poll.poll(_remaining_ms(deadline))

    def _drain(self) -> None:
        while True:
            try:
                if self._expect_fds:
                    data, ancillary, _, source = self._inbox.recvmsg(self._capacity, ANCILLARY_BYTES)
                    fds = received_fds(ancillary)
                    if not sent_by_this_user(ancillary):
                        source = None  # never trusted
                    size = len(data)
                    view = memoryview(data)
                else:
                    size, source = self._inbox.recvfrom_into(self._buf)
                    fds = []
                    view = memoryview(self._buf)
            except BlockingIOError:
                return
            self._accept(view, size, source, fds)

    def _accept(self, view: memoryview, size: int, source: object, fds: list[int]) -> None:
        keep = False
        if size >= HEADER.size:
            kind, sender, generation = HEADER.unpack_from(view)
            trusted = 0 <= sender < self._size and source == self._sources[sender]
            if trusted and kind == ARRIVE and generation > self.arrived[sender]:
                self.arrived[sender] = generation
                self.bodies[generation % 2][sender] = bytes(view[HEADER.size : size])
            elif trusted and kind == RELEASE and sender == 0 and generation > self.released:
                self.released = generation
                bodies, at = self.bodies[generation % 2], HEADER.size
                for rank in range(self._size):
                    length = view[at] if at < size else 0
                    bodies[rank] = bytes(view[at + 1 : min(at + 1 + length, size)])
                    at += 1 + length
            elif trusted and kind == HELLO and fds and sender not in self.hellos:
                self.hellos[sender] = (fds[0], bytes(view[HEADER.size : size]))
                keep = True
            # WAKE and untrusted messages only make the waiter look at its state again.
        for index, fd in enumerate(fds):
            if not (keep and index == 0):
                os.close(fd)

    def wake(self) -> None:
        """Interrupts a blocked :meth:`wait` (safe from any thread)."""
        # A full inbox wakes the waiter anyway; a closed one has no waiter.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
            sock.sendto(HEADER.pack(WAKE, self._rank, 0), socket.MSG_DONTWAIT, self._inbox_name(self._rank))

    def close(self) -> None:
        """Closes every socket; peers see this rank as gone."""
        for sock in self._out.values():
            sock.close()
        self._out.clear()
        self._inbox.close()
        for fd, _ in self.hellos.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.hellos.clear()


def sent_by_this_user(ancillary: list[tuple[int, int, bytes]]) -> bool:
    """Whether a message's ``SCM_CREDENTIALS`` (the receiving socket has ``SO_PASSCRED`` on) say its
    sender runs as this process's user: a message of another user on the host is never trusted, even
    from the right socket name (abstract names can be taken by anyone who learns them first)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDENTIALS.size:
            _, uid, _ = _CREDENTIALS.unpack_from(data)
            return uid in (os.getuid(), os.geteuid())
    return False


def received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The descriptors an ``SCM_RIGHTS`` message carried (``recvmsg``'s ancillary data); the caller closes them."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds.extend(array.array("i", data[:usable]))
    return fds
