"""What a local rank called, carried in the first barrier of every call, and the mismatch it reveals."""

from __future__ import annotations

import functools
import json
import struct
import zlib
from typing import Any

import numpy as np

from collsvc.errors import CollectiveMismatchError
from collsvc.types import DTYPE_CODES, OP_CODES, ReduceOp, numpy_dtype

_DESC = struct.Struct("<QIIqqI")  # digest, collective, dtype code, count, root (-1: none), op code
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "reduce_scatter",
    "barrier",
    "all_to_all",
    "gather",
    "scatter",
)
_OP_NAMES = {code: op.name for op, code in OP_CODES.items()}


@functools.lru_cache(maxsize=512)
def encode(collective: str, dtype: np.dtype, count: int, op: ReduceOp | None, root: int | None, digest: int) -> bytes:
    """The descriptor bytes; equal on two ranks exactly when their calls agree."""
    return _DESC.pack(
        digest & (2**64 - 1),
        COLLECTIVES.index(collective),
        zlib.crc32(f"{dtype.name}/{dtype.str}".encode()),
        count,
        -1 if root is None else root,
        0 if op is None else OP_CODES[op],
    )


@functools.lru_cache(maxsize=1)
def _dtype_names() -> dict[int, str]:
    names: dict[int, str] = {}
    for name in DTYPE_CODES:
        try:
            dtype = numpy_dtype(name)
        except TypeError:  # bfloat16 without ml_dtypes
            continue
        names[zlib.crc32(f"{dtype.name}/{dtype.str}".encode())] = name
    return names


def describe(body: bytes) -> dict[str, Any] | str:
    """A rank's call as far as its descriptor tells: collective, dtype, element count, op, root and the
    digest of its full signature (which also covers the shape). "?" for an unreadable descriptor."""
    if len(body) != _DESC.size:
        return "?"
    digest, coll, dtype, count, root, op = _DESC.unpack(body)
    return {
        "op": COLLECTIVES[coll] if coll < len(COLLECTIVES) else f"#{coll}",
        "dtype": _dtype_names().get(dtype, f"#{dtype:08x}"),
        "count": count,
        "reduce_op": _OP_NAMES.get(op, ""),
        "root": None if root < 0 else root,
        "digest": f"{digest:#018x}",
    }


def mismatch(where: str, bodies: list[bytes], mine: str, labels: list[bytes] | None = None) -> CollectiveMismatchError:
    """The error every rank raises when ``bodies`` (one per local rank) differ.

    ``details`` maps each local rank to :func:`describe` of its descriptor, overlaid with its full
    signature where its ``labels`` entry (JSON of ``Signature.describe``) is readable: the descriptor's
    element count and digest stay, so ranks whose signatures agree still show what differed.
    """
    details: dict[int, Any] = {}
    for rank, body in enumerate(bodies):
        label = labels[rank] if labels is not None and rank < len(labels) else b""
        described = describe(body)
        try:
            signature = json.loads(label.decode()) if label else {}
        except ValueError:
            signature = {}
        details[rank] = {**described, **signature} if isinstance(described, dict) else signature or described
    return CollectiveMismatchError(
        f"{where}: local ranks called different collectives: {details}; this rank: {mine}", details
    )
