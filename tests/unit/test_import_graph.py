"""The shape of collsvc/: no import cycles, modules import only their own layer or lower ones, one role per
module (nobody but the Job reaches into a job's parts; the fast path knows backends only by their seam).

Pure and fast: the sources are parsed with ``ast``; nothing from collsvc is imported. Every import of
a collsvc module counts, also one under ``if TYPE_CHECKING:`` and one inside a function (a lazy
import): all of them name a dependency a reader must understand first. The generated
``collsvc/proto/v1/*_pb2*.py`` modules are leaves of the graph; their own imports are not checked.

The layer table below is the "Where to look" diagram of docs/architecture.md as the code has it.
When a test here fails, its message names the file, line and import to look at.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "collsvc"
# A loose guard against accidents (a pasted block, a generated table), not a size to trim under: what
# keeps a module small is that it has one role, which the checks below the layer test express.
MAX_MODULE_LINES = 600

# Lowest first. A rule names a module and covers every module below it (longest rule wins), so
# "collsvc" is the default for a module that no other rule names. A module may import modules of its
# own layer (the cycle test keeps those acyclic) and of lower layers, never of a higher one.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "bottom",
        (
            "collsvc.types",
            "collsvc.options",
            "collsvc.launcher_env",
            "collsvc.config",
            "collsvc.errors",
            "collsvc.proto",
        ),
    ),
    ("arrays", ("collsvc.arrays",)),
    # with failure_report, which client/job installs in every rank and the launcher reads
    ("observability", ("collsvc.observability",)),
    ("server state", ("collsvc.server.state",)),
    ("server services", ("collsvc.server.services", "collsvc.server.interceptors", "collsvc.server.request_limits")),
    ("server app", ("collsvc.server",)),  # app, metrics
    (
        "backend contract",
        (
            "collsvc.client.backends.base",
            "collsvc.client.backends.reduction",
            "collsvc.client.backends.grpc_options",
        ),
    ),
    ("backends", ("collsvc.client.backends",)),  # ring, shm, nccl
    (
        "job services",
        (
            "collsvc.client.fork_guard",
            "collsvc.client.heartbeat",
            "collsvc.client.rendezvous",
            "collsvc.client.join_report",
            "collsvc.client.join_relay",
            "collsvc.client.relay_wire",
            "collsvc.client.departures",
            "collsvc.client.peer_address",
            "collsvc.client.reconnect",
            "collsvc.client.coordinator_channel",
            "collsvc.client.coordinator_channels",
            "collsvc.client.progress",
            "collsvc.client.failure_state",
            "collsvc.client.devices",
            "collsvc.client.work",
            "collsvc.client.timeout_report",
            "collsvc.client.coordinator_access",
            "collsvc.client.calls",
            "collsvc.client.job_handle",
        ),
    ),
    ("job", ("collsvc.client.job", "collsvc.client.connect")),
    (
        "ops",
        (
            "collsvc.client.ops",
            "collsvc.client.operands",
            "collsvc.client.bucketing",
            "collsvc.client.objects",
            "collsvc.client.fast_path",
        ),
    ),
    ("communicator", ("collsvc.client",)),
    ("api", ("collsvc._api", "collsvc._mpirun_coordinator")),
    ("elastic", ("collsvc.elastic",)),  # the rank side: State, run, membership
    ("package", ("collsvc",)),  # collsvc/__init__.py: the public names, loaded lazily
    ("torch", ("collsvc.torch",)),
    # collsvc run: the supervision loop, the embedded coordinator, the join relay, the fork server
    ("launch", ("collsvc.launch",)),
    ("elastic launcher", ("collsvc.elastic.launch", "collsvc.elastic.rejoin")),
    # collsvc bench: its ranks run the public API; the parent starts them as the launcher does
    ("bench", ("collsvc.bench",)),
    ("cli", ("collsvc.cli", "collsvc.__main__")),
    # the seeds' own APIs over the public one (see COMPAT_IMPORTS below)
    ("compat", ("collsvc.compat",)),
)

# Rooms that stand side by side in the diagram: neither may import the other, whatever their layers.
SEPARATE_ROOMS: tuple[tuple[str, str], ...] = (("collsvc.client", "collsvc.server"),)


@dataclass(frozen=True)
class ImportEdge:
    """One import statement of ``importer`` that names the collsvc module ``imported``."""

    importer: str
    imported: str
    path: Path
    line: int
    statement: str

    @property
    def where(self) -> str:
        """``collsvc/x.py:12: from collsvc.y import z``: what a reader opens to see the import."""
        return f"{self.path.relative_to(REPO_ROOT)}:{self.line}: {self.statement}"


def is_generated(path: Path) -> bool:
    """Whether ``path`` is a module generated from the protos (``*_pb2.py``, ``*_pb2_grpc.py``)."""
    return path.name.endswith(("_pb2.py", "_pb2_grpc.py"))


def module_name(path: Path) -> str:
    """The dotted module name of a file under the repository root (a package is its ``__init__``)."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_files() -> list[Path]:
    """Every ``.py`` file of collsvc/, generated ones included, in a stable order."""
    return sorted((REPO_ROOT / PACKAGE).rglob("*.py"))


