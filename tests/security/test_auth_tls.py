"""Promise 7, secure by default: the token on the coordinator and on every peer endpoint, mutual TLS
end to end, the token ``collsvc run`` makes, and the pickle rule of object collectives.

Already covered elsewhere (not repeated here): missing and wrong token read alike and health answers
without one (tests/integration/test_auth.py), unknown job and wrong member secret read alike (same),
and ``collsvc coordinator --host 0.0.0.0`` without auth exits 2 (tests/cli/test_commands.py).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

import collsvc
from collsvc.client.backends.ring import frames
from collsvc.options import Limits
from collsvc.proto.v1 import coordinator_pb2 as pb
from tests.cli._util import run_cli, script
from tests.harness import TOKEN, coordinator, run_ranks
from tests.security import ranks
from tests.security._util import COORDINATOR, DELIVER, expected_sum, held_job, raw_call
from tests.security.certs import Certs, tls_env

NO_TOKEN = {"COLLSVC_TOKEN": ""}


def test_wrong_token_reads_the_same_for_a_live_job_an_unknown_job_and_garbage() -> None:
    """An outsider learns nothing: not which jobs exist, not whether the body parsed."""
    with coordinator() as (_, address), held_job(address, 1) as (job_id, _, _):
        live = pb.GetMembersRequest(job_id=job_id).SerializeToString()
        bodies = {
            "live": live,
            "unknown": pb.GetMembersRequest(job_id="no-such-job").SerializeToString(),
            "garbage": b"\xff\xff\xff\xff not protobuf",
        }
        answers = set()
        for method in ("GetMembers", "GetKey", "Leave", "GetStatus", "Join"):
            for token in (None, "wrong", TOKEN[:-1], TOKEN + "x"):
                for body in bodies.values():
                    answers.add(raw_call(address, COORDINATOR + method, body, token=token)[:2])
        assert answers == {
            (grpc.StatusCode.UNAUTHENTICATED, "authentication failed: missing or wrong token "
             "(expected 'authorization: Bearer <token>')")
        }  # fmt: skip
        # With the token, the same garbage is parsed (and refused as such): the check came first.
        code, _, _ = raw_call(address, COORDINATOR + "GetKey", bodies["garbage"], token=TOKEN)
        assert code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OK)


def test_peer_endpoint_checks_the_token_before_decoding_and_bounds_frames() -> None:
    with coordinator() as (_, address):
        with held_job(address, 2) as (_, table, future):
            peer = table[1].peer_address
            garbage = b"\x00" * 100
            huge = frames.encode_header(0, 1, 1, 0, 0, b"", 1 << 40)  # advertises 1 TiB, carries none
            denied = {raw_call(peer, DELIVER, body, token=t)[:2] for body in (garbage, huge) for t in (None, "wrong")}
            assert denied == {(grpc.StatusCode.UNAUTHENTICATED, "peer call denied: missing or wrong job token")}
            # The same frames with the token reach the decoder, which refuses them without allocating.
            code, details, _ = raw_call(peer, DELIVER, huge, token=TOKEN)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "over the limit" in details, details
            code, details, _ = raw_call(peer, DELIVER, garbage, token=TOKEN)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            # Over gRPC's receive limit: refused by gRPC itself, before our handler runs.
            oversized = b"\x00" * (Limits().max_message_bytes + 8192 + 1)
            code, details, _ = raw_call(peer, DELIVER, oversized, token=TOKEN, timeout=30)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert future.result().values == [expected_sum(2)] * 2  # the job itself never noticed


def test_a_job_runs_over_mutual_tls_and_peers_refuse_plaintext_and_strangers(certs: Certs) -> None:
    env = {**NO_TOKEN, **tls_env(certs.client)}
    with coordinator(token=None, tls=certs.server) as (_, address):
        with held_job(address, 2, token=None, tls=certs.client, env=env) as (_, table, future):
            peer = table[0].peer_address
            assert raw_call(peer, DELIVER, b"x")[0] == grpc.StatusCode.UNAVAILABLE  # plaintext
            assert raw_call(peer, DELIVER, b"x", tls=certs.rogue)[0] == grpc.StatusCode.UNAVAILABLE
            # A certificate of the job's CA gets through TLS to the frame decoder.
            assert raw_call(peer, DELIVER, b"x", tls=certs.client)[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert future.result().values == [expected_sum(2)] * 2
        # TLS authenticates the peers, so object collectives unpickle without a token.
        result = run_ranks(ranks.env_token_and_objects, 2, address=address, env=env)
        assert [v.get("object") for v in result.values] == [{"from": 0}] * 2


@pytest.mark.parametrize("client", ["no certificate", "certificate of another CA", "plaintext"])
def test_a_client_the_tls_coordinator_refuses_fails_fast_with_authentication_error(
    certs: Certs, client: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("COLLSVC_TOKEN", "COLLSVC_TOKEN_FILE", "COLLSVC_TLS_CERT", "COLLSVC_TLS_KEY", "COLLSVC_TLS_CA"):
        monkeypatch.delenv(name, raising=False)
    if client == "certificate of another CA":
        for name, value in tls_env(certs.rogue).items():
            monkeypatch.setenv(name, value)
    with coordinator(token=None, tls=certs.server) as (_, address):
        if client == "plaintext":  # a TLS client at a plaintext coordinator
            for name, value in tls_env(certs.client).items():
                monkeypatch.setenv(name, value)
            with coordinator(token=None) as (_, plain):
                address = plain
                start = time.monotonic()
                with pytest.raises(collsvc.AuthenticationError, match="TLS"):
                    collsvc.init(coordinator=address, world_size=1, rank=0, timeout=20)
        else:
            start = time.monotonic()
            with pytest.raises(collsvc.AuthenticationError, match="TLS"):
                collsvc.init(coordinator=address, world_size=1, rank=0, timeout=20)
    assert time.monotonic() - start < 10.0  # not the whole 20 s timeout


def test_run_gives_its_ranks_a_fresh_token_that_outsiders_lack(tmp_path: Path) -> None:
    path = script(
        tmp_path,
        "outsider.py",
        """
        import os, grpc, numpy as np, collsvc
        token, address = os.environ["COLLSVC_TOKEN"], os.environ["COLLSVC_COORDINATOR"]
        method = "/collsvc.proto.v1.Coordinator/GetStatus"
        with grpc.insecure_channel(address) as ch:
            grpc.channel_ready_future(ch).result(timeout=30)  # collsvc run starts ranks and coordinator together
            call = ch.unary_unary(method, request_serializer=None, response_deserializer=None)
            try:
                call(b"", timeout=5)
                print("OUTSIDER allowed")
            except grpc.RpcError as exc:
                print("OUTSIDER", exc.code().name)
            call(b"", timeout=5, metadata=(("authorization", "Bearer " + token),))
        comm = collsvc.init()
        print("TOKEN", len(token), float(comm.all_reduce(np.ones(1))[0]))
        comm.close()
        """,
    )
    first = run_cli("run", "-n", "2", path, timeout=90)
    second = run_cli("run", "-n", "1", path, timeout=90, COLLSVC_TOKEN="")
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    lines = sorted(line for line in first.lines("stdout") if "OUTSIDER" in line or "TOKEN" in line)
    assert lines == ["[rank 0] OUTSIDER UNAUTHENTICATED", "[rank 0] TOKEN 43 2.0",
                     "[rank 1] OUTSIDER UNAUTHENTICATED", "[rank 1] TOKEN 43 2.0"]  # fmt: skip


def test_object_collectives_refuse_to_unpickle_without_authentication() -> None:
    with coordinator(token=None) as (_, address):
        refused = run_ranks(ranks.env_token_and_objects, 2, address=address, env=NO_TOKEN)
        for value in refused.values:
            assert value["token"] is False and "object" not in value
            assert "COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE" in value["error"]
        allowed = run_ranks(
            ranks.env_token_and_objects, 2, address=address,
            env={**NO_TOKEN, "COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE": "1"},
        )  # fmt: skip
        assert [v["object"] for v in allowed.values] == [{"from": 0}] * 2
    assert os.environ.get("COLLSVC_ALLOW_UNAUTHENTICATED_PICKLE") is None


def test_an_advertised_object_size_is_checked_before_allocating() -> None:
    with coordinator() as (_, address):
        result = run_ranks(ranks.advertise_huge_object, 2, address=address, timeout=60)
    assert result.values[0] == "sent"
    assert result.values[1].startswith("ResourceLimitError"), result.values[1]
