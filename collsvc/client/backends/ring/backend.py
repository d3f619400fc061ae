"""The ring backend: collective algorithms over channels from the gRPC transport (host arrays)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from collsvc.client.backends.base import Call, Channel
from collsvc.client.backends.ring import algorithms
from collsvc.client.backends.ring.reduction import finish_average
from collsvc.types import ReduceOp


class RingBackend:
    """Implements :class:`~collsvc.client.backends.base.Backend` for numpy arrays.

    ``channel_for`` maps a call to a channel (the gRPC transport's, or the in-memory twin's in tests).
    """

    name = "ring"

    def __init__(self, channel_for: Callable[[Call], Channel]) -> None:
        self._channel_for = channel_for

    def _run(self, call: Call, body: Callable[[Channel], Any]) -> None:
        channel = self._channel_for(call)
        body(channel)
        channel.flush()

    def all_reduce(self, call: Call, buf: np.ndarray, op: ReduceOp) -> None:
        self._run(call, lambda ch: algorithms.all_reduce(ch, buf, op))
        if op is ReduceOp.AVG:
            finish_average(buf, call.group.size)

    def reduce(self, call: Call, buf: np.ndarray, op: ReduceOp, root: int) -> None:
        self._run(call, lambda ch: algorithms.reduce(ch, buf, op, root))
        if op is ReduceOp.AVG and call.group.index == root:
            finish_average(buf, call.group.size)

    def broadcast(self, call: Call, buf: np.ndarray, root: int) -> None:
        self._run(call, lambda ch: algorithms.broadcast(ch, buf, root))

    def all_gather(self, call: Call, src: np.ndarray, out: np.ndarray) -> None:
        self._run(call, lambda ch: algorithms.all_gather(ch, src, out))

    def reduce_scatter(self, call: Call, src: np.ndarray, out: np.ndarray, op: ReduceOp) -> None:
        self._run(call, lambda ch: algorithms.reduce_scatter(ch, src, out, op))
        if op is ReduceOp.AVG:
            finish_average(out, call.group.size)

    def gather(self, call: Call, src: np.ndarray, out: np.ndarray | None, root: int) -> None:
        self._run(call, lambda ch: algorithms.gather(ch, src, out, root))

    def scatter(self, call: Call, src: np.ndarray | None, out: np.ndarray, root: int) -> None:
        self._run(call, lambda ch: algorithms.scatter(ch, src, out, root))

    def all_to_all(self, call: Call, src: np.ndarray, out: np.ndarray) -> None:
        self._run(call, lambda ch: algorithms.all_to_all(ch, src, out))

    def send(self, call: Call, buf: np.ndarray, dst: int) -> None:
        self._run(call, lambda ch: algorithms.send(ch, buf, dst))

    def recv(self, call: Call, out: np.ndarray, src: int) -> None:
        self._run(call, lambda ch: algorithms.recv(ch, out, src))

    def close(self) -> None:
        """Nothing to release: the transport belongs to the job."""

    def abort(self, error: BaseException) -> None:
        """Waiters are woken through the job's mailbox, which the failure state fails."""
