"""collsvc's own environment variables are read in collsvc/config.py, or somewhere that says why not.

Pure and fast: the sources are parsed with ``ast``; nothing from collsvc is imported. ``config.py`` and
its companion ``launcher_env.py`` (the launcher families' variables: torchrun, Open MPI, Slurm, the
Kubernetes operators) are the readers. Anywhere else, each of these needs an entry in ``ALLOWED`` with
its reason (and the code a one-line comment at the read):

- a read of a ``COLLSVC_*`` variable from ``os.environ`` or ``os.getenv``, also through a name bound to
  ``os.environ`` (a parameter that defaults to it, ``env = os.environ if env is None else env``), with
  the variable written out or held in a constant of collsvc;
- the whole environment handed to a function that is not one of the readers' (``rank_env(os.environ)``,
  ``dict(os.environ, ...)``): what it reads there cannot be told from here;
- a read whose variable this test cannot name (a computed key).

Writes (``os.environ[...] = ...``, ``update``, ``clear``) are not reads and need nothing.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "collsvc"
READERS = ("collsvc/config.py", "collsvc/launcher_env.py")
PREFIX = "COLLSVC_"
WHOLE = "the whole environment"  # the variable of a read that hands all of it on
UNKNOWN = "a variable this test cannot name"

# (file, function, variable) -> why that read does not go through config.py.
ALLOWED: dict[tuple[str, str, str], str] = {
    ("collsvc/launch/launcher.py", "Launcher._spawn", f"{WHOLE} -> rank_env"): (
        "each rank's environment starts as a copy of the launcher's"
    ),
    ("collsvc/elastic/launch.py", "ElasticLauncher._start_replacement", f"{WHOLE} -> rank_env"): (
        "a replacement rank's environment starts as a copy of the launcher's"
    ),
    ("collsvc/bench/harness.py", "run_bench", f"{WHOLE} -> dict"): (
        "the benchmark ranks' environment starts as a copy of this process's"
    ),
    ("collsvc/bench/worker.py", "main", "COLLSVC_BENCH"): "written for its ranks by `collsvc bench` (run_bench)",
    ("collsvc/bench/worker.py", "main", "COLLSVC_BACKEND"): "written for its ranks by `collsvc bench` (run_bench)",
    ("collsvc/client/rendezvous.py", "CoordinatorClient._join_through_launcher", "COLLSVC_JOIN_RELAY"): (
        "written by collsvc run (launch/join_relay.py) for its ranks, with the relay's secret"
    ),
    ("collsvc/observability/failure_report.py", "write_report", "COLLSVC_REPORT_DIR"): (
        "written by collsvc run (launch/launcher.py) for its ranks: the folder it reads their reports from"
    ),
    ("collsvc/observability/failure_report.py", "write_report", "COLLSVC_RANK"): (
        "written by collsvc run with COLLSVC_REPORT_DIR; only read when that is set"
    ),
    ("collsvc/elastic/membership.py", "Membership.start", "COLLSVC_ELASTIC_JOIN"): (
        "written by the elastic launcher and by elastic.rejoin for a newcomer"
    ),
    ("collsvc/elastic/rejoin.py", "main", f"{WHOLE} -> environment_for"): (
        "the script it execs gets a copy of this process's environment"
    ),
    ("collsvc/elastic/rejoin.py", "main", "COLLSVC_ELASTIC_JOIN"): (
        "whether the elastic launcher already made this process a newcomer (its own handshake)"
    ),
    ("collsvc/torch/_bootstrap.py", "_under_collsvc_launcher", "COLLSVC_COORDINATOR"): (
        "which launcher's variables are set (COLLSVC_COORDINATOR or torchrun's MASTER_ADDR) tells the two apart"
    ),
    ("collsvc/torch/_bootstrap.py", "WorldSession.join", "COLLSVC_COORDINATOR"): (
        "only whether it is set; collsvc.init then reads it through config"
    ),
}

_KEYED_METHODS = ("get", "setdefault", "pop")
_WHOLE_METHODS = ("copy", "items", "keys", "values")


@dataclass(frozen=True)
class EnvRead:
    """One read of the environment: where, in which function, and of which variable."""

    path: str
    line: int
    function: str
    variable: str

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.path, self.function, self.variable)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _string_constants(tree: ast.Module) -> dict[str, str]:
    """The module-level ``NAME = "text"`` assignments of a module."""
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def package_constants() -> dict[str, dict[str, str]]:
    """The string constants of every module of collsvc/, by module name."""
    return {
        _module_name(path): _string_constants(ast.parse(path.read_text(encoding="utf-8")))
        for path in sorted((REPO_ROOT / PACKAGE).rglob("*.py"))
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    }


class _Finder(ast.NodeVisitor):
    """Collects the environment reads of one module (see the module docstring for what counts)."""

    def __init__(self, path: str, tree: ast.Module, constants: dict[str, dict[str, str]]) -> None:
        self.path = path
        self.reads: list[EnvRead] = []
        self._scope: list[str] = []
        self._bound: list[set[str]] = [set()]
        self._os = {"os"}
        self._environ: set[str] = set()
        self._getenv: set[str] = set()
        self._reader_names: set[str] = set()  # functions imported from the readers
        self._reader_modules: set[str] = set()  # the readers' modules, by local name
        self._names = dict(constants.get(_module_name(REPO_ROOT / path), {}))  # constant values by local name
        self._module_constants: dict[str, dict[str, str]] = {}  # imported collsvc modules' constants
        readers = {_module_name(REPO_ROOT / reader) for reader in READERS}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    local = alias.asname or alias.name
                    if alias.name == "os":
                        self._os.add(local)
                    elif alias.name in readers and alias.asname:
                        self._reader_modules.add(local)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    local = alias.asname or alias.name
                    submodule = f"{node.module}.{alias.name}"
                    if node.module == "os" and alias.name == "environ":
                        self._environ.add(local)
                    elif node.module == "os" and alias.name == "getenv":
                        self._getenv.add(local)
                    elif node.module in readers:
                        self._reader_names.add(local)
                    elif submodule in readers:
                        self._reader_modules.add(local)
                    if submodule in constants:
                        self._module_constants[local] = constants[submodule]
                    elif alias.name in constants.get(node.module, {}):
                        self._names[local] = constants[node.module][alias.name]

    # -- what a node is ------------------------------------------------------------------------------

    def _is_env(self, node: ast.expr) -> bool:
        if isinstance(node, ast.Attribute):
            return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id in self._os
        return isinstance(node, ast.Name) and (node.id in self._environ or node.id in self._bound[-1])

    def _may_be_env(self, node: ast.expr) -> bool:
        """Whether ``node`` evaluates to the environment itself (``env or os.environ``, ``a if c else b``)."""
        if isinstance(node, ast.IfExp):
            return self._may_be_env(node.body) or self._may_be_env(node.orelse)
        if isinstance(node, ast.BoolOp):
            return any(self._may_be_env(value) for value in node.values)
        return self._is_env(node)

    def _variable(self, node: ast.expr) -> str | None:
        """The variable a key names; None when it is not collsvc's own."""
        value: str | None = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            value = node.value
        elif isinstance(node, ast.Name) and node.id in self._names:
            value = self._names[node.id]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.attr in self._module_constants.get(node.value.id, {})
        ):
            value = self._module_constants[node.value.id][node.attr]
        else:
            return UNKNOWN
        return value if value.startswith(PREFIX) else None

    def _is_reader_function(self, func: ast.expr) -> bool:
        if isinstance(func, ast.Name):
            return func.id in self._reader_names
        return (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in self._reader_modules
        )

    def _add(self, node: ast.AST, variable: str | None) -> None:
        if variable is not None:
            function = ".".join(self._scope) or "<module>"
            self.reads.append(EnvRead(self.path, getattr(node, "lineno", 0), function, variable))

    # -- scopes --------------------------------------------------------------------------------------

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scope.append(node.name)
        self.generic_visit(node)
        self._scope.pop()

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = node.args
        positional = [*args.posonlyargs, *args.args]
        pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True))
        pairs += [(arg, default) for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True) if default]
        bound = {arg.arg for arg, default in pairs if self._may_be_env(default)}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign) and self._may_be_env(sub.value):
                bound |= {target.id for target in sub.targets if isinstance(target, ast.Name)}
        self._scope.append(node.name)
        self._bound.append(bound)
        self.generic_visit(node)
        self._bound.pop()
        self._scope.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    # -- reads ---------------------------------------------------------------------------------------

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Attribute) and self._is_env(func.value):
            if func.attr in _KEYED_METHODS and node.args:
                self._add(node, self._variable(node.args[0]))
            elif func.attr in _WHOLE_METHODS:
                self._add(node, f"{WHOLE} -> {func.attr}")
        elif node.args and (
            (isinstance(func, ast.Attribute) and func.attr == "getenv" and self._is_env_module(func.value))
            or (isinstance(func, ast.Name) and func.id in self._getenv)
        ):
            self._add(node, self._variable(node.args[0]))
        if not self._is_reader_function(func):
            handed = [*node.args, *(keyword.value for keyword in node.keywords)]
            if any(self._is_env(arg.value if isinstance(arg, ast.Starred) else arg) for arg in handed):
                self._add(node, f"{WHOLE} -> {ast.unparse(func)}")
        self.generic_visit(node)

    def _is_env_module(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Name) and node.id in self._os

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.ctx, ast.Load) and self._is_env(node.value):
            self._add(node, self._variable(node.slice))
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        for op, right in zip(node.ops, node.comparators, strict=True):
            if isinstance(op, (ast.In, ast.NotIn)) and self._is_env(right):
                self._add(node, self._variable(node.left))
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values, strict=True):
            if key is None and self._is_env(value):  # {**os.environ, ...}
                self._add(node, f"{WHOLE} -> {{**...}}")
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        if self._is_env(node.iter):
            self._add(node, f"{WHOLE} -> for")
        self.generic_visit(node)


