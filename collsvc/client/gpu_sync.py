"""What the Communicator adds for GPU collectives, which return once NCCL has them enqueued: an
explicit wait for completion (``synchronize``), and ``Work`` handles whose ``wait()`` raises what the
NCCL backend's watchdog found (see docs/gpu.md, "When errors surface")."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from collsvc.client.backends.base import Backend, GroupSpec, Signature
from collsvc.client.calls import CallRunner
from collsvc.client.job import Job
from collsvc.client.work import OrderedExecutor, Work


class GpuSync:
    """Mixed into the Communicator (which sets these attributes)."""

    _job: Job
    _calls: CallRunner
    _executor: OrderedExecutor
    name: str

    def synchronize(self) -> None:
        """Blocks until every GPU collective this process issued so far finished on the GPU (async
        calls still queued first), as ``torch.cuda.synchronize()`` would, but raising the collective's
        error: without it, a failure found after a call returned is raised by the next call or
        ``Work.wait()``. Returns at once when the job does not run on NCCL.

        Raises:
            CollectiveTimeoutError (naming the late ranks) / RankFailedError / AbortedError /
                CollsvcError: a collective failed, now or earlier.
        """
        if self._job.backend_name == "nccl":
            nccl: Any = self._job.backend_for(True)
            self._executor.run(nccl.synchronize)

    def _async_work(
        self,
        future_of: Callable[[], Any],
        group: GroupSpec,
        stream: str,
        seq: int,
        signature: Signature,
        backend: Backend,
    ) -> Work[Any]:
        """The Work of call ``seq`` of ``stream`` (submitted here): its ``wait()`` also settles a GPU
        call (the backend's ``settle``: raises what the watchdog found; in blocking mode, waits)."""
        late = functools.partial(self._calls.late_for, group, stream, seq, signature)
        future = self._executor.submit(future_of)
        title = f"{signature.text} #{seq} in group '{self.name}'"
        return Work(future, title, late, getattr(backend, "settle", None))
