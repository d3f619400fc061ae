"""Whether the NCCL backend can run in this process, and what to install when it cannot.

The backend owns its probe: ``collsvc.client.devices`` asks here which device a member may report, so
device identity and the backend agree by construction. Nothing here imports CuPy at module import.
"""

from __future__ import annotations

import warnings
from typing import Any

from collsvc.errors import BackendUnavailableError

INSTALL_HINT = "pip install 'collsvc[cuda12]'"

# What the backend calls in ``cupy.cuda.nccl``. NCCL_AVG, NCCL_BFLOAT16 and send/recv are optional: their
# absence is handled per operation (``dtypes.py``, ``group_comm.has_p2p``).
REQUIRED_NCCL_NAMES = (
    "NcclCommunicator", "get_unique_id", "get_version", "groupStart", "groupEnd",
    "NCCL_INT8", "NCCL_UINT8", "NCCL_INT32", "NCCL_UINT32", "NCCL_INT64", "NCCL_UINT64",
    "NCCL_FLOAT16", "NCCL_FLOAT32", "NCCL_FLOAT64", "NCCL_SUM", "NCCL_PROD", "NCCL_MAX", "NCCL_MIN",
)  # fmt: skip
REQUIRED_COMMUNICATOR_METHODS = (
    "allReduce", "reduce", "broadcast", "allGather", "reduceScatter", "check_async_error", "abort", "destroy",
)  # fmt: skip


def load_cupy() -> tuple[Any, Any]:
    """Returns ``(cupy, cupy.cuda.nccl)``.

    Raises:
        BackendUnavailableError: CuPy is missing, cannot load the NCCL library, lacks a function the
            backend calls, or sees no GPU.
    """
    try:
        with warnings.catch_warnings():  # CuPy warns when libnccl is missing; the error below says more
            warnings.simplefilter("ignore")
            import cupy
            from cupy.cuda import nccl
    except Exception as exc:
        raise BackendUnavailableError(f"the nccl backend needs CuPy ({exc}); install it with {INSTALL_HINT}") from exc
    version = getattr(cupy, "__version__", "?")
    if not getattr(nccl, "available", False) or not hasattr(nccl, "NcclCommunicator"):
        raise BackendUnavailableError(
            f"CuPy {version} cannot load the NCCL library; install it with "
            f"{INSTALL_HINT}, which brings nvidia-nccl-cu12 (CuPy >= 14 no longer bundles NCCL)"
        )
    missing = [n for n in REQUIRED_NCCL_NAMES if not hasattr(nccl, n)]
    missing += [f"NcclCommunicator.{n}" for n in REQUIRED_COMMUNICATOR_METHODS if not hasattr(nccl.NcclCommunicator, n)]
    if missing:
        raise BackendUnavailableError(f"CuPy {version}'s cupy.cuda.nccl lacks {', '.join(missing)}; upgrade CuPy")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        raise BackendUnavailableError(f"the nccl backend needs a CUDA GPU; CUDA says: {exc}") from exc
    if count < 1:
        raise BackendUnavailableError("the nccl backend needs a CUDA GPU; none is visible to this process")
    return cupy, nccl


def unavailable_reason() -> str | None:
    """What stops this process from running the NCCL backend, in words with the fix; None when it can."""
    try:
        load_cupy()
    except BackendUnavailableError as exc:
        return str(exc)
    return None
