"""``collsvc run`` joins its ranks through its relay: one JoinBatch for the ranks of the launcher."""

from __future__ import annotations

from pathlib import Path

from tests.cli._util import run_cli, script

BODY = """
import collsvc, numpy as np
comm = collsvc.init()
total = comm.all_reduce(np.full(3, comm.rank + 1.0, np.float32))
print(comm.rank, comm.local_rank, comm.size, total.tolist(), flush=True)
"""


def test_the_ranks_of_collsvc_run_join_in_one_call_and_run(tmp_path: Path) -> None:
    res = run_cli("run", "--log-level", "INFO", "-n", "3", script(tmp_path, "sum.py", BODY), timeout=90)
    assert res.returncode == 0, res.stderr
    assert sorted(res.lines("stdout")) == [f"[rank {r}] {r} {r} 3 [6.0, 6.0, 6.0]" for r in range(3)]
    assert "join relay: joined 3 ranks of job 'default' in one call" in res.stderr
