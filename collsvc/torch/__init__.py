"""collsvc as a torch.distributed backend.

```python
import torch.distributed as dist
import collsvc.torch                   # registers backend "collsvc" for cpu and cuda tensors
dist.init_process_group("collsvc")     # under collsvc run, torchrun, env://, tcp:// or file://
```

Importing this module registers the backend and lets ``env://`` join the collsvc job under
``collsvc run``. Errors from collectives are the collsvc errors, each also a
``torch.distributed.DistBackendError``. See docs/torch.md.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from collsvc.torch._bootstrap import CoordinatorStore, create_process_group, install_rendezvous
from collsvc.torch._errors import to_torch_error, torch_error_class
from collsvc.torch._monitored_barrier import install as install_monitored_barrier
from collsvc.torch._process_group import BACKEND_NAME, ProcessGroupCollsvc
from collsvc.torch._work import CollsvcWork


def register() -> None:
    """Registers the ``"collsvc"`` backend with torch.distributed and lets ``dist.monitored_barrier`` run on
    collsvc groups (done on import; idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"])
    install_rendezvous()
    install_monitored_barrier()


def monitored_barrier(
    group: Any = None, timeout: datetime.timedelta | float | None = None, wait_all_ranks: bool = False
) -> None:
    """``dist.monitored_barrier`` for collsvc groups only (since ``import collsvc.torch``, torch's own
    ``dist.monitored_barrier`` also runs on them: see ``_monitored_barrier.py``).

    Args:
        group: a collsvc process group, or None for the default group.
        timeout: how long to wait (timedelta or seconds); None: the group's timeout.
        wait_all_ranks: how the message's first line names the missing ranks, as gloo's does (all, or
            the first); the error's ``ranks`` always lists every missing rank.

    Raises:
        CollectiveTimeoutError: some ranks did not arrive; ``waiting_on`` names them (also a
            ``DistBackendError``).
        RankFailedError: a rank failed or left instead (also a ``DistBackendError``).
        ValueError: ``timeout`` is not above zero.
        TypeError: the group is not a collsvc group.
    """
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, ProcessGroupCollsvc):
        raise TypeError(f"monitored_barrier: {pg!r} is not a collsvc process group; use dist.monitored_barrier")
    pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


register()

__all__ = [
    "BACKEND_NAME",
    "CollsvcWork",
    "CoordinatorStore",
    "ProcessGroupCollsvc",
    "monitored_barrier",
    "register",
    "to_torch_error",
    "torch_error_class",
]
