"""all_reduce and reduce_scatter with ``compression=`` on real rank processes and a real coordinator.

Two fake hosts (``COLLSVC_HOST`` per rank) make the frames between them cross "hosts" over the peer
endpoint and its bulk lane: 1 rank per host takes the flat compressed exchange, 2 per host the
hierarchical all_reduce with the leaders' exchange compressed. Each result is within docs/api.md's
bound of numpy's exact result and bitwise identical on every rank; on one host it is exact. Ranks that
disagree on the compression get CollectiveMismatchError; bad arguments the typed errors, locally.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.types import COMPRESSIONS, ReduceOp, numpy_dtype
from tests.harness import coordinator, run_ranks
from tests.multiproc.test_faults import attempt

UNIT_ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-53, "bfloat16": 2.0**-8}
# Below the ring's small-message switch (2 MiB), above it and above one 4 MiB step of the hierarchy.
COUNTS = {"float32": [1000, 1_100_003], "float64": [700_001], "bfloat16": [3001]}


def make(rank: int, count: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + count)
    return (rng.standard_normal(count) * 4 + rank).astype(numpy_dtype(dtype))


def bound(name: str, inputs: list[np.ndarray], exact: np.ndarray, dtype: str) -> np.ndarray:
    """docs/api.md's bound on |result - exact|, plus the rounding of the sums (in float32, and in the
    array's own dtype where an exact host-local reduce runs first) and of the result's dtype."""
    n = len(inputs)
    total_abs = sum(np.abs(x.astype(np.float64)) for x in inputs)
    slack = n * max(2.0**-23, UNIT_ROUNDOFF[dtype]) * total_abs + UNIT_ROUNDOFF[dtype] * np.abs(exact)
    if name == "minmax_uint8":
        largest = sum(np.abs(x.astype(np.float64)).max() for x in inputs)
        return 2 * largest / 255 + slack
    floor = (n + 1) * n * 2.0**-25 if name == "fp16" else 0.0
    return 2 * UNIT_ROUNDOFF[name] * total_abs + slack + floor


def same_bits_everywhere(comm: collsvc.Communicator, result: np.ndarray) -> bool:
    raw = np.frombuffer(np.ascontiguousarray(result).tobytes(), np.uint8)
    rows = comm.all_gather(raw).reshape(comm.size, -1)
    return all(np.array_equal(rows[0], row) for row in rows)


def compressed_calls(comm: collsvc.Communicator) -> dict[str, Any]:
    n, me, checked = comm.size, comm.rank, []
    for name in COMPRESSIONS:
        for dtype, counts in COUNTS.items():
            for count in counts:
                inputs = [make(r, count, dtype) for r in range(n)]
                exact = sum(x.astype(np.float64) for x in inputs)
                got = comm.all_reduce(inputs[me], compression=name)
                assert got.dtype == inputs[me].dtype and got.shape == (count,)
                error = np.abs(got.astype(np.float64) - exact)
                assert np.all(error <= bound(name, inputs, exact, dtype)), (name, dtype, count, error.max())
                assert same_bits_everywhere(comm, got), (name, dtype, count)
                if count > 1000 and dtype == "float32":  # it did compress
                    assert not np.array_equal(got, comm.all_reduce(inputs[me])), (name, dtype, count)
                checked.append((name, dtype, count))
        # reduce_scatter: rank r gets block r; AVG keeps the mean; a strided 2-D view goes in as any array
        rows = [make(r, 2 * n * 3001, "float32").reshape(2 * n, 3001)[::2] for r in range(n)]
        exact = sum(x.astype(np.float64) for x in rows) / n
        block = comm.reduce_scatter(rows[me], ReduceOp.AVG, compression=name)
        flat = [x.reshape(-1) for x in rows]
        mine = slice(me * 3001, (me + 1) * 3001)
        limit = bound(name, flat, exact.reshape(-1), "float32")[mine] / n + 1e-6
        assert np.all(np.abs(block.reshape(-1) - exact[me]) <= limit), name
        scalar = comm.all_reduce(np.float32(me + 0.5), compression=name)  # 0-d
        assert scalar.shape == () and abs(float(scalar) - n * n / 2) <= 0.05 * n * n
        assert same_bits_everywhere(comm, scalar)
        out = np.empty(5000, np.float32)
        comm.all_reduce(make(me, 5000, "float32"), compression=name, out=out, async_op=True).wait()
        assert same_bits_everywhere(comm, out)
    return {"checked": len(checked), "errors": bad_arguments(comm), "mismatch": mismatched(comm)}


def bad_arguments(comm: collsvc.Communicator) -> list[str]:
    """Each raises at once on every rank, before anything is sent (the calls after it still agree)."""
    seen = []
    for call in (
        lambda: comm.all_reduce(np.ones(4, np.float32), compression="int8"),
        lambda: comm.all_reduce(np.ones(4, np.int32), compression="bf16"),
        lambda: comm.all_reduce(np.ones(4, np.float32), ReduceOp.MAX, compression="fp16"),
        lambda: comm.reduce_scatter(np.ones(4 * comm.size, np.int64), compression="minmax_uint8"),
        lambda: comm.reduce_scatter(np.ones(4 * comm.size), ReduceOp.PRODUCT, compression="bf16"),
    ):
        try:
            call()
        except (TypeError, ValueError) as exc:
            seen.append(type(exc).__name__)
    comm.barrier()
    return seen


def mismatched(comm: collsvc.Communicator) -> dict[str, Any]:
    """Last: a mismatch breaks the job. Even ranks compress, odd ones do not."""
    return attempt(comm.all_reduce, np.ones(300_000, np.float32), compression="bf16" if comm.rank % 2 == 0 else None)


@pytest.mark.parametrize("per_host", [1, 2])
def test_compressed_reductions_across_two_hosts(per_host: int) -> None:
    with coordinator() as (_, address):
        result = run_ranks(
            compressed_calls,
            2 * per_host,
            address=address,
            rank_env=lambda rank: {"COLLSVC_HOST": f"host{rank // per_host}"},
            timeout=120,
            allow_failures=True,
        )
    for rank, outcome in enumerate(result.outcomes):
        assert outcome.error is None, f"rank {rank}:\n{outcome.error}"
        seen = outcome.value
        assert seen["checked"] == len(COMPRESSIONS) * sum(len(c) for c in COUNTS.values())
        assert seen["errors"] == ["ValueError", "TypeError", "ValueError", "TypeError", "ValueError"]
        mismatch = seen["mismatch"]
        assert mismatch["type"] == "CollectiveMismatchError", (rank, mismatch)
        assert "compression=bf16" in mismatch["message"], mismatch["message"]


def one_host(comm: collsvc.Communicator) -> dict[str, Any]:
    x = make(comm.rank, 1_100_003, "float32")
    exact = comm.all_reduce(x)
    same = [np.array_equal(comm.all_reduce(x, compression=name), exact) for name in COMPRESSIONS]
    rows = x[: 2 * 1000].reshape(2, 1000)
    same.append(np.array_equal(comm.reduce_scatter(rows, compression="fp16"), comm.reduce_scatter(rows)))
    return {"exact": same, "mismatch": mismatched(comm)}


def test_one_host_is_exact_and_still_checks_the_compression() -> None:
    with coordinator() as (_, address):
        result = run_ranks(
            one_host, 2, address=address, env={"COLLSVC_HOST": "one-host"}, timeout=60, allow_failures=True
        )
    for outcome in result.outcomes:
        assert outcome.error is None, f"\n{outcome.error}"
        assert all(outcome.value["exact"])
        assert outcome.value["mismatch"]["type"] == "CollectiveMismatchError"
        assert "compression=bf16" in outcome.value["mismatch"]["message"]
