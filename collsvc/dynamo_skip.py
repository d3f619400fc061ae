"""``torch.compile`` runs collsvc as it runs numpy or a C++ backend: without tracing into it.

Dynamo, the tracer behind ``torch.compile``, offers it every Python frame a compiled function reaches,
also those reached through a call it left out of its graph. Two such frames were collsvc's:

- ``torch.compile(DistributedDataParallel(model))`` on collsvc: DDP broadcasts buffers before each
  forward with a call Dynamo runs as it is; gloo's C++ backend has no Python frames there, collsvc's
  backend has, and Dynamo tried to compile them (``InternalTorchDynamoError`` on the process group);
- a compiled function that calls ``comm.all_reduce(tensor)``: Dynamo traced into the array adapters.

Dynamo runs the files on its skip list as they are, as it does numpy's; :func:`install` (called by
``import collsvc``) puts collsvc's package there. Neither torch nor Dynamo is imported for this (Dynamo
costs ~2.5 s): when Dynamo's skip list (``torch._dynamo.trace_rules``) is already imported, collsvc is
added at once; else a finder on ``sys.meta_path`` adds it right after that module is first imported,
then takes itself off ``sys.meta_path``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import importlib.abc

SKIP_LIST_MODULE = "torch._dynamo.trace_rules"
PACKAGE = "collsvc"
_skipped = False  # collsvc is on Dynamo's skip list


def _skip_collsvc(trace_rules: ModuleType) -> None:
    """Puts collsvc's package on Dynamo's skip list once (a Dynamo without ``trace_rules.add``: a warning)."""
    global _skipped
    add = getattr(trace_rules, "add", None)
    if add is None:
        warnings.warn("torch.compile may trace into collsvc: this torch's Dynamo has no trace_rules.add", stacklevel=2)
    elif not _skipped:
        add(PACKAGE)
        _skipped = True


class _LoadThenSkip:
    """Loads Dynamo's skip list with its own loader, then puts collsvc on it."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _skip_collsvc(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        if name == "_loader":  # not set yet (a copy made without __init__): no endless recursion
            raise AttributeError(name)
        return getattr(self._loader, name)


class _SkipListFinder:
    """A ``sys.meta_path`` finder that finds nothing itself: when Dynamo's skip list is imported, it
    wraps the loader the standard path finder gives."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != SKIP_LIST_MODULE:
            return None
        _remove_finder()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = cast("importlib.abc.Loader", _LoadThenSkip(spec.loader))
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _SkipListFinder)]


def install() -> None:
    """Makes ``torch.compile`` skip collsvc's frames, now or once Dynamo is imported (idempotent; never
    imports torch)."""
    trace_rules = sys.modules.get(SKIP_LIST_MODULE)
    if trace_rules is not None:
        _remove_finder()
        _skip_collsvc(trace_rules)
    elif not any(isinstance(finder, _SkipListFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SkipListFinder())
