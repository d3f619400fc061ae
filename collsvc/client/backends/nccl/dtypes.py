"""How each (reduce op, dtype) pair runs on NCCL: pure tables, no CuPy needed.

NCCL reduces a fixed set of element types with SUM/PROD/MIN/MAX (and AVG from 2.10). Everything else is
planned here, once, so the backend's methods stay a few lines each:

- complex64/complex128 travel as twice as many float32/float64 (SUM and AVG only: they are elementwise
  on the real and imaginary parts; PRODUCT is not).
- bool travels as uint8 holding 0/1: SUM is a logical or (MAX), PRODUCT a logical and (MIN), matching
  numpy's ``np.add``/``np.multiply`` on bools. BAND/BOR map to MIN/MAX the same way.
- BAND/BOR/BXOR on integers have no NCCL op: the blocks are gathered and folded on the GPU in rank order.
- AVG without NCCL_AVG (NCCL < 2.10) is SUM followed by a division on the GPU.

Data-movement collectives (broadcast, gathers, scatters, all_to_all, send/recv) move raw bytes and do not
consult these tables, so they take every dtype collsvc supports.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from collsvc.types import ReduceOp

# NCCL_AVG and NCCL_BFLOAT16 arrived in NCCL 2.10 (version code 21000); send/recv in 2.7 (2700).
NCCL_AVG_MIN_VERSION = 21000
NCCL_BFLOAT16_MIN_VERSION = 21000
NCCL_P2P_MIN_VERSION = 2700

# logical dtype -> (NCCL datatype attribute of cupy.cuda.nccl, dtype to view the buffer as, elements per item)
_NATIVE: dict[str, tuple[str, str | None, int]] = {
    "int8": ("NCCL_INT8", None, 1),
    "uint8": ("NCCL_UINT8", None, 1),
    "int32": ("NCCL_INT32", None, 1),
    "uint32": ("NCCL_UINT32", None, 1),
    "int64": ("NCCL_INT64", None, 1),
    "uint64": ("NCCL_UINT64", None, 1),
    "float16": ("NCCL_FLOAT16", None, 1),
    "float32": ("NCCL_FLOAT32", None, 1),
    "float64": ("NCCL_FLOAT64", None, 1),
    "bfloat16": ("NCCL_BFLOAT16", None, 1),  # the buffer is a uint16 view; NCCL only sees the pointer
    "complex64": ("NCCL_FLOAT32", "float32", 2),
    "complex128": ("NCCL_FLOAT64", "float64", 2),
    "bool": ("NCCL_UINT8", "uint8", 1),
}

REDUCIBLE_DTYPES: tuple[str, ...] = tuple(_NATIVE)

_NATIVE_OPS: dict[ReduceOp, str] = {
    ReduceOp.SUM: "NCCL_SUM",
    ReduceOp.PRODUCT: "NCCL_PROD",
    ReduceOp.MIN: "NCCL_MIN",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.AVG: "NCCL_AVG",
}

# bool as 0/1 bytes: every reduction is MIN or MAX, except BXOR (folded).
_BOOL_OPS: dict[ReduceOp, str] = {
    ReduceOp.SUM: "NCCL_MAX",
    ReduceOp.BOR: "NCCL_MAX",
    ReduceOp.MAX: "NCCL_MAX",
    ReduceOp.PRODUCT: "NCCL_MIN",
    ReduceOp.BAND: "NCCL_MIN",
    ReduceOp.MIN: "NCCL_MIN",
}

_FOLD_UFUNCS: dict[ReduceOp, str] = {
    ReduceOp.BAND: "bitwise_and",
    ReduceOp.BOR: "bitwise_or",
    ReduceOp.BXOR: "bitwise_xor",
}


class Mode(Enum):
    """How a reduction runs."""

    NATIVE = "native"  # one NCCL reduction with ``nccl_op``
    SUM_THEN_DIVIDE = "sum_then_divide"  # NCCL_SUM, then divide by the group size on the GPU
    FOLD = "fold"  # gather the blocks, then fold them with ``ufunc`` in rank order


@dataclass(frozen=True)
class ReducePlan:
    """What the backend does for one (op, dtype) pair.

    Attributes:
        mode: native NCCL reduction, SUM then divide, or gather and fold.
        nccl_dtype: attribute name in ``cupy.cuda.nccl`` of the element type NCCL sees.
        view: the dtype to view the flat buffer as before handing it to NCCL (None: as it is).
        factor: NCCL elements per logical element (2 for complex through a real view).
        nccl_op: attribute name of the NCCL reduction (NATIVE and SUM_THEN_DIVIDE).
        ufunc: name of the CuPy bitwise ufunc (FOLD).
    """

    mode: Mode
    nccl_dtype: str
    view: str | None
    factor: int
    nccl_op: str = ""
    ufunc: str = ""


def supported_message() -> str:
    return "the nccl backend reduces " + ", ".join(REDUCIBLE_DTYPES)


def plan_reduction(op: ReduceOp, dtype: str, nccl_version: int, has_avg: bool = True) -> ReducePlan:
    """Plans one reduction.

    Args:
        op: the reduction.
        dtype: logical dtype name (``Call.signature.dtype``; bfloat16 buffers arrive as uint16 views).
        nccl_version: ``cupy.cuda.nccl.get_version()``.
        has_avg: whether this CuPy build defines NCCL_AVG.

    Raises:
        TypeError: the dtype cannot be reduced on NCCL (int16, uint16, bfloat16 before NCCL 2.10), or the
            op is undefined for it (PRODUCT on complex, bitwise on floats, AVG on integers).
    """
    if not isinstance(op, ReduceOp):
        raise TypeError(f"op must be a collsvc.ReduceOp, got {op!r}")
    if dtype not in _NATIVE:
        raise TypeError(f"{op.name} of {dtype} is not supported on NCCL; {supported_message()}")
    if dtype == "bfloat16" and nccl_version < NCCL_BFLOAT16_MIN_VERSION:
        raise TypeError(f"{op.name} of bfloat16 needs NCCL >= 2.10 (found version code {nccl_version})")
    nccl_dtype, view, factor = _NATIVE[dtype]
    if dtype == "bool":
        if op is ReduceOp.AVG:
            raise TypeError("AVG of bool is not allowed; use SUM and divide")
        if op is ReduceOp.BXOR:
            return ReducePlan(Mode.FOLD, nccl_dtype, view, factor, ufunc="bitwise_xor")
        return ReducePlan(Mode.NATIVE, nccl_dtype, view, factor, nccl_op=_BOOL_OPS[op])
    is_complex = dtype.startswith("complex")
    is_float = dtype.startswith(("float", "bfloat"))
    if op in _FOLD_UFUNCS:
        if is_complex or is_float:
            raise TypeError(f"{op.name} needs an integer or bool array, got {dtype}")
        return ReducePlan(Mode.FOLD, nccl_dtype, view, factor, ufunc=_FOLD_UFUNCS[op])
    if is_complex and op is not ReduceOp.SUM and op is not ReduceOp.AVG:
        raise TypeError(f"{op.name} of complex dtype {dtype} is not supported on NCCL (SUM and AVG are)")
    if op is ReduceOp.AVG:
        if not (is_complex or is_float):
            raise TypeError(f"AVG of integer dtype {dtype} is not allowed; use SUM and divide")
        if not has_avg or nccl_version < NCCL_AVG_MIN_VERSION:
            return ReducePlan(Mode.SUM_THEN_DIVIDE, nccl_dtype, view, factor, nccl_op="NCCL_SUM")
    return ReducePlan(Mode.NATIVE, nccl_dtype, view, factor, nccl_op=_NATIVE_OPS[op])


def describe(signature_op: str, dtype: str, shape: tuple[int, ...], reduce_op: str, group: str, seq: int) -> str:
    """A one-line description of a call for errors and logs, e.g. ``all_reduce(float32[1024], sum)``."""
    dims = ",".join(str(d) for d in shape)
    extra = f", {reduce_op}" if reduce_op else ""
    return f"{signature_op}({dtype}[{dims}]{extra}) in group {group!r} at seq {seq}"