def reads_in_source(path: str, source: str, constants: dict[str, dict[str, str]]) -> list[EnvRead]:
    """The environment reads of collsvc's own variables in ``source`` (``path`` relative to the repository)."""
    tree = ast.parse(source, filename=path)
    finder = _Finder(path, tree, constants)
    finder.visit(tree)
    return sorted(finder.reads, key=lambda read: (read.line, read.variable))


def package_reads() -> Iterator[EnvRead]:
    """Every read outside the readers, in collsvc/ (generated modules excluded)."""
    constants = package_constants()
    for path in sorted((REPO_ROOT / PACKAGE).rglob("*.py")):
        relative = path.relative_to(REPO_ROOT).as_posix()
        if relative in READERS or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            continue
        yield from reads_in_source(relative, path.read_text(encoding="utf-8"), constants)


def test_collsvc_variables_are_read_in_config_or_say_why_not() -> None:
    unexplained = [
        f"{read.path}:{read.line}: {read.function}: {read.variable}"
        for read in package_reads()
        if read.key not in ALLOWED
    ]
    assert not unexplained, (
        "environment reads outside collsvc/config.py: read these through a function of config.py, or add "
        "(file, function, variable) with the reason to ALLOWED in this test and a one-line comment at the "
        "read:\n" + "\n".join(unexplained)
    )


