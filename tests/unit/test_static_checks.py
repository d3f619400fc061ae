"""mypy, strict on collsvc/ (its configuration is in pyproject.toml), passes.

It is what checks that each backend implements the ``Backend`` protocol and that the layers' seams
keep their types, so CI runs it with the tests (the ``test`` extra installs mypy and the stubs).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
# A cold run (no .mypy_cache) took 17 s on a busy 2-core machine, a warm one 1.2 s; the limit stays
# under pytest's own timeout (pyproject.toml) so that a stuck run fails with this test's message.
MYPY_TIMEOUT_S = 240.0


@pytest.mark.skipif(
    importlib.util.find_spec("mypy") is None,
    reason="mypy is not installed (pip install -e '.[test]' installs it)",
)
def test_mypy_strict_passes_on_collsvc() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=MYPY_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, f"mypy failed (exit {result.returncode}):\n{result.stdout}{result.stderr}"
