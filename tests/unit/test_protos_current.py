"""The committed generated code equals what the pinned generator makes from protos/."""

from __future__ import annotations

import filecmp
import importlib.metadata
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PINNED = re.search(r"grpcio-tools==([0-9.]+)", (ROOT / "pyproject.toml").read_text()).group(1)  # type: ignore[union-attr]


def test_generated_code_is_current(tmp_path: Path) -> None:
    try:
        have = importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"grpcio-tools=={PINNED} is not installed (pip install -e '.[dev]')")
    if have != PINNED:
        pytest.skip(f"grpcio-tools {have} installed, the generator is pinned to {PINNED}")
    subprocess.run(["bash", str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)], check=True)
    committed = ROOT / "collsvc/proto/v1"
    fresh = tmp_path / "collsvc/proto/v1"
    names = sorted(p.name for p in fresh.iterdir() if p.is_file())
    assert names, "the generator produced nothing"
    _, mismatch, errors = filecmp.cmpfiles(committed, fresh, names, shallow=False)
    assert not mismatch and not errors, f"regenerate with scripts/gen_protos.sh: {mismatch + errors} differ"


def test_runtime_floors_match_the_generator() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert f'"grpcio>={PINNED}"' in text
    gencode = (ROOT / "collsvc/proto/v1/common_pb2.py").read_text()
    major, minor, patch = re.search(r"Domain.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", gencode).groups()  # type: ignore[union-attr]
    assert f'"protobuf>={major}.{minor}.{patch}"' in text
