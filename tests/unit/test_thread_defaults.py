"""Thread-pool sizes ``collsvc run`` gives its ranks (``config.thread_defaults`` through ``rank_env``)."""

from __future__ import annotations

import os

import pytest

from collsvc.config import thread_defaults
from collsvc.launch.spec import LaunchSpec, rank_env

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@pytest.mark.parametrize("ranks", [2, 3, 4, 64])
def test_several_ranks_share_the_cores(ranks: int) -> None:
    assert thread_defaults({}, ranks) == {"OMP_NUM_THREADS": str(max(1, CORES // ranks))}


def test_one_rank_or_a_users_setting_is_left_alone() -> None:
    assert thread_defaults({}, 1) == {}
    assert thread_defaults({"OMP_NUM_THREADS": "7"}, 4) == {}
    assert thread_defaults({"OMP_NUM_THREADS": ""}, 64) == {"OMP_NUM_THREADS": "1"}  # empty means unset


def test_rank_env_applies_them_and_keeps_the_users() -> None:
    spec = LaunchSpec(command=["python", "x.py"], nproc=64)
    assert rank_env({}, spec, "127.0.0.1:1", None, 0)["OMP_NUM_THREADS"] == str(max(1, CORES // 64))
    assert rank_env({"OMP_NUM_THREADS": "5"}, spec, "127.0.0.1:1", None, 0)["OMP_NUM_THREADS"] == "5"
    single = LaunchSpec(command=["python", "x.py"], nproc=1)
    assert "OMP_NUM_THREADS" not in rank_env({}, single, "127.0.0.1:1", None, 0)
