"""What a local rank called, carried in the first barrier of every call, and the mismatch it reveals."""

from __future__ import annotations

import struct
import zlib

import numpy as np

from collsvc.errors import CollectiveMismatchError
from collsvc.types import OP_CODES, ReduceOp

_DESC = struct.Struct("<QIIqqI")  # digest, collective, dtype code, count, root (-1: none), op code
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")
_OP_NAMES = {code: op.name for op, code in OP_CODES.items()}


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


def mismatch(where: str, bodies: list[bytes], mine: str) -> CollectiveMismatchError:
    """The error every rank raises when ``bodies`` (one per local rank) differ.

    ``details`` maps each local rank to its digest in hex when the caller's digests differ, else to a
    description of its call (the digests agree, so the calls differ in what the digest did not cover).
    """
    decoded = [_DESC.unpack(b) if len(b) == _DESC.size else None for b in bodies]
    digests = {d[0] for d in decoded if d is not None}
    details: dict[int, str] = {}
    for rank, desc in enumerate(decoded):
        if desc is None:
            details[rank] = "?"
        elif len(digests) > 1:
            details[rank] = f"{desc[0]:#018x}"
        else:
            _, coll, dtype, count, root, op = desc
            details[rank] = (
                f"{COLLECTIVES[coll]} dtype#{dtype:08x} x{count} op={_OP_NAMES.get(op, '-')} "
                f"root={None if root < 0 else root}"
            )
    return CollectiveMismatchError(
        f"{where}: local ranks called different collectives: {details}; this rank: {mine}", details
    )
