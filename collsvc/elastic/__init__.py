"""Elastic training: a job that survives losing members and takes in new ones.

``State`` holds the training state with an in-memory restore point (``commit()``); ``run`` decorates
the training function so that, after a member fails, the survivors restore the last commit, re-form
with the remaining and newly admitted members, and call it again. See the "Elastic training" section of docs/api.md.

Both are imported on first use: ``collsvc run`` imports ``collsvc.elastic.launch`` and must not pay
for numpy and gRPC.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collsvc.elastic._run import run
    from collsvc.elastic.state import State

_LAZY = {"State": "collsvc.elastic.state", "run": "collsvc.elastic._run"}


def __getattr__(name: str) -> Any:
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'collsvc.elastic' has no attribute {name!r}")


__all__ = ["State", "run"]
