"""collsvc's failure guarantees through torch's API: a dead rank, a mismatch and a timeout raise the
collsvc error naming the rank, and that error is also a ``torch.distributed.DistBackendError``."""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.harness import run_ranks
from tests.torch._util import NO_COORDINATOR, run_torch

torch = pytest.importorskip("torch")


def dies_after_first_step(rank: int, n: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from collsvc import RankFailedError

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    model(torch.randn(4, 8)).sum().backward()
    if rank == n - 1:
        os._exit(3)  # a crash: no leave, no goodbye
    start = time.monotonic()
    work = dist.all_reduce(torch.ones(1 << 12), async_op=True)
    with pytest.raises(dist.DistBackendError) as caught:
        work.wait()
    future_error = None
    try:
        work.get_future().wait()
    except Exception as exc:  # noqa: BLE001 - the Future carries the same error
        future_error = type(exc).__name__
    err = caught.value
    assert isinstance(err, RankFailedError), repr(err)
    # The next call fails at once, also when DDP's C++ reducer makes it.
    with pytest.raises(RankFailedError):
        dist.broadcast(torch.zeros(2), src=0)
    with pytest.raises(RankFailedError) as from_ddp:
        model(torch.randn(4, 8)).sum().backward()
    assert isinstance(from_ddp.value, dist.DistBackendError)
    return {"ranks": err.ranks, "seconds": time.monotonic() - start, "future": future_error}


def test_dead_rank_raises_rank_failed_everywhere() -> None:
    result = run_torch(dies_after_first_step, 3, allow_failures=True, timeout=120)
    survivors = [o for o in result.outcomes if o.rank != 2]
    assert result.outcomes[2].exitcode == 3
    for outcome in survivors:
        assert outcome.error is None, outcome.error
        assert outcome.value["ranks"] == [2]
        assert outcome.value["future"] == "RankFailedError"
        assert outcome.value["seconds"] < 30.0  # heartbeats, not the 60 s collective timeout


def mismatched_calls(rank: int, n: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from collsvc import CollectiveMismatchError

    caught: dict[str, Any] = {}
    # Different reduce ops on the same tensors: TORCH_DISTRIBUTED_DEBUG=DETAIL does not compare ops.
    op = dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX
    try:
        dist.all_reduce(torch.ones(8), op=op)
    except dist.DistBackendError as exc:
        assert isinstance(exc, CollectiveMismatchError), repr(exc)
        caught = {"type": type(exc).__name__, "message": str(exc), "details": sorted(exc.details)}
    return caught


def test_mismatch_raises_on_every_rank() -> None:
    result = run_torch(mismatched_calls, 2, timeout=120)
    for value in result.values:
        assert value["type"] == "CollectiveMismatchError"
        assert "SUM" in value["message"] and "MAX" in value["message"]


def mismatched_sizes(rank: int, n: int) -> dict[str, Any]:
    """Uneven ``all_to_all_single`` where rank 2 expects 2 rows from rank 0, which sends it 1, and an
    uneven list ``all_gather`` where rank 0 expects 3 elements from rank 1, which gives 2; then both
    calls with agreeing sizes."""
    import torch
    import torch.distributed as dist

    from collsvc import CollectiveMismatchError

    def caught(call: Any) -> str | None:
        try:
            call()
        except dist.DistBackendError as exc:
            assert isinstance(exc, CollectiveMismatchError), repr(exc)
            return str(exc)
        return None

    sends = [rank + 1] * n  # rank r sends r + 1 rows to every rank
    expects = [peer + 1 for peer in range(n)]
    wrong = [2, *expects[1:]] if rank == 2 else expects
    mine = torch.full((sum(sends),), float(rank))
    a2a = caught(lambda: dist.all_to_all_single(torch.zeros(sum(wrong)), mine, wrong, sends))
    gives = torch.full((rank + 1,), float(rank))  # rank r gives r + 1 elements
    believed = [1, 3, 3] if rank == 0 else [1, 2, 3]
    gather = caught(lambda: dist.all_gather([torch.zeros(k) for k in believed], gives))
    out = torch.zeros(sum(expects))
    dist.all_to_all_single(out, mine, expects, sends)  # the group still works
    gathered = [torch.zeros(k) for k in expects]
    dist.all_gather(gathered, gives)
    return {"a2a": a2a, "gather": gather, "after": out.tolist(), "gathered": [t.tolist() for t in gathered]}


def test_uneven_calls_with_disagreeing_sizes_raise_on_every_rank() -> None:
    result = run_torch(mismatched_sizes, 3, timeout=120)
    for value in result.values:
        assert value["a2a"] is not None and "rank 0 sends 1 rows to rank 2, which expects 2" in value["a2a"]
        assert value["gather"] is not None and "rank 1 gives 2 elements, rank 0 expects 3" in value["gather"]
        assert value["after"] == [0.0, 1.0, 1.0, 2.0, 2.0, 2.0]
        assert value["gathered"] == [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0]]


def gives_up_waiting(rank: int, n: int) -> dict[str, Any] | None:
    """Rank 2 stays away; the others wait on an async all_reduce with a 1 s timeout."""
    import datetime
    import time

    import torch
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if rank == 2:
        store.wait(["gave-up/0", "gave-up/1"], datetime.timedelta(seconds=60))
        return None
    work = dist.all_reduce(torch.ones(4), async_op=True)
    started = time.monotonic()
    try:
        work.wait(timeout=datetime.timedelta(seconds=1))
        seen: dict[str, Any] = {"type": None}
    except dist.DistBackendError as exc:
        seen = {"type": type(exc).__name__, "message": str(exc), "ranks": getattr(exc, "ranks", None)}
    seen["elapsed"] = time.monotonic() - started
    store.set(f"gave-up/{rank}", "1")
    store.wait(["gave-up/0", "gave-up/1"], datetime.timedelta(seconds=60))  # none leaves before both gave up
    return seen


def test_a_wait_that_gives_up_names_the_ranks_the_call_waits_for() -> None:
    result = run_torch(gives_up_waiting, 3, timeout=120)
    for seen in result.values[:2]:
        assert seen["type"] == "CollectiveTimeoutError" and seen["ranks"] == [2], seen
        assert "did not complete within 1s; waiting on rank 2 (" in seen["message"], seen
        assert 1.0 <= seen["elapsed"] < 5.0, seen


def joins_a_world_of_three(rank: int, store_path: str) -> dict[str, Any]:
    """Ranks 0 and 1 of a world of 3 call init_process_group; rank 2 never starts."""
    import datetime
    import time

    import torch.distributed as dist

    import collsvc.torch  # noqa: F401 - registers the backend

    started = time.monotonic()
    try:
        limit = datetime.timedelta(seconds=3)
        dist.init_process_group("collsvc", init_method=f"file://{store_path}", rank=rank, world_size=3, timeout=limit)
    except dist.DistBackendError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - started}
    dist.destroy_process_group()
    return {"type": None}


