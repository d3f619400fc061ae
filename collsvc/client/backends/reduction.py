"""Elementwise reductions into preallocated numpy buffers, shared by every ring algorithm.

Every function here writes through ``out=`` so the bytes path never allocates per chunk. AVG is reduced
as SUM; the backend divides once at the end with :func:`finish_average`, so every rank divides the
same bit pattern by the same count and gets the same result.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from collsvc.types import BFLOAT16, BITWISE_OPS, ReduceOp

_UFUNCS: dict[ReduceOp, Any] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
    ReduceOp.BAND: np.bitwise_and,
    ReduceOp.BOR: np.bitwise_or,
    ReduceOp.BXOR: np.bitwise_xor,
}

# numpy's add/multiply on bool are or/and already, but say so: the semantics are the contract.
_BOOL_UFUNCS: dict[ReduceOp, Any] = {
    **_UFUNCS,
    ReduceOp.SUM: np.logical_or,
    ReduceOp.AVG: np.logical_or,
    ReduceOp.PRODUCT: np.logical_and,
}

# Per thread: nanoseconds spent in reduce_to since the thread started (read by the call recorder).
_spent = threading.local()

# (ufunc name, dtype) -> whether numpy (or ml_dtypes) has a same-type loop for it; probed once.
_NATIVE: dict[tuple[str, np.dtype], bool] = {}

# numpy's error state is a context variable (numpy >= 2.0). ``np.errstate`` builds a new state on every
# entry, ~2 us: most of a 4 KiB reduction. Where the variable is reachable, a reduction switches it to
# a state made once per caller state instead (the same state np.errstate would make).


def _numpy_error_state() -> tuple[Any, Any]:
    """numpy's error-state context variable and its state maker, or (None, None) (numpy 1.x)."""
    try:
        from numpy._core import umath
    except ImportError:
        return None, None
    variable, maker = getattr(umath, "_extobj_contextvar", None), getattr(umath, "_make_extobj", None)
    return (variable, maker) if variable is not None and maker is not None else (None, None)


_ERROR_STATE, _make_error_state = _numpy_error_state()
# (the caller's error state, the same with overflow and invalid ignored): made from the last one seen.
_quieted: tuple[Any, Any] = (None, None)


def reduced_as(op: ReduceOp) -> ReduceOp:
    """The op the data is combined with: AVG is reduced as SUM (then :func:`finish_average` divides once)."""
    return ReduceOp.SUM if op is ReduceOp.AVG else op


def ufunc_for(op: ReduceOp, dtype: np.dtype) -> Any:
    """The numpy ufunc that applies ``op`` to arrays of ``dtype``.

    Raises:
        TypeError: ``op`` is not a :class:`ReduceOp`.
    """
    table = _BOOL_UFUNCS if dtype.kind == "b" else _UFUNCS
    try:
        return table[op]
    except (KeyError, TypeError):
        raise TypeError(f"op must be a collsvc.ReduceOp, got {op!r}") from None


def _has_native_loop(ufunc: Any, dtype: np.dtype) -> bool:
    key = (ufunc.__name__, dtype)
    known = _NATIVE.get(key)
    if known is None:
        probe = np.zeros(1, dtype=dtype)
        try:
            ufunc(probe, probe, out=probe)
            known = True
        except TypeError:  # numpy raises UFuncTypeError (a TypeError) when no loop matches
            known = False
        _NATIVE[key] = known
    return known


def native_ufunc(op: ReduceOp, dtype: np.dtype) -> Any:
    """The ufunc that applies ``op`` to ``dtype`` in one same-type kernel, or None where numpy has no
    such loop (bfloat16 arithmetic, which :func:`reduce_to` does in float32).

    Raises:
        TypeError: ``op`` is not a :class:`ReduceOp`.
    """
    ufunc = ufunc_for(op, dtype)
    return ufunc if _has_native_loop(ufunc, dtype) else None


def check_reducible(op: ReduceOp, dtype: np.dtype) -> None:
    """Checks that :func:`reduce_into` can apply ``op`` to ``dtype``, before any frame is sent.

    Raises:
        TypeError: ``op`` is not a ReduceOp, or no loop exists (a bitwise op on floats, say).
    """
    ufunc = ufunc_for(op, dtype)
    if not _has_native_loop(ufunc, dtype) and (dtype != BFLOAT16 or op in BITWISE_OPS):
        raise TypeError(f"{op.name} is not defined for dtype {dtype}")


