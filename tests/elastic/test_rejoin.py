"""A process restarted with the environment it first had rejoins its elastic job as a newcomer.

That is what a Kubernetes Indexed Job does to a failed pod: a new pod with the same completion index,
hence the same ``COLLSVC_RANK``, world size and job id. Started through ``python -m
collsvc.elastic.rejoin``, the restarted process finds the job running and waits to be admitted,
instead of waiting in ``collsvc.init()`` for a generation 0 that moved on without it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cli._util import cli_env
from tests.elastic._util import JOB_SCRIPT, reference
from tests.harness import TOKEN, coordinator

WORLD_SIZE = 3
VICTIM = 2
WAIT_S = 90.0


def start_rank(rank: int, env: dict[str, str]) -> subprocess.Popen[str]:
    """Rank ``rank`` with the static environment a pod of an Indexed Job has."""
    return subprocess.Popen(
        [sys.executable, "-m", "collsvc.elastic.rejoin", JOB_SCRIPT],
        env={**env, "COLLSVC_RANK": str(rank)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_rank_restarted_with_its_first_environment_is_admitted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    with coordinator() as (_, address):
        env = cli_env(
            COLLSVC_COORDINATOR=address,
            COLLSVC_WORLD_SIZE=str(WORLD_SIZE),
            COLLSVC_JOB_ID="indexed-job-uid",
            COLLSVC_TOKEN=TOKEN,
            COLLSVC_ELASTIC_TIMEOUT="30",
            ELASTIC_OUT=str(out),
            ELASTIC_KILLS=f"12:{VICTIM}",  # rank 2 SIGKILLs itself at step 12 (once: a marker file says so)
            ELASTIC_GROW_TO=str(WORLD_SIZE),  # the survivors train on until the restarted rank is back
        )
        ranks = [start_rank(rank, env) for rank in range(WORLD_SIZE)]
        outputs: list[tuple[str, str]] = []
        try:
            ranks[VICTIM].wait(timeout=WAIT_S)
            victim_output = ranks[VICTIM].communicate()
            assert ranks[VICTIM].returncode == -9, victim_output
            ranks.append(start_rank(VICTIM, env))  # the Job controller's new pod for the same index
            outputs = [rank.communicate(timeout=WAIT_S) for rank in ranks]
        finally:
            for rank in ranks:
                rank.kill()  # no-op for a process that exited; a hung one must not outlive the test
    explain = "\n".join(
        f"process {index} exit {rank.returncode}:\n{stdout}\n{stderr}"
        for index, (rank, (stdout, stderr)) in enumerate(zip(ranks, outputs, strict=False))
    )
    codes = [rank.returncode for rank in ranks]
    assert codes == [-9 if index == VICTIM else 0 for index in range(WORLD_SIZE)] + [0], explain
    restarted_stderr = outputs[-1][1]
    assert "elastic job 'indexed-job-uid' already runs" in restarted_stderr, explain
    assert all("already runs" not in stderr for _, stderr in outputs[:-1]), explain
    finals = [json.loads(path.read_text()) for path in sorted(out.glob("final-*.json"))]
    admitted = sorted((f for f in finals if f["admitted"]), key=lambda f: f["rank"])
    assert [f["rank"] for f in admitted] == list(range(WORLD_SIZE)), explain
    assert {f["pid"] for f in admitted} == {rank.pid for rank in ranks if rank.returncode == 0}, explain
    assert all(f["w"] == admitted[0]["w"] and f["step"] == admitted[0]["step"] for f in admitted), explain
    expected = reference(admitted[0]["step"])
    assert max(abs(a - b) for a, b in zip(admitted[0]["w"], expected, strict=True)) < 1e-9, explain
