"""The lossy wire codecs (``ring/compression.py``): round trips within their stated bounds, and the
edge cases the docs promise (zeros, constant chunks, inf and nan, empty blocks, odd lengths)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from collsvc.client.backends.ring.compression import CHUNK, Codec, codec, working_dtype
from collsvc.types import BFLOAT16, COMPRESSIONS, ReduceOp, check_compression

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}


def round_trip(name: str, values: np.ndarray) -> np.ndarray:
    c: Codec = codec(name)
    data = np.empty(c.encoded_bytes(values.shape[0], values.dtype), np.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy warning escapes a codec, whatever the values
        c.encode(values, data)
        out = np.empty_like(values)
        c.decode(data, out)
    return out


def chunk_ranges(values: np.ndarray) -> np.ndarray:
    """Each element's chunk's max - min."""
    ranges = np.empty_like(values)
    for lo in range(0, values.shape[0], CHUNK):
        part = values[lo : lo + CHUNK]
        ranges[lo : lo + CHUNK] = part.max() - part.min()
    return ranges


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", COMPRESSIONS)
def test_round_trips_stay_within_the_documented_bound(name: str, dtype: type) -> None:
    rng = np.random.default_rng(7)
    values = (rng.standard_normal(3 * CHUNK + 123) * np.geomspace(1e-3, 1e3, 3 * CHUNK + 123)).astype(dtype)
    got = round_trip(name, values)
    error = np.abs(got.astype(np.float64) - values)
    if name in UNIT_ROUNDOFF:
        assert np.all(error <= UNIT_ROUNDOFF[name] * np.abs(values) + 2.0**-25)
    else:
        ulps = 4 * np.finfo(dtype).eps * np.abs(values).max()
        assert np.all(error <= chunk_ranges(values.astype(np.float64)) / 510 + ulps)
    assert got.dtype == values.dtype


def test_minmax_codes_offset_from_the_chunk_min_and_keep_its_ends() -> None:
    values = np.array([-1.0, 0.0, 0.5, 1.0], np.float32)
    c = codec("minmax_uint8")
    data = np.empty(c.encoded_bytes(4, values.dtype), np.uint8)
    c.encode(values, data)
    assert data.shape == (8 + 4,) and data[:8].view(np.float32).tolist() == [-1.0, 1.0]
    codes = data[8:].tolist()  # round((x + 1) * 127.5): 0 sits on a half, either neighbour is in bound
    assert codes[0] == 0 and codes[1] in (127, 128) and codes[2:] == [191, 255]
    got = round_trip("minmax_uint8", values)
    assert got[0] == -1.0 and got[-1] == 1.0


@pytest.mark.parametrize("name", COMPRESSIONS)
def test_zeros_constant_chunks_and_empty_blocks_are_exact(name: str) -> None:
    for values in (np.zeros(CHUNK + 5, np.float32), np.full(2 * CHUNK + 1, 3.0, np.float64), np.empty(0, np.float32)):
        assert np.array_equal(round_trip(name, values), values)
    assert np.array_equal(round_trip(name, np.array([2.5], np.float32)), [2.5])  # one value: a 1-element chunk


def test_minmax_chunk_with_inf_or_nan_decodes_as_nan_and_others_are_untouched() -> None:
    values = np.linspace(-1, 1, 3 * CHUNK).astype(np.float32)
    values[10] = np.inf
    values[CHUNK + 7] = np.nan
    got = round_trip("minmax_uint8", values)
    assert np.isnan(got[:CHUNK]).all() and np.isnan(got[CHUNK : 2 * CHUNK]).all()
    assert np.isfinite(got[2 * CHUNK :]).all()


def test_minmax_range_that_overflows_the_dtype_decodes_as_nan() -> None:
    values = np.array([-3e38, 3e38, 0.0], np.float32)
    assert np.isnan(round_trip("minmax_uint8", values)).all()


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_casts_keep_inf_and_nan_elementwise(name: str) -> None:
    values = np.array([np.inf, -np.inf, np.nan, 1.0], np.float32)
    got = round_trip(name, values)
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2]) and got[3] == 1.0


def test_fp16_overflows_to_inf_above_its_range_as_torch_does() -> None:
    assert round_trip("fp16", np.array([1e5, -1e5], np.float32)).tolist() == [np.inf, -np.inf]


def test_encoded_sizes() -> None:
    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    assert codec("bf16").encoded_bytes(10, f32) == 20 and codec("fp16").encoded_bytes(10, f64) == 20
    assert codec("minmax_uint8").encoded_bytes(CHUNK + 1, f32) == CHUNK + 1 + 2 * 8
    assert codec("minmax_uint8").encoded_bytes(CHUNK, f64) == CHUNK + 16
    assert working_dtype(np.dtype(np.float64)) == f64
    assert working_dtype(np.dtype(np.float16)) == f32
    if BFLOAT16 is not None:
        assert working_dtype(BFLOAT16) == f32


def test_check_compression_names_the_accepted_values_and_refuses_ints_and_other_ops() -> None:
    assert check_compression(None, ReduceOp.MAX, "int32") == ""
    assert check_compression("bf16", ReduceOp.AVG, "bfloat16") == "bf16"
    with pytest.raises(ValueError, match="'bf16', 'fp16', 'minmax_uint8'"):
        check_compression("int8", ReduceOp.SUM, "float32")
    with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
        check_compression("fp16", ReduceOp.SUM, "int64")
    with pytest.raises(ValueError, match="SUM or AVG, got MAX"):
        check_compression("minmax_uint8", ReduceOp.MAX, "float32")
