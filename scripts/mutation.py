#!/usr/bin/env python3
"""Mutation testing of the collective paths against the conformance suite, without extra tools.

Each mutant changes one expression of a target file (a flipped comparison, ``and``/``or`` swapped,
``is``/``is not`` swapped, ``not`` dropped, an arithmetic operator swapped, a constant or a slice bound
off by one, a boolean constant flipped), in a copy of the repository, and runs a fast slice of
tests/conformance (``COLLSVC_CONFORMANCE=quick``) against it. A mutant is *killed* when the slice
fails (or runs past its limit), *survives* when it passes. Mutants are drawn in a seeded random order
and run until the time budget is spent; the counts say how many were generated, run, killed and
survived, and every survivor is listed with its line.

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

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [
    "collsvc/client/ops.py",
    "collsvc/client/operands.py",
    "collsvc/client/fast_path.py",
    "collsvc/client/repeated.py",
    "collsvc/client/backends/shm/steps.py",
    "collsvc/client/backends/shm/prepared.py",
    "collsvc/client/backends/shm/group.py",
]
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
    outcome: str = "not run"
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
            mutants.append(Mutant(path, line, kind, original, text, start, end))
    return mutants


def apply(source: str, mutant: Mutant) -> str:
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for text in lines:
        offsets.append(offsets[-1] + len(text.encode()))
    raw = source.encode()
    lo = offsets[mutant.start[0] - 1] + mutant.start[1]
    hi = offsets[mutant.end[0] - 1] + mutant.end[1]
    return (raw[:lo] + mutant.mutated.encode() + raw[hi:]).decode()


def run_slice(copy: Path, limit: float) -> tuple[str, float]:
    """Runs the quick conformance slice against ``copy``: "killed", "survived" or "timeout"."""
    env = dict(os.environ, PYTHONPATH=str(copy), COLLSVC_CONFORMANCE="quick")
    began = time.monotonic()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/conformance"],
            cwd=copy,
            env=env,
            capture_output=True,
            timeout=limit,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - began
    return ("survived" if result.returncode == 0 else "killed"), time.monotonic() - began


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", default=TARGETS)
    parser.add_argument("--budget", type=float, default=1500.0, help="seconds to spend running mutants")
    parser.add_argument("--limit", type=float, default=240.0, help="seconds one mutant's slice may take")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="mutation.json")
    parser.add_argument("--list", action="store_true", help="only count and list the mutants")
    parser.add_argument("--recheck", help="a previous run's JSON: run its survivors again (after new cases)")
    args = parser.parse_args()
    mutants = [m for path in args.files for m in generate(path)]
    if args.recheck:
        previous = json.loads(Path(args.recheck).read_text())["mutants"]
        wanted = {(m["path"], m["line"], m["kind"], m["original"]) for m in previous if m["outcome"] == "survived"}
        mutants = [m for m in mutants if (m.path, m.line, m.kind, m.original) in wanted]
    generated = {path: sum(m.path == path for m in mutants) for path in args.files}
    print(f"{len(mutants)} mutants: {generated}", flush=True)
    if args.list:
        for m in mutants:
            print(f"{m.path}:{m.line}: {m.kind}: {m.original} -> {m.mutated}")
        return 0
    if not args.recheck:
        random.Random(args.seed).shuffle(mutants)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="collsvc-mutation-") as tmp:
        copy = Path(tmp) / "repo"
        shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "__pycache__", ".mypy_cache", "*.egg-info"))
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
                mutant.outcome, mutant.seconds = run_slice(copy, args.limit)
            finally:
                target.write_text(original)
            print(f"{mutant.outcome:8} {mutant.path}:{mutant.line} {mutant.kind}: {mutant.original!r}", flush=True)
    ran = [m for m in mutants if m.outcome in ("killed", "survived", "timeout")]
    summary = {
        "generated": len(mutants),
        "generated_by_file": generated,
        "run": len(ran),
        "killed": sum(m.outcome == "killed" for m in ran),
        "timeout": sum(m.outcome == "timeout" for m in ran),
        "survived": sum(m.outcome == "survived" for m in ran),
        "invalid": sum(m.outcome == "invalid" for m in mutants),
        "seconds": round(time.monotonic() - began),
        "seed": args.seed,
        "mutants": [asdict(m) for m in mutants if m.outcome != "not run"],
    }
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "mutants"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
