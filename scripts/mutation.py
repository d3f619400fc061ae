#!/usr/bin/env python3
"""Mutation testing of the collective paths against the conformance suite, without extra tools.

Each mutant changes one expression of a target file (a flipped comparison, ``and``/``or`` swapped,
``is``/``is not`` swapped, ``not`` dropped, an arithmetic operator swapped, a constant or a slice bound
off by one, a boolean constant flipped), in a copy of the repository, and runs two tiers of tests
against it, the fast one first: the unit tests that pin its file (:data:`UNIT_TESTS`), then a fast
slice of tests/conformance (``COLLSVC_CONFORMANCE=quick``). A mutant is *killed* when a tier fails (or
runs past its limit; the record names the tier), *survives* when both pass. Mutants are drawn in a
seeded random order and run until the time budget is spent; the counts say, per file and in all, how
many were generated, run, killed by each tier and survived, and every survivor is listed with its line.

    python scripts/mutation.py --budget 1500 --out mutation.json [--seed 1] [FILE ...]
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [
    "collsvc/client/ops.py",
    "collsvc/client/operands.py",
    "collsvc/client/fast_path.py",
    "collsvc/client/backends/shm/repeated.py",
    "collsvc/client/backends/shm/steps.py",
    "collsvc/client/backends/shm/prepared.py",
    "collsvc/client/backends/shm/group.py",
]
# The unit tests that pin each target file, run before the conformance slice (seconds, not tens of them).
UNIT_TESTS = {
    "collsvc/client/ops.py": ["tests/unit/test_nccl_fake.py"],
    "collsvc/client/operands.py": ["tests/unit/test_result_buffer.py", "tests/unit/test_nccl_fake.py"],
    "collsvc/client/fast_path.py": ["tests/unit/test_nccl_fake.py"],
    "collsvc/client/backends/shm/repeated.py": ["tests/unit/shm/test_repeated_calls.py"],
    "collsvc/client/backends/shm/steps.py": ["tests/unit/shm"],
    "collsvc/client/backends/shm/prepared.py": ["tests/unit/shm"],
    "collsvc/client/backends/shm/group.py": ["tests/unit/shm"],
}
TIERS = ("unit", "conformance")
# Targets that moved since earlier runs (old path -> new path): --recheck maps an old run's survivors.
MOVED = {"collsvc/client/repeated.py": "collsvc/client/backends/shm/repeated.py"}
_FLIP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_ARITH = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult}


@dataclass
class Mutant:
    path: str
    line: int
    kind: str
    original: str
    mutated: str
    start: tuple[int, int]
    end: tuple[int, int]
    context: str = ""  # the source line(s) the mutant changes, stripped: finds it again after edits
    outcome: str = "not run"
    tier: str = ""  # the tier that killed it ("unit" or "conformance"); empty while it survives
    seconds: float = 0.0


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                lines.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return lines


def _variants(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Mutated copies of ``node`` (each one change), with the kind of change."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            flipped = _FLIP.get(type(op))
            if flipped is not None:
                copy = ast.parse(ast.unparse(node), mode="eval").body
                assert isinstance(copy, ast.Compare)
                copy.ops[i] = flipped()
                yield f"comparison {type(op).__name__} -> {flipped.__name__}", copy
    elif isinstance(node, ast.BoolOp):
        copy = ast.parse(ast.unparse(node), mode="eval").body
        assert isinstance(copy, ast.BoolOp)
        copy.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield "and <-> or", copy
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        yield "not dropped", node.operand
    elif isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        copy = ast.parse(ast.unparse(node), mode="eval").body
        assert isinstance(copy, ast.BinOp)
        copy.op = _ARITH[type(node.op)]()
        yield f"arithmetic {type(node.op).__name__} -> {type(copy.op).__name__}", copy
    elif isinstance(node, ast.Slice):
        for bound in ("lower", "upper"):
            if getattr(node, bound) is not None:
                copy = ast.parse(f"x[{ast.unparse(node)}]", mode="eval").body
                assert isinstance(copy, ast.Subscript) and isinstance(copy.slice, ast.Slice)
                setattr(copy.slice, bound, ast.BinOp(getattr(copy.slice, bound), ast.Add(), ast.Constant(1)))
                yield f"slice {bound} bound + 1", copy.slice
    elif isinstance(node, ast.Constant) and type(node.value) is bool:
        yield "boolean constant flipped", ast.Constant(not node.value)
    elif isinstance(node, ast.Constant) and type(node.value) is int and node.value in (0, 1, 2):
        yield f"constant {node.value} -> {node.value + 1}", ast.Constant(node.value + 1)


def generate(path: str) -> list[Mutant]:
    """Every mutant of ``path`` (docstrings, asserts, logging and type annotations left alone)."""
    source = (ROOT / path).read_text()
    tree = ast.parse(source)
    skip = _docstring_lines(tree)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assert, ast.AnnAssign, ast.FunctionDef, ast.AsyncFunctionDef)):
            targets = [node.test] if isinstance(node, ast.Assert) else []
            if isinstance(node, ast.AnnAssign):
                targets = [node.annotation]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                targets = [a.annotation for a in [*node.args.args, *node.args.kwonlyargs] if a.annotation]
                targets += [node.returns] if node.returns else []
            for target in targets:
                for inner in ast.walk(target):
                    if hasattr(inner, "lineno"):
                        skip.update(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    mutants = []
    lines = source.splitlines(keepends=True)

    def segment(node: ast.AST) -> str | None:
        end_line, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
        if end_line is None or end_col is None:
            return None
        first, last = node.lineno - 1, end_line - 1  # type: ignore[attr-defined]
        if first == last:
            return lines[first].encode()[node.col_offset : end_col].decode()  # type: ignore[attr-defined]
        parts = [lines[first].encode()[node.col_offset :].decode()]  # type: ignore[attr-defined]
        parts += lines[first + 1 : last]
        parts.append(lines[last].encode()[:end_col].decode())
        return "".join(parts)

    for node in ast.walk(tree):
        if not hasattr(node, "lineno") and not isinstance(node, ast.Slice):
            continue
        line = getattr(node, "lineno", None)
        if line is None or line in skip:
            continue
        original = segment(node)
        if original is None:
            continue
        for kind, mutated in _variants(node):
            text = ast.unparse(mutated)
            if text == original:
                continue
            start = (node.lineno, node.col_offset)
            end = (node.end_lineno or node.lineno, node.end_col_offset or 0)
            text = text if isinstance(node, ast.Slice) else f"({text})"
            context = _context(lines, node.lineno, node.end_lineno or node.lineno)
            mutants.append(Mutant(path, line, kind, original, text, start, end, context))
    return mutants


def _context(lines: list[str], first: int, last: int) -> str:
    """Lines ``first``..``last`` (1-based) of a source, each stripped, joined by one space."""
    return " ".join(text.strip() for text in lines[first - 1 : last])


def _tree() -> str:
    """The commit the run's tree is at (with "+changes" when the working tree differs from it)."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "collsvc", "tests"], cwd=ROOT, capture_output=True)
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def _old_context(tree: str, previous: dict[str, Any], cache: dict[str, list[str] | None]) -> str:
    """The source line(s) an earlier run's mutant changed, read from commit ``tree`` (empty if unknown)."""
    if previous.get("context"):
        return str(previous["context"])
    path = previous["path"]
    if path not in cache:
        shown = subprocess.run(["git", "show", f"{tree}:{path}"], cwd=ROOT, capture_output=True, text=True)
        cache[path] = shown.stdout.splitlines(keepends=True) if shown.returncode == 0 else None
    lines = cache[path]
    if lines is None:
        return ""
    return _context(lines, previous["start"][0], previous["end"][0])


