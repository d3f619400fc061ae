"""The failure promises of docs/operations.md, proven with real rank processes.

Every test asserts the error *type*, the *ranks* (and hosts) it names, and how long it took. Ranks
signal each other through the coordinator's key/value store (never by sleeping), and time is measured
inside the ranks with ``time.monotonic`` from the moment the fault was triggered.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import collsvc
from collsvc.client.devices import cupy_available
from collsvc.errors import CollsvcError
from tests.harness import coordinator, run_ranks

HOST = "faults-host"  # every rank reports this host name (one host: the shared-memory path)
# Fast liveness for the tests: ranks beat every 0.3 s; the coordinator gives up after 2 s of silence.
FAST_HEARTBEAT = {"COLLSVC_HEARTBEAT_INTERVAL": "0.3", "COLLSVC_HOST": HOST}
KV_WAIT = 30.0  # bound on every key/value wait between ranks (a hang fails the test, it does not sleep)
DETECT_BOUND = 10.0  # promise 1: a dead rank is named everywhere within 10 s
FAIL_FAST_BOUND = 1.0  # promise 4: once failed, a later call raises at once


def describe(exc: BaseException, started: float) -> dict[str, Any]:
    """What a rank saw, in a picklable form the parent can assert on."""
    seen: dict[str, Any] = {
        "type": type(exc).__name__,
        "message": str(exc),
        "elapsed": time.monotonic() - started,
    }
    for attr in ("ranks", "hosts", "waiting_on", "details", "reason"):
        if hasattr(exc, attr):
            seen[attr] = getattr(exc, attr)
    return seen


def attempt(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Runs ``fn``; returns ``describe`` of the collsvc error it raised, or ``{"type": None}``."""
    started = time.monotonic()
    try:
        value = fn(*args, **kwargs)
    except CollsvcError as exc:
        return describe(exc, started)
    return {"type": None, "value": value, "elapsed": time.monotonic() - started}


def kv(comm: collsvc.Communicator) -> Any:
    """The job's coordinator client: set/get on its key/value store signal between ranks."""
    return comm.job.store


# --------------------------------------------------------------------------------------------------
# Promise 1: a dead, exited, raising, frozen or departed rank is named on every surviving rank.


def die_mid_job(comm: collsvc.Communicator, mode: str, victim: int) -> dict[str, Any]:
    """Every rank runs one collective; then the survivors start another and ``victim`` dies.

    Survivors issue an async all_reduce (pending when the victim dies), tell the victim, and wait for
    its last word; then they time how long the pending call takes to fail, and a later call too.
    """
    survivors = [r for r in range(comm.size) if r != victim]
    sub = comm.new_group(survivors)  # a group that does not need the victim
    assert np.array_equal(comm.all_reduce(np.ones(4)), np.full(4, comm.size))
    store = kv(comm)
    if comm.rank == victim:
        for rank in survivors:
            store.get(f"entered/{rank}", KV_WAIT)
        store.set("victim-pid", str(os.getpid()).encode())
        store.set("dying", b"1")
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif mode == "exit":
            os._exit(3)  # no clean-up at all, like a crash in native code
        elif mode == "raise":
            raise RuntimeError("victim raised mid-job")  # the harness then calls collsvc.destroy()
        elif mode == "close":
            comm.close()
            return {"closed": True}
        raise AssertionError(f"unknown mode {mode}")
    pending = comm.all_reduce(np.ones(1 << 14), async_op=True)
    store.set(f"entered/{comm.rank}", b"1")
    store.get("dying", KV_WAIT)
    pending_seen = attempt(pending.wait)
    later_seen = attempt(comm.all_reduce, np.ones(4))
    later_barrier = attempt(comm.barrier)
    sub_seen = attempt(sub.all_reduce, np.ones(4)) if sub is not None else None
    if mode == "sigstop" and comm.rank == survivors[0]:
        os.kill(int(store.get("victim-pid", KV_WAIT)), signal.SIGKILL)  # the harness cannot end it
    # Promise 4: after the failure the process joins a new job on the same coordinator and works.
    job_id = os.environ["COLLSVC_JOB_ID"]
    collsvc.destroy()
    again = collsvc.init(job_id=f"{job_id}-again", world_size=len(survivors), rank=survivors.index(comm.rank))
    total = again.all_reduce(np.ones(4)).tolist()
    return {"pending": pending_seen, "later": later_seen, "barrier": later_barrier, "sub": sub_seen, "again": total}


