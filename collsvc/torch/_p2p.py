"""isend / irecv over the Communicator's blocking send and recv.

torch lets one rank post a receive before the matching send (``batch_isend_irecv`` with both
directions, say), so each posted operation must wait somewhere other than the caller's thread. Each
(peer, tag, direction) has one worker thread: operations of one stream keep the order they were
posted in, which is the order torch matches them in, and streams never wait on each other.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from collsvc.torch._streams import current, run_on

if TYPE_CHECKING:  # imported by collsvc itself at run time, in its own order
    from collsvc.client.communicator import Communicator

T = TypeVar("T")


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
        _check_tag(tag, what)

    @staticmethod
    def _into(tensor: torch.Tensor, receive: Callable[[torch.Tensor], T]) -> Callable[[], T]:
        """``receive(out)`` into ``tensor``, through a contiguous buffer when ``tensor`` is not one."""
        target = tensor.detach()

        def run() -> T:
            if target.is_contiguous():
                return receive(target)
            buffer = torch.empty_like(target, memory_format=torch.contiguous_format)
            result = receive(buffer)
            target.copy_(buffer)
            return result

        return run

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> concurrent.futures.Future[Any]:
        """Posts a send of ``tensor`` (its contents at the time of the call) to ``dst``.

        Raises:
            ValueError: ``dst`` is this rank or outside the group, or ``tag`` < 0.
        """
        self._check(dst, tag, "send")
        data = tensor.detach().contiguous()
        stream = current()  # CUDA tensors: the send runs on the caller's stream, on the lane's thread
        return self._stream("send", dst, tag).submit(run_on, stream, lambda: self._comm.send(data, dst, tag))

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> concurrent.futures.Future[Any]:
        """Posts a receive from ``src`` into ``tensor``.

        Raises:
            ValueError: ``src`` is this rank or outside the group, or ``tag`` < 0.
        """
        self._check(src, tag, "recv")
        receive = self._into(tensor, lambda out: self._comm.recv(src, tag, out=out))
        return self._stream("recv", src, tag).submit(run_on, current(), receive)

    def recv_any(self, tensor: torch.Tensor, tag: int) -> concurrent.futures.Future[Any]:
        """Posts a receive from whichever rank sends with ``tag`` first; the future's value is that rank.

        Raises:
            ValueError: ``tag`` < 0.
        """
        _check_tag(tag, "recv")
        receive = self._into(tensor, lambda out: self._comm.recv_any(tag, out=out)[0])
        lane = self._stream("recv", -1, tag)  # -1: the lane of receives from any rank
        return lane.submit(run_on, current(), receive)

    def close(self) -> None:
        with self._lock:
            pools, self._streams = list(self._streams.values()), {}
        for pool in pools:
            pool.shutdown(wait=False, cancel_futures=True)


def _check_tag(tag: int, what: str) -> None:
    if tag < 0:
        raise ValueError(f"{what}: tag must be >= 0, got {tag}")
