"""reduce_into / reduce_to / finish_average on every dtype, and the step-id and geometry helpers."""

from __future__ import annotations

import numpy as np
import pytest

from collsvc.client.backends import reduction
from collsvc.client.backends.reduction import check_reducible, finish_average, reduce_into, reduce_to
from collsvc.client.backends.ring.algorithms_common import (
    block_bounds,
    check_steps,
    chunk_count,
    chunk_slice,
    elements_per_chunk,
    step_id,
)
from collsvc.types import ReduceOp

from .threads import ALL_DTYPES, BF16, assert_equal_values, exact_inputs, ops_for, reference


def test_reduce_into_matches_reference_for_every_allowed_pair() -> None:
    rng = np.random.default_rng(1)
    for dtype in ALL_DTYPES:
        for op in [*ops_for(dtype), *([ReduceOp.AVG] if dtype.kind in "fcV" else [])]:
            rows = exact_inputs(rng, dtype, op, 2, 33)
            dst = rows[0].copy()
            src = rows[1].copy()
            src.flags.writeable = False  # received frames are read-only
            reduce_into(op, dst, src)
            assert_equal_values(dst, reference(op, rows), f"{dtype}/{op.name}")


def test_bool_sum_is_or_and_product_is_and() -> None:
    a = np.array([True, True, False, False])
    b = np.array([True, False, True, False])
    for op, expected in (
        (ReduceOp.SUM, [1, 1, 1, 0]),
        (ReduceOp.PRODUCT, [1, 0, 0, 0]),
        (ReduceOp.BXOR, [0, 1, 1, 0]),
    ):
        dst = a.copy()
        reduce_into(op, dst, b)
        assert dst.tolist() == [bool(x) for x in expected]


def test_reduce_to_keeps_operand_order_and_allows_aliasing() -> None:
    a = np.array([1.0, 2.0, 3.0], np.float32)
    b = np.array([4.0, 5.0, 6.0], np.float32)
    reduce_to(ReduceOp.SUM, b, a, b)
    assert b.tolist() == [5.0, 7.0, 9.0]
    out = np.empty(3, np.float32)
    reduce_to(ReduceOp.MAX, out, a, np.array([0, 9, 0], np.float32))
    assert out.tolist() == [1.0, 9.0, 3.0]


def test_bitwise_on_floats_is_rejected_before_anything_moves() -> None:
    for dtype in (np.dtype(np.float32), BF16, np.dtype(np.complex64)):
        with pytest.raises(TypeError):
            check_reducible(ReduceOp.BAND, dtype)
    with pytest.raises(TypeError, match="ReduceOp"):
        check_reducible("sum", np.dtype(np.float32))  # type: ignore[arg-type]