def test_init_names_the_rank_that_never_arrived(tmp_path: Path) -> None:
    """torch's own message was "Timeout waiting for key: default_pg/0//cpu//.../host/2" on rank 0 and
    ".../coordinator" on rank 1; both now name rank 2."""
    result = run_ranks(
        joins_a_world_of_three,
        2,
        address=NO_COORDINATOR,  # the ranks bootstrap through torch's file store
        args=(str(tmp_path / "store"),),
        env={"COLLSVC_COORDINATOR": "", "MASTER_ADDR": ""},
        use_init=False,
    )
    for seen in result.values:
        assert seen["type"] == "RendezvousError", seen
        assert "ranks [2] of 3 never reached it" in seen["message"], seen
        assert seen["elapsed"] < 30, seen


def misses_a_collective(rank: int, n: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from collsvc import CollectiveTimeoutError

    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.get("rank0-saw-timeout")  # stays out of the collective until rank 0 gave up on it
        return {}
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(4))
    except dist.DistBackendError as exc:
        assert isinstance(exc, CollectiveTimeoutError), repr(exc)
        outcome = {"ranks": exc.ranks, "seconds": time.monotonic() - start}
    finally:
        store.set("rank0-saw-timeout", "1")
    return outcome


def test_init_timeout_is_honoured_and_names_the_missing_rank() -> None:
    result = run_torch(misses_a_collective, 2, collective_timeout=3.0, timeout=120)
    value = result.values[0]
    assert value["ranks"] == [1]
    assert 2.5 <= value["seconds"] < 30.0  # the 3 s timeout, not the 60 s default of the other tests


def group_timeout(rank: int, n: int) -> dict[str, Any]:
    import datetime

    import torch
    import torch.distributed as dist

    from collsvc import CollectiveTimeoutError

    store = dist.distributed_c10d._get_default_store()
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        store.get("rank0-gave-up")
        return {}
    seconds: dict[str, float] = {}
    try:
        for way in ("waited at once", "async_op"):
            start = time.monotonic()
            with pytest.raises(dist.DistBackendError) as caught:
                if way == "async_op":
                    dist.all_reduce(torch.ones(4), group=group, async_op=True).wait()
                else:
                    dist.all_reduce(torch.ones(4), group=group)
            assert isinstance(caught.value, CollectiveTimeoutError), repr(caught.value)
            seconds[way] = time.monotonic() - start
    finally:
        store.set("rank0-gave-up", "1")
    return seconds


def test_new_group_timeout_is_honoured() -> None:
    result = run_torch(group_timeout, 2, collective_timeout=60.0, timeout=120)
    for way, seconds in result.values[0].items():
        assert 1.5 <= seconds < 30.0, way  # the group's 2 s, not the job's 60 s


