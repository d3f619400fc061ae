"""``collsvc run`` of more ranks than this host's cores can keep at the default heartbeat pace.

128 ranks doing three barriers failed on 2 busy cores with the 5 s default (448 "missed heartbeats"
lines, the embedded coordinator failing healthy ranks by the hundred); the launcher now slows the pace
in proportion to the ranks per core and says so, and --heartbeat-timeout sets it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from collsvc.launch.launcher import RANKS_PER_CORE_AT_DEFAULT_PACE, embedded_pace, usable_cores
from tests.cli._util import run_cli

BARRIERS = """
import collsvc
comm = collsvc.init()
for _ in range(3):
    comm.barrier()
collsvc.destroy()
"""


def test_the_pace_scales_with_ranks_per_core() -> None:
    assert embedded_pace(8, 2) == (1.0, 5.0)
    assert embedded_pace(2 * RANKS_PER_CORE_AT_DEFAULT_PACE, 2) == (1.0, 5.0)
    assert embedded_pace(256, 2) == (256 / 16, 5 * 256 / 16)
    assert embedded_pace(256, 2, timeout=30.0) == (6.0, 30.0)  # a fifth of the timeout
    assert embedded_pace(4, 2, timeout=2.0) == (0.4, 2.0)


def test_heartbeat_timeout_is_for_the_embedded_coordinator_only(tmp_path: Path) -> None:
    script = tmp_path / "noop.py"
    script.write_text("pass\n")
    result = run_cli("run", "--coordinator", "127.0.0.1:1", "--heartbeat-timeout", "9", str(script))
    assert result.returncode == 2 and "--heartbeat-timeout" in result.stderr, result.stderr


def test_128_ranks_on_this_host_pass_three_barriers(tmp_path: Path) -> None:
    n = 128
    if usable_cores() * RANKS_PER_CORE_AT_DEFAULT_PACE >= n:
        pytest.skip(f"{usable_cores()} cores keep the default pace for {n} ranks")
    script = tmp_path / "barriers.py"
    script.write_text(BARRIERS)
    result = run_cli("run", "-n", str(n), str(script), timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "missed heartbeats" not in result.stderr + result.stdout
    # Nor a member that left taken for one that died (a Leave the crowded coordinator answered late).
    assert "closed without leaving" not in result.stderr + result.stdout
    assert f"collsvc run: {n} ranks on {usable_cores()} cores: ranks heartbeat every" in result.stderr
    print(f"MEASURED collsvc run -n {n} (3 barriers): {result.seconds:.1f}s")
