"""Building blocks the NCCL backend composes its collectives from: grouped point-to-point exchanges of
equal-sized blocks, device-to-device copies, and the reductions NCCL lacks (bitwise folds, AVG by
division). Every call is enqueued on the group's stream; nothing here waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from collsvc.client.backends.nccl.dtypes import Mode, ReducePlan
from collsvc.client.backends.nccl.group_comm import GroupComm


def ptr(array: Any) -> int:
    """The device address of a CuPy array's first byte."""
    return int(array.data.ptr)


class Blocks:
    """Block operations over one CuPy and its ``cupy.cuda.nccl``.

    Args:
        cupy: the ``cupy`` module.
        nccl: ``cupy.cuda.nccl``.
    """

    def __init__(self, cupy: Any, nccl: Any) -> None:
        self._cp = cupy
        self._nccl = nccl
        self.byte_type = int(nccl.NCCL_UINT8)

    @contextlib.contextmanager
    def grouped(self) -> Iterator[None]:
        """``ncclGroupStart``/``ncclGroupEnd`` around the sends and receives enqueued inside."""
        self._nccl.groupStart()
        try:
            yield
        finally:
            self._nccl.groupEnd()

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        runtime = self._cp.cuda.runtime
        runtime.memcpyAsync(dst, src, nbytes, runtime.memcpyDeviceToDevice, stream)

    def gather_into(self, gc: GroupComm, stream: int, blocks: Any, mine: Any, nb: int) -> None:
        """Receives every member's block into ``blocks`` in group order (ours copied locally)."""
        me = gc.group.index
        for r in range(gc.group.size):
            if r == me:
                self.copy(ptr(blocks) + r * nb, ptr(mine), nb, stream)
            else:
                gc.comm.recv(ptr(blocks) + r * nb, nb, self.byte_type, r, stream)

    def all_to_all(self, gc: GroupComm, stream: int, src: Any, out: Any, nb: int) -> None:
        """Block r of ``src`` goes to member r; block r of ``out`` comes from member r."""
        me = gc.group.index
        for r in range(gc.group.size):
            if r == me:
                self.copy(ptr(out) + r * nb, ptr(src) + r * nb, nb, stream)
            else:
                gc.comm.send(ptr(src) + r * nb, nb, self.byte_type, r, stream)
                gc.comm.recv(ptr(out) + r * nb, nb, self.byte_type, r, stream)

    def fold(self, gc: GroupComm, blocks: Any, out: Any, plan: ReducePlan) -> None:
        """``out = blocks[0] op blocks[1] op ...`` in rank order, on the communicator's stream."""
        ufunc = getattr(self._cp, plan.ufunc)
        view = plan.view
        with gc.stream:
            b = blocks.view(view) if view else blocks
            o = out.view(view) if view else out
            o[...] = b[0]
            for r in range(1, b.shape[0]):
                ufunc(o, b[r], out=o)

    def maybe_divide(self, gc: GroupComm, buf: Any, plan: ReducePlan) -> None:
        """Divides by the group size when the plan is SUM then divide (AVG without ``NCCL_AVG``)."""
        if plan.mode is not Mode.SUM_THEN_DIVIDE:
            return
        with gc.stream:
            v = buf.view(plan.view) if plan.view else buf
            v /= gc.group.size
