"""The per-job key/value store against a real coordinator."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from collsvc.errors import ResourceLimitError
from collsvc.options import Limits
from collsvc.proto.v1 import coordinator_pb2 as pb

from .conftest import Client, expect_error


def test_set_get_add_compare_set_delete_before_anyone_joined(client: Client) -> None:
    client("SetKey", pb.SetKeyRequest(job_id="early", key="nccl/id", value=b"\x00\x01"))
    got = client("GetKey", pb.GetKeyRequest(job_id="early", key="nccl/id"))
    assert got.found and got.value == b"\x00\x01"
    assert not client("GetKey", pb.GetKeyRequest(job_id="early", key="missing")).found

    assert client("AddKey", pb.AddKeyRequest(job_id="early", key="n", amount=3)).value == 3
    assert client("AddKey", pb.AddKeyRequest(job_id="early", key="n", amount=4)).value == 7
    assert client("GetKey", pb.GetKeyRequest(job_id="early", key="n")).value == b"7"

    swap = client("CompareSetKey", pb.CompareSetKeyRequest(job_id="early", key="c", expect_absent=True, desired=b"a"))
    assert (swap.swapped, swap.value) == (True, b"a")
    swap = client("CompareSetKey", pb.CompareSetKeyRequest(job_id="early", key="c", expected=b"x", desired=b"b"))
    assert (swap.swapped, swap.value) == (False, b"a")
    assert client("DeleteKey", pb.DeleteKeyRequest(job_id="early", key="c")).deleted
    assert not client("DeleteKey", pb.DeleteKeyRequest(job_id="early", key="c")).deleted

    not_a_number = lambda: client("AddKey", pb.AddKeyRequest(job_id="early", key="nccl/id", amount=1))  # noqa: E731
    assert isinstance(expect_error(not_a_number), ValueError)


def test_get_waits_until_the_key_is_set(client: Client) -> None:
    waiting = threading.Event()
    results: list[Any] = []

    def get() -> None:
        waiting.set()
        results.append(client("GetKey", pb.GetKeyRequest(job_id="j", key="k", wait=True, timeout_s=10)))

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(get)
        assert waiting.wait(5)
        client("SetKey", pb.SetKeyRequest(job_id="j", key="k", value=b"v"))
        future.result(timeout=10)
    assert results[0].found and results[0].value == b"v"


def test_get_wait_times_out_with_found_false(client: Client) -> None:
    start = time.monotonic()
    reply = client("GetKey", pb.GetKeyRequest(job_id="j", key="never", wait=True, timeout_s=0.2))
    assert not reply.found
    assert 0.15 <= time.monotonic() - start < 3.0


def test_limits_are_resource_exhausted(start_coordinator: Callable[..., Any]) -> None:
    _, client = start_coordinator(limits=Limits(max_value_bytes=16, max_key_bytes=8, max_keys_per_job=2))
    too_big = lambda: client("SetKey", pb.SetKeyRequest(job_id="j", key="k", value=b"x" * 17))  # noqa: E731
    assert isinstance(expect_error(too_big), ResourceLimitError)
    long_key = lambda: client("SetKey", pb.SetKeyRequest(job_id="j", key="k" * 9, value=b""))  # noqa: E731
    assert isinstance(expect_error(long_key), ResourceLimitError)
    client("SetKey", pb.SetKeyRequest(job_id="j", key="a", value=b""))
    client("SetKey", pb.SetKeyRequest(job_id="j", key="b", value=b""))
    third = lambda: client("SetKey", pb.SetKeyRequest(job_id="j", key="c", value=b""))  # noqa: E731
    assert isinstance(expect_error(third), ResourceLimitError)
