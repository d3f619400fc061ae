"""``scripts/gpu_checks.sh`` (every GPU check in one run) keeps working where no GPU is: each check
says it was skipped, the script exits 0, and every output file is written. On a GPU machine the
script itself is the check (docs/gpu.md), so this test steps aside there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli._util import REPO, cli_env
from tests.smoke.test_scripts import gpu_reason

OUTPUTS = ("environment.txt", "pytest.txt", "nccl_overhead.txt", "torch_cuda.txt", "bench_nccl.txt")


def test_gpu_checks_script_says_what_it_skipped_without_a_gpu(tmp_path: Path) -> None:
    if gpu_reason() is None:
        pytest.skip("a GPU is here: run scripts/gpu_checks.sh itself")
    base = cli_env()
    env = {**base, "PYTHON": sys.executable, "PYTHONPATH": os.pathsep.join([str(REPO), base.get("PYTHONPATH", "")])}
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_checks.sh"), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = {name: (tmp_path / name).read_text() for name in OUTPUTS}
    assert "skipped" in text["pytest.txt"] and "failed" not in text["pytest.txt"], text["pytest.txt"]
    assert "nccl_overhead.py needs a GPU, skipped" in text["nccl_overhead.txt"], text["nccl_overhead.txt"]
    assert "needs a GPU, skipped" in text["torch_cuda.txt"] or "collsvc data plane" in text["torch_cuda.txt"]
    assert "--device cuda needs CuPy and a CUDA GPU" in text["bench_nccl.txt"], text["bench_nccl.txt"]
    assert "Traceback" not in "".join(text.values()), text
