"""The coordinator local rank 0 starts under Open MPI's mpirun with none given, without mpirun itself:
two processes with the variables mpirun sets (so this runs where Open MPI is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Rank 1 outlives rank 0: once rank 0 has left the job, rank 1 still reaches the coordinator (the key/value
# store lives there), which rank 0's process keeps up at exit until rank 1 has left too. (A coordinator
# stopped at once is not always gone by then: this checks the outcome, not the wait itself.)
RANK = r"""
import sys, time
import collsvc

comm = collsvc.init(timeout=60)
comm.barrier()
if comm.rank == 0:
    print("rank 0 done", flush=True)
    sys.exit(0)
deadline = time.monotonic() + 60
while 0 not in comm.job.departed:
    assert time.monotonic() < deadline, "rank 0 never left"
    time.sleep(0.01)
comm.job.store.set("after-rank-0", b"still here")
print("rank 1 read", comm.job.store.get("after-rank-0", timeout=10).decode(), flush=True)
"""


def _env(rank: int, folder: Any, job: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COLLSVC_", "MASTER_", "OMPI_", "PMIX_"))}
    env.update(
        PYTHONPATH=REPO,
        OMPI_COMM_WORLD_SIZE="2",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
        OMPI_COMM_WORLD_RANK=str(rank),
        OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
        OMPI_MCA_ess_base_jobid=job,
        OMPI_MCA_orte_jobfam_session_dir=str(folder),
        COLLSVC_COORDINATOR_GRACE="3",
    )
    return env


def test_local_rank_0_serves_the_others_until_they_left(tmp_path: Any) -> None:
    job = f"{os.getpid()}{len(str(tmp_path))}"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK],
            env=_env(rank, tmp_path, job),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (1, 0)  # the others may start first: they wait for rank 0's file
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    assert "rank 1 read still here" in outputs[0] and "rank 0 done" in outputs[1], outputs
    assert os.listdir(tmp_path) == [], "rank 0 removes the coordinator's file and the ranks' markers"
