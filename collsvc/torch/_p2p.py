"""isend / irecv over the Communicator's blocking send and recv.

torch lets one rank post a receive before the matching send (``batch_isend_irecv`` with both
directions, say), so each posted operation must wait somewhere other than the caller's thread. Each
(peer, tag, direction) has one worker thread: operations of one stream keep the order they were
posted in, which is the order torch matches them in, and streams never wait on each other.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # imported by collsvc itself at run time, in its own order
    from collsvc.client.communicator import Communicator


class PointToPoint:
    """Posts sends and receives of one Communicator on per-stream worker threads."""

    def __init__(self, comm: Communicator) -> None:
        self._comm = comm
        self._lock = threading.Lock()
        self._streams: dict[tuple[str, int, int], concurrent.futures.ThreadPoolExecutor] = {}

    def _stream(self, direction: str, peer: int, tag: int) -> concurrent.futures.ThreadPoolExecutor:
        key = (direction, peer, tag)
        with self._lock:
            pool = self._streams.get(key)
            if pool is None:
                pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"collsvc-{direction}-{peer}-{tag}")
                self._streams[key] = pool
            return pool

    def _check(self, peer: int, tag: int, what: str) -> None:
        if isinstance(peer, bool) or not 0 <= peer < self._comm.size or peer == self._comm.rank:
            raise ValueError(f"{what}: rank {peer} is not another rank of this group of {self._comm.size}")
        if tag < 0:
            raise ValueError(f"{what}: tag must be >= 0, got {tag}")

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> concurrent.futures.Future[Any]:
        """Posts a send of ``tensor`` (its contents at the time of the call) to ``dst``.

        Raises:
            ValueError: ``dst`` is this rank or outside the group, or ``tag`` < 0.
        """
        self._check(dst, tag, "send")
        data = tensor.detach().contiguous()
        return self._stream("send", dst, tag).submit(self._comm.send, data, dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> concurrent.futures.Future[Any]:
        """Posts a receive from ``src`` into ``tensor``.

        Raises:
            ValueError: ``src`` is this rank or outside the group, or ``tag`` < 0.
        """
        self._check(src, tag, "recv")
        target = tensor.detach()

        def receive() -> None:
            if target.is_contiguous():
                self._comm.recv(src, tag, out=target)
            else:
                target.copy_(
                    self._comm.recv(src, tag, out=torch.empty_like(target, memory_format=torch.contiguous_format))
                )

        return self._stream("recv", src, tag).submit(receive)

    def recv_any(self, tensor: torch.Tensor, tag: int) -> concurrent.futures.Future[Any]:
        """Posts a receive from whichever rank sends with ``tag`` first; the future's value is that rank.

        Raises:
            ValueError: ``tag`` < 0.
        """
        if tag < 0:
            raise ValueError(f"recv: tag must be >= 0, got {tag}")
        target = tensor.detach()

        def receive() -> int:
            if target.is_contiguous():
                source, _ = self._comm.recv_any(tag, out=target)
            else:
                source, data = self._comm.recv_any(
                    tag, out=torch.empty_like(target, memory_format=torch.contiguous_format)
                )
                target.copy_(data)
            return source

        return self._stream("recv", -1, tag).submit(receive)  # -1: the lane of receives from any rank

    def close(self) -> None:
        with self._lock:
            pools, self._streams = list(self._streams.values()), {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)
