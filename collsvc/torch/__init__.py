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
from collsvc.torch._process_group import BACKEND_NAME, ProcessGroupCollsvc
from collsvc.torch._work import CollsvcWork


def register() -> None:
    """Registers the ``"collsvc"`` backend with torch.distributed (done on import; idempotent)."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu", "cuda"])
    install_rendezvous()


def monitored_barrier(
    group: Any = None, timeout: datetime.timedelta | float | None = None, wait_all_ranks: bool = False
) -> None:
    """``dist.monitored_barrier`` for collsvc groups (torch's own accepts only gloo groups).

    Args:
        group: a collsvc process group, or None for the default group.
        timeout: how long to wait (timedelta or seconds); None: the group's timeout.
        wait_all_ranks: accepted for torch compatibility; collsvc always names every missing rank.

    Raises:
        CollectiveTimeoutError: some ranks did not arrive; ``waiting_on`` names them (also a
            ``DistBackendError``).
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
