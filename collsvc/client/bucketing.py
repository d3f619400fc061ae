"""Gradient bucketing: reduce arrays in fused buckets of about ``pack_size`` bytes as they become ready.

Buckets are fixed from the order of the arrays given (put them in the order backpropagation produces
them) so they are identical on every rank. A bucket launches once all its arrays are ready *and* every
earlier bucket has launched, so every rank issues the same fused all_reduces in the same order even
when gradients become ready in a different order on different ranks.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

from collsvc.arrays import adapt
from collsvc.client.work import Work
from collsvc.types import ReduceOp, check_op_dtype, numpy_dtype


class AllReducer(Protocol):
    """What the bucketer needs of a communicator (the Communicator is one)."""

    def all_reduce(self, x: Any, op: ReduceOp = ..., *, out: Any = ..., async_op: bool = ...) -> Any: ...


class GradientBucketer:
    """Call it with each array when it is ready; ``wait()`` launches the rest and waits for all.

    Results are written back in place into the given arrays.
    """

    def __init__(self, comm: AllReducer, arrays: list[Any], pack_size: int, op: ReduceOp) -> None:
        if not arrays:
            raise ValueError("all_reduce_callback needs at least one array")
        if isinstance(pack_size, bool) or not isinstance(pack_size, int) or pack_size < 1:
            raise ValueError(f"pack_size must be a positive number of bytes, got {pack_size!r}")
        self._comm = comm
        self._op = op
        self._arrays = arrays
        self._index = {id(a): i for i, a in enumerate(arrays)}
        if len(self._index) != len(arrays):
            raise ValueError("all_reduce_callback: the same array appears twice")
        self._buckets: list[list[int]] = []
        current: list[int] = []
        current_bytes = 0
        current_dtype = ""
        for i, array in enumerate(arrays):
            a = adapt(array, name=f"arrays[{i}]")
            check_op_dtype(op, numpy_dtype(a.dtype))
            nbytes = int(a.array.nbytes)
            # A bucket holds one dtype (one fused transfer) and closes once it reaches pack_size.
            if current and (a.dtype != current_dtype or current_bytes >= pack_size):
                self._buckets.append(current)
                current, current_bytes = [], 0
            current.append(i)
            current_bytes += nbytes
            current_dtype = a.dtype
        self._buckets.append(current)
        self._bucket_of = {i: b for b, members in enumerate(self._buckets) for i in members}
        self._missing = [len(members) for members in self._buckets]
        self._next = 0
        self._works: list[Work[Any]] = []
        self._lock = threading.Lock()

    @property
    def num_buckets(self) -> int:
        return len(self._buckets)

    def __call__(self, array: Any) -> None:
        """Marks ``array`` ready; launches every bucket that is now complete and next in order.

        Raises:
            ValueError: ``array`` is not one of the arrays given, or was already marked ready.
        """
        index = self._index.get(id(array))
        if index is None:
            raise ValueError("all_reduce_callback: this array is not one of the arrays it was made with")
        with self._lock:
            bucket = self._bucket_of[index]
            if self._missing[bucket] <= 0:
                raise ValueError(f"all_reduce_callback: arrays[{index}] was already marked ready")
            self._missing[bucket] -= 1
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self._buckets) and self._missing[self._next] == 0:
            members = [self._arrays[i] for i in self._buckets[self._next]]
            work = self._comm.all_reduce(members, self._op, out=members, async_op=True)
            self._works.append(work)
            self._next += 1

    def wait(self, timeout: float | None = None) -> None:
        """Launches the buckets not yet launched (ready or not) and waits for every bucket.

        Raises:
            CollsvcError: a bucket's all_reduce failed.
        """
        with self._lock:
            for b in range(self._next, len(self._buckets)):
                self._missing[b] = 0
            self._launch_ready()
            works = list(self._works)
        try:
            for work in works:
                work.wait(timeout)
        finally:
            with self._lock:  # ready for the next step
                self._missing = [len(members) for members in self._buckets]
                self._next = 0
                self._works = []
