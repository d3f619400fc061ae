"""Reduce operations and the dtype table, shared by the client's layers.

The option dataclasses the coordinator shares live in :mod:`collsvc.options`, which imports no numpy.
"""

from __future__ import annotations

import enum

import numpy as np

try:  # ml_dtypes gives numpy a bfloat16; it is a runtime dependency but stay importable without it.
    import ml_dtypes

    BFLOAT16: np.dtype | None = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - exercised only in stripped installs
    BFLOAT16 = None


class ReduceOp(enum.Enum):
    """Elementwise reduction applied by all_reduce, reduce and reduce_scatter."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"
    AVG = "avg"

    # Members are singletons compared by identity: hash them as such, in C (Enum's own __hash__ is
    # Python code, and ops are dictionary keys on every collective's path).
    __hash__ = object.__hash__


BITWISE_OPS = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})

# Wire codes: stable small integers for signatures and frame headers.
_DTYPE_NAMES: tuple[str, ...] = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
DTYPE_CODES: dict[str, int] = {name: code for code, name in enumerate(_DTYPE_NAMES, start=1)}
OP_CODES: dict[ReduceOp, int] = {op: code for code, op in enumerate(ReduceOp, start=1)}


# Supported dtypes seen so far -> their collsvc names (numpy's dtype.name is slow: it runs Python code).
_NAME_OF: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """The collsvc name of a numpy dtype ("bfloat16" for ml_dtypes' bfloat16).

    Raises:
        TypeError: the dtype is not one collsvc supports.
    """
    known = _NAME_OF.get(dtype)
    if known is not None:
        return known
    name = "bfloat16" if BFLOAT16 is not None and dtype == BFLOAT16 else dtype.name
    if name not in DTYPE_CODES or dtype.byteorder == ">":
        supported = ", ".join(_DTYPE_NAMES)
        raise TypeError(f"unsupported dtype {dtype!s}; supported: {supported}")
    if len(_NAME_OF) < 256:  # bounded: equal dtypes with distinct metadata hash apart
        _NAME_OF[dtype] = name
    return name


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype for a collsvc dtype name.

    Raises:
        TypeError: unknown name, or bfloat16 without ml_dtypes.
    """
    if name == "bfloat16":
        if BFLOAT16 is None:
            raise TypeError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes")
        return BFLOAT16
    if name not in DTYPE_CODES:
        raise TypeError(f"unsupported dtype {name!r}")
    return np.dtype(name)


# (op, dtype) pairs check_op_dtype has accepted: a repeated call checks one set membership.
_ALLOWED_PAIRS: set[tuple[ReduceOp, np.dtype]] = set()


def check_op_dtype(op: ReduceOp, dtype: np.dtype) -> None:
    """Rejects reduce-op/dtype pairs that API.md forbids.

    Raises:
        TypeError: op is not a ReduceOp, the dtype is unsupported, a bitwise op on a non-integer,
            non-bool dtype, MIN/MAX on complex, or AVG on an integer or bool dtype.
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a collsvc.ReduceOp, got {op!r}")
    if (op, dtype) in _ALLOWED_PAIRS:
        return
    name = dtype_name(dtype)
    kind = dtype.kind
    if op in BITWISE_OPS and kind not in "biu":
        raise TypeError(f"{op.name} needs an integer or bool array, got {name}")
    if op in (ReduceOp.MIN, ReduceOp.MAX) and kind == "c":
        raise TypeError(f"{op.name} is undefined for complex dtype {name}")
    if op is ReduceOp.AVG and kind in "biu":
        raise TypeError(f"AVG of integer or bool dtype {name} is not allowed; use SUM and divide")
    if len(_ALLOWED_PAIRS) < 1024:
        _ALLOWED_PAIRS.add((op, dtype))


# Lossy wire formats all_reduce and reduce_scatter accept for the frames that cross hosts (docs/api.md,
# "Compressed wire"): torch's bf16/fp16 compress hooks and Bagua's MinMaxUInt8.
COMPRESSIONS: tuple[str, ...] = ("bf16", "fp16", "minmax_uint8")
COMPRESSIBLE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})


def check_compression(compression: object, op: ReduceOp, dtype: str) -> str:
    """Checks a reduction's ``compression`` argument against its op and dtype (a collsvc dtype name).

    Returns:
        The compression's name, "" for None (an exact wire).

    Raises:
        ValueError: an unknown compression, or an op other than SUM and AVG with one.
        TypeError: a compression for a dtype other than float16, bfloat16, float32 or float64.
    """
    if compression is None:
        return ""
    if not isinstance(compression, str) or compression not in COMPRESSIONS:
        accepted = ", ".join(repr(name) for name in COMPRESSIONS)
        raise ValueError(f"compression must be None or one of {accepted}, got {compression!r}")
    if dtype not in COMPRESSIBLE_DTYPES:
        raise TypeError(f"compression={compression!r} needs a float16, bfloat16, float32 or float64 array, got {dtype}")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        name = op.name if isinstance(op, ReduceOp) else repr(op)
        raise ValueError(f"compression={compression!r} needs op SUM or AVG, got {name}")
    return compression