def host_env(transport: str) -> Any:
    """Per-rank environment: one host (shared memory between ranks), one host per rank (gRPC), or two
    ranks per host (hier: the pending 128 KiB all_reduce goes by slices, every rank crossing hosts)."""

    def env(rank: int) -> dict[str, str]:
        return {"COLLSVC_HOST": host_of(rank, transport)}

    return env


def host_of(rank: int, transport: str) -> str:
    if transport == "hier":
        return f"host{rank // 2}"
    return HOST if transport == "shm" else f"host{rank}"


@pytest.mark.parametrize(
    ("mode", "world_size", "transport"),
    [
        ("sigkill", 2, "shm"),
        ("sigkill", 3, "shm"),
        ("sigkill", 3, "grpc"),
        ("exit", 3, "shm"),
        ("raise", 3, "shm"),
        ("close", 3, "shm"),
        ("close", 2, "grpc"),
        # 3 ranks over gRPC: a survivor may need the departed rank only through the other survivor;
        # the departed rank's final progress (sent with Leave) fails that wait at once too.
        ("close", 3, "grpc"),
        ("sigstop", 3, "shm"),
        ("sigkill", 4, "hier"),
        ("close", 4, "hier"),
    ],
)
def test_dead_rank_is_named_everywhere(mode: str, world_size: int, transport: str) -> None:
    victim = 1
    # heartbeat_timeout 2 s (default 5 s) keeps the frozen-rank case fast; nothing else depends on it.
    with coordinator(heartbeat_timeout=2.0, heartbeat_interval=0.3) as (_, address):
        result = run_ranks(
            die_mid_job,
            world_size,
            address=address,
            args=(mode, victim),
            env=FAST_HEARTBEAT,
            rank_env=host_env(transport),
            allow_failures=True,
            timeout=40,
        )
    left_cleanly = mode in ("close", "raise")  # "raise": the harness's finally calls collsvc.destroy()
    for outcome in result.outcomes:
        if outcome.rank == victim:
            continue
        assert outcome.error is None, f"rank {outcome.rank}: {outcome.error}"
        seen = outcome.value
        for what in ("pending", "later", "barrier"):
            got = seen[what]
            assert got["type"] == "RankFailedError", (outcome.rank, what, got)
            assert got["ranks"] == [victim], (outcome.rank, what, got)
            assert got["hosts"] == [host_of(victim, transport)], (outcome.rank, what, got)
            assert ("left the job" in got["message"]) == left_cleanly, got["message"]
        assert seen["pending"]["elapsed"] < DETECT_BOUND, seen["pending"]
        assert seen["later"]["elapsed"] < FAIL_FAST_BOUND, seen["later"]
        assert seen["barrier"]["elapsed"] < FAIL_FAST_BOUND, seen["barrier"]
        sub = seen["sub"]
        if left_cleanly:  # a group without the departed rank goes on
            assert sub["type"] is None, sub
            assert sub["value"].tolist() == [world_size - 1] * 4
        else:  # a crash fails the whole job: every later call names the dead rank at once
            assert sub["type"] == "RankFailedError" and sub["ranks"] == [victim], sub
            assert sub["elapsed"] < FAIL_FAST_BOUND, sub
        assert seen["again"] == [world_size - 1] * 4  # a new job after the failure works
        print(
            f"MEASURED {mode} ws={world_size} {transport} rank {outcome.rank}: "
            f"{seen['pending']['elapsed']:.2f}s: {seen['pending']['message']}"
        )
    exits = {o.rank: o.exitcode for o in result.outcomes}
    expected_exit = {"sigkill": -signal.SIGKILL, "sigstop": -signal.SIGKILL, "exit": 3, "raise": 1, "close": 0}
    assert exits[victim] == expected_exit[mode], exits