def match_survivors(mutants: list[Mutant], previous: list[dict[str, Any]], tree: str) -> list[Mutant]:
    """The mutants of this tree that an earlier run's survivors stand for (lines may have moved, files
    too: :data:`MOVED`): the same change of the same text on the same source line(s), the nearest to
    the old line (then column) where several match; a survivor whose line is gone matches nothing (it is reported)."""
    cache: dict[str, list[str] | None] = {}
    found: list[Mutant] = []
    for old in previous:
        if old["outcome"] != "survived":
            continue
        path = MOVED.get(old["path"], old["path"])
        context = _old_context(tree, old, cache)
        same = [
            m
            for m in mutants
            if (m.path, m.kind, m.original, m.mutated) == (path, old["kind"], old["original"], old["mutated"])
            and (not context or m.context == context)
        ]
        if not same and context:  # moved to another target file (a refactor), same line of source
            same = [
                m
                for m in mutants
                if (m.kind, m.original, m.mutated, m.context) == (old["kind"], old["original"], old["mutated"], context)
            ]
        if not same:
            print(f"gone     {old['path']}:{old['line']} {old['kind']}: {old['original']!r}", flush=True)
            continue
        # Nearest line first, then nearest column: one line may hold the same change twice (two 0s).
        best = min(same, key=lambda m: (abs(m.line - old["line"]), abs(m.start[1] - old["start"][1])))
        if best not in found:
            found.append(best)
    return found


