"""Helpers for the elastic tests: run tests/elastic/elastic_job.py under ``collsvc run`` and read back
what every process of the job ended with."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cli._util import Result, run_cli, summary_lines

JOB_SCRIPT = str(Path(__file__).with_name("elastic_job.py"))
sys.path.insert(0, str(Path(__file__).parent))
from elastic_job import reference  # noqa: E402 - the script's own maths, for the expected weights


@dataclass
class ElasticRun:
    result: Result
    finals: list[dict[str, Any]]  # one per process that returned from training, admitted or not

    @property
    def admitted(self) -> list[dict[str, Any]]:
        return sorted((f for f in self.finals if f["admitted"]), key=lambda f: f["rank"])

    @property
    def summary(self) -> list[str]:
        return summary_lines(self.result.stderr)

    def explain(self) -> str:
        return f"exit {self.result.returncode}\nstdout:\n{self.result.stdout}\nstderr:\n{self.result.stderr}"

    def assert_consistent(self, size: int) -> None:
        """The final membership has ``size`` ranks 0..size-1 that agree on everything, and the weights
        equal those of the same steps without failures."""
        ranks = self.admitted
        assert [f["rank"] for f in ranks] == list(range(size)), self.explain()
        assert all(f["size"] == size for f in ranks), self.explain()
        first = ranks[0]
        for other in ranks[1:]:
            assert other["w"] == first["w"], self.explain()  # bitwise: every rank holds the same bytes
            assert other["step"] == first["step"], self.explain()
            assert other["sizes"] == first["sizes"], self.explain()
        expected = reference(first["step"])
        assert max(abs(a - b) for a, b in zip(first["w"], expected, strict=True)) < 1e-9, self.explain()


def run_elastic(tmp_path: Path, *launcher_args: str, timeout: float = 120.0, **env: str) -> ElasticRun:
    """Runs the elastic job script with ``collsvc run LAUNCHER_ARGS``; ``env`` configures the script."""
    out = tmp_path / "out"
    out.mkdir()
    # Generous re-form waits: on a loaded machine a survivor late for the alive window would rejoin only
    # as a newcomer, and a test that counts members would see one too few.
    env.setdefault("COLLSVC_ELASTIC_TIMEOUT", "30")
    result = run_cli("run", *launcher_args, JOB_SCRIPT, timeout=timeout, ELASTIC_OUT=str(out), **env)
    finals = [json.loads(path.read_text()) for path in sorted(out.glob("final-*.json"))]
    return ElasticRun(result, finals)