# --------------------------------------------------------------------------------------------------
# Promise 2: a stuck collective or barrier names the ranks that never entered it, and their last op.


def one_rank_stays_away(rank: int, kind: str, absent: int) -> dict[str, Any] | None:
    """Everyone runs one all_reduce; then all but ``absent`` enter ``kind``, which must time out."""
    comm = collsvc.init(timeout=2.0)  # seconds for any one collective
    try:
        comm.all_reduce(np.ones(4))
        store = kv(comm)
        present = [r for r in range(comm.size) if r != absent]
        if rank == absent:
            for other in present:  # stays alive and heartbeating, but never enters the collective
                store.get(f"done/{other}", KV_WAIT)
            return None
        seen = attempt(comm.all_reduce, np.ones(4)) if kind == "all_reduce" else attempt(comm.barrier, timeout=1.0)
        later = attempt(comm.all_reduce, np.ones(4))
        store.set(f"done/{rank}", b"1")
        return {"seen": seen, "later": later, "pid": os.getpid(), "job": comm.job.options.job_id}
    finally:
        collsvc.destroy()


# The last case: heartbeats far apart (5 s) against a 1 s timeout. The coordinator's progress of the
# ranks that did enter the barrier is then older than their entering it; the timed-out rank must still
# name only the absent one (the coordinator asks the ranks that look late first).
@pytest.mark.parametrize(
    ("kind", "timeout", "heartbeat"), [("all_reduce", 2.0, "0.3"), ("barrier", 1.0, "0.3"), ("barrier", 1.0, "5")]
)
def test_stuck_collective_names_who_is_missing(kind: str, timeout: float, heartbeat: str, tmp_path: Path) -> None:
    absent, world_size = 2, 3
    with coordinator() as (_, address):
        result = run_ranks(
            one_rank_stays_away,
            world_size,
            address=address,
            args=(kind, absent),
            env={**FAST_HEARTBEAT, "COLLSVC_HEARTBEAT_INTERVAL": heartbeat, "COLLSVC_DUMP_DIR": str(tmp_path)},
            use_init=False,
            timeout=40,
        )
    for outcome in result.outcomes:
        if outcome.rank == absent:
            continue
        seen, later = outcome.value["seen"], outcome.value["later"]
        assert seen["type"] == "CollectiveTimeoutError", seen
        assert [w["rank"] for w in seen["waiting_on"]] == [absent], seen
        missing = seen["waiting_on"][0]
        assert missing["host"] == HOST, missing
        assert missing["last_op"] == "all_reduce(float64[4], SUM)", missing
        assert f"timed out after {timeout:g}s" in seen["message"], seen["message"]
        assert f"waiting on rank {absent} ({HOST}; last completed: all_reduce" in seen["message"], seen["message"]
        # Bounded by the timeout: not before it, and not much after it.
        assert timeout <= seen["elapsed"] < timeout + 3.0, seen
        # Fail fast afterwards, with the same type.
        assert later["type"] == "CollectiveTimeoutError" and later["elapsed"] < FAIL_FAST_BOUND, later
        # The flight recorder: a JSON file per failed rank listing its recent collectives.
        path = tmp_path / f"collsvc-{outcome.value['job']}-rank{outcome.rank}-{outcome.value['pid']}.json"
        dump = json.loads(path.read_text())
        assert dump["rank"] == outcome.rank and "CollectiveTimeoutError" in dump["error"]
        ops = [(r["seq"], r["op"], r["outcome"]) for r in dump["recent"]]
        assert ops[0] == (1, "all_reduce(float64[4], SUM)", "ok"), ops
        assert ops[-1][1].startswith(kind) and ops[-1][2] == "CollectiveTimeoutError", ops
        print(
            f"MEASURED {kind} timeout={timeout}: rank {outcome.rank} raised after {seen['elapsed']:.2f}s: "
            f"{seen['message']}"
        )