def test_bfloat16_fallback_through_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ml_dtypes without a bfloat16 loop still reduces, with the same result as the native loop."""
    rng = np.random.default_rng(2)
    a = rng.standard_normal(50).astype(BF16)
    b = rng.standard_normal(50).astype(BF16)
    for op in (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX):
        native = a.copy()
        reduce_into(op, native, b)
        ufunc = reduction.ufunc_for(op, BF16)
        monkeypatch.setitem(reduction._NATIVE, (ufunc.__name__, BF16), False)
        fallback = a.copy()
        reduce_into(op, fallback, b)
        monkeypatch.undo()
        assert fallback.tobytes() == native.tobytes(), op


def test_finish_average() -> None:
    buf = np.array([3.0, 6.0, -9.0], np.float16)
    finish_average(buf, 3)
    assert buf.tolist() == [1.0, 2.0, -3.0]
    bf = np.array([4.0, 2.0], BF16)
    finish_average(bf, 4)
    assert bf.astype(np.float32).tolist() == [1.0, 0.5]
    cx = np.array([2 + 4j], np.complex64)
    finish_average(cx, 2)
    assert cx.tolist() == [1 + 2j]
    finish_average(np.zeros(0, np.float32), 5)
    with pytest.raises(TypeError):
        finish_average(np.ones(2, np.int32), 2)
    with pytest.raises(ValueError):
        finish_average(np.ones(2), 0)


def test_geometry_and_step_ids() -> None:
    assert block_bounds(10, 3) == [0, 4, 7, 10]  # numpy.array_split's boundaries
    assert [len(part) for part in np.array_split(np.arange(10), 3)] == [4, 3, 3]
    assert block_bounds(2, 4) == [0, 1, 2, 2, 2]
    assert block_bounds(0, 3) == [0, 0, 0, 0]
    assert chunk_count(0, 8) == 1 and chunk_count(8, 8) == 1 and chunk_count(9, 8) == 2
    assert chunk_slice(10, 19, 1, 8) == slice(18, 19)
    assert chunk_slice(5, 5, 0, 8) == slice(5, 5)
    assert elements_per_chunk(np.dtype(np.complex128), 8) == 1  # never splits an element
    assert elements_per_chunk(np.dtype(np.float32), 64) == 16
    with pytest.raises(ValueError):
        elements_per_chunk(np.dtype(np.float32), 0)
    assert step_id(12, (1 << 26) - 1) < 1 << 32
    check_steps(1 << 13, 1 << 13)
    with pytest.raises(ValueError, match="chunk size"):
        check_steps((1 << 13) + 1, 1 << 13)


def test_float_overflow_is_a_result_not_a_warning() -> None:
    import warnings

    dst = np.array([np.finfo(np.float32).max, np.inf], np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reduce_into(ReduceOp.SUM, dst, np.array([np.finfo(np.float32).max, -np.inf], np.float32))
    assert np.isinf(dst[0]) and np.isnan(dst[1])


def test_quiet_fold_keeps_the_callers_error_settings_and_silences_only_overflow_and_invalid() -> None:
    import threading
    import warnings

    big = np.array([np.finfo(np.float32).max, np.inf], np.float32)
    other = np.array([np.finfo(np.float32).max, -np.inf], np.float32)
    for caller in ({"over": "raise", "invalid": "raise", "divide": "raise"}, {"all": "warn"}, {"all": "ignore"}):
        with np.errstate(**caller), warnings.catch_warnings():
            before = np.geterr()
            warnings.simplefilter("error")
            out = np.empty(2, np.float32)
            reduction.quiet_fold(np.add, out, [big, other])  # overflow and inf - inf: no warning, no raise
            assert np.isinf(out[0]) and np.isnan(out[1])
            assert np.geterr() == before, caller  # the caller's settings are back
            if before["divide"] == "raise":
                with pytest.raises(FloatingPointError):  # and only overflow and invalid were silenced
                    reduction.quiet_fold(np.divide, np.empty(1), [np.ones(1), np.zeros(1)])
    # Another thread with other settings: each gets its own state back.
    seen: list[dict[str, str]] = []

    def other_thread() -> None:
        with np.errstate(under="raise"):
            reduction.quiet_fold(np.add, np.empty(2, np.float32), [big, other])
            seen.append(np.geterr())

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert seen[0]["under"] == "raise" and seen[0]["over"] == np.geterr()["over"]


def test_reduce_parts_equals_pairwise_reduction_bit_for_bit() -> None:
    """The shared-memory groups combine all parts in one pass; the bits must be those of the pairwise
    kernels, in the same order, for every dtype and op."""
    rng = np.random.default_rng(7)
    for dtype in ALL_DTYPES:
        for op in [*ops_for(dtype), *([ReduceOp.AVG] if dtype.kind in "fcV" else [])]:
            for parts_count in (2, 3, 5):
                rows = exact_inputs(rng, dtype, op, parts_count, 17)
                expected = rows[0].copy()
                reduce_into(op, expected, rows[1])
                for row in rows[2:]:
                    reduce_into(op, expected, row)
                got = np.empty_like(rows[0])
                reduction.reduce_parts(op, got, rows)
                assert got.tobytes() == expected.tobytes(), f"{dtype}/{op.name}/{parts_count}"


def test_reduce_parts_needs_two_parts() -> None:
    with pytest.raises(ValueError, match="at least two"):
        reduction.reduce_parts(ReduceOp.SUM, np.zeros(2), [np.zeros(2)])
