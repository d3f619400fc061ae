"""collsvc: collective communication for distributed training.

See docs/api.md for the contract: ``collsvc.init()`` returns a :class:`Communicator` (called again for
the same job, the same one); module-level functions act on the default one.
"""

from typing import TYPE_CHECKING, Any

from collsvc.client import fork_guard

fork_guard.keep_grpc_fork_handlers_off()  # before anything loads gRPC: see collsvc/client/fork_guard.py

from collsvc import dynamo_skip  # noqa: E402

if TYPE_CHECKING:  # the public names, for type checkers and IDEs; loaded lazily at run time
    from collsvc import elastic
    from collsvc._api import (
        all_gather,
        all_gather_object,
        all_reduce,
        all_to_all,
        barrier,
        broadcast,
        broadcast_object,
        default_communicator,
        destroy,
        find_group,
        gather,
        get_local_rank,
        get_rank,
        get_world_size,
        init,
        is_initialized,
        new_group,
        recv,
        reduce,
        reduce_scatter,
        scatter,
        send,
    )
    from collsvc.client.communicator import Communicator
    from collsvc.client.work import Work
    from collsvc.errors import (
        AbortedError,
        AuthenticationError,
        BackendUnavailableError,
        CollectiveMismatchError,
        CollectiveTimeoutError,
        CollsvcError,
        ForkedChildError,
        JobBrokenError,
        JobEndedError,
        RankFailedError,
        RendezvousError,
        ResourceLimitError,
    )
    from collsvc.types import ReduceOp

    SUM = ReduceOp.SUM
    PRODUCT = ReduceOp.PRODUCT
    MIN = ReduceOp.MIN
    MAX = ReduceOp.MAX
    BAND = ReduceOp.BAND
    BOR = ReduceOp.BOR
    BXOR = ReduceOp.BXOR
    AVG = ReduceOp.AVG

_LAZY = {
    "Communicator": "collsvc.client.communicator",
    "Work": "collsvc.client.work",
    "ReduceOp": "collsvc.types",
    **{
        name: "collsvc.errors"
        for name in (
            "AbortedError",
            "AuthenticationError",
            "BackendUnavailableError",
            "CollectiveMismatchError",
            "CollectiveTimeoutError",
            "CollsvcError",
            "ForkedChildError",
            "JobBrokenError",
            "JobEndedError",
            "RankFailedError",
            "RendezvousError",
            "ResourceLimitError",
        )
    },
}
_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG")


def __getattr__(name: str) -> Any:
    # `collsvc run` imports this package; keep numpy/gRPC client machinery out of its start-up path.
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _OPS:
        return getattr(importlib.import_module("collsvc.types").ReduceOp, name)
    if name == "elastic":  # the subpackage collsvc.elastic (State, run), imported on first use
        return importlib.import_module("collsvc.elastic")
    if not name.startswith("__"):
        api = importlib.import_module("collsvc._api")
        if hasattr(api, name):
            return getattr(api, name)
    raise AttributeError(f"module 'collsvc' has no attribute {name!r}")


__version__ = "0.1.0"

dynamo_skip.install()  # torch.compile runs collsvc's code as it is, without tracing into it

__all__ = [
    "AVG",
    "BAND",
    "BOR",
    "BXOR",
    "MAX",
    "MIN",
    "PRODUCT",
    "SUM",
    "AbortedError",
    "AuthenticationError",
    "BackendUnavailableError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CollsvcError",
    "Communicator",
    "ForkedChildError",
    "JobBrokenError",
    "JobEndedError",
    "RankFailedError",
    "ReduceOp",
    "RendezvousError",
    "ResourceLimitError",
    "Work",
    "__version__",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_object",
    "default_communicator",
    "destroy",
    "elastic",
    "find_group",
    "gather",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
]
