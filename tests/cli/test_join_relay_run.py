"""``collsvc run`` joins its ranks through its relay (one JoinBatch per launcher), and a job over two
launchers, as on two nodes, passes its barriers in the data plane: no coordinator call."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.cli._util import run_cli, script
from tests.harness import TOKEN, coordinator

BODY = """
import collsvc, numpy as np
comm = collsvc.init()
total = comm.all_reduce(np.full(3, comm.rank + 1.0, np.float32))
print(comm.rank, comm.local_rank, comm.size, total.tolist(), flush=True)
"""

TWO_NODES = """
import sys, collsvc, numpy as np
from tests.observability.test_metrics import scrape, value
comm = collsvc.init()
for step in range(3):
    comm.barrier()
    total = comm.all_reduce(np.array([comm.rank], np.int64))
if comm.rank == 0:
    samples = scrape(int(sys.argv[1]))
    count = value(samples, "collsvc_barrier_wait_seconds_count", job=comm.job.options.job_id, group="world")
    comm.job.store.set("counted", str(int(count or 0)).encode())
else:
    comm.job.store.get("counted", 30.0)
print(comm.rank, comm.local_rank, int(total[0]), comm.job.store.get("counted", 30.0).decode(), flush=True)
"""


def test_the_ranks_of_collsvc_run_join_in_one_call_and_run(tmp_path: Path) -> None:
    res = run_cli("run", "--log-level", "INFO", "-n", "3", script(tmp_path, "sum.py", BODY), timeout=90)
    assert res.returncode == 0, res.stderr
    assert sorted(res.lines("stdout")) == [f"[rank {r}] {r} {r} 3 [6.0, 6.0, 6.0]" for r in range(3)]
    assert "join relay: joined 3 ranks of job 'default' in one call" in res.stderr


def test_two_launchers_join_per_node_and_pass_barriers_without_the_coordinator(tmp_path: Path) -> None:
    path = script(tmp_path, "two_nodes.py", TWO_NODES)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    with coordinator(metrics_port=0) as (thread, address), ThreadPoolExecutor(2) as pool:
        launches = [
            pool.submit(
                run_cli,
                *("run", "--log-level", "INFO", "--coordinator", address, "--token-file", str(token_file)),
                *("--nnodes", "2", "--node-rank", str(node), "-n", "2", "--job-id", "two-nodes"),
                path,
                str(thread.metrics_port),
                timeout=120,
                cwd=Path(__file__).resolve().parents[2],
                COLLSVC_HOST=f"node{node}",
            )
            for node in (0, 1)
        ]
        results = [launch.result() for launch in launches]
    for node, res in enumerate(results):
        assert res.returncode == 0, res.stderr
        assert "join relay: joined 2 ranks of job 'two-nodes' in one call" in res.stderr
        ranks = (2 * node, 2 * node + 1)
        # 3 barriers over two nodes: the nodes' leaders meet over their lanes, no coordinator barrier
        # call (it once took one per node, and before that one per rank).
        assert sorted(res.lines("stdout")) == [f"[rank {r}] {r} {r % 2} 6 0" for r in ranks]