def receives_with_another_tag(rank: int) -> dict[str, Any]:
    """Rank 0 sends with tag 1, then enters the group's first all_reduce; rank 1 waits for a message with
    tag 2 (the group's first collective, the one the coordinator was asked about, never started there)."""
    comm = collsvc.init(timeout=2.0)
    try:
        if rank == 0:
            comm.send(np.ones(3), dst=1, tag=1)
            return attempt(comm.all_reduce, np.ones(4))
        return attempt(comm.recv, 0, tag=2, shape=3, dtype="float64")
    finally:
        collsvc.destroy()


def test_a_receive_that_times_out_names_its_sender() -> None:
    """The coordinator counts a group's collectives, not the messages of one pair and tag: asked about
    the group's call with the message's number, it named the receiver itself (rank 0 had gone on to
    that call). A timed-out receive names the sender, and says which message it waited for."""
    with coordinator() as (_, address):
        result = run_ranks(receives_with_another_tag, 2, address=address, env=FAST_HEARTBEAT, use_init=False)
    sender, receiver = result.values
    assert receiver["type"] == "CollectiveTimeoutError", receiver
    assert [w["rank"] for w in receiver["waiting_on"]] == [0], receiver
    assert receiver["message"].startswith("message #1 from rank 0 to rank 1 with tag 2 in group 'world'"), receiver
    # Rank 0's all_reduce times out waiting on rank 1, unless rank 1's leaving (after its own timeout, a
    # few milliseconds sooner) reaches it first: then it is told why rank 1 left.
    if sender["type"] == "RankFailedError":
        assert sender["message"].startswith("rank 1 (faults-host) left the job after its collective failed"), sender
    else:
        assert sender["type"] == "CollectiveTimeoutError", sender
        assert [w["rank"] for w in sender["waiting_on"]] == [1], sender


# --------------------------------------------------------------------------------------------------
# Promise 3: mismatched calls raise CollectiveMismatchError on every rank, with per-rank details.

MISMATCHES = ("collective", "reduce_op", "dtype", "shape", "root")


def mismatched_call(comm: collsvc.Communicator, kind: str, odd: bool) -> tuple[Any, np.ndarray]:
    """The call of one rank for mismatch ``kind``; ``odd`` ranks call something else. Returns the
    Work and the array the call may write (in place), to check that no data was combined."""
    x = np.full(
        5 if kind == "shape" and odd else 4, comm.rank + 1, np.float32 if kind == "dtype" and odd else np.float64
    )
    if kind == "collective":
        return (comm.all_gather(x, async_op=True) if odd else comm.all_reduce(x, out=x, async_op=True)), x
    if kind == "reduce_op":
        return comm.all_reduce(x, collsvc.MAX if odd else collsvc.SUM, out=x, async_op=True), x
    if kind in ("dtype", "shape"):
        return comm.all_reduce(x, out=x, async_op=True), x
    return comm.broadcast(x, src=1 if odd else 0, out=x, async_op=True), x


def mismatch_every_kind(rank: int, odd_rank: int) -> dict[str, Any]:
    """One fresh job per mismatch kind (promise 4: init works again after a failure)."""
    base = os.environ["COLLSVC_JOB_ID"]
    seen: dict[str, Any] = {}
    for kind in MISMATCHES:
        comm = collsvc.init(job_id=f"{base}-{kind}", timeout=10.0)
        try:
            comm.barrier()
            work, x = mismatched_call(comm, kind, comm.rank == odd_rank)
            before = x.copy()
            seen[kind] = attempt(work.wait)
            seen[kind]["untouched"] = bool(np.array_equal(x, before))
            seen[kind]["later"] = attempt(comm.all_reduce, np.ones(4))
        finally:
            collsvc.destroy()
    comm = collsvc.init(job_id=f"{base}-after")
    seen["after"] = comm.all_reduce(np.ones(4)).tolist()
    collsvc.destroy()
    return seen


