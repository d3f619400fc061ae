"""What a new user meets first: init called twice, a read-only out=, flight-recorder dumps that pile
up, and a script that never calls destroy(). Real coordinator, real rank processes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.client.progress import prune_dumps
from tests.harness import coordinator, run_ranks


# ---- init twice ---------------------------------------------------------------------------------------------
def init_again(comm: collsvc.Communicator) -> dict[str, Any]:
    same = collsvc.init()  # the same environment names the same job: the joined communicator comes back
    explicit = collsvc.init(rank=comm.rank)
    seen: dict[str, Any] = {"same": same is comm, "explicit": explicit is comm, "job_id": comm.job.options.job_id}
    for label, kwargs in (("job", {"job_id": "another-job"}), ("size", {"world_size": comm.size + 1})):
        try:
            collsvc.init(**kwargs)
        except collsvc.RendezvousError as exc:
            seen[label] = str(exc)
    # A bare init() where the environment names no job at all means the joined one too.
    saved = os.environ.pop("COLLSVC_COORDINATOR")
    try:
        seen["bare"] = collsvc.init() is comm
    finally:
        os.environ["COLLSVC_COORDINATOR"] = saved
    # Nothing was joined twice: the job still works, with the original ranks.
    seen["sum"] = comm.all_reduce(np.array([comm.rank + 1.0])).tolist()
    seen["default"] = collsvc.get_rank() == comm.rank
    return seen


def test_init_twice_returns_the_joined_communicator_or_names_the_conflict() -> None:
    with coordinator() as (_, address):
        result = run_ranks(init_again, 2, address=address, timeout=60)
    for rank, seen in enumerate(result.values):
        assert seen["same"] and seen["explicit"] and seen["bare"] and seen["default"], seen
        assert seen["sum"] == [3.0], seen
        assert f"already joined job '{seen['job_id']}' as rank {rank} of 2" in seen["job"], seen
        assert "job_id 'another-job'" in seen["job"] and "collsvc.destroy()" in seen["job"], seen
        assert "world_size 3 (joined with 2)" in seen["size"], seen


def init_after_destroy(comm: collsvc.Communicator) -> bool:
    collsvc.destroy()
    assert not collsvc.is_initialized()
    again = collsvc.init(job_id=comm.job.options.job_id + "-second")  # a fresh job after destroy()
    joined = again is not comm and again.size == comm.size
    again.barrier()
    return joined


def test_init_after_destroy_joins_a_new_job() -> None:
    with coordinator() as (_, address):
        result = run_ranks(init_after_destroy, 2, address=address, timeout=60)
    assert result.values == [True, True]


# ---- read-only out ------------------------------------------------------------------------------------------
def read_only_out(comm: collsvc.Communicator) -> dict[str, str]:
    frozen = np.zeros(4)
    frozen.flags.writeable = False
    x = np.ones(4)
    messages: dict[str, str] = {}
    attempts: dict[str, Any] = {
        "all_reduce": lambda: comm.all_reduce(x, out=frozen),
        "in_place": lambda: comm.all_reduce(frozen, out=frozen),
        "broadcast": lambda: comm.broadcast(x, out=frozen),
        "all_gather": lambda: comm.all_gather(np.ones(2), out=frozen),
        "fused": lambda: comm.all_reduce([x, x], out=[np.zeros(4), frozen]),
        "recv": lambda: comm.recv(1 - comm.rank, out=frozen),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
        except ValueError as exc:
            messages[name] = str(exc)
    # Refused before anything was sent: the next collective of every rank still matches up.
    messages["after"] = str(comm.all_reduce(np.array([1.0])).tolist())
    return messages


def test_read_only_out_is_refused_before_the_exchange_naming_out() -> None:
    with coordinator() as (_, address):
        result = run_ranks(read_only_out, 2, address=address, timeout=60)
    for messages in result.values:
        assert messages["after"] == "[2.0]", messages
        for name in ("all_reduce", "in_place", "broadcast", "all_gather", "fused", "recv"):
            assert name in messages, (name, messages)
            assert messages[name].startswith("out is read-only"), messages[name]
            assert "assignment destination" not in messages[name]


# ---- flight-recorder dumps are bounded ----------------------------------------------------------------------
def mismatch(comm: collsvc.Communicator) -> dict[str, Any]:
    x = np.ones(4)
    try:
        if comm.rank == 0:
            comm.all_reduce(x)
        else:
            comm.all_gather(x)
    except collsvc.CollectiveMismatchError as exc:
        return {"error": type(exc).__name__, "pid": os.getpid(), "job": comm.job.options.job_id}
    raise AssertionError("a mismatched collective returned")


def test_flight_recorder_keeps_only_the_newest_dumps(tmp_path: Path) -> None:
    old = [tmp_path / f"collsvc-old-job-rank{r}-{1000 + r}.json" for r in range(5)]
    for age, path in enumerate(old):
        path.write_text("{}")
        os.utime(path, (1_000_000 + age, 1_000_000 + age))  # older than anything written now
    unrelated = [tmp_path / "collsvc-notes.json", tmp_path / "results.json", tmp_path / "collsvc-job-rank0-1.txt"]
    for path in unrelated:
        path.write_text("keep me")
    with coordinator() as (_, address):
        result = run_ranks(
            mismatch, 2, address=address, env={"COLLSVC_DUMP_DIR": str(tmp_path), "COLLSVC_DUMP_KEEP": "3"}
        )
    # The rank that records the failure first dumps it (the other may learn it from the coordinator).
    candidates = [tmp_path / f"collsvc-{v['job']}-rank{rank}-{v['pid']}.json" for rank, v in enumerate(result.values)]
    fresh = [path for path in candidates if path.exists()]
    assert fresh, sorted(p.name for p in tmp_path.iterdir())
    for path in fresh:
        assert "CollectiveMismatchError" in json.loads(path.read_text())["error"]
    dumps = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("collsvc-") and p.suffix == ".json")
    # Three dumps kept in all, the newest: the new ones and then the newest old ones.
    kept = [*fresh, *old[len(old) - (3 - len(fresh)) :]]
    assert dumps == sorted([*(p.name for p in kept), "collsvc-notes.json"])  # notes: not a dump's name
    assert all(p.exists() for p in unrelated)


def test_prune_keeps_the_dump_just_written_even_when_it_is_not_the_newest(tmp_path: Path) -> None:
    paths = [tmp_path / f"collsvc-j-rank{r}-{r + 10}.json" for r in range(3)]
    for age, path in enumerate(paths):
        path.write_text("{}")
        os.utime(path, (2_000_000 + age, 2_000_000 + age))
    deleted = prune_dumps(str(tmp_path), 1, keep_path=str(paths[0]))
    assert sorted(deleted) == [str(paths[1])]
    assert paths[0].exists() and paths[2].exists()


@pytest.mark.parametrize("value", ["0", "many"])
def test_a_bad_dump_keep_is_named(value: str) -> None:
    from collsvc.config import flight_recorder_keep

    with pytest.raises(ValueError, match="COLLSVC_DUMP_KEEP"):
        flight_recorder_keep({"COLLSVC_DUMP_KEEP": value})
