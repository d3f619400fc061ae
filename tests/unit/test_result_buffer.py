"""``Operand.result_buffer``: which results land straight in the caller's ``out`` (pure logic, no ranks)."""

from __future__ import annotations

import numpy as np

from collsvc.arrays import adapt
from collsvc.client.operands import Operand


def _buffer(x: np.ndarray, out: np.ndarray | None, shape: tuple[int, ...]) -> tuple[np.ndarray, bool]:
    buffer = Operand.of(adapt(x), x, out, False).result_buffer(shape)
    return buffer.array, buffer.is_out


def test_a_contiguous_writable_out_apart_from_the_input_is_the_buffer() -> None:
    x, out = np.ones(6), np.empty((3, 6))
    array, is_out = _buffer(x, out, (3, 6))
    assert is_out and np.shares_memory(array, out) and array.shape == (18,)


def test_no_out_a_strided_out_a_read_only_out_or_one_overlapping_the_input_get_a_fresh_array() -> None:
    whole = np.zeros(18)
    strided = np.zeros(36)[::2]
    frozen = np.zeros(18)
    frozen.flags.writeable = False
    for x, out in ((np.ones(6), None), (np.ones(6), strided), (np.ones(6), frozen), (whole[6:12], whole)):
        array, is_out = _buffer(x, out, (18,))
        assert not is_out and array.shape == (18,)
        assert out is None or not np.shares_memory(array, out)
