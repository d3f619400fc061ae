"""docs/architecture.md names every module of collsvc/, so that a reader finds each one's room there.

A module counts as named when its path from the repository root appears in the document
(``collsvc/launch/spec.py``), also inside a brace list (``collsvc/launch/{launcher,spec}.py``). Package
``__init__.py`` files and the generated ``*_pb2*.py`` modules are left out.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DOC = REPO_ROOT / "docs" / "architecture.md"
_BRACES = re.compile(r"([\w./]*)\{([\w,]+)\}([\w.]*)")
_PATH = re.compile(r"collsvc/[\w/]+\.py")


def named_paths(text: str) -> set[str]:
    """Every ``collsvc/...py`` path ``text`` names, brace lists expanded."""
    expanded = _BRACES.sub(
        lambda match: " ".join(f"{match[1]}{name}{match[3]}" for name in match[2].split(",")),
        text,
    )
    return set(_PATH.findall(expanded))


def package_modules() -> list[str]:
    """The module files of collsvc/ the document must name."""
    return sorted(
        path.relative_to(REPO_ROOT).as_posix()
        for path in (REPO_ROOT / "collsvc").rglob("*.py")
        if path.name != "__init__.py" and not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    )


def test_every_module_is_named_in_the_architecture_doc() -> None:
    named = named_paths(DOC.read_text(encoding="utf-8"))
    missing = [module for module in package_modules() if module not in named]
    assert not missing, (
        "docs/architecture.md does not name these modules (add each to its room in the 'Where to look' "
        "table):\n" + "\n".join(missing)
    )


def test_the_architecture_doc_names_no_module_that_is_gone() -> None:
    named = named_paths(DOC.read_text(encoding="utf-8"))
    gone = sorted(path for path in named if not (REPO_ROOT / path).is_file())
    assert not gone, "docs/architecture.md names modules that do not exist:\n" + "\n".join(gone)


def test_brace_lists_expand() -> None:
    text = "see `collsvc/launch/{launcher,spec}.py` and collsvc/errors.py, not collsvc/client/"
    assert named_paths(text) == {"collsvc/launch/launcher.py", "collsvc/launch/spec.py", "collsvc/errors.py"}
