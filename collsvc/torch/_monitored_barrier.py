"""``dist.monitored_barrier`` on collsvc groups.

torch's ``dist.monitored_barrier`` refuses every group whose backend is not named gloo, before it asks
the group ("monitored_barrier is only implemented for GLOO backend"), although the group itself has
the method. Importing ``collsvc.torch`` puts a wrapper in its place (in ``torch.distributed`` and
``torch.distributed.distributed_c10d``): a collsvc group runs its own
:meth:`~collsvc.torch.ProcessGroupCollsvc.monitored_barrier`; any other group, a rank outside the
group and an uninitialized default group go to torch's function unchanged. Code that bound torch's
function before ``import collsvc.torch`` (``from torch.distributed import monitored_barrier``) keeps
torch's.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from collsvc.torch._process_group import ProcessGroupCollsvc

_WRAPPED = "__collsvc_wrapped__"


def install() -> None:
    """Puts the wrapper in place of torch's ``monitored_barrier`` (idempotent)."""
    torch_function = c10d.monitored_barrier
    if getattr(torch_function, _WRAPPED, None) is not None:
        return

    @functools.wraps(torch_function)
    def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        target = group
        if target is None and dist.is_initialized():
            target = c10d._get_default_group()
        if isinstance(target, ProcessGroupCollsvc):
            return target.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)
        return torch_function(group, timeout, wait_all_ranks)

    setattr(monitored_barrier, _WRAPPED, torch_function)
    c10d.monitored_barrier = monitored_barrier
    dist.monitored_barrier = monitored_barrier
