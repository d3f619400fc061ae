"""What the NCCL backend relies on in CuPy, written down once.

``test_cupy_library.py`` checks these tables against the real CuPy (it needs CuPy and the NCCL library,
not a GPU); ``test_nccl_fake.py`` checks the in-process fake against the same tables, so the fake cannot
drift from the library it stands in for. Recorded from CuPy 14.2.0 with NCCL 2.32.3.
"""

from __future__ import annotations

import inspect
from typing import Any

# NcclCommunicator method -> its parameters after ``self``, as CuPy's signature names them.
COMMUNICATOR_METHODS: dict[str, tuple[str, ...]] = {
    "allReduce": ("sendbuf", "recvbuf", "count", "datatype", "op", "stream"),
    "reduce": ("sendbuf", "recvbuf", "count", "datatype", "op", "root", "stream"),
    "broadcast": ("sendbuff", "recvbuff", "count", "datatype", "root", "stream"),
    "allGather": ("sendbuf", "recvbuf", "count", "datatype", "stream"),
    "reduceScatter": ("sendbuf", "recvbuf", "recvcount", "datatype", "op", "stream"),
    "send": ("sendbuf", "count", "datatype", "peer", "stream"),
    "recv": ("recvbuf", "count", "datatype", "peer", "stream"),
    "check_async_error": (),
    "abort": (),
    "destroy": (),
}

# The values of NCCL's nccl.h enums, as cupy.cuda.nccl exports them.
NCCL_CONSTANTS: dict[str, int] = {
    "NCCL_INT8": 0,
    "NCCL_UINT8": 1,
    "NCCL_INT32": 2,
    "NCCL_UINT32": 3,
    "NCCL_INT64": 4,
    "NCCL_UINT64": 5,
    "NCCL_FLOAT16": 6,
    "NCCL_FLOAT32": 7,
    "NCCL_FLOAT64": 8,
    "NCCL_BFLOAT16": 9,
    "NCCL_SUM": 0,
    "NCCL_PROD": 1,
    "NCCL_MAX": 2,
    "NCCL_MIN": 3,
    "NCCL_AVG": 4,
}

MEMCPY_DEVICE_TO_DEVICE = 3


def parameters(function: Any) -> tuple[str, ...]:
    """Parameter names after ``self``, from ``inspect`` or, for Cython methods, the docstring's first line.

    Cython writes the signature as ``Class.name(self, intptr_t sendbuf, size_t count, ...)``.
    """
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        first = (function.__doc__ or "").strip().splitlines()[0]
        inside = first[first.index("(") + 1 : first.rindex(")")]
        names = tuple(p.split("=")[0].split()[-1] for p in inside.split(",") if p.strip())
    return names[1:] if names[:1] == ("self",) else names
