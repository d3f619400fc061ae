"""Elastic jobs end to end: real ranks under ``collsvc run --min-ranks/--max-restarts``, real SIGKILLs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli._util import cli_env
from tests.elastic._util import JOB_SCRIPT, run_elastic
from tests.harness import TOKEN, coordinator


def test_shrinks_to_the_survivors_without_restarts(tmp_path: Path) -> None:
    job = run_elastic(tmp_path, "-n", "4", "--min-ranks", "2", "--max-restarts", "0", ELASTIC_KILLS="12:2")
    assert job.result.returncode == 0, job.explain()
    job.assert_consistent(size=3)
    assert job.admitted[0]["sizes"][:2] == [4, 4]  # commits at steps 5 and 10 on 4 ranks, then 3
    assert job.admitted[0]["sizes"][-1] == 3
    assert "rank 2 on host testhost failed: killed by signal SIGKILL (9)" in job.summary[0], job.explain()
    assert "elastic job finished" in job.summary[-1] and "0 replacement(s)" in job.summary[-1], job.explain()


def test_a_replacement_is_admitted_and_receives_the_state(tmp_path: Path) -> None:
    job = run_elastic(
        tmp_path, "-n", "4", "--min-ranks", "2", "--max-restarts", "1", ELASTIC_KILLS="12:2", ELASTIC_GROW_TO="4"
    )
    assert job.result.returncode == 0, job.explain()
    job.assert_consistent(size=4)
    assert 3 in job.admitted[0]["sizes"], job.explain()  # trained on 3 ranks until the replacement came
    assert "[replacement 1] finished:" in job.result.stdout, job.explain()
    assert "1 replacement(s) started" in job.summary[-1], job.explain()


def test_a_member_that_dies_during_the_re_form_is_dropped_too(tmp_path: Path) -> None:
    # Rank 3 dies at step 12; rank 1 dies right after announcing itself alive for generation 1, so the
    # first plan names it and the others find it missing before joining: they re-form again without it.
    job = run_elastic(
        tmp_path,
        "-n",
        "4",
        "--min-ranks",
        "2",
        ELASTIC_KILLS="12:3",
        ELASTIC_DIE_IN_REFORM="1:1",
        COLLSVC_ELASTIC_TIMEOUT="8",
    )
    assert job.result.returncode == 0, job.explain()
    job.assert_consistent(size=2)
    assert job.admitted[-1]["sizes"][-1] == 2
    failed = [line for line in job.summary if "failed: killed by signal SIGKILL" in line]
    assert len(failed) == 2, job.explain()


def test_the_job_fails_when_fewer_than_min_ranks_remain(tmp_path: Path) -> None:
    # 3 ranks, at least 2: the first death is survived, the second (at a later step) is not.
    job = run_elastic(tmp_path, "-n", "3", "--min-ranks", "2", ELASTIC_KILLS="8:2,22:1", ELASTIC_STEPS="400")
    assert job.result.returncode == 128 + 9, job.explain()
    last = job.summary[-1]
    assert "elastic job failed on host testhost: 1 rank(s) left, fewer than --min-ranks 2" in last, job.explain()
    assert "0 of 0 restart(s) used" in last, job.explain()
    assert not job.admitted, job.explain()  # the last survivor was stopped before it finished


def test_numpy_and_torch_state_survive_a_failure(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    job = run_elastic(
        tmp_path, "-n", "3", "--min-ranks", "2", ELASTIC_KILLS="7:0", ELASTIC_TORCH="1", ELASTIC_STEPS="20"
    )
    assert job.result.returncode == 0, job.explain()
    job.assert_consistent(size=2)
    first, second = job.admitted
    assert first["t"] == second["t"] and first["module"] == second["module"], job.explain()
    # t gains the world size each step: 3 per step before the failure's restore point (step 5), then 2.
    assert first["t"] == [5 * 3.0 + 15 * 2.0] * 6, job.explain()
    # Each state-dict tensor gains 1 per step from its initial values, on every rank after the broadcast.
    assert first["step"] == 20


def test_two_nodes_each_replace_their_own_failed_rank(tmp_path: Path) -> None:
    # Two launchers (two "nodes" on loopback) share an external coordinator; node 1's rank 3 dies and
    # node 1's launcher starts the replacement, which the job admits.
    out = tmp_path / "out"
    out.mkdir()
    env = cli_env(
        COLLSVC_TOKEN=TOKEN,
        ELASTIC_OUT=str(out),
        ELASTIC_KILLS="12:3",
        ELASTIC_GROW_TO="4",
        COLLSVC_ELASTIC_TIMEOUT="30",
    )
    with coordinator() as (_, address):
        nodes = [
            subprocess.Popen(
                [sys.executable, "-m", "collsvc", "run", "--coordinator", address, "--nnodes", "2"]
                + ["--node-rank", str(node), "-n", "2", "--min-ranks", "1", "--max-restarts", "1", JOB_SCRIPT],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for node in (0, 1)
        ]
        try:
            outputs = [node.communicate(timeout=120) for node in nodes]
        finally:
            for node in nodes:
                node.kill()  # no-op for a launcher that exited; a hung one must not outlive the test
    explain = "\n".join(
        f"node {index} exit {node.returncode}:\n{stdout}\n{stderr}"
        for index, (node, (stdout, stderr)) in enumerate(zip(nodes, outputs, strict=True))
    )
    assert [node.returncode for node in nodes] == [0, 0], explain
    assert "[replacement 1] finished:" in outputs[1][0], explain
    finals = [json.loads(path.read_text()) for path in sorted(out.glob("final-*.json"))]
    admitted = sorted((f for f in finals if f["admitted"]), key=lambda f: f["rank"])
    assert [f["rank"] for f in admitted] == [0, 1, 2, 3], explain
    assert all(f["w"] == admitted[0]["w"] for f in admitted), explain