# The field that differs, per kind, as CollectiveMismatchError.details describes each rank's call.
FIELD = {"collective": "op", "reduce_op": "reduce_op", "dtype": "dtype", "shape": "shape", "root": "root"}


def call_value(entry: dict[str, Any], field: str) -> Any:
    """One field of a rank's call in CollectiveMismatchError.details. Over shared memory a peer's call
    is known from its descriptor, which carries the element count rather than the shape."""
    return entry.get(field, entry.get("count")) if field == "shape" else entry[field]


@pytest.mark.parametrize(("world_size", "transport"), [(2, "shm"), (3, "shm"), (3, "grpc")])
def test_mismatch_is_always_an_error(world_size: int, transport: str) -> None:
    odd = world_size - 1
    with coordinator() as (_, address):
        result = run_ranks(
            mismatch_every_kind,
            world_size,
            address=address,
            args=(odd,),
            env=FAST_HEARTBEAT,
            rank_env=host_env(transport),
            use_init=False,
            timeout=60,
        )
    for outcome in result.outcomes:
        for kind in MISMATCHES:
            got = outcome.value[kind]
            where = (kind, outcome.rank, got)
            # Every rank raises at the call itself: over gRPC, rooted calls (where some ranks never depend
            # on the odd rank's data) first agree on every member's signature.
            assert got["type"] == "CollectiveMismatchError", where
            details = {int(k): v for k, v in got["details"].items()}
            assert odd in details and len(details) >= 2, where  # at least the two disagreeing ranks
            other = next(r for r in details if r != odd)
            field = FIELD[kind]

            assert isinstance(details[odd], dict) and isinstance(details[other], dict), where
            assert call_value(details[odd], field) != call_value(details[other], field), where
            assert got["elapsed"] < 5.0, where  # found by the check, not by the 10 s timeout
            assert got["untouched"], where  # nothing was combined into the in-place buffer
            later = got["later"]
            assert later["type"] == "CollectiveMismatchError" and later["elapsed"] < FAIL_FAST_BOUND, where
        assert outcome.value["after"] == [world_size] * 4
        print(
            f"MEASURED mismatch ws={world_size} {transport} rank {outcome.rank}: "
            + ", ".join(f"{k} {outcome.value[k]['elapsed']:.3f}s" for k in MISMATCHES)
        )
        print("  e.g.", outcome.value["dtype"].get("message"))


def receives_a_smaller_message(rank: int) -> dict[str, Any]:
    """Rank 0 sends float32[4]; rank 1 receives into float32[3]; then both call all_reduce."""
    comm = collsvc.init(timeout=10.0)
    try:
        if rank == 0:
            first = attempt(comm.send, np.ones(4, dtype=np.float32), dst=1)
        else:
            first = attempt(comm.recv, 0, out=np.zeros(3, dtype=np.float32))
        return {"first": first, "later": attempt(comm.all_reduce, np.ones(2))}
    finally:
        collsvc.destroy()


@pytest.mark.parametrize("transport", ["shm", "grpc"])
def test_a_message_of_another_size_is_a_mismatch_naming_sender_and_receiver(transport: str) -> None:
    with coordinator() as (_, address):
        result = run_ranks(
            receives_a_smaller_message,
            2,
            address=address,
            env=FAST_HEARTBEAT,
            rank_env=host_env(transport),
            use_init=False,
            timeout=40,
        )
    sender, receiver = result.values
    expected = (
        "size or dtype mismatch at message #1 from rank 0 to rank 1 with tag 0 in group 'world': "
        "rank 0 sends float32[4]; rank 1 receives into float32[3]"
    )
    assert receiver["first"]["type"] == "CollectiveMismatchError", receiver
    assert receiver["first"]["message"] == expected, receiver
    for seen in (sender["later"], receiver["later"]):  # the sender learns it at its next call
        assert seen["type"] == "CollectiveMismatchError" and seen["elapsed"] < DETECT_BOUND, seen