def apply(source: str, mutant: Mutant) -> str:
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for text in lines:
        offsets.append(offsets[-1] + len(text.encode()))
    raw = source.encode()
    lo = offsets[mutant.start[0] - 1] + mutant.start[1]
    hi = offsets[mutant.end[0] - 1] + mutant.end[1]
    return (raw[:lo] + mutant.mutated.encode() + raw[hi:]).decode()


def run_tests(copy: Path, paths: list[str], limit: float, env: dict[str, str] | None = None) -> tuple[str, float]:
    """Runs pytest on ``paths`` in ``copy`` (stopping at the first failure): "killed", "survived" or
    "timeout", and the seconds it took."""
    env = dict(os.environ, PYTHONPATH=str(copy), **(env or {}))
    began = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *paths],
            cwd=copy,
            env=env,
            capture_output=True,
            timeout=limit,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - began
    return ("survived" if result.returncode == 0 else "killed"), time.monotonic() - began


def run_slice(copy: Path, limit: float) -> tuple[str, float]:
    """Runs the quick conformance slice against ``copy``: "killed", "survived" or "timeout"."""
    return run_tests(copy, ["tests/conformance"], limit, {"COLLSVC_CONFORMANCE": "quick"})


def run_tiers(copy: Path, path: str, limit: float) -> tuple[str, str, float]:
    """Runs ``path``'s unit tests (:data:`UNIT_TESTS`), then, if they pass, the conformance slice, in
    ``copy``: (outcome, the tier that killed it or "", seconds in all)."""
    seconds = 0.0
    unit = UNIT_TESTS.get(path, [])
    if unit:
        outcome, seconds = run_tests(copy, unit, limit)
        if outcome != "survived":
            return outcome, "unit", seconds
    outcome, more = run_slice(copy, limit)
    return outcome, ("" if outcome == "survived" else "conformance"), seconds + more


