"""A mismatch error never lists identical calls: when every rank's signature agrees, the error says
what did differ and that the fault is collsvc's, not the program's."""

from __future__ import annotations

import json

import numpy as np
import pytest

from collsvc.client.backends.base import Call, GroupSpec, Signature, mismatch_error
from collsvc.client.backends.ring.global_ranks import global_mismatch
from collsvc.client.backends.shm import descriptor


def scatter_call() -> Call:
    signature = Signature.of("scatter", "float32", (6,), root=0)
    return Call(GroupSpec("world", (0, 1), 0), "world", 1, signature, deadline=0.0)


def test_different_calls_are_listed_per_rank() -> None:
    call = scatter_call()
    error = mismatch_error(
        call, {0: call.signature.describe(), 1: Signature.of("scatter", "float32", (8,), root=0).describe()}
    )
    assert str(error).startswith("collective mismatch at scatter #1 in group 'world': rank 0 called scatter(float32[6]")
    assert "internal fault" not in str(error)


def test_identical_calls_read_as_an_internal_fault_naming_what_differed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLLSVC_DEBUG", raising=False)
    call = scatter_call()
    same = call.signature.describe()
    error = mismatch_error(call, {0: {**same, "count": 3, "digest": "0x1"}, 1: {**same, "count": 6, "digest": "0x1"}})
    text = str(error)
    assert "rank 0 called" not in text and "rank 1 called" not in text
    assert "internal fault at scatter #1 in group 'world': every rank called scatter(float32[6], root=0)" in text
    assert "count: rank 0 3, rank 1 6" in text
    assert "fault in collsvc, not in your program" in text
    assert "Each rank's record" not in text  # only with COLLSVC_DEBUG=1
    monkeypatch.setenv("COLLSVC_DEBUG", "1")
    assert "Each rank's record: {0: {" in str(mismatch_error(call, error.details))


def test_shared_memory_descriptors_keep_the_count_beside_identical_labels() -> None:
    """The shared-memory path: labels (full signatures) agree, descriptors' element counts differ."""
    call = scatter_call()
    label = json.dumps(call.signature.describe()).encode()
    bodies = [descriptor.encode("scatter", np.dtype(np.float32), count, None, 0, 7) for count in (3, 6)]
    local_error = descriptor.mismatch("world", bodies, "scatter", [label, label])
    error = global_mismatch(call, (0, 1), local_error)
    assert "internal fault" in str(error) and "count: rank 0 3, rank 1 6" in str(error)
