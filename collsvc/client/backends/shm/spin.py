"""How long a shared-memory wait polls before it sleeps.

A rank that sleeps in ``poll`` must be woken by its peer's datagram: on a virtual machine that is an
inter-processor interrupt and a context switch, tens of microseconds, more than a whole small
all_reduce. A rank that keeps polling (non-blocking reads, yielding the core between reads) sees the
datagram within a microsecond, and its peer's send wakes no one.

While every local rank has a core of its own, a wait polls up to :data:`SPIN_SECONDS`. With more
ranks than cores, a polling rank could take the core from the very peer it waits for; there it polls
only briefly (:data:`SHARED_CORE_SPIN_SECONDS`), and each poll hands the core to any runnable peer
(``sched_yield``), which is how a rank on a shared core passes the turn without a sleep and a wake-up.
Measured on 2 cores, 4 ranks, 4 KiB all_reduce of the group alone: 132-151 us p50 sleeping at once,
103-118 us polling 15-50 us.

Barriers through memory words (``board.py``) poll without a system call, and each poll hands the core
over, so there a rank on a shared core polls longer (:data:`SHARED_CORE_MEMORY_SPIN_SECONDS`): long
enough to cover the peer that shares its core doing its part of the call. Measured on 2 cores, 4 ranks,
``collsvc bench --sizes 4K:4K``: 290 us p50 polling 30 us, 204 us polling 100 us, 140-145 us polling
300-5,000 us.
"""

from __future__ import annotations

import os

from collsvc.config import shm_spin_seconds

# Long enough to cover a peer that a busy virtual machine's host held back for a while: measured on
# 2 cores, 2 ranks, 4 KiB all_reduce in a loop, 100 us put 6-9 % of the waits to sleep, and each sleep
# cost about 1 ms to wake from (99-141 us a call instead of 49-52 us; 1 ms: no sleeps, 49-52 us).
# A rank waiting for a real straggler burns at most this much CPU before it sleeps.
SPIN_SECONDS = 1e-3
# With more local ranks than cores: a few hand-overs of the core, then sleep.
SHARED_CORE_SPIN_SECONDS = 30e-6
# The same with barriers through memory words: hand-overs cost no system call but the yield.
SHARED_CORE_MEMORY_SPIN_SECONDS = 300e-6


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


def spin_seconds(local_size: int, cores: int | None = None, *, memory_barriers: bool = False) -> float:
    """The polling budget of a wait in a group of ``local_size`` ranks on this host, whose barriers go
    through memory words (``memory_barriers``) or datagrams.

    ``COLLSVC_SHM_SPIN_US`` overrides it (microseconds; 0 turns polling off).

    Raises:
        ValueError: ``COLLSVC_SHM_SPIN_US`` is not a number >= 0.
    """
    override = shm_spin_seconds()
    if override is not None:
        return override
    if local_size <= (usable_cores() if cores is None else cores):
        return SPIN_SECONDS
    return SHARED_CORE_MEMORY_SPIN_SECONDS if memory_barriers else SHARED_CORE_SPIN_SECONDS