def monitored_barrier_without_one_rank(rank: int, n: int) -> dict[str, Any]:
    import torch.distributed as dist

    from collsvc import CollectiveTimeoutError, RankFailedError

    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)  # everyone: passes
    with pytest.raises(ValueError, match="above zero"):
        dist.monitored_barrier(timeout=datetime.timedelta(0))
    gloo = dist.new_group(backend="gloo")  # a group of another backend still gets torch's own
    dist.monitored_barrier(gloo, timeout=datetime.timedelta(seconds=60))
    store = dist.distributed_c10d._get_default_store()
    absent = n - 1
    if rank == absent:  # alive and heartbeating, but busy elsewhere until the others gave up
        store.wait([f"gave-up/{r}" for r in range(absent)], datetime.timedelta(seconds=60))
        return {}
    start = time.monotonic()
    try:
        with pytest.raises(dist.DistBackendError) as caught:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=1))
    finally:
        store.set(f"gave-up/{rank}", "1")
    error = caught.value
    # Timed out itself, or saw a peer leave after timing out: either way the absent rank is named.
    assert isinstance(error, (CollectiveTimeoutError, RankFailedError)), repr(error)
    return {"ranks": error.ranks, "message": str(error), "seconds": time.monotonic() - start}


def test_dist_monitored_barrier_runs_on_collsvc_and_names_the_absent_rank() -> None:
    result = run_torch(monitored_barrier_without_one_rank, 3, timeout=120)
    for value in result.values[:2]:
        assert value["ranks"] == [2], value
        # gloo's wording first (torch code matches it), then collsvc's own account
        assert value["message"].startswith("Rank 2 failed to pass monitoredBarrier in 1000 ms:\n"), value
        assert "waiting on rank 2" in value["message"], value
        assert value["seconds"] < 10.0, value


def _averaging_hook(group, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations
    import torch.distributed as dist

    tensor = bucket.buffer().div_(group.size())
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def killed_mid_training(rank: int, n: int, how: str) -> dict[str, Any]:
    """Trains DDP (with or without a comm hook) or FSDP2 until rank 1 is SIGKILLed at step 3; survivors
    report what training raised."""
    import signal

    import torch
    import torch.distributed as dist

    from collsvc import CollsvcError, RankFailedError

    torch.manual_seed(0)
    model: Any = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if how == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = fully_shard(model, mesh=init_device_mesh("cpu", (n,)))
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
        if how == "ddp-hook":
            model.register_comm_hook(dist.distributed_c10d._get_default_group(), _averaging_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0.0
    for step in range(1000):
        if step == 3 and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 3:
            start = time.monotonic()
        optimizer.zero_grad()
        try:
            model(torch.randn(8, 16)).sum().backward()
            optimizer.step()
        except BaseException as exc:  # noqa: BLE001 - the test reports what training raised
            return {
                "type": type(exc).__name__,
                "dist": isinstance(exc, dist.DistBackendError),
                "collsvc": isinstance(exc, CollsvcError),
                "failed": isinstance(exc, RankFailedError),
                "ranks": list(getattr(exc, "ranks", [])),
                "message": str(exc)[:400],
                "seconds": time.monotonic() - start,
            }
    return {"type": None}


@pytest.mark.parametrize("how", ["ddp", "ddp-hook", "fsdp2"])
def test_a_rank_killed_mid_training_is_named_through_ddp_and_fsdp(how: str) -> None:
    """DDP's reducer reads a failed Future's error in C++; the error that leaves ``backward()`` is still
    the collsvc one (before: a pickling error about the torch error class, or a crash)."""
    result = run_torch(killed_mid_training, 3, args=(how,), allow_failures=True, timeout=120)
    assert result.outcomes[1].exitcode == -9
    for outcome in (result.outcomes[0], result.outcomes[2]):
        assert outcome.error is None, outcome.error
        caught = outcome.value
        assert caught["dist"] and caught["collsvc"] and caught["failed"], caught
        assert caught["ranks"] == [1], caught
        assert caught["seconds"] < 30.0, caught


def coordinator_host_killed(rank: int, n: int) -> dict[str, Any]:
    """Rank 0 (which hosts the embedded coordinator under torchrun's environment) is SIGKILLed while the
    others run collectives; they report what they raised and how long after rank 0's death."""
    import signal

    import torch
    import torch.distributed as dist

    from collsvc import RankFailedError

    dist.all_reduce(torch.ones(4))
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        while True:
            dist.all_reduce(torch.ones(4))
    except dist.DistBackendError as exc:
        return {
            "failed": isinstance(exc, RankFailedError),
            "ranks": list(getattr(exc, "ranks", [])),
            "message": str(exc)[:300],
            "seconds": time.monotonic() - start,
        }


def test_the_death_of_the_rank_hosting_the_coordinator_is_named_at_once() -> None:
    """Under torchrun rank 0 hosts the coordinator, which dies with it and can never come back: the
    others name rank 0 within seconds instead of waiting out the grace meant for a restarting one."""
    result = run_torch(coordinator_host_killed, 3, mode="env", allow_failures=True, timeout=120)
    assert result.outcomes[0].exitcode == -9
    for outcome in result.outcomes[1:]:
        assert outcome.error is None, outcome.error
        caught = outcome.value
        assert caught["failed"] and caught["ranks"] == [0], caught
        assert caught["seconds"] < 5.0, caught  # the grace for a coordinator that may restart is 20 s
