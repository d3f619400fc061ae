"""How long a shared-memory wait polls before it sleeps: only while every local rank has a core.

A rank that sleeps in ``poll`` must be woken by its peer's datagram: on a virtual machine that is an
inter-processor interrupt and a context switch, tens of microseconds, more than a whole small
all_reduce. A rank that keeps polling (non-blocking reads, yielding the core between reads) sees the
datagram within a microsecond, and its peer's send wakes no one. That pays only when every local
rank has a core of its own: with more ranks than cores, a polling rank takes the core from the very
peer it waits for, so then waits sleep at once.
"""

from __future__ import annotations

import os

# Long enough to cover a peer that is a few Python calls behind, short enough that a rank waiting
# for a slow peer (a large message, a straggler) goes to sleep almost at once.
SPIN_SECONDS = 100e-6


def usable_cores() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota if one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max", encoding="ascii") as handle:
            quota, period = handle.read().split()[:2]
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, int(int(quota) / int(period))))


def spin_seconds(local_size: int, cores: int | None = None) -> float:
    """The polling budget of a wait in a group of ``local_size`` ranks on this host (0: sleep at once).

    ``COLLSVC_SHM_SPIN_US`` overrides it (microseconds; 0 turns polling off).
    """
    override = os.environ.get("COLLSVC_SHM_SPIN_US")
    if override:
        return max(0.0, float(override) / 1e6)
    return SPIN_SECONDS if local_size <= (usable_cores() if cores is None else cores) else 0.0