def checked_modules() -> dict[str, Path]:
    """The modules whose imports and sizes are checked: all of collsvc/ but the generated ones."""
    return {module_name(path): path for path in package_files() if not is_generated(path)}


def known_modules() -> frozenset[str]:
    """Every module name of collsvc/, generated ones included: what an import may resolve to."""
    return frozenset(module_name(path) for path in package_files())


def _resolve(name: str, known: frozenset[str]) -> str:
    """The longest known module that ``name`` starts with (``collsvc.x.Name`` -> ``collsvc.x``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def _absolute_base(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` names, relative forms resolved against ``importer``."""
    if not node.level:
        return node.module or ""
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def _one_line(lines: list[str], node: ast.stmt) -> str:
    text = " ".join(" ".join(lines[node.lineno - 1 : node.end_lineno or node.lineno]).split())
    text = text.replace("( ", "(").replace(", )", ")").replace(" )", ")")
    return text if len(text) <= 110 else text[:107] + "..."


def imports_in_source(
    importer: str, path: Path, source: str, known: frozenset[str], *, is_package: bool = False
) -> list[ImportEdge]:
    """Every import of a collsvc module in ``source``, wherever it stands (top level, function, if).

    ``from collsvc.x import y`` counts as an import of ``collsvc.x.y`` when that is a module, and of
    ``collsvc.x`` otherwise; relative imports are resolved against ``importer``.

    Raises:
        SyntaxError: ``source`` does not parse.
    """
    lines = source.splitlines()
    edges: list[ImportEdge] = []
    for node in ast.walk(ast.parse(source, filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name, known) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute_base(importer, is_package, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.append(submodule if submodule in known else _resolve(base, known))
        else:
            continue
        statement = _one_line(lines, node)
        for target in dict.fromkeys(targets):  # one edge per module, in order
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                edges.append(ImportEdge(importer, target, path, node.lineno, statement))
    return sorted(edges, key=lambda edge: (edge.line, edge.imported))


def import_edges() -> list[ImportEdge]:
    """The import graph of collsvc/ (generated modules excluded as importers), one edge per import."""
    known = known_modules()
    edges: list[ImportEdge] = []
    for name, path in checked_modules().items():
        source = path.read_text(encoding="utf-8")
        edges += imports_in_source(name, path, source, known, is_package=path.name == "__init__.py")
    return edges


def strongly_connected_components(nodes: Iterable[str], edges: Iterable[ImportEdge]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that import each other, directly or not."""
    successors: dict[str, set[str]] = {node: set() for node in nodes}
    for edge in edges:
        successors.setdefault(edge.importer, set()).add(edge.imported)
        successors.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    lowest: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowest[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(successors[node]):
            if successor not in index:
                visit(successor)
                lowest[node] = min(lowest[node], lowest[successor])
            elif successor in on_stack:
                lowest[node] = min(lowest[node], index[successor])
        if lowest[node] == index[node]:
            component: list[str] = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return components


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...] = LAYERS) -> tuple[int, str]:
    """The (position, name) of the layer whose longest rule covers ``module``.

    Raises:
        LookupError: no rule covers ``module``.
    """
    best: tuple[int, int, str] | None = None  # (rule length, position, layer name)
    for position, (layer, rules) in enumerate(layers):
        for rule in rules:
            if (module == rule or module.startswith(rule + ".")) and (best is None or len(rule) > best[0]):
                best = (len(rule), position, layer)
    if best is None:
        raise LookupError(f"no layer rule covers {module}")
    return best[1], best[2]


def _in_room(module: str, room: str) -> bool:
    return module == room or module.startswith(room + ".")


def cycle_report(edges: list[ImportEdge], modules: Mapping[str, Path]) -> list[str]:
    """One paragraph per import cycle: its modules, then the imports among them that close it."""
    paragraphs = []
    for component in strongly_connected_components(modules, edges):
        members = set(component)
        inside = [edge for edge in edges if edge.importer in members and edge.imported in members]
        if len(component) == 1 and not inside:
            continue
        lines = [f"cycle among {len(component)} module(s): {', '.join(component)}", "  imports that close it:"]
        lines += [f"    {edge.where}   ({edge.importer} -> {edge.imported})" for edge in inside]
        paragraphs.append("\n".join(lines))
    return paragraphs


def test_the_graph_has_no_import_cycles() -> None:
    edges = import_edges()
    report = cycle_report(edges, checked_modules())
    assert not report, "collsvc/ has import cycles (type-only and lazy imports count):\n\n" + "\n\n".join(report)


def test_no_module_imports_a_higher_layer() -> None:
    violations = []
    for edge in import_edges():
        importer_position, importer_layer = layer_of(edge.importer)
        imported_position, imported_layer = layer_of(edge.imported)
        if imported_position > importer_position:
            violations.append(
                f"{edge.where}\n    {edge.importer} (layer {importer_position} {importer_layer!r}) imports "
                f"{edge.imported} (layer {imported_position} {imported_layer!r}), a higher layer"
            )
    assert not violations, (
        "modules import upward (move the code down, or change LAYERS in this test if the diagram in "
        "docs/architecture.md changes with it):\n" + "\n".join(violations)
    )


def test_rooms_side_by_side_do_not_import_each_other() -> None:
    violations = [
        f"{edge.where}   ({edge.importer} -> {edge.imported})"
        for edge in import_edges()
        for first, second in SEPARATE_ROOMS
        for room, other in ((first, second), (second, first))
        if _in_room(edge.importer, room) and _in_room(edge.imported, other)
    ]
    assert not violations, "rooms that stand side by side (SEPARATE_ROOMS) import each other:\n" + "\n".join(violations)


def test_every_layer_rule_names_a_module() -> None:
    known = known_modules()
    rules = [rule for _, layer_rules in LAYERS for rule in layer_rules]
    stale = [rule for rule in rules if rule not in known]
    duplicated = sorted({rule for rule in rules if rules.count(rule) > 1})
    assert not stale, f"LAYERS names modules that no longer exist: {stale}"
    assert not duplicated, f"LAYERS names these modules twice: {duplicated}"


def test_no_module_is_over_the_loose_size_guard() -> None:
    oversized = []
    for path in checked_modules().values():
        lines = path.read_bytes().count(b"\n")  # what `wc -l` counts
        if lines > MAX_MODULE_LINES:
            oversized.append(f"{path.relative_to(REPO_ROOT)}: {lines} lines")
    assert not oversized, (
        f"modules over {MAX_MODULE_LINES} lines (a module this long has more than one role: split it at a seam):\n"
        + "\n".join(oversized)
    )


# -- one role per module ----------------------------------------------------------------------------------

# The parts of a joined job (client/job.py). Only the Job, which holds them for their lifecycle, and
# client/connect.py, which builds them, may touch them through a job; everyone else gets the narrow handle
# it needs (the call runner, the coordinator's access, JobHandle, a backend), passed in.
JOB_PARTS = ("ring", "progress", "recorder", "failure", "departed", "client", "join", "options")
JOB_OWNERS = ("collsvc.client.job", "collsvc.client.connect")
_REACH_THROUGH = re.compile(r"(?<![A-Za-z0-9_])_?job\.(" + "|".join(JOB_PARTS) + r")\.\w")


def reach_throughs(source: str) -> list[tuple[int, str]]:
    """The (line number, line) of each ``job.<part>.<name>`` in ``source`` (``self._job.client.get``,
    ``comm.job.options.timeout``): code that reaches through a job into one of its parts."""
    return [
        (number, line.strip())
        for number, line in enumerate(source.splitlines(), start=1)
        if _REACH_THROUGH.search(line)
    ]


def test_nobody_but_the_job_reaches_into_its_parts() -> None:
    violations = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line}"
        for name, path in checked_modules().items()
        if name not in JOB_OWNERS
        for number, line in reach_throughs(path.read_text(encoding="utf-8"))
    ]
    assert not violations, (
        "modules reach through a job into its parts (take the narrow handle it needs instead: "
        "client/calls.py's CallRunner, client/coordinator_access.py, JobHandle, a backend):\n" + "\n".join(violations)
    )


# The fast path meets the general path at the Backend interface (Backend.prepare): it may know backends
# only by their seam (backends/base.py), never by the internals of one of them.
FAST_PATH = ("collsvc.client.fast_path",)
BACKEND_INTERNALS = ("collsvc.client.backends.shm", "collsvc.client.backends.ring")


def test_the_fast_path_knows_backends_only_by_their_seam() -> None:
    violations = [
        edge.where
        for edge in import_edges()
        if any(_in_room(edge.importer, room) for room in FAST_PATH)
        and any(_in_room(edge.imported, room) for room in BACKEND_INTERNALS)
    ]
    assert not violations, (
        "the fast path imports shared-memory or ring internals (ask the backend: Backend.prepare):\n"
        + "\n".join(violations)
    )


def test_reach_throughs_are_found() -> None:
    source = "x = self._job.client.get(k)\ny = comm.job.options.timeout\nz = job.calls\nw = my_job.ring\n"
    assert [number for number, _ in reach_throughs(source)] == [1, 2]


# The guard's own checks: a graph that missed type-only or lazy imports would pass for the wrong reason.

_KNOWN = frozenset({"collsvc", "collsvc.a", "collsvc.a.b", "collsvc.a.c", "collsvc.d", "collsvc.proto.v1.x_pb2"})


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import collsvc.a.b\n", ["collsvc.a.b"]),
        ("import collsvc\n", ["collsvc"]),
        ("from collsvc.a.b import Name\n", ["collsvc.a.b"]),
        ("from collsvc.a import b, c, Name\n", ["collsvc.a", "collsvc.a.b", "collsvc.a.c"]),
        ("from collsvc import d\n", ["collsvc.d"]),
        ("from collsvc.proto.v1 import x_pb2\n", ["collsvc.proto.v1.x_pb2"]),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from collsvc.d import T\n", ["collsvc.d"]),
        ("def f():\n    from collsvc.d import g\n    return g\n", ["collsvc.d"]),
        ("from . import c\n", ["collsvc.a.c"]),
        ("from .c import Name\n", ["collsvc.a.c"]),
        ("from .. import d\n", ["collsvc.d"]),
        ("import os\nfrom numpy import ndarray\n", []),
    ],
)
def test_the_graph_sees_every_kind_of_import(source: str, expected: list[str]) -> None:
    path = REPO_ROOT / "collsvc" / "a" / "b.py"
    edges = imports_in_source("collsvc.a.b", path, source, _KNOWN)
    assert sorted(edge.imported for edge in edges) == expected


def test_relative_imports_in_a_package_resolve_against_the_package() -> None:
    path = REPO_ROOT / "collsvc" / "a" / "__init__.py"
    edges = imports_in_source("collsvc.a", path, "from .b import Name\nfrom . import c\n", _KNOWN, is_package=True)
    assert [edge.imported for edge in edges] == ["collsvc.a.b", "collsvc.a.c"]


def test_a_cycle_is_reported_with_the_imports_that_close_it() -> None:
    path = REPO_ROOT / "collsvc" / "a" / "b.py"
    edges = [
        ImportEdge("collsvc.a.b", "collsvc.a.c", path, 3, "from collsvc.a.c import f"),
        ImportEdge("collsvc.a.c", "collsvc.a.b", path, 9, "from collsvc.a.b import g"),
        ImportEdge("collsvc.a.c", "collsvc.d", path, 10, "import collsvc.d"),
    ]
    report = cycle_report(edges, {"collsvc.a.b": path, "collsvc.a.c": path, "collsvc.d": path})
    assert len(report) == 1
    assert "collsvc.a.b, collsvc.a.c" in report[0]
    assert "collsvc/a/b.py:3: from collsvc.a.c import f" in report[0]
    assert "collsvc/a/b.py:9: from collsvc.a.b import g" in report[0]
    assert "collsvc.d" not in report[0].split("imports that close it")[1]


def test_layer_rules_pick_the_longest_match() -> None:
    assert layer_of("collsvc.client.backends.base")[1] == "backend contract"
    assert layer_of("collsvc.client.backends.ring.frames")[1] == "backends"
    assert layer_of("collsvc.client.communicator")[1] == "communicator"
    assert layer_of("collsvc.elastic.launch")[1] == "elastic launcher"
    assert layer_of("collsvc.elastic.membership")[1] == "elastic"
    assert layer_of("collsvc")[1] == "package"
    assert layer_of("collsvc.launch.fork_server")[1] == "launch"
    assert layer_of("collsvc.bench.worker")[1] == "bench"
    assert layer_of("collsvc.cli.remote")[1] == "cli"
    assert layer_of("collsvc.observability.failure_report")[1] == "observability"


# The compat faces translate the seeds' APIs onto the public one: they may import the package itself
# (its lazily loaded public names) and each other, nothing inside collsvc.
COMPAT_IMPORTS = ("collsvc", "collsvc.compat")


def test_compat_faces_import_only_the_public_api() -> None:
    violations = [
        edge.where
        for edge in import_edges()
        if layer_of(edge.importer)[1] == "compat"
        and not (edge.imported == "collsvc" or edge.imported.startswith("collsvc.compat"))
    ]
    assert not violations, (
        "collsvc.compat imports collsvc internals (use the public names of `collsvc`):\n" + "\n".join(violations)
    )