def test_every_allowed_read_still_exists_and_says_why() -> None:
    found = {read.key for read in package_reads()}
    stale = [key for key in ALLOWED if key not in found]
    assert not stale, f"ALLOWED names reads that are gone (remove them): {stale}"
    assert all(reason.strip() for reason in ALLOWED.values())


# The finder's own checks: a finder that missed a kind of read would pass for the wrong reason.

_CONSTANTS = {"collsvc.a": {"DIR_ENV": "COLLSVC_DIR", "OTHER_ENV": "GRPC_X"}, "collsvc.b": {}}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ('import os\nos.environ.get("COLLSVC_X")\n', ["COLLSVC_X"]),
        ('import os\nos.environ["COLLSVC_X"]\n', ["COLLSVC_X"]),
        ('import os\nos.getenv("COLLSVC_X", "1")\n', ["COLLSVC_X"]),
        ('import os\n"COLLSVC_X" in os.environ\n', ["COLLSVC_X"]),
        ('from os import environ\nenviron.get("COLLSVC_X")\n', ["COLLSVC_X"]),
        ("import os\nfrom collsvc.a import DIR_ENV\nos.environ.get(DIR_ENV)\n", ["COLLSVC_DIR"]),
        ("import os\nfrom collsvc import a\nos.environ.get(a.DIR_ENV)\n", ["COLLSVC_DIR"]),
        ("import os\nfrom collsvc.a import OTHER_ENV\nos.environ.get(OTHER_ENV)\n", []),
        ('import os\nos.environ.get("MASTER_ADDR")\nos.environ["COLLSVC_X"] = "1"\nos.environ.clear()\n', []),
        ("import os\ndef f(name):\n    return os.environ.get(name)\n", [UNKNOWN]),
        ('import os\ndef f(env=os.environ):\n    return env.get("COLLSVC_X")\n', ["COLLSVC_X"]),
        (
            'import os\ndef f(env=None):\n    env = os.environ if env is None else env\n    return env["COLLSVC_X"]\n',
            ["COLLSVC_X"],
        ),
        ("import os\nbuild(os.environ, 3)\n", [f"{WHOLE} -> build"]),
        ('import os\ndef f():\n    env = build(os.environ)\n    return env.get("COLLSVC_X")\n', [f"{WHOLE} -> build"]),
        ("import os\ndict(os.environ, A='1')\n", [f"{WHOLE} -> dict"]),
        ("import os\nx = {**os.environ}\n", [f"{WHOLE} -> {{**...}}"]),
        ("from collsvc.config import tls_from_env\nimport os\ntls_from_env(os.environ)\n", []),
        ("import os\nfrom collsvc import config\nconfig.read_token(None, os.environ)\n", []),
    ],
)
def test_the_finder_sees_every_kind_of_read(source: str, expected: list[str]) -> None:
    reads = reads_in_source("collsvc/b.py", source, _CONSTANTS)
    assert [read.variable for read in reads] == expected


def test_a_read_is_named_by_its_function() -> None:
    source = 'import os\nclass C:\n    def m(self):\n        return os.environ.get("COLLSVC_X")\n'
    (read,) = reads_in_source("collsvc/b.py", source, _CONSTANTS)
    assert (read.path, read.line, read.function) == ("collsvc/b.py", 4, "C.m")
