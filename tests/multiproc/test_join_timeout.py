"""The join timeout is its own knob: COLLSVC_JOIN_TIMEOUT bounds the wait for peers at init, while the
per-collective timeout stays long."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.harness import TOKEN, coordinator

ALONE = """
import collsvc
try:
    collsvc.init(world_size=2, rank=0, timeout=120)
except collsvc.RendezvousError as exc:
    print("RendezvousError:", exc)
"""


def test_join_timeout_bounds_the_wait_for_peers_only() -> None:
    with coordinator() as (_, address):
        env = {
            **os.environ,
            "COLLSVC_COORDINATOR": address,
            "COLLSVC_TOKEN": TOKEN,
            "COLLSVC_JOB_ID": f"alone-{os.getpid()}",
            "COLLSVC_JOIN_TIMEOUT": "1.5",
        }
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-c", ALONE], env=env, capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - started
    assert "RendezvousError:" in done.stdout, done.stdout + done.stderr
    assert "within 1.5s; ranks that never joined: [1]" in done.stdout, done.stdout
    assert elapsed < 30, elapsed  # the collective timeout (120 s) did not apply
    print(f"MEASURED join timeout 1.5 s: init failed after {elapsed:.2f}s (process start included)")
