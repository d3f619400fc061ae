"""Every collective of docs/api.md, in every call form, dtype, op, size class (path), group and array
kind, against numpy, on 1-4 real rank processes over shared memory, gRPC frames and two fake hosts
(hierarchical). See docs/conformance.md.

By default a slice that covers every value of every axis runs (CI); ``COLLSVC_CONFORMANCE=full`` runs
the whole product (``scripts/conformance.sh``). ``COLLSVC_CONFORMANCE_CASES=REGEX`` runs only the cases whose
description matches. ``COLLSVC_CONFORMANCE_REPORT=DIR`` writes one JSON
summary per (world size, transport) there.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.conformance import driver
from tests.conformance.cases import generate

# (world size, transport) jobs of the CI slice; the full product adds the rest.
CI_CONFIGS = [(1, "shm"), (2, "shm"), (3, "shm"), (4, "shm"), (2, "grpc"), (3, "noshm"), (4, "hier")]
FULL_CONFIGS = [
    (1, "shm"),
    (2, "shm"),
    (3, "shm"),
    (4, "shm"),
    (2, "grpc"),
    (3, "grpc"),
    (4, "grpc"),
    (3, "noshm"),
    (3, "hier"),
    (4, "hier"),
]
# The mutation runs' jobs (scripts/mutation.py): shared memory with the fast path, and gRPC frames.
QUICK_CONFIGS = [(2, "shm"), (3, "shm"), (2, "grpc")]
CONFIGS = {"full": FULL_CONFIGS, "quick": QUICK_CONFIGS}.get(driver.level(), CI_CONFIGS)

# Cases known to fail, by a pattern of their description: the reason names the bug. Strict: a known
# failure that passes fails the test (remove it here once fixed).
KNOWN_FAILURES: dict[str, str] = {}


def _known(case: str) -> str | None:
    for pattern, reason in KNOWN_FAILURES.items():
        if re.search(pattern, case):
            return reason
    return None


@pytest.mark.parametrize(("world_size", "transport"), CONFIGS, ids=[f"{n}-{t}" for n, t in CONFIGS])
def test_every_call_form_matches_numpy(world_size: int, transport: str) -> None:
    report = driver.run(world_size, transport)
    target = os.environ.get("COLLSVC_CONFORMANCE_REPORT")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        (Path(target) / f"{world_size}-{transport}.json").write_text(json.dumps(report.as_dict(), indent=1))
    unexpected = {case: msgs for case, msgs in report.failures.items() if _known(case) is None}
    names = [c.describe() for c in generate(world_size, transport, report.level)]
    fixed = [c for c in names if _known(c) is not None and c not in report.failures]
    lines = [f"{len(unexpected)} of {report.cases} cases failed ({report.jobs} jobs, {report.seconds:.0f} s):"]
    for case, msgs in sorted(unexpected.items()):
        lines.append(f"  {case}")
        lines += [f"      {m[:400]}" for m in msgs[:3]]
    if fixed:
        lines.append("known failures that passed (remove them from KNOWN_FAILURES): " + "; ".join(fixed))
    assert not unexpected and not fixed, "\n".join(lines)
