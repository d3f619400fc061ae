"""JoinBatch (a host's ranks joined in one call) and barriers one member passes for its host, on a
real coordinator: the same ranks, errors and withdrawals as one call per member."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from collsvc.errors import AuthenticationError, RendezvousError, ResourceLimitError
from collsvc.options import Limits
from collsvc.proto.v1 import coordinator_pb2 as pb

from .conftest import Client, expect_error


def member(job_id: str, world_size: int, host: str, local: int, timeout_s: float = 10.0) -> pb.JoinRequest:
    return pb.JoinRequest(
        job_id=job_id, world_size=world_size, host=host, pid=local, local_rank_hint=local, timeout_s=timeout_s
    )


def join_batch(client: Client, requests: list[pb.JoinRequest], timeout: float = 15.0) -> list[Any]:
    replies = list(client("JoinBatch", pb.JoinBatchRequest(members=requests), timeout=timeout).members)
    for request, reply in zip(requests, replies, strict=True):
        client.secrets[(request.job_id, reply.rank)] = reply.member_secret
    return replies


def test_two_hosts_join_in_one_call_each_beside_a_single_join(client: Client) -> None:
    hosts = {"a": [member("mixed", 7, "a", i) for i in range(3)], "b": [member("mixed", 7, "b", i) for i in range(3)]}
    with ThreadPoolExecutor(3) as pool:
        batches = {host: pool.submit(join_batch, client, requests) for host, requests in hosts.items()}
        single = pool.submit(client.join, "mixed", 7, host="c", pid=9, timeout_s=10.0)
        replies = {host: future.result() for host, future in batches.items()}
        lone = single.result()
    ranks = sorted([r.rank for batch in replies.values() for r in batch] + [lone.rank])
    assert ranks == list(range(7))
    for batch in replies.values():
        # In the order of the request: local_rank_hint 0, 1, 2 got local ranks 0, 1, 2 of a host of 3.
        assert [(r.local_rank, r.local_size, r.world_size) for r in batch] == [(0, 3, 7), (1, 3, 7), (2, 3, 7)]
        assert len({r.node_rank for r in batch}) == 1
        assert len({r.member_secret for r in batch}) == 3
    assert (lone.local_rank, lone.local_size) == (0, 1)


def test_one_member_per_host_passes_the_barrier_for_its_host(client: Client) -> None:
    with ThreadPoolExecutor(2) as pool:
        a_future, b_future = (
            pool.submit(join_batch, client, [member("hosts", 4, host, i) for i in range(2)]) for host in "ab"
        )
        a, b = a_future.result(), b_future.result()

    def host_barrier(replies: list[Any], generation: int, timeout_s: float = 10.0) -> Any:
        request = client.barrier_request("hosts", replies[0].rank, generation, timeout_s)
        request.on_behalf_of.extend(r.rank for r in replies[1:])
        return client("Barrier", request, timeout=timeout_s + 5)

    with ThreadPoolExecutor(2) as pool:
        outcomes = [pool.submit(host_barrier, a, 1), pool.submit(host_barrier, b, 1)]
        assert all(f.result().complete for f in outcomes)
    # Host b never arrives at generation 2: host a's call names exactly b's two ranks.
    reply = host_barrier(a, 2, timeout_s=0.5)
    assert not reply.complete
    assert sorted(w.rank for w in reply.waiting_on) == sorted(r.rank for r in b)
    # Nobody speaks for a member of another host.
    request = client.barrier_request("hosts", a[0].rank, 3, 1.0)
    request.on_behalf_of.append(b[0].rank)
    error = expect_error(lambda: client("Barrier", request))
    assert isinstance(error, AuthenticationError)
    assert f"rank {b[0].rank} is not one" in str(error)


def test_a_batch_that_times_out_withdraws_every_member(client: Client) -> None:
    error = expect_error(lambda: join_batch(client, [member("short", 4, "a", i, timeout_s=0.3) for i in range(2)]))
    assert isinstance(error, RendezvousError)
    assert "only 2 of 4 members joined" in str(error)
    # Their places are free: four other members fill the job.
    replies = join_batch(client, [member("short", 4, "b", i) for i in range(4)])
    assert sorted(r.rank for r in replies) == [0, 1, 2, 3]


def test_a_refused_member_withdraws_those_admitted_before_it(client: Client) -> None:
    requests = [member("dup", 3, "a", 0), member("dup", 3, "a", 1)]
    requests[0].requested_rank = 1
    requests[1].requested_rank = 1  # taken by the first
    error = expect_error(lambda: join_batch(client, requests))
    assert "rank 1" in str(error)
    status = client("GetStatus", pb.GetStatusRequest())
    assert [job.job_id for job in status.jobs if job.job_id == "dup"] == []  # the job it created is gone


def test_a_batch_names_one_job_and_carries_at_most_a_host_of_members(
    start_coordinator: Callable[..., tuple[Any, Client]],
) -> None:
    _, client = start_coordinator(limits=Limits(max_ranks_per_host=4))
    error = expect_error(lambda: join_batch(client, [member("x", 2, "a", 0), member("y", 2, "a", 1)]))
    assert isinstance(error, ValueError)
    assert "one batch joins one job" in str(error)
    error = expect_error(lambda: join_batch(client, [member("big", 8, "a", i) for i in range(5)]))
    assert isinstance(error, ResourceLimitError)
    assert "JoinBatchRequest.members has 5 entries, over the limit of 4" in str(error)
    error = expect_error(lambda: join_batch(client, []))
    assert "no members" in str(error)


@pytest.mark.parametrize("waiting", [3, 4])
def test_the_join_quota_counts_each_member_of_a_batch(
    start_coordinator: Callable[..., tuple[Any, Client]], waiting: int
) -> None:
    _, client = start_coordinator(limits=Limits(max_pending_joins_per_client=3))
    requests = [member("quota", 8, "a", i, timeout_s=0.3) for i in range(waiting)]
    error = expect_error(lambda: join_batch(client, requests))
    expected = RendezvousError if waiting <= 3 else ResourceLimitError
    assert isinstance(error, expected), error
