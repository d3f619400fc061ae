"""Join, members, barriers, groups and status against a real coordinator."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from collsvc.errors import RendezvousError
from collsvc.proto.v1 import common_pb2
from collsvc.proto.v1 import coordinator_pb2 as pb

from .conftest import Client, expect_error


def _barrier_all(client: Client, job_id: str, ranks: list[int], generation: int, group: str = "world") -> list[bool]:
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [
            pool.submit(
                client,
                "Barrier",
                client.barrier_request(job_id, r, generation, 5, group),
            )
            for r in ranks
        ]
        return [f.result().complete for f in futures]


def test_four_concurrent_joiners_get_host_contiguous_ranks(client: Client) -> None:
    replies = client.join_all("j", 4, lambda i: {"host": "b" if i % 2 else "a", "pid": 10 + i})
    by_host = {h: sorted(r.rank for i, r in enumerate(replies) if ("b" if i % 2 else "a") == h) for h in "ab"}
    assert by_host == {"a": [0, 1], "b": [2, 3]}
    assert {(r.rank, r.local_rank, r.local_size, r.node_rank, r.num_nodes) for r in replies} == {
        (0, 0, 2, 0, 2),
        (1, 1, 2, 0, 2),
        (2, 0, 2, 1, 2),
        (3, 1, 2, 1, 2),
    }
    assert len({r.job_incarnation for r in replies}) == 1 and replies[0].job_incarnation != 0
    assert len({r.member_secret for r in replies}) == 4

    members = client("GetMembers", pb.GetMembersRequest(job_id="j"))
    assert [m.rank for m in members.members] == [0, 1, 2, 3]
    assert [m.host for m in members.members] == ["a", "a", "b", "b"]
    assert all(m.state == common_pb2.MEMBER_STATE_ALIVE for m in members.members)
    assert members.job_incarnation == replies[0].job_incarnation

    # Back-to-back barriers: generation 2 right after 1 never mixes with it.
    assert _barrier_all(client, "j", [0, 1, 2, 3], 1) == [True] * 4
    assert _barrier_all(client, "j", [3, 2, 1, 0], 2) == [True] * 4


def test_barrier_timeout_names_who_did_not_arrive(client: Client) -> None:
    replies = client.join_all("j", 3, lambda i: {"host": f"h{i}", "requested_rank": i})
    progress = [common_pb2.Progress(group="world", started_seq=7, finished_seq=6, last_op="all_reduce(float32[8])")]
    watch = client.watch("j", replies[2], progress)
    assert watch.next().kind == pb.EVENT_KIND_WATCHING  # the first request's progress is recorded

    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(
                client,
                "Barrier",
                client.barrier_request("j", r, 1, 0.3),
            )
            for r in (0, 1)
        ]
        results = [f.result() for f in futures]
    for result in results:
        assert not result.complete
        (waiting,) = result.waiting_on
        assert (waiting.rank, waiting.host, waiting.last_op, waiting.finished_seq) == (
            2,
            "h2",
            "all_reduce(float32[8])",
            6,
        )
    progress_reply = client("GetProgress", pb.GetProgressRequest(job_id="j", group="world", seq=1))
    assert [w.rank for w in progress_reply.not_started] == [0, 1]


def test_world_size_disagreement_fails_immediately(client: Client) -> None:
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(expect_error, lambda n=n: client.join("j", n, timeout_s=1.0)) for n in (2, 3)]
        errors = [f.result() for f in futures]
    assert all(isinstance(e, RendezvousError) for e in errors)
    messages = " | ".join(map(str, errors))
    assert "world_size 2" in messages and "world_size 3" in messages
    assert "only 1 of" in messages  # the other joiner timed out waiting


def test_duplicate_rank_names_rank_and_host(client: Client) -> None:
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(expect_error, lambda h=h: client.join("j", 2, timeout_s=1.0, host=h, requested_rank=0))
            for h in ("alpha", "beta")
        ]
        errors = [f.result() for f in futures]
    assert all(isinstance(e, RendezvousError) for e in errors)
    duplicate = [str(e) for e in errors if "already taken" in str(e)]
    assert len(duplicate) == 1 and "rank 0" in duplicate[0]
    assert "'alpha'" in duplicate[0] and "'beta'" in duplicate[0]


def test_join_after_job_is_full_is_refused(client: Client) -> None:
    client.join_all("j", 2)
    error = expect_error(lambda: client.join("j", 2))
    assert isinstance(error, RendezvousError) and "full" in str(error)


def test_groups_progress_and_status(client: Client) -> None:
    client.join_all("j", 3, lambda i: {"host": "node", "requested_rank": i, "pid": 100 + i})
    client("NewGroup", pb.NewGroupRequest(job_id="j", name="pair", ranks=[0, 2]))
    client("NewGroup", pb.NewGroupRequest(job_id="j", name="pair", ranks=[0, 2]))  # idempotent
    assert isinstance(
        expect_error(lambda: client("NewGroup", pb.NewGroupRequest(job_id="j", name="pair", ranks=[1]))),
        ValueError,
    )
    found = client("FindGroup", pb.FindGroupRequest(job_id="j", name="pair"))
    assert found.found and list(found.ranks) == [0, 2]
    assert not client("FindGroup", pb.FindGroupRequest(job_id="j", name="nope")).found
    assert _barrier_all(client, "j", [0, 2], 1, group="pair") == [True, True]
    unknown = client.barrier_request("j", 0, 1, 1, group="nope")
    assert isinstance(expect_error(lambda: client("Barrier", unknown)), ValueError)

    status = client("GetStatus", pb.GetStatusRequest())
    (job,) = status.jobs
    assert (job.job_id, job.world_size, job.state) == ("j", 3, "running")
    assert [m.pid for m in job.members] == [100, 101, 102]
    assert [(g.name, list(g.ranks)) for g in job.groups] == [("pair", [0, 2])]
    assert len(job.progress) == 3
    assert isinstance(expect_error(lambda: client("GetStatus", pb.GetStatusRequest(job_id="zz"))), ValueError)


def test_a_member_that_left_after_arriving_is_not_blamed_for_the_barrier(client: Client) -> None:
    """Rank 0 arrives, times out first (a shorter timeout) and leaves, as a rank does after its barrier
    failed. Rank 1, still waiting, must time out naming rank 2 (never arrived), not blame rank 0."""
    replies = client.join_all("j", 3, lambda i: {"host": f"h{i}", "requested_rank": i})
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client, "Barrier", client.barrier_request("j", 1, 1, 2.0))
        first = client("Barrier", client.barrier_request("j", 0, 1, 0.3))
        assert not first.complete and [w.rank for w in first.waiting_on] == [2]
        client("Leave", pb.LeaveRequest(job_id="j", rank=0, member_secret=replies[0].member_secret))
        second = waiting.result()
    assert not second.complete
    assert [w.rank for w in second.waiting_on] == [2]