def reduce_to(op: ReduceOp, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """``out = a OP b`` elementwise; ``out`` may be ``a`` or ``b`` (in place).

    The operand order is kept as given, so callers that need bit-identical results on every rank
    (floating-point NaN payloads, signed zeros) pass operands in an order fixed by rank, not by role.

    Args:
        op: the reduction; AVG is applied as SUM.
        out: destination, same dtype and length as ``a`` and ``b``.
        a: left operand.
        b: right operand (for example a read-only view of a received frame).

    Raises:
        TypeError: ``op`` is not a ReduceOp, or the dtype has no loop for it (bitwise on floats).
        ValueError: the lengths differ.
    """
    ufunc = ufunc_for(op, out.dtype)
    started = time.perf_counter_ns()
    try:
        _combine(ufunc, op, out, a, b)
    finally:
        _spent.ns = getattr(_spent, "ns", 0) + time.perf_counter_ns() - started


def reduce_parts(op: ReduceOp, out: np.ndarray, parts: list[np.ndarray]) -> None:
    """``out = parts[0] OP parts[1] OP ...`` in this order (AVG applied as SUM), in one kernel pass each.

    The same as :func:`reduce_to` then :func:`reduce_into` for every further part, with one error-state
    switch and one clock read for all of them (small collectives pay for each). ``out`` may be
    ``parts[0]`` or ``parts[1]`` but no later part (it is overwritten first).

    Raises:
        TypeError: ``op`` is not a ReduceOp, or the dtype has no loop for it.
        ValueError: fewer than two parts, or the lengths differ.
    """
    if len(parts) < 2:
        raise ValueError(f"reduce_parts needs at least two parts, got {len(parts)}")
    ufunc = ufunc_for(op, out.dtype)
    if not _has_native_loop(ufunc, out.dtype):
        reduce_to(op, out, parts[0], parts[1])
        for part in parts[2:]:
            reduce_to(op, out, out, part)
        return
    started = time.perf_counter_ns()
    try:
        quiet_fold(ufunc, out, parts)
    finally:
        _spent.ns = getattr(_spent, "ns", 0) + time.perf_counter_ns() - started


def fold(ufunc: Any, out: np.ndarray, parts: Sequence[np.ndarray]) -> None:
    """``out = parts[0] UFUNC parts[1] UFUNC ...`` in this order, one kernel pass per part (``out`` may be
    ``parts[0]`` or ``parts[1]`` but no later part). No error-state switch and no clock: the caller's."""
    ufunc(parts[0], parts[1], out=out)
    for part in parts[2:]:
        ufunc(out, part, out=out)


def quiet_fold(ufunc: Any, out: np.ndarray, parts: Sequence[np.ndarray]) -> None:
    """:func:`fold` with numpy's overflow and invalid warnings off, its other error settings as the
    caller has them: overflow to inf and inf - inf = nan are results, not errors, as in every other
    collective library (numpy's RuntimeWarnings would only be noise in the user's log).

    Raises:
        ValueError / TypeError: as the ufunc raises them (lengths, dtypes).
    """
    global _quieted
    if _ERROR_STATE is None:
        with np.errstate(over="ignore", invalid="ignore"):
            fold(ufunc, out, parts)
        return
    current = _ERROR_STATE.get()
    quieted = _quieted
    if quieted[0] is not current:
        quieted = _quieted = (current, _make_error_state(over="ignore", invalid="ignore"))
    token = _ERROR_STATE.set(quieted[1])
    try:  # fold(ufunc, out, parts), inline: a 4 KiB all_reduce is mostly calls like this one
        ufunc(parts[0], parts[1], out=out)
        for part in parts[2:]:
            ufunc(out, part, out=out)
    finally:
        _ERROR_STATE.reset(token)


def reducing_ns() -> int:
    """Nanoseconds this thread has spent in reduction kernels so far (the timeline's "reducing" phase)."""
    return int(getattr(_spent, "ns", 0))


def _combine(ufunc: Any, op: ReduceOp, out: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    if _has_native_loop(ufunc, out.dtype):
        quiet_fold(ufunc, out, (a, b))
        return
    check_reducible(op, out.dtype)
    # A bfloat16 without a native loop (an old ml_dtypes): compute in float32 and round once. float32
    # carries more than 2p+2 bits of bfloat16's p, so the double rounding still gives the correctly
    # rounded result, the same on every rank.
    wide = np.empty(out.shape, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        ufunc(a.astype(np.float32), b.astype(np.float32), out=wide)
    out[...] = wide.astype(out.dtype)


def reduce_into(op: ReduceOp, dst: np.ndarray, src: np.ndarray) -> None:
    """``dst = dst OP src`` in place, without allocating.

    Args:
        op: the reduction; AVG is applied as SUM (the caller divides afterwards).
        dst: the accumulator, written in place.
        src: the other operand, same dtype and length (may be read-only).

    Raises:
        TypeError: ``op`` is not a ReduceOp, or the dtype has no loop for it.
        ValueError: the lengths differ.
    """
    reduce_to(op, dst, dst, src)


def finish_average(buf: np.ndarray, count: int) -> None:
    """Divides a SUM-reduced ``buf`` by ``count`` in place, turning it into the AVG result.

    The division is one correctly rounded ufunc per element, so identical inputs give identical
    outputs on every rank.

    Args:
        buf: a floating-point or complex array holding the sum.
        count: the number of contributions (the group size).

    Raises:
        TypeError: ``buf`` is not a floating-point or complex array.
        ValueError: ``count`` is not positive.
    """
    if count <= 0:
        raise ValueError(f"count must be positive, got {count}")
    if buf.dtype.kind not in "fc" and buf.dtype != BFLOAT16:
        raise TypeError(f"cannot average an array of dtype {buf.dtype}")
    if count == 1 or buf.size == 0:
        return
    np.divide(buf, count, out=buf)