def counts(mutants: list[Mutant], paths: list[str], generated: dict[str, int]) -> dict[str, dict[str, int]]:
    """Per target file: mutants generated, run, killed by each tier (a run past its limit counts as
    killed by the tier it ran in), survived, invalid."""
    table: dict[str, dict[str, int]] = {}
    for path in paths:
        ran = [m for m in mutants if m.path == path and m.outcome in ("killed", "survived", "timeout")]
        row = {"generated": generated[path], "run": len(ran)}
        for tier in TIERS:
            row[f"killed_{tier}"] = sum(m.tier == tier for m in ran)
        row["survived"] = sum(m.outcome == "survived" for m in ran)
        row["invalid"] = sum(m.path == path and m.outcome == "invalid" for m in mutants)
        table[path] = row
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=TARGETS)
    parser.add_argument("--budget", type=float, default=1500.0, help="seconds to spend running mutants")
    parser.add_argument("--limit", type=float, default=240.0, help="seconds one mutant's slice may take")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="mutation.json")
    parser.add_argument("--list", action="store_true", help="only count and list the mutants")
    parser.add_argument("--recheck", help="a previous run's JSON: run its survivors again (after new cases)")
    parser.add_argument("--tree", help="with --recheck: the commit the previous run ran on (default: its record)")
    args = parser.parse_args()
    mutants = [m for path in args.files for m in generate(path)]
    if args.recheck:
        record = json.loads(Path(args.recheck).read_text())
        tree = args.tree or str(record.get("tree", "")).split("+")[0]
        mutants = match_survivors(mutants, record["mutants"], tree)
    generated = {path: sum(m.path == path for m in mutants) for path in args.files}
    print(f"{len(mutants)} mutants: {generated}", flush=True)
    if args.list:
        for m in mutants:
            print(f"{m.path}:{m.line}: {m.kind}: {m.original} -> {m.mutated}")
        return 0
    if not args.recheck:
        random.Random(args.seed).shuffle(mutants)
    began = time.monotonic()
    copied_at = _tree()  # now, as the tree is copied: the working tree may change while the mutants run
    with tempfile.TemporaryDirectory(prefix="collsvc-mutation-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", ".mypy_cache", "*.egg-info"))
        unit = sorted({test for path in args.files for test in UNIT_TESTS.get(path, [])})
        if unit:
            baseline, seconds = run_tests(copy, unit, args.limit)
            print(f"unmutated unit tests ({' '.join(unit)}): {baseline} in {seconds:.0f} s", flush=True)
            if baseline != "survived":
                print("the unmutated unit tests fail: fix that first", file=sys.stderr)
                return 2
        baseline, seconds = run_slice(copy, args.limit)
        print(f"unmutated slice: {baseline} in {seconds:.0f} s", flush=True)
        if baseline != "survived":
            print("the unmutated slice fails: fix that first", file=sys.stderr)
            return 2
        for mutant in mutants:
            if time.monotonic() - began > args.budget:
                break
            target = copy / mutant.path
            original = target.read_text()
            mutated = apply(original, mutant)
            try:
                compile(mutated, mutant.path, "exec")
            except SyntaxError:
                mutant.outcome = "invalid"
                continue
            target.write_text(mutated)
            try:
                mutant.outcome, mutant.tier, mutant.seconds = run_tiers(copy, mutant.path, args.limit)
            finally:
                target.write_text(original)
            outcome = f"{mutant.outcome} ({mutant.tier})" if mutant.tier else mutant.outcome
            print(f"{outcome:20} {mutant.path}:{mutant.line} {mutant.kind}: {mutant.original!r}", flush=True)
    ran = [m for m in mutants if m.outcome in ("killed", "survived", "timeout")]
    summary = {
        "generated": len(mutants),
        "generated_by_file": generated,
        "run": len(ran),
        "killed": sum(m.outcome == "killed" for m in ran),
        "timeout": sum(m.outcome == "timeout" for m in ran),
        **{f"killed_{tier}": sum(m.tier == tier for m in ran) for tier in TIERS},
        "survived": sum(m.outcome == "survived" for m in ran),
        "invalid": sum(m.outcome == "invalid" for m in mutants),
        "seconds": round(time.monotonic() - began),
        "seed": args.seed,
        "tree": copied_at,
        "unit_tests": {path: UNIT_TESTS.get(path, []) for path in args.files},
        "by_file": counts(mutants, args.files, generated),
        "mutants": [asdict(m) for m in mutants if m.outcome != "not run"],
    }
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("mutants", "by_file")}), flush=True)
    for path, row in summary["by_file"].items():
        print(f"{path}: {row}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
