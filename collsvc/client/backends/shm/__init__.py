"""Collectives among the ranks of one host through shared memory (Linux).

:class:`LocalGroup` is the entry point; ``segment`` holds the memfd segments, ``doorbell`` the
abstract-socket wake-ups.
"""

from __future__ import annotations

from collsvc.client.backends.shm.group import LocalGroup

__all__ = ["LocalGroup"]