def barrier_against_all_reduce(rank: int) -> dict[str, Any]:
    """Rank 0 enters a barrier while the others call all_reduce at the same sequence number."""
    comm = collsvc.init(timeout=10.0)
    try:
        if comm.rank == 0:
            return attempt(comm.barrier)
        return attempt(comm.all_reduce, np.ones(4))
    finally:
        collsvc.destroy()


@pytest.mark.parametrize("world_size", [2, 3])
def test_barrier_against_another_collective_is_a_mismatch(world_size: int) -> None:
    """A group on one host runs its barriers in shared memory, where the first step compares every
    rank's call: a barrier met by an all_reduce is a mismatch on every rank at once, not a timeout."""
    with coordinator() as (_, address):
        result = run_ranks(
            barrier_against_all_reduce, world_size, address=address, env=FAST_HEARTBEAT, use_init=False, timeout=60
        )
    for outcome in result.outcomes:
        got = outcome.value
        assert got["type"] == "CollectiveMismatchError", (outcome.rank, got)
        assert got["elapsed"] < 5.0, (outcome.rank, got)  # found by the check, not by the 10 s timeout
        calls = {int(k): v for k, v in got["details"].items()}
        assert calls[0]["op"] == "barrier" and calls[world_size - 1]["op"] == "all_reduce", (outcome.rank, got)


# --------------------------------------------------------------------------------------------------
# Promise 6: `collsvc run` names a rank killed by a signal and stops the others.


def test_collsvc_run_names_a_killed_rank(tmp_path: Path) -> None:
    from tests.cli._util import HOST as CLI_HOST
    from tests.cli._util import run_cli, script, summary_lines

    path = script(
        tmp_path,
        "killed.py",
        """
        import os, signal
        import numpy as np
        import collsvc

        comm = collsvc.init()
        comm.all_reduce(np.ones(4))
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.barrier()  # the others block here until they learn that rank 1 died (or are stopped)
        print("unreachable")
        """,
    )
    res = run_cli("run", "-n", "3", path, timeout=60)
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    # Ranks that already failed because of it are named as its victims (which ones depends on timing).
    (summary,) = summary_lines(res.stderr)
    assert summary.startswith(f"collsvc run: rank 1 on host {CLI_HOST} failed: killed by signal SIGKILL (9)"), summary
    assert "unreachable" not in res.stdout
    assert res.seconds < 15.0, res.seconds
    print(f"MEASURED collsvc run with a SIGKILLed rank: {res.seconds:.2f}s")


def init_with_nccl(rank: int) -> dict[str, str]:
    try:
        collsvc.init(backend="nccl", timeout=30)
    except collsvc.CollsvcError as exc:
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": "none", "message": ""}


@pytest.mark.skipif(cupy_available(), reason="this host has a GPU; tests/gpu covers backend='nccl' there")
def test_backend_nccl_without_a_gpu_fails_init_and_leaves_cleanly(caplog: pytest.LogCaptureFixture) -> None:
    """Every rank raises at init, naming itself and the fix; it leaves the job instead of vanishing."""
    caplog.set_level(logging.INFO, logger="collsvc.server")
    with coordinator() as (_, address):
        result = run_ranks(init_with_nccl, 2, address=address, use_init=False, job_id="nccl-on-cpu")
    for rank, seen in enumerate(result.values):
        assert seen["type"] == "BackendUnavailableError", seen
        assert f"rank {rank}" in seen["message"] and "backend='ring'" in seen["message"], seen
        assert "pip install" in seen["message"] or "CUDA" in seen["message"], seen
    server_lines = [r.getMessage() for r in caplog.records if "nccl-on-cpu" in r.getMessage()]
    assert any("left" in line for line in server_lines), server_lines
    assert not any("failed" in line for line in server_lines), server_lines
