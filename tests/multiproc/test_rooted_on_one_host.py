"""gather and scatter among the ranks of one host go through shared memory (``LocalGroup.gather`` /
``scatter``), with the mismatch check of every shared-memory call: results against numpy for every
root, and ranks that disagree on the root or the collective fail at once, on every rank."""

from __future__ import annotations

from typing import Any

import numpy as np

import collsvc
from tests.harness import coordinator, run_ranks
from tests.multiproc.test_fast_path import HOST, assert_mismatch_on_every_rank
from tests.multiproc.test_faults import attempt


def every_root(comm: collsvc.Communicator) -> bool:
    n, me = comm.size, comm.rank
    for rows in (1, 5, 300_001):  # the last spans several 4 MiB steps
        blocks = [np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) + 1000 * r for r in range(n)]
        for root in range(n):
            got = comm.gather(blocks[me], root)
            assert got is None if me != root else np.array_equal(got, np.concatenate(blocks))
            whole = np.concatenate(blocks) if me == root else None
            share = comm.scatter(whole, root, out=np.empty_like(blocks[me]))
            assert np.array_equal(share, blocks[me])
    return True


def test_gather_and_scatter_on_one_host_match_numpy_for_every_root() -> None:
    with coordinator() as (_, address):
        result = run_ranks(every_root, 3, address=address, env=HOST, timeout=120)
    assert all(result.values)


def roots_disagree(comm: collsvc.Communicator) -> dict[str, Any]:
    return attempt(comm.gather, np.ones(8), comm.rank)  # each rank thinks it is the root


def test_gather_roots_that_disagree_are_a_mismatch_on_every_rank() -> None:
    assert_mismatch_on_every_rank(roots_disagree, "gather(float64[8], root=0)", "gather(float64[8], root=1)")


def gather_meets_scatter(comm: collsvc.Communicator) -> dict[str, Any]:
    if comm.rank == 0:
        return attempt(comm.gather, np.ones(8), 0)
    return attempt(comm.scatter, None, 0, out=np.empty(8))


def test_a_gather_met_by_a_scatter_is_a_mismatch_on_every_rank() -> None:
    assert_mismatch_on_every_rank(gather_meets_scatter, "gather", "scatter")
