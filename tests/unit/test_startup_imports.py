"""What start-up loads: each check runs a fresh interpreter and reads its ``sys.modules``.

``collsvc run`` must start its ranks before it loads gRPC or protobuf (the embedded coordinator loads
them on a thread while the ranks start) and never loads numpy; ``import collsvc`` must stay cheap; and a rank never
loads the coordinator's server side, torch or CuPy unless the user's code does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Heavy modules by top-level name, and the server side: collsvc's and gRPC's health service (the bare
# grpc_health package is loaded by grpc itself, which looks for its plugins).
HEAVY = ("grpc", "google", "numpy", "ml_dtypes", "torch", "cupy")
SERVER_SIDE = ("collsvc.server", "grpc_health.v1", "prometheus_client")
NEVER_IN_A_RANK = ("torch", "cupy", *SERVER_SIDE)


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLSVC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def under(modules: set[str], prefixes: tuple[str, ...]) -> list[str]:
    """The modules that are one of ``prefixes`` or inside one of them."""
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_import_collsvc_loads_nothing_heavy() -> None:
    modules = loaded_after("import collsvc")
    assert under(modules, HEAVY) == []
    # All but the first stdlib only: fork_guard sets gRPC's fork handlers off before anything loads gRPC.
    assert under(modules, ("collsvc",)) == [
        "collsvc",
        "collsvc.client",
        "collsvc.client.fork_guard",
        "collsvc.dynamo_skip",
    ]


def test_the_launcher_starts_ranks_before_loading_grpc_protobuf_or_numpy() -> None:
    # Everything `collsvc run` imports before it starts the ranks: the CLI with its parser, the launcher
    # and, for --min-ranks/--max-restarts, the elastic launcher.
    modules = loaded_after(
        "import collsvc.cli.main\ncollsvc.cli.main.build_parser().parse_args(['run', '-n', '2', 'x.py'])\n"
        "import collsvc.launch.launcher, collsvc.elastic.launch"
    )
    assert under(modules, HEAVY) == []
    assert under(modules, SERVER_SIDE) == []


def test_the_coordinator_loads_no_numpy() -> None:
    # The embedded coordinator starts in the launcher while the ranks import numpy themselves: the
    # server side and everything the launcher runs beside it (the join relay) must not load it too.
    modules = loaded_after(
        "import collsvc.server.app, collsvc.options, collsvc.launch.embedded_coordinator, collsvc.launch.join_relay"
    )
    assert under(modules, ("numpy", "ml_dtypes")) == []
    assert "collsvc.server.app" in modules  # sanity


@pytest.mark.parametrize(
    "code",
    [
        "import collsvc\ncollsvc.init",  # what init's path imports (the lazy API module)
        "import collsvc\ncollsvc.Communicator, collsvc.ReduceOp, collsvc.SUM, collsvc.RankFailedError",
    ],
    ids=["init", "public-names"],
)
def test_a_rank_never_loads_the_server_side_torch_or_cupy(code: str) -> None:
    modules = loaded_after(code)
    assert under(modules, NEVER_IN_A_RANK) == []
    assert "grpc" in modules  # sanity: the API did load


def test_a_joined_rank_has_not_loaded_the_server_side_torch_or_cupy(tmp_path: Path) -> None:
    # The full path through a real coordinator: `collsvc run` (embedded coordinator, other process).
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, sys, collsvc\n"
        "comm = collsvc.init()\n"
        "comm.barrier()\n"
        "print('MODULES', json.dumps(sorted(sys.modules)), flush=True)\n"
        "collsvc.destroy()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("COLLSVC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "collsvc", "run", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    reports = [line.split("MODULES ", 1)[1] for line in done.stdout.splitlines() if "MODULES " in line]
    assert len(reports) == 2, done.stdout
    for report in reports:
        assert under(set(json.loads(report)), NEVER_IN_A_RANK) == []
