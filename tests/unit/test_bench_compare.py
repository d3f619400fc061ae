"""benchmarks/compare_gloo.py's pure parts: the compared rows, the table, sizes, and the marker block."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from collsvc.bench.protocol import Measurement, layout, median_of_repeats, result_row

REPO = Path(__file__).resolve().parents[2]


def load_compare_gloo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compare_gloo", REPO / "benchmarks" / "compare_gloo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compare_gloo", module)
    spec.loader.exec_module(module)
    return module


compare_gloo = load_compare_gloo()


def rows(p50: float, p99: float) -> list[dict[str, Any]]:
    shape = layout("all_reduce", 4096, 2, 4)
    return median_of_repeats([[result_row("all_reduce", 2, shape, "float32", 4, 8, Measurement(p50, p99, 0, 50, 0))]])


def test_ratio_is_gloo_p50_over_collsvc_p50_and_the_table_shows_both_percentiles() -> None:
    (compared,) = compare_gloo.compare_rows(rows(0.001, 0.004), rows(0.003, 0.009))
    assert compared["ratio_p50"] == pytest.approx(3.0)
    assert compared["collsvc"]["p99"] == 0.004 and compared["gloo"]["p99"] == 0.009
    line = compare_gloo.table([compared])[-1]
    assert line.startswith("| all_reduce | 2 | 4 KiB | 8 | 1.000 ms | 4.000 ms | 3.000 ms | 9.000 ms |")
    assert line.endswith("| 3.00x |")


def test_sizes_accept_lists_and_ranges() -> None:
    assert compare_gloo.parse_sizes("4K,1M") == [4096, 1 << 20]
    assert compare_gloo.parse_sizes("4K:64K,1M") == [4096, 16384, 65536, 1 << 20]
    with pytest.raises(ValueError):
        compare_gloo.parse_sizes("4X")


def test_write_block_replaces_only_its_markers(tmp_path: Path) -> None:
    doc = tmp_path / "performance.md"
    other = "<!-- b:begin -->\nold b\n<!-- b:end -->\n"
    doc.write_text(f"# Title\n<!-- a:begin -->\nold a\n<!-- a:end -->\nmiddle\n{other}")
    compare_gloo.write_block(doc, "a", "new a\n| table |")
    assert doc.read_text() == f"# Title\n<!-- a:begin -->\nnew a\n| table |\n<!-- a:end -->\nmiddle\n{other}"


def test_write_block_appends_missing_markers_and_creates_files(tmp_path: Path) -> None:
    doc = tmp_path / "notes.md"
    compare_gloo.write_block(doc, "c", "first")
    assert doc.read_text() == "<!-- c:begin -->\nfirst\n<!-- c:end -->\n"
    compare_gloo.write_block(doc, "d", "second")
    assert doc.read_text().endswith("\n<!-- d:begin -->\nsecond\n<!-- d:end -->\n")
    assert "first" in doc.read_text()
